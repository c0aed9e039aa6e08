"""Drafter checkpoint folders: the engines' native EAGLE-3 format, the speculators format, and the
target tensors a drafter shares (embedding, lm_head, final norm).

A native folder is config.json + model.safetensors (no embedding). config.json is a one-layer model
config (model_type llama, or deepseek_v2 for an MLA drafter) with ``eagle_aux_hidden_state_layer_ids``
in the convention of the engine that will read it, any keys that engine adds (``extra_config``), and a
``draftloop`` block recording the trained ids in layer_input convention and the full `DrafterConfig`.
Kernels name no engine: the engine modules (infra/engines/) pass their convention and extra keys.

The draftloop block's ``metadata`` also carries what the drafter was trained against
(`contract_record`: the target's chat template hash, dtype and quantization, the last hidden state's
semantics), which the pairing check (infra/engines/pairing.py) compares with what is served. Bad input
(a truncated or missing weights file, missing or misshapen tensors, non-finite weights, a d2t that is
not offsets) raises `DrafterFormatError` naming the file and the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from .drafter import DrafterConfig, Eagle3Drafter
from .layer_ids import Convention, LayerIds, normalize_convention
from .shards import LAST_HIDDEN_AFTER_FINAL_NORM, LAST_HIDDEN_STATE_KEY, TARGET_DTYPE_KEY

__all__ = [
    "CHAT_TEMPLATE_KEY",
    "TARGET_QUANTIZATION_KEY",
    "DrafterFormatError",
    "LayerIdExportError",
    "chat_template_sha256",
    "check_safetensors_file",
    "check_target_weights",
    "contract_record",
    "export_speculators",
    "load_drafter",
    "load_target_head",
    "read_drafter_config",
    "save_drafter",
    "target_quantization",
    "vocab_mapping_problem",
]

FORMAT_VERSION = 1
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# Keys of the draftloop block's metadata that record what the drafter was trained against.
CHAT_TEMPLATE_KEY = "chat_template_sha256"
TARGET_QUANTIZATION_KEY = "target_quantization"


class DrafterFormatError(ValueError):
    """A drafter or target folder that cannot be read; the message names the file and the reason.

    ``check`` names what failed (weights, tensors, d2t, final_norm, config) for the pairing report."""

    def __init__(self, message: str, check: str = "format") -> None:
        super().__init__(message)
        self.check = check

    def __reduce__(self) -> tuple[Any, ...]:  # keeps `check` across processes (Ray, Prefect)
        return (type(self), (str(self), self.check))


# --------------------------------------------------------------------------------------------- contract


def chat_template_sha256(path: str | os.PathLike[str]) -> str | None:
    """sha256 of the chat template a tokenizer folder holds (chat_template.jinja, chat_template.json or
    tokenizer_config.json's ``chat_template``), or of a template file; None when there is none."""
    source = Path(path)
    template: Any = None
    if source.is_file():
        template = source.read_text()
    elif (source / "chat_template.jinja").is_file():
        template = (source / "chat_template.jinja").read_text()
    else:
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (source / name).is_file():
                template = _read_json(source / name).get("chat_template")
                if template is not None:
                    break
    if template is None:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def target_quantization(target_config: Mapping[str, Any]) -> str | None:
    """The quantization method a target checkpoint declares (``quantization_config.quant_method``)."""
    quantization = target_config.get("quantization_config")
    if not isinstance(quantization, Mapping):
        text_config = target_config.get("text_config")
        quantization = text_config.get("quantization_config") if isinstance(text_config, Mapping) else None
    return str(quantization.get("quant_method", "unknown")) if isinstance(quantization, Mapping) else None


def contract_record(
    target_dir: str | os.PathLike[str], *, target_dtype: str | None, last_hidden_state: str | None
) -> dict[str, Any]:
    """What a drafter is trained against, for its draftloop block's metadata: the target tokenizer's chat
    template (synthesis and extraction render conversations with it), the dtype and quantization the
    target ran in when its hidden states were extracted, and those hidden states' last-state semantics."""
    folder = Path(target_dir)
    return {
        CHAT_TEMPLATE_KEY: chat_template_sha256(folder),
        TARGET_DTYPE_KEY: target_dtype,
        TARGET_QUANTIZATION_KEY: target_quantization(_read_json(folder / "config.json")),
        LAST_HIDDEN_STATE_KEY: last_hidden_state,
    }


def vocab_mapping_problem(d2t: Tensor, t2d: Tensor | None, vocab_size: int) -> str | None:
    """Why ``d2t`` (offsets: draft id + d2t[draft id] = target id) and ``t2d`` (which target ids the draft
    vocabulary holds) do not describe one injective map into the target vocabulary; None when they do."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        return f"d2t has dtype {d2t.dtype}; expected integer offsets"
    if t2d is not None and tuple(t2d.shape) != (vocab_size,):
        return f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) (the target vocabulary)"
    offsets = d2t.reshape(-1).long()
    target_ids = torch.arange(offsets.numel()) + offsets
    inside = (target_ids >= 0) & (target_ids < vocab_size)
    marked = t2d.bool() if t2d is not None else None
    wrong = ~inside
    if marked is not None:
        wrong |= inside & ~marked[target_ids.clamp(0, vocab_size - 1)]
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        offset, target_id = int(offsets[i]), int(target_ids[i])
        message = f"d2t[{i}] = {offset} maps draft id {i} to target id {target_id} (draft id + offset), " + (
            f"outside the target vocabulary of {vocab_size}"
            if not bool(inside[i])
            else "which t2d does not mark"
        )
        if marked is not None and 0 <= offset < vocab_size and bool(marked[offset]):
            message += f"; t2d marks {offset} itself: d2t holds absolute target ids, not offsets"
        return message + " (d2t must hold offsets: draft id + d2t[draft id] = target id)"
    unique, counts = torch.unique(target_ids, return_counts=True)
    if unique.numel() < target_ids.numel():
        repeated = int(unique[counts > 1][0])
        both = (target_ids == repeated).nonzero().flatten()[:2].tolist()
        return f"d2t maps draft ids {both} to the same target id {repeated}"
    if marked is not None and int(marked.sum()) != target_ids.numel():
        return (
            f"t2d marks {int(marked.sum())} target ids but d2t maps {target_ids.numel()} draft ids: "
            "t2d is not the inverse of d2t"
        )
    return None


def check_safetensors_file(path: str | os.PathLike[str]) -> None:
    """Refuse a weights file that is missing, has no readable safetensors header, or holds fewer bytes
    than its header lists (a truncated copy or download)."""
    file = Path(path)
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if header_len < 0 or header_len > size - 8:
                raise DrafterFormatError(
                    f"{file}: truncated or not a safetensors file ({size} bytes, no complete header)",
                    check="weights",
                )
            header = json.loads(handle.read(header_len))
        end = max(
            (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
            default=0,
        )
    except FileNotFoundError:
        raise DrafterFormatError(f"{file}: weights file not found", check="weights") from None
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError):
        raise DrafterFormatError(
            f"{file}: not a safetensors file (unreadable header)", check="weights"
        ) from None
    held = size - 8 - header_len
    if end > held:
        raise DrafterFormatError(
            f"{file}: truncated: its header lists {end} bytes of tensor data, the file holds {held}",
            check="weights",
        )


def check_target_weights(target_dir: str | os.PathLike[str], *, allow_bin: bool = False) -> list[Path]:
    """The target's safetensors files, each checked complete; refuses a folder without weights, or whose
    index names a file that is not there. ``allow_bin``: a folder of pytorch_model*.bin files only is
    accepted as it is (engines serve it; only safetensors headers can be checked cheaply)."""
    folder = Path(target_dir)
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise DrafterFormatError(f"{index_path}: no weight_map", check="weights")
        files = [folder / name for name in sorted(set(map(str, weight_map.values())))]
        for file in files:
            if not file.exists():
                raise DrafterFormatError(
                    f"{file}: weights file not found (listed in {index_path.name})", check="weights"
                )
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files and allow_bin and any(folder.glob("pytorch_model*.bin")):
            return sorted(folder.glob("pytorch_model*.bin"))
        if not files:
            raise DrafterFormatError(f"{folder}: no *.safetensors weights files", check="weights")
    for file in files:
        check_safetensors_file(file)
    return files


class LayerIdExportError(ValueError):
    """Export asked for aux layer ids other than those the drafter was trained on."""


# --------------------------------------------------------------------------------------------- native


def _layer_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The drafter's decoder layer as a one-layer transformers model config (both formats start here)."""
    return {
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
    }


def _native_config(drafter: Eagle3Drafter, exported_ids: LayerIds) -> dict[str, Any]:
    """config.json of the engines' EAGLE-3 drafter classes: a one-layer model config plus the ids."""
    cfg = drafter.config
    data: dict[str, Any] = {
        **_layer_config(cfg),
        "rope_theta": cfg.rope_theta,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": _DTYPE_NAMES.get(drafter.fc.weight.dtype, "float32"),
        "eagle_aux_hidden_state_layer_ids": list(exported_ids.ids),
    }
    if cfg.rope_scaling:
        data["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.attention == "llama":
        data.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama")
    else:
        # model_type deepseek_v2, never deepseek_v3 (vLLM rewrites that to its MTP drafter). The MoE
        # fields are unused by the dense drafter layer but must be integers for config validation.
        data.update(
            architectures=["Eagle3DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_interleave=True,
            moe_intermediate_size=cfg.intermediate_size,
            n_routed_experts=1,
            n_shared_experts=1,
            num_experts_per_tok=1,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )
    return data


def save_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike[str],
    *,
    convention: Convention = "layer_input",
    engine: str = "vllm",
    extra_config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    layer_ids: LayerIds | None = None,
    allow_layer_mismatch: bool = False,
) -> Path:
    """Write the native folder: config.json + model.safetensors (no embedding).

    ``convention``: the one the serving engine reads ``eagle_aux_hidden_state_layer_ids`` in;
    ``extra_config``: keys that engine needs beyond the common ones; ``engine``: recorded in the
    ``draftloop`` block only. The exported ids are the trained ones; ``layer_ids`` may restate them (any
    convention) and is refused when it names other tensors, unless ``allow_layer_mismatch`` (to measure
    what a wrong export costs). The ``draftloop`` block always records the trained ids.
    """
    cfg = drafter.config
    capture_ids = cfg.aux_layer_ids if layer_ids is None else layer_ids.to("layer_input")
    if capture_ids.ids != cfg.aux_layer_ids.ids and not allow_layer_mismatch:
        raise LayerIdExportError(
            f"drafter was trained on aux layers {list(cfg.aux_layer_ids.ids)} (layer_input) but the export "
            f"asks the engine to capture {list(capture_ids.ids)} (layer_input"
            + (f"; given as {list(layer_ids.ids)} {layer_ids.convention}" if layer_ids is not None else "")
            + "): it would read other tensors than it was trained on"
        )
    last_hidden = (metadata or {}).get(LAST_HIDDEN_STATE_KEY)
    if last_hidden is not None and last_hidden != LAST_HIDDEN_AFTER_FINAL_NORM:
        raise DrafterFormatError(
            f"{out_dir}: the drafter was trained on last hidden states {last_hidden!r}, but its loss and the "
            f"engines take them as {LAST_HIDDEN_AFTER_FINAL_NORM!r} (logits = lm_head(last hidden state))",
            check="final_norm",
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    exported = capture_ids.to(normalize_convention(convention))
    config = {**_native_config(drafter, exported), **(extra_config or {})}
    config["draftloop"] = {
        "format_version": FORMAT_VERSION,
        "aux_layer_ids": list(cfg.aux_layer_ids.ids),
        "aux_layer_ids_convention": "layer_input",
        "convention_exported": exported.convention,
        "engine": engine,
        "drafter_config": cfg.to_json(),
        "metadata": dict(metadata or {}),
    }
    tensors = {k: v.cpu() for k, v in drafter.weights_state_dict().items()}
    if cfg.draft_vocab_size == cfg.vocab_size:
        # vLLM builds no d2t parameter when the vocabularies are equal and rejects one in the checkpoint
        # ("no module or parameter named 'draft_id_to_target_id'"); load_drafter rebuilds the identity.
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DrafterFormatError(f"{path}: not found") from exc
    except json.JSONDecodeError as exc:
        raise DrafterFormatError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise DrafterFormatError(f"{path}: expected a JSON object")
    return data


def _read_weights(folder: Path) -> tuple[dict[str, Tensor], str]:
    """(tensors, the file(s) they came from, for messages)."""
    single = folder / "model.safetensors"
    shards = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
    if shards:
        merged: dict[str, Tensor] = {}
        for shard in shards:
            check_safetensors_file(shard)
            merged.update(load_file(str(shard)))
        return merged, str(shards[0]) if len(shards) == 1 else f"{folder}/*.safetensors"
    binary = folder / "pytorch_model.bin"
    if binary.exists():
        try:
            loaded = torch.load(str(binary), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a damaged pickle/zip
            raise DrafterFormatError(f"{binary}: unreadable ({exc})", check="weights") from exc
        return cast(dict[str, Tensor], loaded), str(binary)
    raise DrafterFormatError(f"{folder}: no model.safetensors (or pytorch_model.bin)", check="weights")


def _normalize_weight_name(name: str) -> str:
    for prefix in ("model.", "module."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    return name


# speculators eagle3 variants our drafter layer does not compute: loading them would be silently wrong.
_SPECULATORS_UNSUPPORTED = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _config_from_native(data: dict[str, Any], path: Path, convention: str | None) -> DrafterConfig:
    """The config of a published drafter (no draftloop config block): its model config plus the aux ids.

    The speculators format nests the layer's model config under ``transformer_layer_config``, and its ids
    are in layer_input convention (its training data comes from vLLM, which reads them so)."""
    if data.get("speculators_model_type") == "eagle3":
        variants = [flag for flag in _SPECULATORS_UNSUPPORTED if data.get(flag)]
        if variants:
            raise DrafterFormatError(f"{path}: speculators eagle3 variant {variants} is not supported")
        layer = data.get("transformer_layer_config")
        if not isinstance(layer, Mapping):
            raise DrafterFormatError(f"{path}: speculators config without a transformer_layer_config")
        shared = ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size")
        data = {**layer, **{key: data[key] for key in shared if data.get(key) is not None}}
        convention = convention or "layer_input"
    ids = data.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = data.get("eagle_config")
    if ids is None and isinstance(eagle_config, Mapping):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        raise DrafterFormatError(
            f"{path}: no eagle_aux_hidden_state_layer_ids (top level or eagle_config); cannot tell which "
            "target layers the drafter was trained on"
        )
    if convention is None:
        raise DrafterFormatError(
            f"{path}: published drafter without a 'draftloop' block: its eagle_aux_hidden_state_layer_ids "
            f"{ids} may be in either convention; pass convention='layer_input' (as vLLM reads them) or "
            "'layer_output' (as SGLang reads them)"
        )
    try:
        return DrafterConfig.from_model_config(
            data,
            LayerIds.parse(ids, convention),
            draft_vocab_size=data.get("draft_vocab_size"),
            target_hidden_size=data.get("target_hidden_size"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DrafterFormatError(f"{path}: cannot build a drafter config ({exc})") from exc


def read_drafter_config(path: str | os.PathLike[str], convention: str | None = None) -> DrafterConfig:
    """The `DrafterConfig` of a native drafter folder: its draftloop block, or (a published drafter) its
    model config plus ``convention`` for its aux ids."""
    config_path = Path(path) / "config.json"
    data = _read_json(config_path)
    block = data.get("draftloop")
    if isinstance(block, Mapping) and "drafter_config" in block:
        try:
            return DrafterConfig.from_json(block["drafter_config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DrafterFormatError(f"{config_path}: invalid draftloop.drafter_config ({exc})") from exc
    return _config_from_native(data, config_path, convention)


def load_drafter(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    convention: str | None = None,
) -> Eagle3Drafter:
    """Read a native drafter folder (ours, with its draftloop block, or a published one).

    A published folder has no record of its ids' convention: pass ``convention`` for it.
    A published checkpoint that carries ``embed_tokens.weight`` gets it attached. Refuses (naming the
    file) missing, unexpected or misshapen tensors, non-finite weights and a d2t that is not offsets.
    """
    folder = Path(path)
    config = read_drafter_config(folder, convention)
    raw, source = _read_weights(folder)
    weights = {_normalize_weight_name(k): v for k, v in raw.items()}
    embed = weights.pop("embed_tokens.weight", None)
    drafter = Eagle3Drafter(config)
    expected = drafter.weights_state_dict()
    if "d2t" not in weights and "t2d" not in weights and config.draft_vocab_size == config.vocab_size:
        weights["d2t"] = expected["d2t"]
        weights["t2d"] = expected["t2d"]
    if "d2t" in weights:
        problem = vocab_mapping_problem(weights["d2t"], weights.get("t2d"), config.vocab_size)
        if problem is not None:
            raise DrafterFormatError(f"{source}: {problem}", check="d2t")
        if "t2d" not in weights:  # SGLang-style checkpoints may omit t2d: rebuild it from d2t.
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(weights["d2t"].numel()) + weights["d2t"].long()] = True
            weights["t2d"] = t2d
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise DrafterFormatError(f"{source}: tensors missing {missing[:8]}", check="tensors")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise DrafterFormatError(f"{source}: unexpected tensors {unexpected[:8]}", check="tensors")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise DrafterFormatError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}",
                check="tensors",
            )
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise DrafterFormatError(
                    f"{source}: tensor {name} has {bad} non-finite values (nan/inf) of {tensor.numel()}",
                    check="tensors",
                )
    if dtype is None:
        dtype = next((t.dtype for n, t in weights.items() if n.endswith("weight")), torch.float32)
    drafter.load_state_dict(weights, strict=False)
    drafter.to(device=device, dtype=dtype)
    drafter.d2t = drafter.d2t.long()
    drafter.t2d = drafter.t2d.bool()
    if embed is not None:
        drafter.attach_embeddings(embed)
    return drafter


def load_target_head(target_dir: str | os.PathLike[str]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(embed_tokens [V, H], lm_head [V, H], final norm weight [H] or None) of an HF target folder.

    Reads only those tensors from the safetensors files (never the whole model); tied embeddings
    (no lm_head tensor, or ``tie_word_embeddings``) return the embedding for both.
    """
    folder = Path(target_dir)
    config = _read_json(folder / "config.json")
    files = check_target_weights(folder)
    index_path = folder / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index_path.exists():
        weight_map = dict(_read_json(index_path).get("weight_map", {}))

    def find(candidates: tuple[str, ...]) -> Tensor | None:
        for name in candidates:
            if weight_map:
                if name in weight_map:
                    with safe_open(str(folder / weight_map[name]), framework="pt") as handle:
                        return handle.get_tensor(name)
                continue
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    if name in handle.keys():  # noqa: SIM118 (safe_open has no __contains__)
                        return handle.get_tensor(name)
        return None

    prefixes = ("model.", "model.language_model.", "language_model.model.", "")
    embed = find(tuple(f"{p}embed_tokens.weight" for p in prefixes))
    if embed is None:
        raise DrafterFormatError(f"{folder}: no embed_tokens.weight in its safetensors files")
    raw_text_config = config.get("text_config")
    text_config: dict[str, Any] = raw_text_config if isinstance(raw_text_config, dict) else {}
    tied = bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))
    lm_head = None if tied else find(("lm_head.weight", "language_model.lm_head.weight"))
    norm = find(tuple(f"{p}norm.weight" for p in prefixes))
    return embed, (lm_head if lm_head is not None else embed), norm


# --------------------------------------------------------------------------------------------- speculators


def export_speculators(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike[str],
    verifier_path: str,
    speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
) -> Path:
    """Write the speculators-library format (``speculators_model_type: eagle3``), which vLLM also loads.

    Llama attention only (speculators' eagle3 has no MLA layer). The ids are written in layer_input
    convention (speculators generates its training data through vLLM, which reads them so).
    """
    cfg = drafter.config
    if cfg.attention != "llama":
        raise ValueError("the speculators eagle3 format has no MLA drafter; export the native folder")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError("speculators eagle3 needs target_hidden_size == hidden_size")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if verifier_architectures is None:
        verifier_config = Path(verifier_path) / "config.json"
        verifier_architectures = (
            list(_read_json(verifier_config).get("architectures") or []) if verifier_config.exists() else []
        )
    layer_config: dict[str, Any] = {
        **_layer_config(cfg),
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
    }
    ids = list(cfg.aux_layer_ids.to("layer_input").ids)
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        # Our layer keeps the raw hidden state as the residual (vLLM's default); speculators' config
        # reader in vLLM defaults this flag to True, so it must be explicit.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": _DTYPE_NAMES.get(drafter.fc.weight.dtype, "float32"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_path), "architectures": verifier_architectures},
        },
        "draftloop": {
            "format_version": FORMAT_VERSION,
            "aux_layer_ids": list(cfg.aux_layer_ids.ids),
            "aux_layer_ids_convention": "layer_input",
            "convention_exported": "layer_input",
            "engine": "speculators",
        },
    }
    tensors: dict[str, Tensor] = {}
    for name, tensor in drafter.weights_state_dict().items():
        if name in ("d2t", "t2d") and cfg.draft_vocab_size == cfg.vocab_size:
            continue  # speculators has no vocabulary tables for a full draft vocabulary
        native = "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name
        tensors[native] = tensor.cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
