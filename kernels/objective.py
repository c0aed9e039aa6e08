"""The EAGLE-3 training objective: training-time test (TTT), unrolled the way vLLM drafts.

For a sample x_0..x_{L-1} with target aux states h_t and final (normed) states g_t:

- step 0 at position t: hidden fc(h_t), token x_{t+1}, position id t; predicts x_{t+2} against the target's
  distribution softmax(lm_head(g_{t+1})) restricted to the draft vocabulary;
- step j: hidden = the drafter's own output of step j-1 at t, token x_{t+1+j}, position id t+j;
  predicts x_{t+2+j} against softmax(lm_head(g_{t+1+j})).

Attention at step j: the step-0 keys at positions <= t (causal) plus the chain keys of steps 1..j at the
same t (the diagonal: kernels/attention.py `Chain`). Loss weight ``decay**j``; only positions whose
predicted token is an assistant token (loss_mask) of the same sample count.

Batches are either one sample per row (right-padded: causal attention never reaches the padding) or
packed rows (kernels/packing.py): then every TTT step stays inside its sample (`Packed`, `Chain` with
segments), and positions restart per sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import AttentionMode, Chain, KVPair, Packed
from .drafter import FIRST_PASS, Eagle3Drafter
from .packing import sample_length

__all__ = ["draft_target_head", "sample_ttt_tokens", "ttt_loss", "ttt_metrics", "ttt_weights"]


def draft_target_head(drafter: Eagle3Drafter, lm_head_weight: Tensor) -> Tensor:
    """The target lm_head rows of the draft vocabulary, in draft-id order [Vd, Ht]."""
    if lm_head_weight.shape[0] != drafter.config.vocab_size:
        raise ValueError(
            f"target lm_head has {lm_head_weight.shape[0]} rows, the drafter's vocabulary is "
            f"{drafter.config.vocab_size}"
        )
    ids = drafter.draft_token_ids().to(lm_head_weight.device)
    return lm_head_weight[ids].detach()


def _segments(batch: Mapping[str, Tensor]) -> Tensor:
    """Which sample of its row each token belongs to [B, L] (-1 = padding)."""
    if "segment_ids" in batch:
        return batch["segment_ids"]
    positions = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device)
    return torch.where(positions[None, :] < batch["lengths"][:, None], 0, -1)


def _positions_and_segments(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(position_ids [B, L], segment ids [B, L] of packed rows or None for one sample per row)."""
    input_ids = batch["input_ids"]
    bsz, length = input_ids.shape
    if "segment_ids" not in batch:  # one sample per row: causal attention never reaches the padding
        positions = torch.arange(length, device=input_ids.device)
        return positions[None, :].expand(bsz, length), None
    # Packed: the drafter keeps every query inside its sample (query t sees key s <= t of the same
    # segment; padding sees padding, so no row is fully masked), with a document-aware block mask
    # when compiled on CUDA, so the attention between samples is never computed.
    return batch["position_ids"], batch["segment_ids"]


def ttt_weights(batch: Mapping[str, Tensor], ttt_length: int) -> Tensor:
    """Counted positions [ttt_length, B, L]: at step j, anchor t counts when x_{t+2+j} is an assistant
    token of the same sample (so no target, token or loss crosses a sample boundary)."""
    segments = _segments(batch)
    length = segments.shape[1]
    pad = ttt_length + 2
    segments_ahead = F.pad(segments, (0, pad), value=-1)
    mask_ahead = F.pad(batch["loss_mask"].bool(), (0, pad))
    steps = [
        mask_ahead[:, 2 + j : 2 + j + length] & (segments_ahead[:, 2 + j : 2 + j + length] == segments)
        for j in range(ttt_length)
    ]
    return torch.stack(steps) & (segments >= 0)


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: Mapping[str, Tensor],
    target_head_draft: Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    step_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Weighted TTT loss of one collated batch, and per-step metrics ``terms`` [3, ttt_length] (loss, acc,
    tokens), left on the batch's device: reading them waits for the GPU, so the training loop reads one
    step's sums once (:func:`ttt_metrics` turns them into lists).

    ``step_tokens`` [ttt_length]: counted positions per TTT step over the whole optimizer step (every
    micro-batch, every rank); step j's loss sums over this batch and divides by them, so the losses of
    a step's micro-batches add up to its token-weighted mean. None: this batch's own counts.
    Per step, the terms' loss and acc are this batch's means, acc being the share of counted positions
    whose drafter argmax equals the target's argmax over the draft vocab; tokens are those positions.
    """
    input_ids = batch["input_ids"]
    length = input_ids.shape[1]
    position_ids, segments = _positions_and_segments(batch)
    weights = ttt_weights(batch, ttt_length).float()

    with torch.no_grad():
        last = batch["last_hidden"].to(target_head_draft.dtype)
        target_logits = torch.matmul(last, target_head_draft.t()).float()  # [B, L, Vd]
        # Padded once at the end so that every step reads a shifted view instead of a copy. Where the
        # shift reaches past a sample's end the position is not counted, and its outputs reach no
        # counted position (own chain only; its step-0 key is visible only to itself).
        pad = ttt_length + 1
        target_probs = F.pad(torch.softmax(target_logits, dim=-1), (0, 0, 0, pad))
        target_argmax = F.pad(target_logits.argmax(-1), (0, pad), value=-1)
        del target_logits
        ids_padded = F.pad(input_ids, (0, pad))

    hidden = drafter.fuse(batch["aux_hidden"])
    step0: KVPair | None = None
    chain: list[KVPair] = []
    total = hidden.new_zeros((), dtype=torch.float32)
    step_losses: list[Tensor] = []
    step_accs: list[Tensor] = []
    step_counts: list[Tensor] = []
    for step in range(ttt_length):
        step_ids = ids_padded[:, 1 + step : 1 + step + length]
        if step0 is None:
            first: AttentionMode = FIRST_PASS if segments is None else Packed(segments)
            hidden, kv = drafter(hidden, step_ids, position_ids, first)
            step0 = kv
        else:
            # Causal over the step-0 keys plus the diagonal (FlexAttention when compiled on CUDA).
            attention = Chain(past=[step0], earlier=chain, segments=segments)
            hidden, kv = drafter(hidden, step_ids, position_ids + step, attention)
            chain = [*chain, kv]
        weight = weights[step]
        probs = target_probs[:, 1 + step : 1 + step + length]
        logits = drafter.logits(hidden).float()
        # Soft cross-entropy with a normalised target: logsumexp(z) - sum(p * z), no log_softmax tensor.
        per_token = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
        tokens = weight.sum()
        loss_sum = (per_token * weight).sum()
        norm = tokens if step_tokens is None else step_tokens[step].to(tokens)
        total = total + (decay**step) * loss_sum / norm.clamp_min(1.0)
        with torch.no_grad():
            hits = (logits.argmax(-1) == target_argmax[:, 1 + step : 1 + step + length]).float() * weight
            step_accs.append(hits.sum() / tokens.clamp_min(1.0))
        step_losses.append(loss_sum.detach() / tokens.clamp_min(1.0))
        step_counts.append(tokens.detach())
    return total, torch.stack([torch.stack(step_losses), torch.stack(step_accs), torch.stack(step_counts)])


def ttt_metrics(terms: Tensor) -> dict[str, list[Any]]:
    """:func:`ttt_loss`'s per-step terms as lists: {"loss": [...], "acc": [...], "tokens": [int, ...]}."""
    losses, accs, counts = terms.tolist()
    return {"loss": losses, "acc": accs, "tokens": [int(t) for t in counts]}


def sample_ttt_tokens(sample: Mapping[str, Tensor], ttt_length: int, max_length: int | None) -> list[int]:
    """Counted positions of each TTT step in one sample (what :func:`ttt_weights` counts for it)."""
    mask = sample["loss_mask"][: sample_length(sample, max_length)].bool()
    return [int(mask[2 + j :].sum()) for j in range(ttt_length)]
