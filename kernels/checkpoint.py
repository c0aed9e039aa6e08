"""Drafter checkpoint folders in the engines' native EAGLE-3 format: `save_drafter` and `load_drafter`.

A native folder is config.json + model.safetensors (no embedding). config.json is a one-layer model
config (model_type llama, or deepseek_v2 for an MLA drafter) with ``eagle_aux_hidden_state_layer_ids``
in the convention of the engine that will read it, any keys that engine adds (``extra_config``) and the
drafter variant adds, and a ``draftloop`` block recording the trained ids in layer_input convention, the
full `DrafterConfig` and what the drafter was trained against (kernels/contract.py). Kernels name no
engine: the engine modules (infra/engines/) pass their convention and extra keys. Published folders
(no draftloop block; the speculators format too) are read when their ids' convention is given; their
variant fields (``fc_norm``, ``norm_output``, ... as vLLM reads them) pick the drafter variant, and a
variant no registered drafter variant computes is refused by name (kernels/variants/). Bad input raises
`DrafterFormatError` naming the file and the reason (kernels/files.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from .drafter import DrafterConfig, Eagle3Drafter
from .files import DrafterFormatError, check_safetensors_file, read_json, vocab_mapping_problem
from .layer_ids import Convention, LayerIds, normalize_convention
from .shards import LAST_HIDDEN_AFTER_FINAL_NORM, LAST_HIDDEN_STATE_KEY
from .variants.base import (
    SPECULATORS_VARIANT_FIELDS,
    UnsupportedVariantError,
    get_variant,
    variant_for_published,
)

__all__ = [
    "DrafterKind",
    "LayerIdExportError",
    "layer_config",
    "load_drafter",
    "read_drafter_config",
    "save_drafter",
    "served_drafter_kind",
    "trained_drafter_kind",
]

FORMAT_VERSION = 1
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class LayerIdExportError(ValueError):
    """Export asked for aux layer ids other than those the drafter was trained on."""


def layer_config(cfg: DrafterConfig) -> dict[str, Any]:
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
        **layer_config(cfg),
        "rope_theta": cfg.rope_theta,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "torch_dtype": DTYPE_NAMES.get(drafter.fc.weight.dtype, "float32"),
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
    data.update(drafter.variant.native_fields(cfg))
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


def _published_variant_fields(data: Mapping[str, Any], speculators: bool) -> dict[str, bool]:
    """A published config's variant fields as vLLM 0.32 reads them: false when absent, except the
    speculators format's norm_before_residual (its eagle3 reader defaults it to true); a native config's
    norm_before_fc may sit in ``eagle_config``, which vLLM's Llama drafter reads first."""
    fields = {name: bool(data.get(name, False)) for name in SPECULATORS_VARIANT_FIELDS}
    if speculators:
        fields["norm_before_residual"] = bool(data.get("norm_before_residual", True))
    eagle_config = data.get("eagle_config")
    if not speculators and isinstance(eagle_config, Mapping) and "norm_before_fc" in eagle_config:
        fields["norm_before_fc"] = bool(eagle_config["norm_before_fc"])
    return fields


@dataclass(frozen=True)
class DrafterKind:
    """A drafter variant and its options, e.g. eagle3.1 {fc_norm: true, norm_before_fc: false, ...}."""

    variant: str
    options: dict[str, Any]

    def __str__(self) -> str:
        on = [name for name, value in sorted(self.options.items()) if value]
        return self.variant + (f" ({', '.join(on)})" if on else "")


def served_drafter_kind(data: Mapping[str, Any]) -> DrafterKind:
    """The layer an engine computes from a drafter config.json's own fields (vLLM's reading; the
    draftloop block is never read by an engine). Refused (UnsupportedVariantError) when no variant does."""
    speculators = data.get("speculators_model_type") == "eagle3"
    found, options = variant_for_published(_published_variant_fields(data, speculators))
    return DrafterKind(found.name, dict(options))


def trained_drafter_kind(data: Mapping[str, Any]) -> DrafterKind | None:
    """The layer a draftloop folder was trained as (its draftloop block); None for a published folder."""
    block = data.get("draftloop")
    if not isinstance(block, Mapping) or not isinstance(block.get("drafter_config"), Mapping):
        return None
    config = block["drafter_config"]
    variant = str(config.get("variant", "eagle3"))
    try:
        options = get_variant(variant).resolve_options(config.get("variant_options") or {})
    except UnsupportedVariantError:
        return DrafterKind(variant, dict(config.get("variant_options") or {}))
    return DrafterKind(variant, options)


def _config_from_native(data: dict[str, Any], path: Path, convention: str | None) -> DrafterConfig:
    """The config of a published drafter (no draftloop config block): its model config plus the aux ids.

    The speculators format nests the layer's model config under ``transformer_layer_config``, and its ids
    are in layer_input convention (its training data comes from vLLM, which reads them so). The variant
    fields (either format) name the drafter variant, refused here when no registered one computes it
    (loading it as another would be silently wrong)."""
    speculators = data.get("speculators_model_type") == "eagle3"
    try:
        found, options = variant_for_published(_published_variant_fields(data, speculators))
    except UnsupportedVariantError as exc:
        raise DrafterFormatError(f"{path}: {exc}") from None
    variant = found.name
    if speculators:
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
            variant=variant,
            variant_options=options,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DrafterFormatError(f"{path}: cannot build a drafter config ({exc})") from exc


def read_drafter_config(path: str | os.PathLike[str], convention: str | None = None) -> DrafterConfig:
    """The `DrafterConfig` of a native drafter folder: its draftloop block, or (a published drafter) its
    model config plus ``convention`` for its aux ids."""
    config_path = Path(path) / "config.json"
    data = read_json(config_path)
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
        held = sorted(set(raw))
        raise DrafterFormatError(
            f"{source}: tensors missing {missing[:8]}, which {folder / 'config.json'} implies; the file "
            f"holds {held[:8]}{' ...' if len(held) > 8 else ''}",
            check="tensors",
        )
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
