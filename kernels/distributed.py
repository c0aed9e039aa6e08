"""Sums over the ranks of a data-parallel training run (torch.distributed, any backend).

Every rank trains its own samples of an optimizer step; what the step needs from all of them (its
counted tokens, its gradient, its metrics) is summed here, one collective per dtype, and is a no-op for
one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["sum_across_ranks", "sum_gradients_across_ranks"]


def sum_across_ranks(tensors: Sequence[Tensor], world: int) -> None:
    """In place: every tensor becomes its sum over the ranks (one collective per dtype)."""
    if world == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    # NCCL reduces only CUDA tensors; gloo CPU ones.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group]).to(on or group[0].device)
        dist.all_reduce(flat)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def sum_gradients_across_ranks(params: Sequence[Tensor], world: int) -> None:
    """Every parameter's gradient becomes the sum of the ranks' (a rank with nothing in a step adds zeros)."""
    for param in params:
        if param.grad is None:  # this rank had nothing to train in the step
            param.grad = torch.zeros_like(param)
    sum_across_ranks([cast(Tensor, p.grad) for p in params], world)
