"""A fake target family, added by this one module and nothing else: "toyqwen" targets.

A toyqwen model is a tiny Llama decoder under another model_type, so no real family covers it. Its
family states where the layers are and its own default aux layer ids (the first, middle and last layer),
which differ from the Llama defaults, so a test can tell the family's answer from a fallback's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from draftloop.kernels.families.base import TargetFamily, register_family
from draftloop.kernels.layer_ids import LayerIds


class ToyQwenConfig(LlamaConfig):
    model_type = "toyqwen"


@dataclass(frozen=True)
class ToyQwenFamily(TargetFamily):
    def decoder(self, model: nn.Module) -> nn.Module:
        inner = model.model
        assert isinstance(inner, nn.Module)
        return inner

    def default_aux_layer_ids(self, depth: int) -> LayerIds:
        return LayerIds((0, depth // 2, depth - 1))


TOYQWEN = register_family(
    ToyQwenFamily(name="toyqwen", model_types=("toyqwen",), engine_patches=("eagle3_enabler",))
)


def tiny_toyqwen(seed: int = 0) -> LlamaForCausalLM:
    """A random 6-layer toyqwen model (hidden 32, vocabulary 64)."""
    torch.manual_seed(seed)
    config = ToyQwenConfig(
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
    )
    return LlamaForCausalLM(config).eval()
