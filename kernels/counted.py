"""Which positions the TTT loss counts: as a mask, and as a compact, bucketed list of flat positions.

At TTT step j, anchor t of a row counts when token t+2+j is an assistant token (loss_mask) of the same
sample as t. Only those anchors need the drafter's logits and the target's probabilities
(kernels/objective.py); the list here names them so the loss computes its vocabulary-sized tensors at
counted positions only.

The list is built on the host from the collated CPU tensors (kernels/packing.py ``collate_rows`` with
``ttt_length``): counting positions is data-dependent (a ``nonzero``), which on the GPU would make the
compiled loss wait for the device and give torch.compile a data-dependent shape. Built here, the loss
gets a tensor whose shape is known before the call: [ttt_length, chunks, per_chunk] with ``chunks``
fixed by the batch shape and ``per_chunk`` the count rounded up to a multiple of ``INDEX_MULTIPLE``,
marked dynamic (one compiled graph for every count, never a 0/1 size that torch would specialise on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CHUNK_TOKENS", "INDEX_MULTIPLE", "MAX_CHUNKS", "CountedIndex", "counted_index", "counted_mask"]

# Counted positions per chunk of the loss head at most (in rows of up to MAX_CHUNKS x this). Large, so that
# the head's [chunk, H] x [H, Vd] matmuls run near the peak: at H 4096, Vd 32k on an H100 its matmuls
# took 20.6 ms per 16,384 positions in chunks of 1,024 and 18.2 ms in chunks of 4,096, the whole loss
# head 25.3 and 22.7 ms (bench/bench_head_chunks.py). Compiled, the soft cross-entropy is one fused pass
# that keeps no fp32 [chunk, Vd] tensor; eagerly a chunk's fp32 temporaries are 4,096 x 32k x 4 B = 512
# MiB each.
CHUNK_TOKENS = 4096
# Chunks per TTT step at most. The compiled loss unrolls its chunk loop (one matmul and soft
# cross-entropy, forward and backward, per chunk and step), so its compile time grows with the chunk
# count (with chunks of 1,024 positions and no cap, none within 580 s at 32k tokens on an H200). Past
# 4 chunks the chunks grow instead: a 32,768-token row's chunks are <= 8,192 positions (fp32 [8192, 32k]
# = 1 GiB beside tens of GiB of activations), and every row length compiles a graph of the same size.
MAX_CHUNKS = 4
# Chunk sizes are rounded up to this: never 0 or 1 (torch.compile would specialise on them), and the
# padding (at most 63 positions of weight 0 per chunk) is noise next to the counted positions.
INDEX_MULTIPLE = 64


def counted_mask(loss_mask: Tensor, segments: Tensor, ttt_length: int) -> Tensor:
    """Counted positions [ttt_length, B, L] (bool) of rows with per-token sample ids ``segments``
    [B, L] (-1 = padding): step j counts anchor t when x_{t+2+j} is an assistant token of t's sample."""
    length = segments.shape[1]
    pad = ttt_length + 2
    segments_ahead = F.pad(segments, (0, pad), value=-1)
    mask_ahead = F.pad(loss_mask.bool(), (0, pad))
    steps = [
        mask_ahead[:, 2 + j : 2 + j + length] & (segments_ahead[:, 2 + j : 2 + j + length] == segments)
        for j in range(ttt_length)
    ]
    return torch.stack(steps) & (segments >= 0)


@dataclass(frozen=True)
class CountedIndex:
    """The counted positions of every TTT step, padded: ``anchors`` [T, K, M] flat positions (row *
    L + t) into the batch's B x L tokens, padding = B*L - 1 (never counted: no token two ahead of the
    last one); ``target_rows`` [T, K, M] where step j's target at that anchor (token t+1+j's target
    distribution) sits in the step-0 target table, whose rows are the step-0 anchors in order."""

    anchors: Tensor
    target_rows: Tensor


def counted_index(
    counted: Tensor,
    chunk_tokens: int = CHUNK_TOKENS,
    multiple: int = INDEX_MULTIPLE,
    max_chunks: int = MAX_CHUNKS,
) -> CountedIndex:
    """The compact index of ``counted`` [T, B, L] (:func:`counted_mask`): K = min(ceil(B*L /
    chunk_tokens), max_chunks) chunks (fixed by the shape) of M = step 0's count / K rounded up to
    ``multiple`` (so M <= chunk_tokens rounded up while B*L <= max_chunks * chunk_tokens), every step
    padded to K * M.

    Why one target table serves every step: step j's target at anchor t is the distribution after token
    t+1+j, which is step 0's target at anchor t+j; and anchor t+j counts at step 0 whenever t counts at
    step j (t+2+j is an assistant token of t's sample, and so of t+j's, which lies between them). So the
    target logits are computed once, at step 0's counted anchors, and no step has more anchors."""
    steps, rows, length = counted.shape
    flat = rows * length
    per_step = counted.reshape(steps, flat)
    real = [per_step[j].nonzero().squeeze(1) for j in range(steps)]
    chunks = min(max(1, -(-flat // chunk_tokens)), max_chunks)
    per_chunk = max(1, -(-max(1, real[0].numel()) // chunks))
    per_chunk = -(-per_chunk // multiple) * multiple
    padded = chunks * per_chunk
    row_of = torch.zeros(flat, dtype=torch.int64, device=counted.device)
    row_of[real[0]] = torch.arange(real[0].numel(), device=counted.device)
    anchors = torch.full((steps, padded), flat - 1, dtype=torch.int64, device=counted.device)
    target_rows = torch.zeros((steps, padded), dtype=torch.int64, device=counted.device)
    for j, positions in enumerate(real):
        anchors[j, : positions.numel()] = positions
        target_rows[j, : positions.numel()] = row_of[positions + j]
    shape = (steps, chunks, per_chunk)
    return CountedIndex(anchors.reshape(shape), target_rows.reshape(shape))
