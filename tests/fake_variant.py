"""A drafter variant added by this one module: a norm after the fusion and one on the handed-on state
(speculators' ``fc_norm`` / ``norm_output``), registered at import. tests/test_drafter_variant.py builds,
trains, saves and loads it; nothing else in the code base names it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter, RMSNorm
from draftloop.kernels.variants.base import DrafterVariant, register_variant

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
        return {
            **super().speculators_fields(config),
            "fc_norm": True,
            "norm_output": bool(config.variant_options["norm_output"]),
        }

    def options_from_speculators(self, data: Mapping[str, Any]) -> dict[str, Any] | None:
        if not data.get("fc_norm") or data.get("norm_before_residual") or data.get("norm_before_fc"):
            return None
        return {"norm_output": bool(data.get("norm_output"))}


VARIANT = register_variant(FcNormVariant(name=NAME, options={"norm_output": True}))
