"""Target families: everything draftloop must know about one kind of target model, in one object.

A family names the Hugging Face `model_type`s it covers and says
- where the decoder layers and the final norm are (what `capture` hooks),
- which attention the drafter uses (`drafter_attention`) and the attention-specific drafter config
  fields read from the target's config (`drafter_config_fields`),
- the default aux layer ids for a target of a given depth,
- which engine-side patches serving it may need (`engine_patches`: names of the vLLM plugin's patches,
  each a no-op on an engine that supports the family natively).

Adding a family = one module in kernels/families/ that calls `register_family(...)` at import; the
registry imports every module of this package on first lookup.

A model_type no module registers goes through the generic decoder-only path (`GENERIC`, the Llama-like
defaults below) when its config has what that path assumes (`generic_refusal` says what it lacks):
a causal LM (`architectures` ending in ForCausalLM), not encoder-decoder, not wrapped (decoder fields at
the top, not only under `text_config`), not multi-head latent attention (no `kv_lora_rank`), and the
shape fields the drafter is built from. The module layout is checked on the model itself
(`TargetFamily.check_structure`: decoder layers, final norm, embeddings and head found, of the config's
depth and sizes), on the meta device before a run (infra/targets/support.py). A family module is for
what differs: MLA drafters, wrappers, engine patches, default layer ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from ..discovery import import_package_modules
from ..layer_ids import LayerIds

__all__ = [
    "GENERIC",
    "GENERIC_CONFIG_FIELDS",
    "DrafterAttention",
    "FamilyRegistrationError",
    "TargetFamily",
    "UnknownFamilyError",
    "config_value",
    "family_for_config",
    "generic_refusal",
    "get_family",
    "known_families",
    "language_model_config",
    "register_family",
]

DrafterAttention = Literal["llama", "mla"]


class FamilyRegistrationError(ValueError):
    """A family whose name or model_type another registered family already has."""


class UnknownFamilyError(ValueError):
    """No registered family covers a model_type (or a family name); the message lists the known ones."""


_REQUIRED: Any = object()


def language_model_config(config: Any) -> Any:
    """The language-model part of a config (object or mapping): targets wrapped for multimodality
    (e.g. Kimi-K2.5) keep the decoder's fields, and its own model_type, in `text_config`."""
    if isinstance(config, Mapping):
        text = config.get("text_config")
        if "hidden_size" not in config and isinstance(text, Mapping):
            merged = dict(text)
            merged.setdefault("model_type", config.get("model_type"))
            return merged
        return dict(config)
    if getattr(config, "hidden_size", None) is None and getattr(config, "text_config", None) is not None:
        return config.text_config
    return config


def config_value(config: Any, name: str, default: Any = _REQUIRED) -> Any:
    """`name` of a config object or mapping; a missing or null value gives `default`, or raises."""
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"model config has no {name!r}")
        return default
    return value


@dataclass(frozen=True)
class TargetFamily:
    """One family of target models. The methods are the Llama-like defaults; a family overrides what
    differs (subclass and register an instance)."""

    name: str
    model_types: tuple[str, ...]
    drafter_attention: DrafterAttention = "llama"
    engine_patches: tuple[str, ...] = ()

    def decoder(self, model: nn.Module) -> nn.Module:
        """The module holding the decoder layers (runs the stack without the lm_head)."""
        candidates: list[Any] = []
        get_decoder = getattr(model, "get_decoder", None)
        if callable(get_decoder):
            with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
                candidates.append(get_decoder())
        inner = getattr(model, "model", None)
        candidates += [inner, getattr(inner, "language_model", None), model]
        for candidate in candidates:
            layers = getattr(candidate, "layers", None)
            if isinstance(candidate, nn.Module) and isinstance(layers, nn.ModuleList):
                return candidate
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no .layers ModuleList)")

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers; layer_input id k is the hidden state entering layer k."""
        layers = self.decoder(model).layers
        assert isinstance(layers, nn.ModuleList)
        return layers

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The norm after the last layer (its output times lm_head = the logits)."""
        decoder = self.decoder(model)
        for name in _FINAL_NORM_NAMES:
            norm = getattr(decoder, name, None)
            if isinstance(norm, nn.Module):
                return norm
        raise ValueError(
            f"cannot find the final norm of {type(model).__name__} "
            f"(none of {', '.join('.' + name for name in _FINAL_NORM_NAMES)} on its decoder)"
        )

    def check_structure(self, model: nn.Module) -> None:
        """Raise ValueError naming what capture, training or serving would not find in `model` (works on
        the meta device: only modules and shapes are read): the decoder layers, as many as the config's
        `num_hidden_layers`; the final norm; the input embeddings and the output head, [vocab, hidden]."""
        config = language_model_config(getattr(model, "config", {}))
        kind = type(model).__name__
        layers = self.decoder_layers(model)
        depth = int(config_value(config, "num_hidden_layers"))
        if len(layers) != depth:
            raise ValueError(f"{kind} has {len(layers)} decoder layers, its config says {depth}")
        self.final_norm(model)
        shape = (int(config_value(config, "vocab_size")), int(config_value(config, "hidden_size")))
        for what, module in (
            ("input embeddings", model.get_input_embeddings()),  # type: ignore[operator]
            ("output head", model.get_output_embeddings()),  # type: ignore[operator]
        ):
            weight = getattr(module, "weight", None)
            if weight is None:
                raise ValueError(f"cannot find the {what} of {kind}")
            if tuple(weight.shape) != shape:
                raise ValueError(
                    f"{kind}'s {what} are {tuple(weight.shape)}, expected [vocab, hidden] = {shape}"
                )

    def default_aux_layer_ids(self, depth: int) -> LayerIds:
        """The target layers a drafter fuses when the config names none (layer_input convention)."""
        return LayerIds.default_for_depth(depth)

    def drafter_config_fields(self, target_config: Any) -> dict[str, Any]:
        """Attention-specific `DrafterConfig` fields for a drafter of this family's target (grouped-query
        attention: key/value heads and head size)."""
        config = language_model_config(target_config)
        heads = int(config_value(config, "num_attention_heads"))
        hidden = int(config_value(config, "hidden_size"))
        return {
            "num_key_value_heads": int(config_value(config, "num_key_value_heads", heads)),
            "head_dim": int(config_value(config, "head_dim", hidden // heads)),
        }


# Where decoders keep their final norm: Llama-like, Phi/StableLM-like, GPT-NeoX-like.
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm")

# The generic decoder-only path: the family of every model_type no module registers whose config fits
# (`generic_refusal`); never registered, so it claims no model_type.
GENERIC = TargetFamily(name="generic", model_types=())

# The config fields the generic path builds the drafter from.
GENERIC_CONFIG_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)

_FAMILIES: dict[str, TargetFamily] = {}
_BY_MODEL_TYPE: dict[str, TargetFamily] = {}


def register_family(family: TargetFamily) -> TargetFamily:
    """Make `family` known; a name or model_type that is taken already is refused."""
    if family.name in _FAMILIES:
        raise FamilyRegistrationError(f"target family {family.name!r} is registered twice")
    taken = {t: _BY_MODEL_TYPE[t].name for t in family.model_types if t in _BY_MODEL_TYPE}
    if taken:
        raise FamilyRegistrationError(
            f"target family {family.name!r} claims model_type(s) already registered: "
            + ", ".join(f"{model_type!r} (family {owner!r})" for model_type, owner in taken.items())
        )
    if not family.model_types:
        raise FamilyRegistrationError(f"target family {family.name!r} names no model_type")
    _FAMILIES[family.name] = family
    for model_type in family.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return family


def _discover() -> None:
    import_package_modules(__name__.rsplit(".", 1)[0])  # once: each module registers its family


def known_families() -> list[TargetFamily]:
    """Every registered family, by name."""
    _discover()
    return [_FAMILIES[name] for name in sorted(_FAMILIES)]


def _known() -> str:
    return "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in known_families())


def get_family(name: str) -> TargetFamily:
    """The family registered as `name`."""
    _discover()
    if name == GENERIC.name:
        return GENERIC
    if name not in _FAMILIES:
        raise UnknownFamilyError(f"unknown target family {name!r}; known families: {_known()}")
    return _FAMILIES[name]


def generic_refusal(config: Any) -> str | None:
    """Why the generic decoder-only path cannot take a target with this config (object or mapping), or
    None when it can: what it assumes is in the module docstring."""
    inner = language_model_config(config)
    if inner is not config and not (isinstance(config, Mapping) and inner == dict(config)):
        return (
            "its decoder is wrapped (fields under text_config): a family module says how to reach it "
            "(kernels/families/deepseek.py does for Kimi-K2.5)"
        )
    if config_value(inner, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; EAGLE-3 drafts for decoder-only targets"
    if config_value(inner, "kv_lora_rank", None) is not None:
        return (
            "it uses multi-head latent attention (kv_lora_rank): its drafter must use MLA too, which a "
            'family module declares (drafter_attention="mla", as kernels/families/deepseek.py)'
        )
    missing = [name for name in GENERIC_CONFIG_FIELDS if config_value(inner, name, None) is None]
    if missing:
        return f"its config has no {', '.join(missing)}"
    architectures = list(config_value(inner, "architectures", None) or [])
    if architectures and not any(str(name).endswith("ForCausalLM") for name in architectures):
        return f"its architectures {architectures} name no causal LM (a class ending in ForCausalLM)"
    return None


def family_for_config(config: Any) -> TargetFamily:
    """The family of a model config (a transformers config or its dict), by its model_type: a registered
    family, else the generic decoder-only path when the config fits it (`generic_refusal`)."""
    _discover()
    model_type = config_value(language_model_config(config), "model_type", None)
    family = _BY_MODEL_TYPE.get(str(model_type)) if model_type else None
    if family is not None:
        return family
    refusal = generic_refusal(config) if model_type else "its config names no model_type"
    if refusal is None:
        return GENERIC
    raise UnknownFamilyError(
        f"no target family for model_type {model_type!r}, and the generic decoder-only path does not fit "
        f"it: {refusal}; known families: {_known()} (adding one = a module in kernels/families/)"
    )
