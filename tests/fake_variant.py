"""A drafter variant added by this one module: a norm after the fusion and one on the handed-on state,
registered at import. tests/test_drafter_variant.py builds, trains, saves and loads it; nothing else in
the code base names it. It has no published form (speculators' ``fc_norm`` / ``norm_output`` are EAGLE
3.1's, kernels/variants/eagle31.py): its speculators export is refused, and it claims no published config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter, RMSNorm
from draftloop.kernels.variants.base import DrafterVariant, UnsupportedVariantError, register_variant

NAME = "fake_fc_norm"


@dataclass(frozen=True)
class FcNormVariant(DrafterVariant):
    def add_modules(self, drafter: Eagle3Drafter, config: DrafterConfig) -> None:
        drafter.fuse_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        drafter.output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self, drafter: Eagle3Drafter, aux_hidden: Tensor) -> Tensor:
        return drafter.fuse_norm(super().fuse(drafter, aux_hidden))

    def output_hidden(self, drafter: Eagle3Drafter, prenorm: Tensor) -> Tensor:
        if drafter.config.variant_options["norm_output"]:
            return drafter.output_norm(prenorm)
        return prenorm

    def speculators_fields(self, config: DrafterConfig) -> dict[str, Any]:
        raise UnsupportedVariantError(f"drafter variant {NAME!r} has no speculators form")

    def options_from_speculators(self, data: Mapping[str, Any]) -> dict[str, Any] | None:
        return None


VARIANT = register_variant(FcNormVariant(name=NAME, options={"norm_output": True}))
