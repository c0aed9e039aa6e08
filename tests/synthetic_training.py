"""A tiny drafter and synthetic hidden-state samples of varied lengths, for the training-loop tests
(packing, streaming, resume). No target model: random states are enough to compare two ways of
training on the same data."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds

LAYERS = LayerIds((1, 2, 3))
TARGET = LlamaConfig(
    hidden_size=16,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    vocab_size=48,
)


def synthetic_samples(
    count: int, seed: int = 0, min_len: int = 5, max_len: int = 30
) -> list[dict[str, torch.Tensor]]:
    """``count`` samples with lengths in [min_len, max_len]; the first 3 tokens are the "prompt"."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        n = int(torch.randint(min_len, max_len + 1, (), generator=gen))
        samples.append(
            {
                "input_ids": torch.randint(0, TARGET.vocab_size, (n,), generator=gen),
                "loss_mask": (torch.arange(n) >= 3).to(torch.uint8),
                "aux_hidden": torch.randn(n, 3 * TARGET.hidden_size, generator=gen),
                "last_hidden": torch.randn(n, TARGET.hidden_size, generator=gen) * 3,
            }
        )
    return samples


def target_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of a pretend target."""
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (TARGET.vocab_size, TARGET.hidden_size)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def new_drafter(embed: torch.Tensor, seed: int = 1) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(DrafterConfig.for_target(TARGET, LAYERS))
    drafter.attach_embeddings(embed)
    return drafter
