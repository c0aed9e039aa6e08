"""Extraction pipeline: target forward passes -> aux hidden states -> committed shards, overlapped.

Capturing the aux layers is nearly free (a few hooks); the cost is moving ~4 x Ht values per token off
the accelerator and writing them. So the three jobs run concurrently:

    compute stream : forward(batch i+1)  forward(batch i+2) ...
    copy stream    :      D2H(batch i) into pinned memory, then an event
    writer threads :           wait event(i), pack shard, sink(shard)   (serialize + write + commit)

Backpressure: at most ``max_inflight`` batches are held between capture and sink, so host memory stays
bounded. The sink decides where a shard goes (local file, fsspec storage through a manifest writer).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .capture import capture_aux_hidden_states
from .layer_ids import LayerIds
from .shards import TARGET_DTYPE_KEY, shard_metadata

__all__ = ["ExtractionStats", "ShardSink", "TokenizedSample", "extract_hidden_states"]

# One training sample before extraction: token ids and the assistant-token mask, both [T].
TokenizedSample = dict[str, Tensor]
# sink(shard_name, packed tensors (DESIGN.md shard format), metadata) commits one shard.
ShardSink = Callable[[str, dict[str, Tensor], dict[str, str]], None]


@dataclass
class ExtractionStats:
    samples: int = 0
    tokens: int = 0
    shards: int = 0
    seconds: float = 0.0
    shard_names: list[str] = field(default_factory=list)


@dataclass
class _Chunk:
    """One forward batch's packed outputs (host tensors once ``ready`` has fired)."""

    input_ids: Tensor
    loss_mask: Tensor
    lengths: list[int]
    aux: Tensor
    last: Tensor
    ready: torch.cuda.Event | None


def _pad_batch(
    samples: Sequence[TokenizedSample], device: torch.device
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(input_ids [B, T], attention mask or None, flat indices of the real tokens or None) on ``device``.

    Built in pinned memory for a CUDA device and copied without blocking: a copy from pageable memory,
    or a boolean-mask gather, would wait for the forward pass still running, and the GPU would idle
    while the host launches the next one.
    """
    pin = device.type == "cuda"
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    longest = max(lengths)
    ids = torch.zeros(len(samples), longest, dtype=torch.long, pin_memory=pin)
    for row, sample in enumerate(samples):
        ids[row, : lengths[row]] = sample["input_ids"]
    if all(n == longest for n in lengths):
        return ids.to(device, non_blocking=True), None, None
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    keep = mask.flatten().nonzero().squeeze(1)  # on the host, where the lengths are known
    if pin:
        mask, keep = mask.pin_memory(), keep.pin_memory()
    return (
        ids.to(device, non_blocking=True),
        mask.to(device=device, dtype=torch.long, non_blocking=True),
        keep.to(device, non_blocking=True),
    )


def _to_host(tensor: Tensor, stream: torch.cuda.Stream | None) -> Tensor:
    """Start an async device->pinned-host copy on ``stream`` (or return CPU tensors as they are)."""
    if stream is None:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
    tensor.record_stream(stream)  # keep the device memory alive until the copy has run
    return host


def _pack(chunks: list[_Chunk]) -> dict[str, Tensor]:
    for chunk in chunks:
        if chunk.ready is not None:
            chunk.ready.synchronize()
    lengths = [n for chunk in chunks for n in chunk.lengths]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)

    def cat(name: str) -> Tensor:
        parts = [getattr(chunk, name) for chunk in chunks]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # one batch per shard: no extra copy

    return {
        "input_ids": cat("input_ids"),
        "loss_mask": cat("loss_mask"),
        "seq_offsets": offsets,
        "aux_hidden": cat("aux"),
        "last_hidden": cat("last"),
    }


@torch.no_grad()
def extract_hidden_states(
    model: nn.Module,
    batches: Iterable[Sequence[TokenizedSample]],
    layer_ids: LayerIds,
    sink: ShardSink,
    *,
    target_name: str,
    samples_per_shard: int,
    shard_prefix: str = "hidden",
    store_dtype: torch.dtype | None = None,
    max_inflight: int = 3,
    writer_threads: int = 2,
    on_shard: Callable[[str, int, int], None] | None = None,
) -> ExtractionStats:
    """Run ``model`` over ``batches`` and commit hidden-state shards through ``sink``.

    A shard holds whole batches: ``samples_per_shard`` is rounded up to a batch boundary.
    ``store_dtype``: dtype of the stored hidden states (default: the model's). ``on_shard(name, samples,
    tokens)`` is called after each shard is committed (progress bars).
    """
    device = next(model.parameters()).device
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    target_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    metadata = shard_metadata(layer_ids, target_name, **{TARGET_DTYPE_KEY: target_dtype})
    stats = ExtractionStats()
    pending: list[_Chunk] = []
    pending_samples = 0
    inflight: deque[Future[None]] = deque()
    start = time.perf_counter()

    def commit(name: str, chunks: list[_Chunk]) -> None:
        tensors = _pack(chunks)
        sink(name, tensors, metadata)
        if on_shard is not None:
            on_shard(name, len(tensors["seq_offsets"]) - 1, int(tensors["input_ids"].shape[0]))

    def flush(pool: ThreadPoolExecutor) -> None:
        nonlocal pending, pending_samples
        if not pending:
            return
        name = f"{shard_prefix}-{stats.shards:05d}.safetensors"
        stats.shards += 1
        stats.shard_names.append(name)
        inflight.append(pool.submit(commit, name, pending))
        pending, pending_samples = [], 0
        while len(inflight) > max_inflight:  # backpressure: bound host memory
            inflight.popleft().result()

    with ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="shard-writer") as pool:
        try:
            for batch in batches:
                if not batch:
                    continue
                input_ids, attention_mask, keep = _pad_batch(batch, device)
                captured = capture_aux_hidden_states(
                    model, input_ids, layer_ids, attention_mask=attention_mask, want_last=True
                )
                assert captured.last is not None
                aux, last = captured.aux, captured.last
                if store_dtype is not None:
                    aux, last = aux.to(store_dtype), last.to(store_dtype)
                aux, last = aux.flatten(0, 1), last.flatten(0, 1)
                if keep is not None:  # padding: gather the real tokens (no padding: a reshape only)
                    aux, last = aux.index_select(0, keep), last.index_select(0, keep)
                if copy_stream is not None:
                    copy_stream.wait_stream(torch.cuda.current_stream(device))
                host_aux, host_last = _to_host(aux, copy_stream), _to_host(last, copy_stream)
                ready = None
                if copy_stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(copy_stream)
                lengths = [int(s["input_ids"].shape[0]) for s in batch]
                pending.append(
                    _Chunk(
                        input_ids=torch.cat([s["input_ids"].reshape(-1).long() for s in batch]),
                        loss_mask=torch.cat([s["loss_mask"].reshape(-1).to(torch.uint8) for s in batch]),
                        lengths=lengths,
                        aux=host_aux,
                        last=host_last,
                        ready=ready,
                    )
                )
                pending_samples += len(batch)
                stats.samples += len(batch)
                stats.tokens += sum(lengths)
                if pending_samples >= samples_per_shard:
                    flush(pool)
            flush(pool)
            while inflight:
                inflight.popleft().result()
        finally:
            for future in inflight:
                future.cancel()
    stats.seconds = time.perf_counter() - start
    return stats
