"""How one drafter pass attends: four explicit modes, each a small typed value with its own function.

A pass computes queries q [B, Hq, T, d] and its own keys/values [B, Hk, T, *] (post-RoPE); the mode says
which keys each query sees:

- `Decode(past)`: the past chunks then the own keys; every past key visible, own keys causal. Inference
  over a KV cache; with no past, the plain causal first pass (training's step 0 on unpacked rows).
- `Masked(past, visible)`: the past chunks then the own keys, visibility given ([T, S_past + T] or
  broadcastable; bool True = visible, or additive). The general reference the other modes must equal.
- `Packed(segments)`: the first pass over packed rows: query t sees own keys s <= t of the same sample.
- `Chain(past, earlier, segments)`: training-time test (and chained drafting from stored states): query t
  sees the first-pass keys ``past`` at positions 0..t (of its own sample when ``segments`` is given) and,
  at its own position only, the keys of the ``earlier`` chain steps and its own key. Computed with
  elementwise products instead of a [T, T*steps] mask.
- `SlottedChain(past, slots, segments)`: the same visibility as `Chain`, the earlier steps held in
  fixed-size `ChainSlots` with a tensor count, so that every chain step is one computation of the same
  shapes (the compiled TTT loss runs steps 1..T-1 through one graph: kernels/objective.py).

Compiled on CUDA, `Packed` and `Chain` are one FlexAttention call whose block mask skips the blocks no
query sees (between samples, off the chain's diagonal); elsewhere a dense mask or the elementwise form.
`SlottedChain` is FlexAttention over the first-pass keys only, its log-sum-exp merged with the diagonal's
scores: the chain's keys cost one score each, not one 128 x 128 block each.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AttentionMode", "Chain", "ChainSlots", "Decode", "KVPair", "Masked", "Packed", "SlottedChain"]

KVPair = tuple[Tensor, Tensor]

# The modes are NamedTuples: immutable, and traced by torch.compile without graph breaks.


class Decode(NamedTuple):
    """Past chunks [B, Hk, S_i, *] then the own keys; every past key visible, own keys causal."""

    past: Sequence[KVPair] = ()

    def attend(self, q: Tensor, own_k: Tensor, own_v: Tensor, scale: float) -> Tensor:
        keys, values = _with_past(self.past, own_k, own_v)
        length = q.shape[2]
        past_len = keys.shape[2] - length
        gqa = keys.shape[1] != q.shape[1]
        if past_len == 0:
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
            )
        visible = torch.ones(length, past_len + length, dtype=torch.bool, device=q.device)
        visible[:, past_len:] = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=gqa)


class Masked(NamedTuple):
    """Past chunks then the own keys, seen as ``visible`` says: [T, S_past + T] (or broadcastable to
    [B, Hq, T, S]); bool (True = visible) or an additive bias."""

    past: Sequence[KVPair]
    visible: Tensor

    def attend(self, q: Tensor, own_k: Tensor, own_v: Tensor, scale: float) -> Tensor:
        keys, values = _with_past(self.past, own_k, own_v)
        gqa = keys.shape[1] != q.shape[1]
        mask = self.visible if self.visible.dtype == torch.bool else self.visible.to(q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


class Packed(NamedTuple):
    """The first pass over packed rows: ``segments`` [B, T] says which sample of its row each position
    belongs to (-1 = padding); query t sees own key s <= t of the same sample."""

    segments: Tensor

    def attend(self, q: Tensor, own_k: Tensor, own_v: Tensor, scale: float) -> Tensor:
        length = q.shape[2]
        if _compiled_flex(q):
            keys = torch.cat([own_k], dim=2)
            values = torch.cat([own_v], dim=2)
            return _flex_chain(q, keys, values, length, 0, scale, self.segments)
        gqa = own_k.shape[1] != q.shape[1]
        visible = _segment_mask(self.segments, length, q.device)
        return F.scaled_dot_product_attention(q, own_k, own_v, attn_mask=visible, scale=scale, enable_gqa=gqa)


class Chain(NamedTuple):
    """A chain step: the first-pass keys ``past`` (of the query length) causally, plus the ``earlier``
    steps' keys and the own key on the diagonal. ``segments`` [B, T]: packed rows (the past stays inside
    the query's sample); None: one sample per row."""

    past: Sequence[KVPair]
    earlier: Sequence[KVPair] = ()
    segments: Tensor | None = None

    def attend(self, q: Tensor, own_k: Tensor, own_v: Tensor, scale: float) -> Tensor:
        joined = _joined(self.past)
        if joined is None:
            raise ValueError("chain attention needs the first pass's keys")
        past_k, past_v = joined
        length = q.shape[2]
        if past_k.shape[2] != length:
            raise ValueError("chain attention needs first-pass keys of the query length (causal)")
        chain = [*self.earlier, (own_k, own_v)]
        # FlexAttention only inside a compiled region: eagerly it would recompile per chain length,
        # and the elementwise form below is faster than uncompiled flex.
        if _compiled_flex(q):
            keys = torch.cat([past_k, *(k for k, _ in chain)], dim=2)
            values = torch.cat([past_v, *(v for _, v in chain)], dim=2)
            return _flex_chain(q, keys, values, length, len(chain), scale, self.segments)
        visible = _past_visible(self.segments, length, q.device)
        return _chain_elementwise(q, past_k, past_v, chain, visible, scale)


class ChainSlots(NamedTuple):
    """The keys and values of a chain's earlier steps in fixed-size slots, [B, Hk, S, T, *]; slots
    0..filled-1 hold steps 1..filled (``filled``: a 0-d integer tensor, so that no step's count is a
    Python number a compiled graph would be specialised on)."""

    keys: Tensor
    values: Tensor
    filled: Tensor

    @classmethod
    def empty(cls, past: KVPair, slots: int) -> ChainSlots:
        """``slots`` empty slots shaped like the first-pass keys and values ``past``."""
        keys, values = past
        batch, heads = keys.shape[:2]
        # Requiring grad as every later step's slots do, so a compiled chain pass sees one kind of input.
        grad = keys.requires_grad or values.requires_grad
        return cls(
            keys.new_zeros(batch, heads, slots, *keys.shape[2:]).requires_grad_(grad),
            values.new_zeros(batch, heads, slots, *values.shape[2:]).requires_grad_(grad),
            torch.zeros((), dtype=torch.int64, device=keys.device),
        )

    def with_step(self, kv: KVPair) -> ChainSlots:
        """These slots with one more step's keys and values ``kv`` [B, Hk, T, *] in the next free slot."""
        slot = (torch.arange(self.keys.shape[2], device=self.keys.device) == self.filled)[:, None, None]
        return ChainSlots(
            torch.where(slot, kv[0].unsqueeze(2), self.keys),
            torch.where(slot, kv[1].unsqueeze(2), self.values),
            self.filled + 1,
        )


class SlottedChain(NamedTuple):
    """A chain step as `Chain` sees it, the earlier steps in ``slots``: the first-pass keys ``past`` causally
    (inside the query's sample with ``segments``), the filled slots and the own key on the diagonal.

    Computed as attention over the past alone (its output and log-sum-exp), then one softmax over that
    log-sum-exp and the diagonal's scores: softmax over past + diagonal = a weighted mix of the past's
    output and the diagonal values, weights softmax([lse_past, s_1, .., s_n, s_own])."""

    past: KVPair
    slots: ChainSlots
    segments: Tensor | None = None

    def attend(self, q: Tensor, own_k: Tensor, own_v: Tensor, scale: float) -> Tensor:
        past_k, past_v = self.past
        if _compiled_flex(q):
            out, lse = _flex_past(q, past_k, past_v, scale, self.segments)
        else:
            out, lse = _dense_past(q, past_k, past_v, scale, self.segments)
        batch, q_heads, length, _ = q.shape
        kv_heads = own_k.shape[1]
        grouped = (batch, kv_heads, q_heads // kv_heads, length)  # query head h = kv head h // G
        q5 = q.view(*grouped, -1).float()
        # [B, Hk, G, T, S]: query t against slot s's key at t (empty slots: -inf, weight 0)
        slot_keys = self.slots.keys.transpose(2, 3).unsqueeze(2).float()  # [B, Hk, 1, T, S, d]
        slot_scores = (q5.unsqueeze(4) * slot_keys).sum(-1) * scale
        empty = torch.arange(slot_scores.shape[-1], device=q.device) >= self.slots.filled
        slot_scores = slot_scores.masked_fill(empty, float("-inf"))
        own_scores = (q5 * own_k.unsqueeze(2).float()).sum(-1, keepdim=True) * scale
        scores = torch.cat((lse.reshape(*grouped, 1), slot_scores, own_scores), dim=-1)
        weights = torch.softmax(scores, dim=-1)
        slot_values = self.slots.values.transpose(2, 3).unsqueeze(2).float()  # [B, Hk, 1, T, S, dv]
        mixed = (
            weights[..., :1] * out.reshape(*grouped, -1).float()
            + (weights[..., 1:-1, None] * slot_values).sum(-2)
            + weights[..., -1:] * own_v.unsqueeze(2).float()
        )
        return mixed.to(q.dtype).reshape(batch, q_heads, length, -1)


AttentionMode = Decode | Masked | Packed | Chain | SlottedChain


def _joined(pairs: Sequence[KVPair]) -> KVPair | None:
    """The chunks concatenated along the sequence axis (None for none)."""
    if not pairs:
        return None
    return torch.cat([k for k, _ in pairs], dim=2), torch.cat([v for _, v in pairs], dim=2)


def _with_past(past: Sequence[KVPair], own_k: Tensor, own_v: Tensor) -> KVPair:
    joined = _joined(past)
    if joined is None:
        return own_k, own_v
    return torch.cat((joined[0], own_k), dim=2), torch.cat((joined[1], own_v), dim=2)


def _segment_mask(segments: Tensor, length: int, device: torch.device) -> Tensor:
    """[B, 1, T, T] bool: query t sees key s <= t of its own sample (padding sees padding, so no row
    is fully masked)."""
    positions = torch.arange(length, device=device)
    same_sample = segments[:, None, :, None] == segments[:, None, None, :]
    return same_sample & (positions[None, :] <= positions[:, None])


def _past_visible(segments: Tensor | None, length: int, device: torch.device) -> Tensor:
    """Which first-pass keys a chain step's queries see: causal [T, T], or with ``segments`` causal inside
    each sample [B, 1, T, T]."""
    if segments is None:
        return torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return _segment_mask(segments, length, device)


def _dense_past(
    q: Tensor, keys: Tensor, values: Tensor, scale: float, segments: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Causal attention over ``keys`` (of the query length; inside each sample with ``segments``): its
    output [B, Hq, T, dv] and log-sum-exp [B, Hq, T] (fp32). The reference for `_flex_past`."""
    batch, q_heads, length, _ = q.shape
    kv_heads = keys.shape[1]
    q5 = q.view(batch, kv_heads, q_heads // kv_heads, length, -1)
    scores = torch.matmul(q5, keys.unsqueeze(2).transpose(-1, -2)).float() * scale
    visible = _past_visible(segments, length, q.device)
    scores = scores.masked_fill(~(visible.unsqueeze(2) if visible.dim() == 4 else visible), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(q.dtype), values.unsqueeze(2))
    return out.reshape(batch, q_heads, length, -1), lse.reshape(batch, q_heads, length)


def _chain_elementwise(
    q: Tensor, past_k: Tensor, past_v: Tensor, chain: list[KVPair], visible: Tensor, scale: float
) -> Tensor:
    """Chain attention without a [T, T*steps] mask: scores over the past keys masked by ``visible``
    ([T, T] or [B, 1, T, T]), plus one score per chain entry at the query's own position."""
    batch, q_heads, length, _ = q.shape
    kv_heads = past_k.shape[1]
    group = q_heads // kv_heads
    # [B, Hk, G, T, d]: grouped queries share a key head without materialising repeated keys.
    q5 = q.view(batch, kv_heads, group, length, -1)
    scores = torch.matmul(q5, past_k.unsqueeze(2).transpose(-1, -2)).float() * scale
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(
        ~visible, float("-inf")
    )
    if bias.dim() == 4:
        bias = bias.unsqueeze(2)
    scores = scores + bias.float()
    diag_scores = torch.stack(
        [(q5 * k.unsqueeze(2)).sum(-1).float() * scale for k, _ in chain], dim=-1
    )  # [B, Hk, G, T, n]
    probs = torch.softmax(torch.cat((scores, diag_scores), dim=-1), dim=-1).to(q.dtype)
    past_len = past_k.shape[2]
    out = torch.matmul(probs[..., :past_len], past_v.unsqueeze(2))
    for index, (_, v) in enumerate(chain):
        out = out + probs[..., past_len + index, None] * v.unsqueeze(2)
    return out.reshape(batch, q_heads, length, -1)


def _compiled_flex(q: Tensor) -> bool:
    """FlexAttention applies: a CUDA query inside a torch.compile region, flex not switched off."""
    return q.is_cuda and torch.compiler.is_compiling() and _flex_available()


_BLOCK_MASKS: dict[tuple[int, int, str], Any] = {}


def _flex_available() -> bool:
    if os.environ.get("DRAFTLOOP_CHAIN_ATTENTION", "flex") != "flex":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - old torch
        return False
    return True


def _flex_chain(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    length: int,
    chain: int,
    scale: float,
    segments: Tensor | None = None,
) -> Tensor:
    """Causal-past + diagonal-chain attention as one sparse FlexAttention call (CUDA).

    keys = cat(past [T], chain_1 [T], ..., chain_n [T]); query t sees past 0..t and entry t of each
    chain segment. The block mask skips every off-diagonal block of the chain segments. With
    ``segments`` [B, T] (packed rows) a past key is visible only inside the query's own sample, and
    the blocks between samples are skipped too (built per batch: the packing changes every batch).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask: Any
    if segments is not None:

        def packed_mask_mod(b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            own_row = kv_idx % length
            past = (kv_idx <= q_idx) & (segments[b, own_row] == segments[b, q_idx])
            return torch.where(kv_idx < length, past, own_row == q_idx)

        block_mask = create_block_mask(
            packed_mask_mod,
            B=segments.shape[0],
            H=None,
            Q_LEN=length,
            KV_LEN=length * (chain + 1),
            device=q.device,
        )
    else:
        cache_key = (length, chain, str(q.device))
        block_mask = _BLOCK_MASKS.get(cache_key)
        if block_mask is None:

            def mask_mod(_b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return (kv_idx <= q_idx) | ((kv_idx >= length) & (kv_idx % length == q_idx))

            block_mask = create_block_mask(
                mask_mod, B=None, H=None, Q_LEN=length, KV_LEN=length * (chain + 1), device=q.device
            )
            if len(_BLOCK_MASKS) > 256:  # lengths vary per batch: keep the cache bounded
                _BLOCK_MASKS.clear()
            _BLOCK_MASKS[cache_key] = block_mask
    gqa = keys.shape[1] != q.shape[1]
    out = flex_attention(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return cast(Tensor, out)


def _flex_past(
    q: Tensor, keys: Tensor, values: Tensor, scale: float, segments: Tensor | None
) -> tuple[Tensor, Tensor]:
    """`_dense_past` as one sparse FlexAttention call (CUDA, compiled): the blocks above the diagonal and
    between samples are skipped; returns the output and its log-sum-exp (natural log, fp32)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    length = q.shape[2]
    if segments is None:

        def causal(_b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx <= q_idx

        block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=length, KV_LEN=length, device=q.device)
    else:

        def same_sample(b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx <= q_idx) & (segments[b, kv_idx] == segments[b, q_idx])

        block_mask = create_block_mask(
            same_sample, B=segments.shape[0], H=None, Q_LEN=length, KV_LEN=length, device=q.device
        )
    gqa = keys.shape[1] != q.shape[1]
    # return_aux, not the deprecated return_lse: the latter's one-time warning is a dynamo guard
    # (flex_attention._WARNINGS_SHOWN) that recompiled the chain-pass graph once, on its second call.
    out, aux = flex_attention(
        q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return cast(Tensor, out), cast(Tensor, aux.lse)
