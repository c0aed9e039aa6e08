"""The draft vocabulary: the most frequent target tokens, as EAGLE-3's d2t/t2d tables.

``d2t`` int64 [Vd]: offsets, target_id = draft_id + d2t[draft_id] (draft ids in ascending target order).
``t2d`` bool [V]: which target tokens are in the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["build_draft_vocab", "count_tokens", "identity_vocab"]


def count_tokens(
    token_ids: Iterable[Tensor], vocab_size: int, weights: Iterable[Tensor] | None = None
) -> Tensor:
    """Occurrences of each target token id [V] (int64) over the given id tensors.

    ``weights`` (same shapes, e.g. loss masks) counts only the weighted positions.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    weight_iter = iter(weights) if weights is not None else None
    for ids in token_ids:
        flat = ids.reshape(-1).long().cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
            raise ValueError(f"token ids out of range for a vocabulary of {vocab_size}")
        weight = None
        if weight_iter is not None:
            weight = next(weight_iter).reshape(-1).long().cpu()
        counts += torch.bincount(flat, weights=weight, minlength=vocab_size).long()
    return counts


def identity_vocab(vocab_size: int) -> tuple[Tensor, Tensor]:
    return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)


def build_draft_vocab(
    token_counts: Tensor | Iterable[Tensor],
    target_vocab_size: int,
    draft_vocab_size: int | None,
) -> tuple[Tensor, Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) keeping the ``draft_vocab_size`` most frequent tokens.

    ``token_counts``: a counts tensor [V], or an iterable of token-id tensors to count.
    Ties (and unseen tokens, when fewer than Vd distinct tokens occur) go to the lower id, so the
    result is deterministic. ``draft_vocab_size`` None or == V gives the exact identity mapping.
    """
    if draft_vocab_size is None or draft_vocab_size == target_vocab_size:
        return identity_vocab(target_vocab_size)
    if not 0 < draft_vocab_size < target_vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in 1..{target_vocab_size} (the target vocabulary), "
            f"got {draft_vocab_size}"
        )
    if isinstance(token_counts, Tensor):
        counts = token_counts.reshape(-1).cpu()
        if counts.numel() != target_vocab_size:
            raise ValueError(f"token_counts has {counts.numel()} entries, expected {target_vocab_size}")
    else:
        counts = count_tokens(token_counts, target_vocab_size)
    order = torch.sort(-counts.double(), stable=True).indices
    selected = torch.sort(order[:draft_vocab_size]).values
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t.to(torch.int64), t2d
