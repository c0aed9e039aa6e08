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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import AttentionMode, Chain, ChainSlots, KVPair, Packed, SlottedChain
from .counted import CountedIndex, counted_index, counted_mask
from .drafter import FIRST_PASS, Eagle3Drafter
from .packing import sample_length

__all__ = [
    "EAGER_REGIONS",
    "LossRegions",
    "batch_counted_index",
    "compiled_regions",
    "draft_target_head",
    "sample_ttt_tokens",
    "ttt_loss",
    "ttt_metrics",
    "ttt_weights",
]


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
    return counted_mask(batch["loss_mask"], _segments(batch), ttt_length)


def batch_counted_index(batch: Mapping[str, Tensor], ttt_length: int) -> CountedIndex:
    """The batch's counted-position index: the one ``collate_rows(..., ttt_length=)`` built on the host,
    or computed here from the batch (on its device: a CUDA batch then waits for the GPU once)."""
    anchors, rows = batch.get("ttt_anchors"), batch.get("ttt_target_rows")
    if anchors is not None and rows is not None and anchors.shape[0] == ttt_length:
        return CountedIndex(anchors, rows)
    return counted_index(ttt_weights(batch, ttt_length))


class _HeadCrossEntropy(torch.autograd.Function):
    """One chunk of counted positions through the head: logits z = x W^T, the weighted soft cross-entropy
    sum_i w_i (logsumexp(z_i) - sum_v p_iv z_iv) against p_i = softmax(row ``rows[i]`` of the target table),
    and the weighted count of argmax hits.

    The loss's gradient dL/dz_i = w_i (softmax(z_i) - p_i) is computed here, by the pass that reads z for
    the loss, and kept in z's dtype (bf16 under autocast) instead of z: backward is then the head's matmuls
    alone, scaled by the incoming scalar on their outputs. No second pass over [n, Vd] rebuilds the
    softmax, and no [n, Vd] fp32 tensor outlives this call."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        head: Tensor,
        table: Tensor,
        table_lse: Tensor,
        table_argmax: Tensor,
        rows: Tensor,
        weight: Tensor,
    ) -> tuple[Tensor, Tensor]:
        logits = F.linear(x, head)  # (autocast applies here: bf16 logits)
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        probs = torch.exp(table[rows].float() - table_lse[rows, None])
        loss_sum = ((lse - (probs * z).sum(-1)) * weight).sum()
        dz = ((torch.exp(z - lse[:, None]) - probs) * weight[:, None]).to(logits.dtype)
        hits = ((logits.argmax(-1) == table_argmax[rows]).float() * weight).sum()
        ctx.mark_non_differentiable(hits)
        # x only for the head's own gradient (a frozen head gets none).
        ctx.save_for_backward(dz, head, x if ctx.needs_input_grad[1] else None)
        ctx.x_dtype = x.dtype
        return loss_sum, hits

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _hits_grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dz, head, x = ctx.saved_tensors
        grad_x = grad_head = None
        if ctx.needs_input_grad[0]:
            grad_x = (torch.matmul(dz, head.to(dz.dtype)).float() * grad).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_head = (torch.matmul(dz.t(), x.to(dz.dtype)).float() * grad).to(head.dtype)
        return grad_x, grad_head, None, None, None, None, None


# The loss's four pieces. Eagerly each is called as is; compiled (`compiled_regions`) each is its own
# graph, reused: the first pass once a batch, the chain pass for steps 1..T-1, the chunk terms for every
# chunk of every step, the target table for every chunk of a batch. One unrolled 7-step graph took ~5 min
# to compile at the Llama-3.1-8B shape.


def _first_pass(
    drafter: Eagle3Drafter, aux_hidden: Tensor, ids: Tensor, positions: Tensor, segments: Tensor | None
) -> tuple[Tensor, KVPair]:
    """Step 0: the fused target states through the drafter, causal (inside each sample when packed)."""
    hidden = drafter.fuse(aux_hidden)
    first: AttentionMode = FIRST_PASS if segments is None else Packed(segments)
    return drafter(hidden, ids, positions, first)


ChainState = tuple[KVPair, ...] | ChainSlots  # the chain's earlier steps: listed (eager) or slotted


def _listed_chain_pass(
    drafter: Eagle3Drafter,
    hidden: Tensor,
    ids: Tensor,
    positions: Tensor,
    past: KVPair,
    chain: ChainState,
    segments: Tensor | None,
) -> tuple[Tensor, ChainState]:
    """Step j >= 1, the earlier steps a list: causal over step 0's keys plus the diagonal (`Chain`)."""
    earlier = cast(tuple[KVPair, ...], chain)
    hidden, kv = drafter(hidden, ids, positions, Chain(past=[past], earlier=earlier, segments=segments))
    return hidden, (*earlier, kv)


def _slotted_chain_pass(
    drafter: Eagle3Drafter,
    hidden: Tensor,
    ids: Tensor,
    positions: Tensor,
    past: KVPair,
    chain: ChainState,
    segments: Tensor | None,
) -> tuple[Tensor, ChainState]:
    """:func:`_listed_chain_pass` with the earlier steps in fixed-size slots: every step has the same
    shapes, so one compiled graph serves them all (`SlottedChain`)."""
    slots = cast(ChainSlots, chain)
    hidden, kv = drafter(hidden, ids, positions, SlottedChain(past, slots, segments))
    return hidden, slots.with_step(kv)


def _target_table(last: Tensor, head: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of the target table: the target's draft-vocabulary logits at ``positions`` of the flat
    final states ``last``, in the matmul's dtype (bf16 under autocast), their logsumexp and argmax (one
    read of the logits when compiled; eagerly an fp32 copy and a kernel per reduction step)."""
    logits = torch.matmul(last[positions], head.t())
    return logits, torch.logsumexp(logits.float(), dim=-1), logits.argmax(-1)


def _chunk_terms(
    drafter: Eagle3Drafter,
    flat_hidden: Tensor,
    step_weights: Tensor,
    anchors: Tensor,
    rows: Tensor,
    table: Tensor,
    table_lse: Tensor,
    table_argmax: Tensor,
) -> tuple[Tensor, Tensor]:
    """One chunk of one step: the weighted soft cross-entropy sum at its counted ``anchors`` (targets:
    ``rows`` of the table) and the weighted count of argmax hits."""
    weight = step_weights[anchors]  # (0 at the padding)
    x = drafter.head_input(flat_hidden[anchors])
    return cast(
        tuple[Tensor, Tensor],
        _HeadCrossEntropy.apply(x, drafter.lm_head.weight, table, table_lse, table_argmax, rows, weight),
    )


@dataclass(frozen=True)
class LossRegions:
    """How :func:`ttt_loss` runs its pieces, and how it keeps the chain between steps."""

    first_pass: Callable[..., tuple[Tensor, KVPair]]
    chain_pass: Callable[..., tuple[Tensor, ChainState]]
    chunk_terms: Callable[..., tuple[Tensor, Tensor]]
    new_chain: Callable[[KVPair, int], ChainState]  # (step 0's keys, T - 1) -> the empty chain
    target_table: Callable[..., tuple[Tensor, Tensor, Tensor]] = _target_table
    # Dynamic sizes marked before each chunk call (compiled: one graph for every count of positions).
    mark_chunk_sizes: bool = False
    # Under autocast, the weights every step reuses cast to its dtype once per batch (`_shared_casts`).
    cast_shared_weights: bool = False


EAGER_REGIONS = LossRegions(_first_pass, _listed_chain_pass, _chunk_terms, lambda _past, _slots: ())


# Inductor's mix-order reduction (the norm's backward: its row and column sums in one kernel) decides by
# the chunk's size whether to fuse, and guards on that decision: on an H100 (torch 2.11) the chunk terms
# first compiled at 4,096 positions held for 1,280..8,191 only (nrow x 4,096 >= 5 MiB elements), so a
# smaller or larger chunk compiled again. Off for this region, one graph serves every count; the unfused
# sums read the chunk's [n, H] gradient once more (bench/RESULTS.md, 2026-12-07 third call).
CHUNK_TERMS_INDUCTOR: dict[str, Any] = {"triton.mix_order_reduction": False}


def compiled_regions() -> LossRegions:
    """The pieces each torch.compile'd on its own (shapes static except a chunk's count of positions):
    three graphs and their backward passes per row shape, and the target table's (no backward), instead
    of one 7-step unroll."""
    return LossRegions(
        cast(Any, torch.compile(_first_pass, dynamic=False)),
        cast(Any, torch.compile(_slotted_chain_pass, dynamic=False)),
        cast(Any, torch.compile(_chunk_terms, dynamic=False, options=CHUNK_TERMS_INDUCTOR)),
        ChainSlots.empty,
        cast(Any, torch.compile(_target_table, dynamic=False)),
        mark_chunk_sizes=True,
        cast_shared_weights=True,
    )


def _shared_casts(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """The decoder layer's and the lm_head's linear weights in the autocast dtype (none outside autocast).

    Autocast casts a weight at every use: each of the T steps (and each chunk, for the lm_head) cast
    every fp32 weight again and, backward, added its gradient into the fp32 ``.grad`` once per call; an
    H100 profile put these casts and adds at ~13% of a step. Cast once here instead, the copies are
    autograd nodes: the steps' gradients meet in the copy, and reach the fp32 leaf once. Norm weights
    stay fp32 (autocast leaves the norms in fp32 either way)."""
    device_type = drafter.fc.weight.device.type
    if not torch.is_autocast_enabled(device_type):
        return {}
    dtype = torch.get_autocast_dtype(device_type)
    casts: dict[str, Tensor] = {}
    for prefix, owner in (("midlayer", drafter.midlayer), ("lm_head", drafter.lm_head)):
        for name, module in owner.named_modules(prefix=prefix):
            if isinstance(module, torch.nn.Linear) and module.weight.dtype != dtype:
                casts[f"{name}.weight"] = module.weight.to(dtype)
    return casts


class _WithCasts(torch.nn.Module):
    """Runs ``body`` with the drafter's weights swapped for :func:`_shared_casts`'s copies (through
    torch.func.functional_call, which restores the parameters however the body ends)."""

    def __init__(self, drafter: Eagle3Drafter, body: Callable[[], tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.drafter = drafter
        self.body = body

    def forward(self) -> tuple[Tensor, Tensor]:
        return self.body()


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: Mapping[str, Tensor],
    target_head_draft: Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    step_tokens: Tensor | None = None,
    regions: LossRegions = EAGER_REGIONS,
) -> tuple[Tensor, Tensor]:
    """Weighted TTT loss of one collated batch, and per-step metrics ``terms`` [3, ttt_length] (loss, acc,
    tokens), left on the batch's device: reading them waits for the GPU, so the training loop reads one
    step's sums once (:func:`ttt_metrics` turns them into lists).

    ``step_tokens`` [ttt_length]: counted positions per TTT step over the whole optimizer step (every
    micro-batch, every rank); step j's loss sums over this batch and divides by them, so the losses of
    a step's micro-batches add up to its token-weighted mean. None: this batch's own counts.
    Per step, the terms' loss and acc are this batch's means, acc being the share of counted positions
    whose drafter argmax equals the target's argmax over the draft vocab; tokens are those positions.

    The decoder layer runs at every position (every key is attended to); the drafter's logits, the
    target's and the cross-entropy only at counted positions (kernels/counted.py), in chunks.
    ``regions``: eager pieces (the default) or :func:`compiled_regions`.
    """
    casts = _shared_casts(drafter) if regions.cast_shared_weights else {}
    if casts:

        def body() -> tuple[Tensor, Tensor]:
            return _ttt_loss(drafter, batch, target_head_draft, ttt_length, decay, step_tokens, regions)

        named = {f"drafter.{name}": tensor for name, tensor in casts.items()}
        return cast(tuple[Tensor, Tensor], torch.func.functional_call(_WithCasts(drafter, body), named, ()))
    return _ttt_loss(drafter, batch, target_head_draft, ttt_length, decay, step_tokens, regions)


def _ttt_loss(
    drafter: Eagle3Drafter,
    batch: Mapping[str, Tensor],
    target_head_draft: Tensor,
    ttt_length: int,
    decay: float,
    step_tokens: Tensor | None,
    regions: LossRegions,
) -> tuple[Tensor, Tensor]:
    input_ids = batch["input_ids"]
    bsz, length = input_ids.shape
    flat = bsz * length
    position_ids, segments = _positions_and_segments(batch)
    weights = ttt_weights(batch, ttt_length).float().reshape(ttt_length, flat)
    index = batch_counted_index(batch, ttt_length)
    chunks = index.anchors.shape[1]

    with torch.no_grad():
        # The target table: logits at the targets of step 0's counted anchors (token t+1), in the
        # matmul's dtype (bf16 under autocast, as the logits were before), their logsumexp and argmax.
        last = batch["last_hidden"].reshape(flat, -1).to(target_head_draft.dtype)
        table_positions = (index.anchors[0] + 1).clamp_max(flat - 1)  # (padding: any in-range row)
        parts = []
        for positions in table_positions:
            if regions.mark_chunk_sizes:
                torch._dynamo.mark_dynamic(positions, 0)
            parts.append(regions.target_table(last, target_head_draft, positions))
        table, table_lse, table_argmax = (
            part[0] if chunks == 1 else torch.cat(part) for part in zip(*parts, strict=True)
        )
        del parts
        # Padded once so that every step reads a shifted view. Where the shift reaches past a sample's
        # end the anchor is not counted, and its outputs reach no counted position (own chain only; its
        # step-0 key is visible only to itself).
        ids_padded = F.pad(input_ids, (0, ttt_length + 1))
    if regions.mark_chunk_sizes:
        for tensor in (table, table_lse, table_argmax):
            torch._dynamo.mark_dynamic(tensor, 0)

    def step_ids(step: int) -> Tensor:
        return ids_padded[:, 1 + step : 1 + step + length].contiguous()

    hidden, past = regions.first_pass(drafter, batch["aux_hidden"], step_ids(0), position_ids, segments)
    chain = regions.new_chain(past, ttt_length - 1)
    total = hidden.new_zeros((), dtype=torch.float32)
    step_losses: list[Tensor] = []
    step_accs: list[Tensor] = []
    step_counts: list[Tensor] = []
    for step in range(ttt_length):
        if step:
            hidden, chain = regions.chain_pass(
                drafter, hidden, step_ids(step), position_ids + step, past, chain, segments
            )
        flat_hidden = hidden.reshape(flat, hidden.shape[-1])
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        hits = hidden.new_zeros((), dtype=torch.float32)
        for k in range(chunks):
            anchors, rows = index.anchors[step, k], index.target_rows[step, k]
            if regions.mark_chunk_sizes:
                torch._dynamo.mark_dynamic(anchors, 0)
                torch._dynamo.mark_dynamic(rows, 0)
            chunk_loss, chunk_hits = regions.chunk_terms(
                drafter, flat_hidden, weights[step], anchors, rows, table, table_lse, table_argmax
            )
            loss_sum = loss_sum + chunk_loss
            hits = hits + chunk_hits
        tokens = weights[step].sum()
        norm = tokens if step_tokens is None else step_tokens[step].to(tokens)
        total = total + (decay**step) * loss_sum / norm.clamp_min(1.0)
        step_accs.append(hits / tokens.clamp_min(1.0))
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
