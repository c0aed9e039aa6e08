"""What a target can or cannot do, checked from its config alone before any stage runs.

`check_target(model_config, ...)` answers in seconds, reading no weights: the family that covers the
target (a registered module, or the generic decoder-only path when the config fits it), the drafter's
attention kind, and, for the generic path, the module layout itself: the model is built on the meta
device from its config (no memory, no weights) and `TargetFamily.check_structure` finds its decoder
layers, final norm, embeddings and head. `refuse_unsupported_target` adds, given the engine, whether it
serves the target's class with EAGLE-3 (infra/engines/class_support.py reads that from its source).
A target that fails is a `TargetRefusedError` whose one-line message names the model type and what to
add; config validation (infra/runtime/config.py) turns it into a config error, so `config validate` and
`run` refuse it before anything is created.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from draftloop.infra.targets.recipes import get_recipe
from draftloop.kernels.families.base import (
    GENERIC,
    GENERIC_CONFIG_FIELDS,
    UnknownFamilyError,
    family_for_config,
)
from draftloop.kernels.layer_ids import LayerIds

if TYPE_CHECKING:
    from draftloop.infra.engines.base import Engine


class TargetRefusedError(ValueError):
    """The cycle cannot take this target; the message is one line naming its model type and the fix.
    `field`: the config field it is reported under."""

    def __init__(self, reason: str, field: str = "target.path") -> None:
        super().__init__(reason)
        self.field = field


class TargetSpec(Protocol):
    """The config's target section, as far as these checks read it."""

    path: str
    create: str | None
    trust_remote_code: bool


@dataclass(frozen=True)
class TargetSupport:
    """How the cycle will treat a target: its family (or "generic") and the drafter attention it needs."""

    model_type: str
    architectures: tuple[str, ...]
    family: str
    drafter_attention: str
    depth: int


def target_model_config(folder: str | Path, recipe: str | None) -> dict[str, Any]:
    """The target's config.json, or what its zoo recipe will write there (the recipe's fields: no
    transformers import) when the folder is not built yet. OSError/ValueError when it cannot be read."""
    config_file = Path(folder) / "config.json"
    if config_file.is_file() or recipe is None:
        data: dict[str, Any] = json.loads(config_file.read_text())
        return data
    spec = get_recipe(recipe)
    return {"model_type": spec.model_type, **spec.config_fields}


def _name(model_config: Mapping[str, Any]) -> str:
    """ "model_type 'x' (Arch)": how a refusal names the target."""
    text = model_config.get("text_config")
    model_type = model_config.get("model_type")
    if not model_type and isinstance(text, Mapping):
        model_type = text.get("model_type")
    architectures = ", ".join(str(name) for name in model_config.get("architectures") or [])
    return f"model_type {model_type!r}" + (f" ({architectures})" if architectures else "")


def check_target(
    model_config: Mapping[str, Any], *, folder: str | Path | None = None, trust_remote_code: bool = False
) -> TargetSupport:
    """The target's family and drafter attention; raises TargetRefusedError when the cycle would fail on
    it. `folder`: the target's folder, for a model_type only its own code defines (trusted only with
    `trust_remote_code`)."""
    try:
        family = family_for_config(dict(model_config))
    except UnknownFamilyError as error:
        # A config.json may spell the shape in its architecture's own names (GPT-J's n_embd): transformers'
        # config class maps them, so ask again with it before refusing.
        missing = any(name not in model_config for name in GENERIC_CONFIG_FIELDS)
        hf_config = _known_hf_config(model_config) if missing else None
        if hf_config is None:
            raise TargetRefusedError(str(error)) from None
        try:
            family = family_for_config(hf_config)
        except UnknownFamilyError as again:
            raise TargetRefusedError(str(again)) from None
    text = model_config.get("text_config")
    fields = text if isinstance(text, Mapping) and "hidden_size" not in model_config else model_config
    if family is GENERIC:
        _check_generic_structure(model_config, folder, trust_remote_code)
    return TargetSupport(
        model_type=str(fields.get("model_type") or model_config.get("model_type")),
        architectures=tuple(str(name) for name in model_config.get("architectures") or ()),
        family=family.name,
        drafter_attention=family.drafter_attention,
        depth=int(fields.get("num_hidden_layers") or 0),
    )


def _known_hf_config(model_config: Mapping[str, Any]) -> Any:
    """transformers' own config object for a model_type it knows (None otherwise)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = model_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    try:
        fields = {key: value for key, value in model_config.items() if key != "model_type"}
        return AutoConfig.for_model(model_type, **fields)
    except Exception:  # a config its own class refuses: the plain refusal stands
        return None


def _check_generic_structure(
    model_config: Mapping[str, Any], folder: str | Path | None, trust_remote_code: bool
) -> None:
    """Build the target on the meta device from its config and check the generic path finds its parts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    name = _name(model_config)
    model_type = str(model_config.get("model_type"))
    add = "add a family module in kernels/families/ that says where its parts are"
    try:
        if model_type in CONFIG_MAPPING:
            fields = {key: value for key, value in model_config.items() if key != "model_type"}
            hf_config = AutoConfig.for_model(model_type, **fields)
        elif folder is not None and trust_remote_code and (Path(folder) / "config.json").is_file():
            hf_config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
        else:
            raise TargetRefusedError(
                f"{name}: transformers has no such model type; a folder that ships its own model code "
                "needs target.trust_remote_code: true (or add a family module in kernels/families/)"
            )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    except TargetRefusedError:
        raise
    except Exception as error:  # transformers raises several types for a config it cannot build
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TargetRefusedError(f"{name}: transformers cannot build it as a causal LM ({reason})") from None
    try:
        GENERIC.check_structure(model)
    except ValueError as error:
        raise TargetRefusedError(
            f"{name}: no family module covers it and the generic decoder-only path does not fit it: "
            f"{error}; {add}"
        ) from None


def refuse_unsupported_target(
    target: TargetSpec, engine: Engine | None, aux_layer_ids: Callable[[], LayerIds]
) -> TargetSupport:
    """`check_target` for the config's target (reported under target.create while its recipe is not
    built), then, given the `engine`, whether it serves the target's class with EAGLE-3."""
    from draftloop.infra.engines.class_support import eagle3_class_support

    built = (Path(target.path) / "config.json").is_file()
    field = "target.path" if built or target.create is None else "target.create"
    model_config = target_model_config(target.path, target.create)
    try:
        support = check_target(model_config, folder=target.path, trust_remote_code=target.trust_remote_code)
    except TargetRefusedError as error:
        raise TargetRefusedError(str(error), field) from None
    served = eagle3_class_support(engine, support.architectures) if engine is not None else None
    if engine is None or served is None:
        return support
    if served.refused:
        raise TargetRefusedError(
            f"model_type {support.model_type!r}: engine {engine.kind} serves {served.architecture} without "
            f"EAGLE-3: {served.detail} (`draftloop engine doctor` shows what the engine does)",
            field,
        )
    ids = aux_layer_ids().ids
    if served.transformers_backend and 0 in ids:
        raise TargetRefusedError(
            f"model_type {support.model_type!r} is served by vLLM's Transformers backend "
            f"({served.engine_class}), which takes layer k's input from layer k-1's output: layer_input "
            f"id 0 would capture the last layer instead; choose ids from 1 (got {list(ids)})",
            "extraction.aux_layer_ids",
        )
    return support
