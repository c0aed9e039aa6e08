"""The drafter contract: refuse a drafter the engine cannot serve with a target, before any server starts.

`check_drafter_contract` runs one function per clause of the contract and returns every issue found;
`check_drafter_pairing` (what evaluation runs before it starts a server, and `engine doctor` reports)
raises `DrafterPairingError` naming every error and returns the warnings, which serving survives and the
verdict reports. The clauses:

- attention: the engine keeps the drafter's KV cache in the target's block layout, so the drafter's
  attention must be the one the target's family asks for (`TargetFamily.drafter_attention`): an MLA
  target's latent cache and a per-head cache share no block size (vLLM dies at start-up with `No common
  block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`);
- the target's weights files are all there and complete; the drafter's tensors are the ones its config
  implies, finite, and its d2t holds offsets (draft id + d2t[draft id] = target id) inverse to t2d;
- the drafter was made for this target: hidden size, vocabulary, aux layer ids within its depth;
- RoPE: rope_theta and rope_scaling equal the target's; max_position_embeddings covers the served
  max_model_len (a drafter made for 2k positions served at 8k silently loses acceptance), or the rows
  a fine-tuning trains on (`FineTuneContract`);
- a drafter to fine-tune from records which target layers its aux ids name (its draftloop block), or
  the config names their convention: read in the wrong one, it would fuse other layers than it learnt;
- what training recorded in the draftloop block (`kernels.contract.contract_record`): the last hidden
  state after the final norm; the chat template synthesis rendered with is the one served (sha256);
  the target dtype and quantization the hidden states came from against the served ones (warnings);
- the EAGLE 3.1 fields the drafter's config sets are read by the engine's installed drafter class
  (infra/engines/variant_support.py): unread, the engine would serve it as plain EAGLE-3.

A published drafter (no draftloop block) has no record: those clauses have nothing to compare. A
fine-tuning (`FineTuneContract`, what config validation passes for training.drafter_init) retrains on the
config's own data, so the clauses about what the folder was trained on are not its business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from draftloop.infra.engines.base import Engine, EngineConfigError, drafter_config_layer_ids, read_json
from draftloop.infra.engines.variant_support import engine_models_folder, variant_support
from draftloop.kernels.checkpoint import load_drafter, read_drafter_config
from draftloop.kernels.contract import (
    CHAT_TEMPLATE_KEY,
    TARGET_QUANTIZATION_KEY,
    chat_template_sha256,
    target_quantization,
)
from draftloop.kernels.drafter import DrafterConfig
from draftloop.kernels.families.base import TargetFamily, UnknownFamilyError, family_for_config
from draftloop.kernels.files import DrafterFormatError, check_target_weights
from draftloop.kernels.shards import LAST_HIDDEN_AFTER_FINAL_NORM, LAST_HIDDEN_STATE_KEY, TARGET_DTYPE_KEY


class DrafterPairingError(EngineConfigError):
    """The drafter cannot run with this target in the engine (refused before any server starts)."""


@dataclass(frozen=True)
class ContractIssue:
    """One broken clause: `check` names it, `message` gives both values and `file` the file concerned."""

    check: str
    severity: Literal["error", "warning"]
    file: str
    message: str

    def __str__(self) -> str:
        where = "" if self.file in self.message else f" ({self.file})"
        return f"{self.check}: {self.message}{where}"


@dataclass(frozen=True)
class FineTuneContract:
    """What training does with a drafter folder it starts from (training.drafter_init): trains on rows of
    up to `max_length` tokens (data.max_length), reading a published drafter's aux ids in
    `layer_id_convention` (training.drafter_init_convention; None: the folder must record them)."""

    max_length: int
    layer_id_convention: str | None = None


@dataclass(frozen=True)
class ServingContract:
    """What the engine will serve with: its max_model_len, dtype, and any quantization or chat template
    its extra arguments force; `layer_id_convention` reads a published drafter's ids."""

    max_model_len: int
    dtype: str
    quantization: str | None = None
    chat_template: Path | None = None
    layer_id_convention: str | None = None
    # The engine's model-class folder (its installed source: which drafter fields it reads) and kind.
    engine_models: Path | None = None
    engine_kind: str | None = None

    @classmethod
    def from_engine(cls, engine: Engine) -> ServingContract:
        settings = engine.settings
        template = _flag_value(settings.extra_args, ("--chat-template",))
        return cls(
            max_model_len=int(settings.max_model_len),
            dtype=str(settings.dtype),
            quantization=_flag_value(settings.extra_args, ("--quantization", "-q")),
            chat_template=Path(template) if template is not None else None,
            layer_id_convention=engine.layer_id_convention,
            engine_models=engine_models_folder(engine),
            engine_kind=engine.kind,
        )


def _flag_value(args: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value of the last `--flag value` / `--flag=value` among `args`."""
    found: str | None = None
    for index, arg in enumerate(args):
        for name in names:
            if arg == name and index + 1 < len(args):
                found = args[index + 1]
            elif arg.startswith(name + "="):
                found = arg[len(name) + 1 :]
    return found


@dataclass(frozen=True)
class _Pair:
    """Everything the checks read, read once."""

    target_dir: Path
    drafter_dir: Path
    target: dict[str, Any]  # the target's config.json
    drafter: dict[str, Any]  # the drafter's config.json
    record: Mapping[str, Any] | None  # the draftloop block's metadata (None: a published drafter)
    drafter_config: DrafterConfig | None  # None when the drafter's config cannot be read
    target_view: DrafterConfig | None  # the drafter the target's config implies (same normalisation)
    serving: ServingContract | None
    fine_tune: FineTuneContract | None

    @property
    def target_file(self) -> str:
        return str(self.target_dir / "config.json")

    @property
    def drafter_file(self) -> str:
        return str(self.drafter_dir / "config.json")


Check = Callable[[_Pair], Iterator[ContractIssue]]


def family_or_none(config: Mapping[str, Any]) -> TargetFamily | None:
    """The family of a model config, or None when no registered family covers its model_type."""
    try:
        return family_for_config(config)
    except UnknownFamilyError:
        return None


def _check_attention(pair: _Pair) -> Iterator[ContractIssue]:
    target_family, drafter_family = family_or_none(pair.target), family_or_none(pair.drafter)
    if target_family is None or drafter_family is None:
        return  # nothing to compare
    needed, given = target_family.drafter_attention, drafter_family.drafter_attention
    if needed == given:
        return
    reason = (
        f"a {given}-attention EAGLE-3 drafter ({pair.drafter.get('architectures')}) cannot serve the "
        f"{target_family.name} target {pair.target.get('architectures')}, whose drafters use {needed} "
        "attention: the engine keeps target and drafter KV caches in one block layout"
    )
    if needed == "mla":
        reason += (
            " and an MLA cache shares no block size with a per-head one (vLLM: 'No common block size ... "
            "CPU_MLA ... CPU_ATTN'). Train an MLA drafter (architectures Eagle3DeepseekV2ForCausalLM), "
            "which the drafter config builder picks for this family."
        )
    else:
        reason += f". Train a {needed}-attention drafter."
    yield ContractIssue("attention", "error", pair.drafter_file, reason)


def _check_target_weights(pair: _Pair) -> Iterator[ContractIssue]:
    try:
        check_target_weights(pair.target_dir, allow_bin=True)
    except DrafterFormatError as error:
        yield ContractIssue("target_weights", "error", str(pair.target_dir), str(error))


def _check_drafter_tensors(pair: _Pair) -> Iterator[ContractIssue]:
    """Missing, unexpected or misshapen tensors, non-finite weights, d2t/t2d (kernels.checkpoint)."""
    if pair.drafter_config is None:
        return  # reported by _check_drafter_config
    try:
        # The ids' convention shapes no tensor: any one reads a published drafter's tensors.
        load_drafter(pair.drafter_dir, convention=_convention(pair))
    except DrafterFormatError as error:
        check = error.check if error.check in ("d2t", "tensors") else "drafter_weights"
        yield ContractIssue(check, "error", str(pair.drafter_dir), str(error))


def _convention(pair: _Pair) -> str:
    return _reading_convention(pair.serving, pair.fine_tune)


def _reading_convention(serving: ServingContract | None, fine_tune: FineTuneContract | None) -> str:
    """The convention a published drafter's ids are read in: the engine's, the fine-tuning's, else
    layer_input (vLLM's; a missing record is its own clause, `_check_layer_id_record`)."""
    named = serving.layer_id_convention if serving else fine_tune.layer_id_convention if fine_tune else None
    return named or "layer_input"


def _check_drafter_config(pair: _Pair) -> Iterator[ContractIssue]:
    if pair.drafter_config is None:
        try:
            read_drafter_config(pair.drafter_dir, _convention(pair))
        except DrafterFormatError as error:
            yield ContractIssue("drafter_config", "error", pair.drafter_file, str(error))


def _check_layer_id_record(pair: _Pair) -> Iterator[ContractIssue]:
    """A fine-tuning without a named convention needs the folder's record of its ids' convention."""
    if (
        pair.fine_tune is None
        or pair.fine_tune.layer_id_convention is not None
        or pair.drafter_config is None
    ):
        return
    try:
        read_drafter_config(pair.drafter_dir, None)  # the record, or a format that fixes the convention
    except DrafterFormatError:
        ids = drafter_config_layer_ids(pair.drafter)
        yield ContractIssue(
            "layer_id_record",
            "error",
            pair.drafter_file,
            f"{pair.drafter_file} has no 'draftloop' block recording the convention of its "
            f"eagle_aux_hidden_state_layer_ids {ids}, and training.drafter_init_convention is null: "
            "name it (layer_input | layer_output | vllm | sglang), or the drafter may fuse other target "
            "layers than it was trained on",
        )


def _check_made_for_target(pair: _Pair) -> Iterator[ContractIssue]:
    drafter, target = pair.drafter_config, pair.target_view
    if drafter is None or target is None:
        return
    if drafter.target_hidden_size != target.hidden_size:
        yield ContractIssue(
            "hidden_size",
            "error",
            pair.drafter_file,
            f"the drafter was made for a target of hidden size {drafter.target_hidden_size}; this target's "
            f"hidden_size is {target.hidden_size} ({pair.target_file})",
        )
    if drafter.vocab_size != target.vocab_size:
        yield ContractIssue(
            "vocab_size",
            "error",
            pair.drafter_file,
            f"the drafter was made for a vocabulary of {drafter.vocab_size} tokens; this target's "
            f"vocab_size is {target.vocab_size} ({pair.target_file})",
        )
    depth = pair.target.get(
        "num_hidden_layers", (pair.target.get("text_config") or {}).get("num_hidden_layers")
    )
    ids = drafter.aux_layer_ids.ids
    if isinstance(depth, int) and ids and max(ids) >= depth:
        yield ContractIssue(
            "aux_layer_ids",
            "error",
            pair.drafter_file,
            f"the drafter reads aux layers {list(ids)} (layer_input) but the target has {depth} decoder "
            f"layers ({pair.target_file})",
        )


def _check_rope(pair: _Pair) -> Iterator[ContractIssue]:
    drafter, target = pair.drafter_config, pair.target_view
    if drafter is not None and target is not None:
        if drafter.rope_theta != target.rope_theta:
            yield ContractIssue(
                "rope_theta",
                "error",
                pair.drafter_file,
                f"rope_theta {drafter.rope_theta!r} in {pair.drafter_file} vs the target's "
                f"{target.rope_theta!r} in {pair.target_file}: positions would rotate differently",
            )
        if (drafter.rope_scaling or None) != (target.rope_scaling or None):
            yield ContractIssue(
                "rope_scaling",
                "error",
                pair.drafter_file,
                f"drafter rope_scaling {drafter.rope_scaling} != target rope_scaling {target.rope_scaling} "
                f"({pair.target_file})",
            )
    served_length = pair.serving.max_model_len if pair.serving is not None else None
    if drafter is not None and served_length is not None and drafter.max_position_embeddings < served_length:
        yield ContractIssue(
            "max_position_embeddings",
            "error",
            pair.drafter_file,
            f"drafter max_position_embeddings {drafter.max_position_embeddings} < served "
            f"engine.max_model_len {served_length}: serve at most "
            f"{drafter.max_position_embeddings} tokens or use a drafter made for longer contexts",
        )
    trained_length = pair.fine_tune.max_length if pair.fine_tune is not None else None
    if (
        drafter is not None
        and trained_length is not None
        and drafter.max_position_embeddings < trained_length
    ):
        yield ContractIssue(
            "max_position_embeddings",
            "error",
            pair.drafter_file,
            f"max_position_embeddings {drafter.max_position_embeddings} in {pair.drafter_file} < "
            f"data.max_length {trained_length}: training rows would reach positions its RoPE was not made "
            "for; lower data.max_length or start from a drafter made for longer contexts",
        )


def _check_final_norm(pair: _Pair) -> Iterator[ContractIssue]:
    if pair.record is None:
        return
    recorded = pair.record.get(LAST_HIDDEN_STATE_KEY)
    if recorded is None:
        yield ContractIssue(
            "final_norm",
            "warning",
            pair.drafter_file,
            f"no {LAST_HIDDEN_STATE_KEY} recorded (trained before it was); the engine gives the last hidden "
            f"state {LAST_HIDDEN_AFTER_FINAL_NORM}",
        )
    elif recorded != LAST_HIDDEN_AFTER_FINAL_NORM:
        yield ContractIssue(
            "final_norm",
            "error",
            pair.drafter_file,
            f"the drafter was trained on last hidden states {recorded!r}; the engine's are "
            f"{LAST_HIDDEN_AFTER_FINAL_NORM!r} (logits = lm_head(last hidden state))",
        )


def _check_chat_template(pair: _Pair) -> Iterator[ContractIssue]:
    if pair.record is None or CHAT_TEMPLATE_KEY not in pair.record:
        return
    trained = pair.record.get(CHAT_TEMPLATE_KEY)
    source = pair.serving.chat_template if pair.serving and pair.serving.chat_template else pair.target_dir
    served = chat_template_sha256(source)
    if trained != served:
        yield ContractIssue(
            "chat_template",
            "error",
            pair.drafter_file,
            f"the drafter was trained on conversations rendered with chat template sha256 {trained}; the "
            f"served one ({source}) has sha256 {served}: the drafter would see other tokens than it learnt",
        )


def _resolved_dtype(dtype: str, target: Mapping[str, Any]) -> str:
    """An engine dtype setting as the dtype the target runs in: an engine's "auto" keeps a 16-bit
    checkpoint's dtype (and picks a 16-bit type for a float32 one, left as "auto")."""
    if dtype != "auto":
        return dtype
    declared = target.get("torch_dtype", target.get("dtype"))
    return str(declared) if declared in ("bfloat16", "float16") else "auto"


def _check_target_numerics(pair: _Pair) -> Iterator[ContractIssue]:
    if pair.record is None or pair.serving is None:
        return
    trained_dtype = pair.record.get(TARGET_DTYPE_KEY)
    served_dtype = _resolved_dtype(pair.serving.dtype, pair.target)
    if trained_dtype is not None and _resolved_dtype(str(trained_dtype), pair.target) != served_dtype:
        yield ContractIssue(
            "target_dtype",
            "warning",
            pair.drafter_file,
            f"the drafter was trained on hidden states of the target in {trained_dtype}; it is served in "
            f"{served_dtype} (engine.dtype {pair.serving.dtype}): acceptance may differ from training's",
        )
    if TARGET_QUANTIZATION_KEY in pair.record:
        trained_quantization = pair.record.get(TARGET_QUANTIZATION_KEY)
        served_quantization = pair.serving.quantization or target_quantization(pair.target)
        if trained_quantization != served_quantization:
            yield ContractIssue(
                "target_quantization",
                "warning",
                pair.drafter_file,
                f"the drafter was trained on the target quantized as {trained_quantization}; it is served "
                f"quantized as {served_quantization}: acceptance may differ from training's",
            )


EAGLE31_FIELDS = ("fc_norm", "norm_before_fc", "norm_output")  # as vLLM 0.32 and SGLang name them


def _check_variant_fields(pair: _Pair) -> Iterator[ContractIssue]:
    """EAGLE 3.1 fields the drafter's config.json sets that the engine's drafter class never reads: served,
    the drafter would run as plain EAGLE-3 (infra/engines/variant_support.py)."""
    serving = pair.serving
    if serving is None or serving.engine_models is None or "speculators_model_type" in pair.drafter:
        return  # no engine source to read (a speculators folder: vLLM translates its fields itself)
    eagle_config = pair.drafter.get("eagle_config")
    nested = eagle_config if isinstance(eagle_config, Mapping) else {}
    fields = {name for name in EAGLE31_FIELDS if pair.drafter.get(name) or nested.get(name)}
    architectures = pair.drafter.get("architectures") or []
    if not fields or not architectures:
        return
    support = variant_support(serving.engine_models, str(architectures[0]), EAGLE31_FIELDS)
    if support is None:
        return  # the engine's folder does not define the class: not ours to judge
    unread = support.unread(fields)
    if not unread:
        return
    weights = " (its fc_norm weights skipped at load)" if "fc_norm" in unread else ""
    yield ContractIssue(
        "variant_fields",
        "error",
        pair.drafter_file,
        f"the drafter sets {', '.join(f'{name}: true' for name in unread)} (EAGLE 3.1), but the "
        f"{serving.engine_kind} class {support.architecture} ({support.module}) does not read "
        f"{'it' if len(unread) == 1 else 'them'}: it would serve the drafter as plain EAGLE-3{weights}. "
        "Use an engine version that reads the fields (SGLang: sgl-project/sglang#24663, the MLA drafter "
        "#26506; vLLM 0.32), or train with training.drafter=eagle3",
    )


CHECKS: tuple[Check, ...] = (
    _check_attention,
    _check_target_weights,
    _check_drafter_config,
    _check_drafter_tensors,
    _check_layer_id_record,
    _check_made_for_target,
    _check_rope,
    _check_final_norm,
    _check_chat_template,
    _check_target_numerics,
    _check_variant_fields,
)
# What the folder was trained on: a fine-tuning retrains on the config's data and records its own.
TRAINED_ON_CHECKS: tuple[Check, ...] = (_check_final_norm, _check_chat_template, _check_target_numerics)


def _read_pair(
    target_dir: Path, drafter_dir: Path, serving: ServingContract | None, fine_tune: FineTuneContract | None
) -> _Pair:
    target = read_json(Path(target_dir) / "config.json")
    drafter = read_json(Path(drafter_dir) / "config.json")
    block = drafter.get("draftloop")
    record = block.get("metadata") if isinstance(block, Mapping) else None
    try:
        drafter_config: DrafterConfig | None = read_drafter_config(
            drafter_dir, _reading_convention(serving, fine_tune)
        )
    except DrafterFormatError:
        drafter_config = None
    target_view: DrafterConfig | None = None
    if drafter_config is not None:
        try:  # the target through the same builder: theta and scaling normalised alike
            target_view = DrafterConfig.from_model_config(target, drafter_config.aux_layer_ids)
        except (KeyError, TypeError, ValueError):
            target_view = None  # an unknown family or an incomplete config: nothing to compare
    return _Pair(
        target_dir=Path(target_dir),
        drafter_dir=Path(drafter_dir),
        target=target,
        drafter=drafter,
        record=record if isinstance(record, Mapping) else None,
        drafter_config=drafter_config,
        target_view=target_view,
        serving=serving,
        fine_tune=fine_tune,
    )


def check_drafter_contract(
    target_dir: Path,
    drafter_dir: Path,
    serving: ServingContract | None = None,
    fine_tune: FineTuneContract | None = None,
) -> list[ContractIssue]:
    """Every broken clause of the drafter contract, errors and warnings (see the module docstring).
    Without `serving`, the clauses about what is served (max_model_len, dtype) are not checked; with
    `fine_tune`, those about the rows training reaches and the ids' convention are, not those about what
    the folder was trained on."""
    pair = _read_pair(Path(target_dir), Path(drafter_dir), serving, fine_tune)
    checks = CHECKS if fine_tune is None else tuple(c for c in CHECKS if c not in TRAINED_ON_CHECKS)
    return [issue for check in checks for issue in check(pair)]


def check_drafter_pairing(
    target_dir: Path, drafter_dir: Path, serving: ServingContract | None = None
) -> list[ContractIssue]:
    """Raise DrafterPairingError naming every contract error; return the warnings (verdict reasons)."""
    issues = check_drafter_contract(target_dir, drafter_dir, serving)
    errors = [issue for issue in issues if issue.severity == "error"]
    if errors:
        field = errors[0].file if len(errors) == 1 else str(drafter_dir)
        reason = errors[0].message if len(errors) == 1 else "; ".join(str(error) for error in errors)
        raise DrafterPairingError(field, reason)
    return [issue for issue in issues if issue.severity == "warning"]
