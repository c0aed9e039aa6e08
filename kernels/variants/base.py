"""Drafter variants: what one kind of EAGLE-3-style drafter adds to the shared layer, in one object.

Every drafter is the layer of kernels/drafter.py (fc fusing the aux states, one decoder layer, norm,
lm_head). A variant says what differs:

- its config fields (`options`: names and defaults), recorded in `DrafterConfig.variant_options`;
- its extra modules (`add_modules`; their weights are saved and loaded with the rest);
- which configs it refuses (`check_config`, e.g. an option an engine's drafter class does not read);
- how the aux states are fused (`fuse`), what the layer's residual is (`residual`), which hidden state
  a pass hands on to the next draft step (`output_hidden`) and what lm_head reads of it (`logits_input`:
  always norm(prenorm), however the handed-on state was taken);
- what it writes into exported configs (`native_fields`, `speculators_fields`) and which published
  configs it reads (`options_from_speculators`: speculators' eagle3 format and vLLM's native drafter
  config name the variant by the same fields).

The methods are plain EAGLE-3's behaviour; a variant overrides what differs (subclass and register an
instance). Adding one = one module in kernels/variants/ that calls `register_variant(...)` at import;
the registry imports every module of this package on first lookup. A config naming no registered
variant, or a published config whose variant fields no variant reads (or more than one claims), is
refused here, naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..discovery import import_package_modules

if TYPE_CHECKING:
    from ..drafter import DrafterConfig, Eagle3Drafter

__all__ = [
    "SPECULATORS_VARIANT_FIELDS",
    "DrafterVariant",
    "UnsupportedVariantError",
    "VariantRegistrationError",
    "get_variant",
    "known_variants",
    "register_variant",
    "variant_for_published",
]

# The fields by which speculators' eagle3 format and vLLM's native drafter configs name the layer variant
# (all false: plain EAGLE-3).
SPECULATORS_VARIANT_FIELDS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class VariantRegistrationError(ValueError):
    """A variant whose name another registered variant already has."""


class UnsupportedVariantError(ValueError):
    """No registered variant of that name, fields or published config; the message names them."""


@dataclass(frozen=True)
class DrafterVariant:
    """One kind of drafter. The methods are plain EAGLE-3's; a variant overrides what differs."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)  # its config fields and their defaults

    def resolve_options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``given`` completed with the defaults; a field this variant does not have is refused."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise UnsupportedVariantError(
                f"drafter variant {self.name!r} has no field(s) {unknown}; "
                f"its fields: {sorted(self.options) or 'none'}"
            )
        return {**self.options, **given}

    def check_config(self, config: DrafterConfig) -> None:
        """Refuse (ValueError naming why) a config this variant cannot build or no engine would serve."""

    def add_modules(self, drafter: Eagle3Drafter, config: DrafterConfig) -> None:
        """Register the variant's own modules on ``drafter`` (after the shared ones; EAGLE-3 has none)."""

    def fuse(self, drafter: Eagle3Drafter, aux_hidden: Tensor) -> Tensor:
        """[B, T, n*Ht] target aux hidden states -> [B, T, H] (vLLM's combine_hidden_states)."""
        return drafter.fc(aux_hidden.to(drafter.fc.weight.dtype))

    def residual(self, drafter: Eagle3Drafter, hidden: Tensor, normed_hidden: Tensor) -> Tensor:
        """The layer's residual stream: the raw incoming hidden state (vLLM's default)."""
        return hidden

    def output_hidden(self, drafter: Eagle3Drafter, prenorm: Tensor) -> Tensor:
        """What a pass hands on (the next step's hidden, and what `logits` reads): the prenorm state."""
        return prenorm

    def logits_input(self, drafter: Eagle3Drafter, hidden: Tensor) -> Tensor:
        """What lm_head reads, from a pass's handed-on ``hidden``: the final norm of the prenorm state
        (vLLM's compute_logits gets the post-norm state whatever is handed on). EAGLE-3: norm(hidden)."""
        return drafter.norm(hidden)

    def native_fields(self, config: DrafterConfig) -> dict[str, Any]:
        """Keys the variant adds to the engines' native config.json (EAGLE-3: none)."""
        return {}

    def speculators_fields(self, config: DrafterConfig) -> dict[str, Any]:
        """The speculators eagle3 variant fields (explicit: vLLM's reader defaults one of them to true).
        A variant with no speculators form raises UnsupportedVariantError, naming itself."""
        return dict.fromkeys(SPECULATORS_VARIANT_FIELDS, False)

    def options_from_speculators(self, data: Mapping[str, Any]) -> dict[str, Any] | None:
        """This variant's options for a published config's variant fields (`SPECULATORS_VARIANT_FIELDS`
        as vLLM reads them, from the speculators format or a native config), or None when it does not
        compute what they describe (EAGLE-3: every variant field false or absent)."""
        return {} if not any(data.get(name) for name in SPECULATORS_VARIANT_FIELDS) else None


_VARIANTS: dict[str, DrafterVariant] = {}


def register_variant(variant: DrafterVariant) -> DrafterVariant:
    """Make ``variant`` known; a name that is taken already is refused."""
    if variant.name in _VARIANTS:
        raise VariantRegistrationError(f"drafter variant {variant.name!r} is registered twice")
    _VARIANTS[variant.name] = variant
    return variant


def _discover() -> None:
    import_package_modules(__name__.rsplit(".", 1)[0])  # once: each module registers its variant


def known_variants() -> list[DrafterVariant]:
    """Every registered variant, by name."""
    _discover()
    return [_VARIANTS[name] for name in sorted(_VARIANTS)]


def get_variant(name: str) -> DrafterVariant:
    """The variant registered as ``name``."""
    _discover()
    if name not in _VARIANTS:
        raise UnsupportedVariantError(
            f"unknown drafter variant {name!r}; known variants: {', '.join(sorted(_VARIANTS))} "
            "(adding one = a module in kernels/variants/)"
        )
    return _VARIANTS[name]


def variant_for_published(data: Mapping[str, Any]) -> tuple[DrafterVariant, dict[str, Any]]:
    """(variant, its options) that computes the drafter a published config's variant fields describe;
    refused, naming those fields, when no registered variant does or when several claim them (which
    one computes it would then be an accident of registration order)."""
    claims = [
        (variant, options)
        for variant in known_variants()
        if (options := variant.options_from_speculators(data)) is not None
    ]
    named = {name: data[name] for name in SPECULATORS_VARIANT_FIELDS if data.get(name)}
    if len(claims) == 1:
        return claims[0]
    if claims:
        raise UnsupportedVariantError(
            f"published drafter variant {named} is claimed by several drafter variants: "
            f"{', '.join(variant.name for variant, _ in claims)}"
        )
    raise UnsupportedVariantError(
        f"published drafter variant {named} is not supported: no drafter variant computes it "
        f"(known variants: {', '.join(v.name for v in known_variants())}; adding one = a module in "
        "kernels/variants/)"
    )
