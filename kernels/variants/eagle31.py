"""EAGLE 3.1: normalised aux states before fc, and the post-norm state handed on to the next draft step.

Matched to vLLM 0.32's drafter classes (``llama_eagle3.py``: ``combine_hidden_states`` and
``LlamaModel.forward``; ``deepseek_eagle3.py``, the MLA drafter); the options are the config fields
vLLM reads at the top level of the drafter's config.json:

- ``norm_before_fc``: one RMSNorm ``input_norm`` [n * Ht] over the concatenated aux states before fc
  (vLLM's Llama drafter also reads it from ``eagle_config``). vLLM's MLA drafter does not read it, so
  an MLA drafter with it on is refused (no engine would serve what was trained);
- ``fc_norm``: one RMSNorm per aux-layer chunk, ``fc_norm.0`` .. ``fc_norm.{n-1}`` [Ht] each, before fc
  (after ``input_norm`` when both are on, as vLLM computes it);
- ``norm_output``: the state handed on to the next draft step is norm(prenorm) instead of prenorm; the
  logits are lm_head(norm(prenorm)) either way.

On disk (and in `weights_state_dict`) the weights are ``input_norm.weight`` and ``fc_norm.<i>.weight``
next to ``fc.weight``: vLLM's load_weights prefixes "model." to reach its ``LlamaModel`` modules of those
names, and the speculators library names its modules the same. Every norm uses the drafter's
``rms_norm_eps`` and starts at ones.

Defaults: the published EAGLE 3.1 drafters' layer (fc_norm and norm_output on, norm_before_fc off;
the speculators library refuses fc_norm together with norm_before_fc, vLLM computes both). Every option
off would be plain EAGLE-3 under another name and is refused: use variant "eagle3".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from .base import DrafterVariant, UnsupportedVariantError, register_variant

if TYPE_CHECKING:
    from ..drafter import DrafterConfig, Eagle3Drafter

NAME = "eagle3.1"
OPTIONS = ("fc_norm", "norm_before_fc", "norm_output")


@dataclass(frozen=True)
class Eagle31Variant(DrafterVariant):
    def check_config(self, config: DrafterConfig) -> None:
        options = config.variant_options
        if not any(options[name] for name in OPTIONS):
            raise ValueError(
                f"drafter variant {NAME!r} with {list(OPTIONS)} all off is plain EAGLE-3: use 'eagle3'"
            )
        if config.attention == "mla" and options["norm_before_fc"]:
            raise ValueError(
                f"drafter variant {NAME!r}: norm_before_fc is not read by vLLM's MLA drafter "
                "(Eagle3DeepseekV2ForCausalLM has no input_norm); use fc_norm"
            )

    def add_modules(self, drafter: Eagle3Drafter, config: DrafterConfig) -> None:
        from ..drafter import RMSNorm  # here, not at the top: kernels/drafter.py imports this package

        options, width = config.variant_options, config.target_hidden_size
        if options["norm_before_fc"]:
            drafter.input_norm = RMSNorm(config.num_aux_layers * width, config.rms_norm_eps)
        if options["fc_norm"]:
            drafter.fc_norm = nn.ModuleList(
                RMSNorm(width, config.rms_norm_eps) for _ in range(config.num_aux_layers)
            )

    def fuse(self, drafter: Eagle3Drafter, aux_hidden: Tensor) -> Tensor:
        options = drafter.config.variant_options
        x = aux_hidden.to(drafter.fc.weight.dtype)
        if options["norm_before_fc"]:
            x = drafter.get_submodule("input_norm")(x)
        if options["fc_norm"]:
            norms = cast(nn.ModuleList, drafter.get_submodule("fc_norm"))
            chunks = x.chunk(drafter.config.num_aux_layers, dim=-1)
            x = torch.cat([norm(chunk) for norm, chunk in zip(norms, chunks, strict=True)], dim=-1)
        return drafter.fc(x)

    def output_hidden(self, drafter: Eagle3Drafter, prenorm: Tensor) -> Tensor:
        return drafter.norm(prenorm) if drafter.config.variant_options["norm_output"] else prenorm

    def logits_input(self, drafter: Eagle3Drafter, hidden: Tensor) -> Tensor:
        # With norm_output the handed-on state already is norm(prenorm): normalising again would be wrong.
        return hidden if drafter.config.variant_options["norm_output"] else drafter.norm(hidden)

    def native_fields(self, config: DrafterConfig) -> dict[str, Any]:
        # Explicit: vLLM's readers default each to false.
        return {name: bool(config.variant_options[name]) for name in OPTIONS}

    def speculators_fields(self, config: DrafterConfig) -> dict[str, Any]:
        options = config.variant_options
        if options["fc_norm"] and options["norm_before_fc"]:
            raise UnsupportedVariantError(
                f"drafter variant {NAME!r} with both fc_norm and norm_before_fc has no speculators form "
                "(its config refuses the pair); export the native folder"
            )
        return {**super().speculators_fields(config), **self.native_fields(config)}

    def options_from_speculators(self, data: Mapping[str, Any]) -> dict[str, Any] | None:
        if data.get("norm_before_residual") or not any(data.get(name) for name in OPTIONS):
            return None  # another layer (no variant computes norm_before_residual), or plain EAGLE-3
        return {name: bool(data.get(name)) for name in OPTIONS}


VARIANT = register_variant(
    Eagle31Variant(name=NAME, options={"fc_norm": True, "norm_before_fc": False, "norm_output": True})
)
