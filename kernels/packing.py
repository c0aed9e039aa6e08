"""Sample packing: variable-length samples in token-budget rows, and batching rows for the TTT loss.

A packed row holds several samples back to back. The batch then carries, per token, ``segment_ids``
(which sample of its row the token belongs to, -1 for padding) and ``position_ids`` (restarting at 0
for every sample); :func:`draftloop.kernels.objective.ttt_loss` turns them into a block-diagonal causal
mask for every TTT step and counts a prediction only when its anchor and the predicted token are in
the same sample. An unpacked batch (one sample per row) carries neither: right padding alone keeps
samples apart there. A packed batch keeps its keys even when a row holds one sample, so a compiled
loss sees one kind of batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .counted import counted_index, counted_mask

__all__ = ["PackedRows", "collate_rows", "collate_samples", "pack_first_fit_decreasing", "sample_length"]

# Row layout of a packed batch: for each row, the samples it holds in order.
PackedRows = Sequence[Sequence[Mapping[str, Tensor]]]


def sample_length(sample: Mapping[str, Tensor], max_length: int | None = None) -> int:
    """Tokens of ``sample`` that training uses (truncated to ``max_length``)."""
    length = int(sample["input_ids"].shape[0])
    return min(length, max_length) if max_length is not None else length


def pack_first_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into rows of at most ``token_budget`` tokens, first-fit decreasing.

    Longest first, each into the first row with room; a sample longer than the budget gets a row of
    its own. Deterministic (ties keep index order), so every rank and every run packs alike.
    """
    if token_budget < 1:
        raise ValueError(f"token budget must be positive, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    rows: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = lengths[index]
        for row, free in enumerate(room):
            if length <= free:
                rows[row].append(index)
                room[row] -= length
                break
        else:
            rows.append([index])
            room.append(max(0, token_budget - length))
    return rows


def collate_rows(
    rows: PackedRows,
    device: torch.device | str = "cpu",
    max_length: int | None = None,
    batch_size: int | None = None,
    pad_multiple: int | None = None,
    *,
    packed: bool = True,
    ttt_length: int | None = None,
) -> dict[str, Tensor]:
    """Right-pad rows of samples into a batch: input_ids/loss_mask [B, L], aux/last [B, L, *],
    lengths [B] (real tokens per row), and when ``packed`` segment_ids and position_ids [B, L]
    (``packed=False``: one sample per row, plain causal attention).

    ``batch_size`` adds empty rows (length 0, nothing counted) up to that many; ``pad_multiple`` rounds
    L up to a multiple — both keep the shapes a compiled loss sees few. ``ttt_length``: also the TTT
    loss's counted positions, ttt_anchors / ttt_target_rows (kernels/counted.py), built here on the host
    so the loss neither waits for the GPU to count them nor sees a data-dependent shape.
    """
    if not rows or not all(rows):
        raise ValueError("a batch needs at least one row and every row at least one sample")
    if not packed and any(len(row) > 1 for row in rows):
        raise ValueError("an unpacked batch holds one sample per row")
    first = rows[0][0]
    row_lengths = [[sample_length(s, max_length) for s in row] for row in rows]
    lengths = [sum(row) for row in row_lengths]
    length = max(lengths)
    if pad_multiple:
        length = -(-length // pad_multiple) * pad_multiple
    batch = max(len(rows), batch_size or 0)
    lengths += [0] * (batch - len(rows))
    # Pinned for a CUDA device: the copies below then run in the background (a copy from pageable memory
    # first waits for every kernel queued before it), so the host collates the next micro-batch meanwhile.
    pin = torch.device(device).type == "cuda"
    aux_width, last_width = int(first["aux_hidden"].shape[-1]), int(first["last_hidden"].shape[-1])
    input_ids = torch.zeros(batch, length, dtype=torch.int64, pin_memory=pin)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool, pin_memory=pin)
    aux = torch.zeros(batch, length, aux_width, dtype=first["aux_hidden"].dtype, pin_memory=pin)
    last = torch.zeros(batch, length, last_width, dtype=first["last_hidden"].dtype, pin_memory=pin)
    segment_ids = torch.full((batch, length), -1, dtype=torch.int64, pin_memory=pin)
    position_ids = torch.zeros(batch, length, dtype=torch.int64, pin_memory=pin)
    for row_index, (row, sizes) in enumerate(zip(rows, row_lengths, strict=True)):
        start = 0
        for segment, (sample, n) in enumerate(zip(row, sizes, strict=True)):
            end = start + n
            input_ids[row_index, start:end] = sample["input_ids"][:n]
            loss_mask[row_index, start:end] = sample["loss_mask"][:n].bool()
            aux[row_index, start:end] = sample["aux_hidden"][:n]
            last[row_index, start:end] = sample["last_hidden"][:n]
            segment_ids[row_index, start:end] = segment
            position_ids[row_index, start:end] = torch.arange(n)
            start = end
    row_lengths_tensor = torch.tensor(lengths, dtype=torch.int64)
    out = {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "aux_hidden": aux,
        "last_hidden": last,
        "lengths": row_lengths_tensor.pin_memory() if pin else row_lengths_tensor,
    }
    if packed:
        out["segment_ids"] = segment_ids
        out["position_ids"] = position_ids
    if ttt_length is not None:
        index = counted_index(counted_mask(loss_mask, segment_ids, ttt_length))
        out["ttt_anchors"] = index.anchors.pin_memory() if pin else index.anchors
        out["ttt_target_rows"] = index.target_rows.pin_memory() if pin else index.target_rows
    return {name: tensor.to(device, non_blocking=True) for name, tensor in out.items()}


def collate_samples(
    samples: Sequence[Mapping[str, Tensor]],
    device: torch.device | str = "cpu",
    max_length: int | None = None,
    batch_size: int | None = None,
    pad_multiple: int | None = None,
) -> dict[str, Tensor]:
    """One sample per row, right-padded: input_ids/loss_mask [B, L], aux/last [B, L, *], lengths [B]
    (see :func:`collate_rows` for ``batch_size`` and ``pad_multiple``)."""
    if not samples:
        raise ValueError("empty batch")
    return collate_rows([[s] for s in samples], device, max_length, batch_size, pad_multiple, packed=False)
