"""Where a training worker's samples come from: stored shards (offline) or producer actors (online).

Both give the worker the same `ShardedSamples` (kernels/data.py: the seeded global order, shuffle
windows, the split between workers, exactly once per epoch), over shards of the same format decoded
by the same reader; only who makes a shard's bytes differs. Stored: read from the extract stage's
dataset, integrity-checked, on a background thread. Streamed: asked from the producers (Ray actor
calls whose results travel through Ray's object store), `depth` shards ahead of the one in training,
so the bytes in flight stay bounded and producers wait when the trainers lag; in hybrid mode a shard
that an earlier epoch stored within the budget is read back instead.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from draftloop.infra.extraction.producer import ProducedShard, StreamShard, cached_shard_info
from draftloop.infra.runtime.storage import Manifest, StorageOptions, join, read_bytes, read_shard
from draftloop.kernels.data import HeldOut, RankSplit, ShardedSamples, ShardRef, split_held_out
from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes

Sample = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StoredHiddenStates:
    """The extract stage's committed dataset (offline)."""

    manifest: Manifest
    storage_options: StorageOptions


@dataclass(frozen=True)
class StreamedHiddenStates:
    """Hidden states computed on request by the train stage's producer actors (online, hybrid)."""

    producers: tuple[Any, ...]  # Ray actor handles of HiddenStateProducer
    shards: tuple[StreamShard, ...]
    depth: int  # shards a worker keeps asked ahead of the one it waits for (the byte cap's share)
    storage_options: StorageOptions
    cache_uri: str | None = None  # hybrid: where epoch 0 stores the shards of `cache_names`
    cache_names: frozenset[str] = frozenset()


HiddenStates = StoredHiddenStates | StreamedHiddenStates


@dataclass
class StreamTraffic:
    """What one worker received from the producers (online); summed over workers for the summary."""

    node_id: str
    shards: int = 0
    bytes_received: int = 0
    bytes_from_other_nodes: int = 0  # computed on another Ray node: crossed between object stores
    bytes_read_from_cache: int = 0
    asked_bytes: int = 0  # bounds of the shards asked and not yet received
    peak_asked_bytes: int = 0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [
                self.shards,
                self.bytes_received,
                self.bytes_from_other_nodes,
                self.bytes_read_from_cache,
                self.peak_asked_bytes,
            ],
            dtype=torch.int64,
        )


TRAFFIC_FIELDS = (
    "shards",
    "bytes_received",
    "bytes_from_other_nodes",
    "bytes_read_from_cache",
    "peak_asked_bytes",
)


@dataclass
class WorkerData:
    """A worker's training samples, the held-out reader, and a token-only reader (vocabulary counts)."""

    samples: ShardedSamples
    load_held_out: Callable[[], list[Sample]]
    load_tokens: Callable[[str], list[Sample]]  # a training shard's samples, input ids and masks at least
    traffic: StreamTraffic | None = field(default=None)


def decode_samples(data: bytes) -> list[Sample]:
    """A shard file's samples (their own tensors: nothing keeps the shard's buffer alive)."""
    tensors, _ = shard_from_bytes(data)
    return [{k: v.clone() for k, v in sample.items()} for sample in iter_hidden_samples(tensors)]


def _training_split(refs: list[ShardRef], held_out: int) -> tuple[list[ShardRef], HeldOut, dict[str, int]]:
    training, plan = split_held_out(refs, held_out, seed=0)
    return training, plan, {shard.name: shard.num_samples for shard in training}


def stored_samples(
    hidden: StoredHiddenStates, window: int, prefetch: int, held_out: int, split: RankSplit = "shards"
) -> WorkerData:
    """The extract stage's shards, each read (integrity-checked) only when training needs it."""

    def read(name: str) -> list[Sample]:
        return decode_samples(read_shard(hidden.manifest, name, hidden.storage_options))

    # A shard's size stands in for its tokens when shards are split between workers.
    refs = [
        ShardRef(info.name, info.rows, info.size)
        for info in hidden.manifest.shards
        if info.name.endswith(".safetensors")
    ]
    training, plan, kept = _training_split(refs, held_out)

    def load_training(name: str) -> list[Sample]:
        return read(name)[: kept[name]]

    def load_held_out() -> list[Sample]:
        return [s for name, count in plan.per_shard.items() for s in read(name)[-count:]]

    samples = ShardedSamples(
        training, load_training, window_shards=window, prefetch_shards=prefetch, split=split
    )
    return WorkerData(samples, load_held_out, load_training)


def streamed_samples(
    hidden: StreamedHiddenStates, window: int, held_out: int, rank: int, split: RankSplit = "shards"
) -> WorkerData:
    """The producers' shards, `hidden.depth` asked ahead (the byte cap), each received once through
    the object store; in hybrid mode, shards stored by an earlier epoch are read back instead."""
    by_name = {shard.name: shard for shard in hidden.shards}
    traffic = StreamTraffic(node_id=ray.get_runtime_context().get_node_id())
    # Workers start on different producers, then take them in turn.
    turn = itertools.count(rank)
    reader = ThreadPoolExecutor(1, thread_name_prefix="stream-cache-read")

    def received(produced: ProducedShard, bound: int) -> list[Sample]:
        traffic.asked_bytes -= bound
        traffic.shards += 1
        traffic.bytes_received += len(produced.data)
        if produced.node_id != traffic.node_id:
            traffic.bytes_from_other_nodes += len(produced.data)
        return decode_samples(produced.data)

    def read_cached(name: str) -> Callable[[], list[Sample]] | None:
        if hidden.cache_uri is None or name not in hidden.cache_names:
            return None
        info = cached_shard_info(hidden.cache_uri, name, hidden.storage_options)
        if info is None:
            return None
        uri, options = join(hidden.cache_uri, name), hidden.storage_options

        def read() -> list[Sample]:
            data = read_bytes(uri, options)
            if len(data) != info.size or hashlib.sha256(data).hexdigest() != info.sha256:
                raise RuntimeError(f"cached hidden-state shard {uri} does not match its sidecar")
            traffic.bytes_read_from_cache += len(data)
            return decode_samples(data)

        return reader.submit(read).result

    def submit(name: str) -> Callable[[], list[Sample]]:
        cached = read_cached(name)
        if cached is not None:
            return cached
        shard = by_name[name]
        producer = hidden.producers[next(turn) % len(hidden.producers)]
        cache_to = hidden.cache_uri if name in hidden.cache_names else None
        ref = producer.produce.remote(shard, cache_to)
        traffic.asked_bytes += shard.max_bytes
        traffic.peak_asked_bytes = max(traffic.peak_asked_bytes, traffic.asked_bytes)
        # The reference is dropped once its samples are decoded: the object leaves the store.
        return lambda: received(ray.get(ref), shard.max_bytes)

    def load(name: str) -> list[Sample]:
        return submit(name)()

    refs = [ShardRef(shard.name, len(shard.conversations), shard.tokens) for shard in hidden.shards]
    training, plan, kept = _training_split(refs, held_out)

    def load_training(name: str) -> list[Sample]:
        return load(name)[: kept[name]]

    def submit_training(name: str) -> Callable[[], list[Sample]]:
        pending = submit(name)
        return lambda: pending()[: kept[name]]

    def load_held_out() -> list[Sample]:
        return [s for name, count in plan.per_shard.items() for s in load(name)[-count:]]

    def load_tokens(name: str) -> list[Sample]:
        producer = hidden.producers[next(turn) % len(hidden.producers)]
        return list(ray.get(producer.token_samples.remote(by_name[name])))[: kept[name]]

    samples = ShardedSamples(
        training,
        load_training,
        window_shards=window,
        prefetch_shards=hidden.depth,
        submit_shard=submit_training,
        split=split,
    )
    return WorkerData(samples, load_held_out, load_tokens, traffic)


def worker_data(
    hidden: HiddenStates, window: int, prefetch: int, held_out: int, rank: int, split: RankSplit = "shards"
) -> WorkerData:
    if isinstance(hidden, StreamedHiddenStates):
        return streamed_samples(hidden, window, held_out, rank, split)
    return stored_samples(hidden, window, prefetch, held_out, split)


def sample_count(hidden: HiddenStates) -> int:
    """Samples in the hidden states (training and held-out together)."""
    if isinstance(hidden, StreamedHiddenStates):
        return sum(len(shard.conversations) for shard in hidden.shards)
    return sum(info.rows for info in hidden.manifest.shards if info.name.endswith(".safetensors"))
