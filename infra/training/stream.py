"""Online training's driver side: producers started, the stream planned under the byte cap, the object
store watched while the workers train, the hybrid cache committed.

Why Ray actors with a bounded set of in-flight object references rather than Ray Data: the training
loop already owns the epoch's order, the shuffle windows, the split between workers and resume at any
sample position (kernels/data.py), and exactly-once training needs exactly that order; a worker asks
the producers for the shards it owns, `depth` ahead, and each reply is one object in the store, freed
when the worker has decoded it. Backpressure is the asking: a producer computes only what a worker
asked for. Fault tolerance is Ray's: a producer whose process dies is restarted and its pending calls
retried (a shard is a pure function of its plan), a training worker that dies restarts the worker group
(Ray Train's failure config) from the last checkpoint, which carries the epoch's position.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from draftloop.infra.engines.actors import start_server_actor
from draftloop.infra.engines.base import get_engine
from draftloop.infra.extraction.engine import extraction_engine, target_depth
from draftloop.infra.extraction.producer import (
    EngineEndpoint,
    ProducerSpec,
    ProducerStats,
    StreamShard,
    cached_shard_info,
    plan_stream_shards,
    remote_producer,
    shard_bytes_bound,
)
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.internals import object_store_stats
from draftloop.infra.runtime.processes import PidRecord, state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray, kill_actors
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, storage_options
from draftloop.infra.synthesis.conversations import conversation_count
from draftloop.infra.targets.resolve import ensure_target
from draftloop.infra.training.sources import StreamedHiddenStates

LOG = logging.getLogger("draftloop.stream")
DEFAULT_STORE_SHARE = 0.25  # of the object store, when extraction.max_bytes_in_flight is not set


class StreamRefused(ValueError):
    """The stream cannot run as configured (it would spill, or there is nothing to train); names why."""


@dataclass
class ObjectStoreWatch:
    """Samples the object store's usage on a thread: peak bytes used and bytes spilled meanwhile."""

    interval_s: float = 0.2
    peak_used_bytes: int = 0
    spilled_bytes: int = 0
    capacity_bytes: int = 0
    _spilled_before: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        stats = object_store_stats()
        self.peak_used_bytes = max(self.peak_used_bytes, stats.used_bytes)
        self.spilled_bytes = stats.spilled_bytes_total - self._spilled_before
        self.capacity_bytes = stats.capacity_bytes

    def __enter__(self) -> ObjectStoreWatch:
        first = object_store_stats()
        self._spilled_before, self.capacity_bytes = first.spilled_bytes_total, first.capacity_bytes

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.sample()
                except Exception:  # the cluster going away ends the watch, not the training
                    return

        self._thread = threading.Thread(target=run, name="object-store-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with suppress(Exception):
            self.sample()


@dataclass
class StreamReport:
    """What the stream did, for the train stage's summary."""

    shards: int
    samples: int
    skipped: int
    depth: int
    max_bytes_in_flight: int
    bytes_all_shards: int  # bounds summed: what a storage budget needs for zero recomputation
    producers: list[ProducerStats]
    watch: ObjectStoreWatch
    cache_manifest: Manifest | None = None
    engine_restarts: int | None = None  # backend engine: times its server died and was started again


@dataclass
class HiddenStateStream:
    """A running stream: what the workers get (`hidden`) and what the summary reports."""

    hidden: StreamedHiddenStates
    skipped: int
    max_bytes_in_flight: int
    watch: ObjectStoreWatch = field(default_factory=ObjectStoreWatch)
    endpoint: EngineEndpoint | None = None

    def report(self, cache_manifest: Manifest | None = None) -> StreamReport:
        stats = list(ray.get([producer.stats.remote() for producer in self.hidden.producers]))
        shards = self.hidden.shards
        server = self.endpoint.server if self.endpoint is not None else None
        return StreamReport(
            shards=len(shards),
            samples=sum(len(s.conversations) for s in shards),
            skipped=self.skipped,
            depth=self.hidden.depth,
            max_bytes_in_flight=self.max_bytes_in_flight,
            bytes_all_shards=sum(s.max_bytes for s in shards),
            producers=stats,
            watch=self.watch,
            cache_manifest=cache_manifest,
            engine_restarts=None if server is None else int(ray.get(server.start_count.remote())) - 1,
        )


def _token_counts(producers: list[Any], count: int) -> list[int]:
    """Every conversation's trained token count (0: skipped), measured by the producers in parallel."""
    size = math.ceil(count / len(producers))
    futures = [
        producer.token_counts.remote(start, min(count, start + size))
        for producer, start in zip(producers, range(0, count, size), strict=False)
    ]
    return [tokens for part in ray.get(futures) for tokens in part]


def depth_for(cap: int, capacity: int, largest: int, workers: int) -> int:
    """Shards each worker keeps asked ahead: at most `cap` bytes in flight over all workers (each
    worker has depth + 1 asked). Refuses, by name, a stream whose smallest window would not fit the
    object store (it would spill instead of training)."""
    need = 2 * workers * largest
    if need > capacity:
        raise StreamRefused(
            f"the largest hidden-state shard ({largest:,} bytes) asked 2 ahead by {workers} worker(s) "
            f"needs {need:,} bytes, more than Ray's object store holds ({capacity:,}): it would spill. "
            "Lower extraction.samples_per_shard or give Ray a larger object store"
        )
    return max(1, cap // (workers * largest) - 1)


@contextmanager
def hidden_state_stream(
    config: ExperimentConfig, conversations: Manifest, cache_uri: str | None, pids: PidRecord
) -> Iterator[HiddenStateStream]:
    """Producers ready for the train stage's workers (an engine server first, for backend engine); on
    exit they and the server are stopped."""
    ensure_ray(config.ray.address, pids)
    with (
        _engine_endpoint(config, pids) as endpoint,
        stream_from(config, conversations, cache_uri, pids, endpoint) as stream,
    ):
        yield stream


@contextmanager
def _engine_endpoint(config: ExperimentConfig, pids: PidRecord) -> Iterator[EngineEndpoint | None]:
    """backend engine: the engine server in its extraction mode (a Ray actor, stopped on exit)."""
    if config.extraction.backend != "engine":
        yield None
        return
    target_path = ensure_target(config)
    run_dir = state_dir() / "work" / str(config.name) / "stream-engine"
    hidden_dir = run_dir / "hidden-states"
    hidden_dir.mkdir(parents=True, exist_ok=True)
    base = get_engine(config.engine.kind, config.engine_settings())
    engine = extraction_engine(
        base, config.aux_layer_ids_internal(), target_depth(Path(target_path)), hidden_dir
    )
    server = start_server_actor(engine, target_path, run_dir, "extraction", pids=pids)
    try:
        yield EngineEndpoint(engine, server.base_url, server.model_name, server.actor)
    finally:
        server.stop()
        pids.forget("engine-extraction")
        # What a server killed mid-request left behind (no reply named those files; none were read).
        shutil.rmtree(hidden_dir, ignore_errors=True)


@contextmanager
def stream_from(
    config: ExperimentConfig,
    conversations: Manifest,
    cache_uri: str | None,
    pids: PidRecord,
    endpoint: EngineEndpoint | None,
) -> Iterator[HiddenStateStream]:
    """`extraction.num_actors` producers (asking `endpoint`, or hosting the target), the stream planned
    over `conversations`; the producers are stopped on exit."""
    section = config.extraction
    count = conversation_count(conversations)
    if count == 0:
        raise StreamRefused(f"no conversations in {conversations.uri}")
    spec = ProducerSpec(
        conversations=conversations,
        storage_options=storage_options(config),
        target_path=ensure_target(config),
        aux_layer_ids=config.aux_layer_ids_internal(),
        dtype=str(section.dtype),
        max_length=int(config.data.max_length),
        trust_remote_code=bool(config.target.trust_remote_code),
        endpoint=endpoint,
    )
    producer_class = remote_producer(float(section.num_gpus_per_actor), section.producer_resource)
    producers = [producer_class.remote(spec) for _ in range(int(section.num_actors))]
    try:
        pids.add("producers", [int(pid) for pid in ray.get([p.pid.remote() for p in producers])])
        stream = _planned(config, producers, count, cache_uri)
        stream.endpoint = endpoint
        yield stream
    finally:
        kill_actors(producers)
        pids.forget("producers")


def _planned(
    config: ExperimentConfig, producers: list[Any], count: int, cache_uri: str | None
) -> HiddenStateStream:
    section = config.extraction
    hidden, dtype = config.target_hidden_size, getattr(torch, str(section.dtype))
    aux_layers = len(config.aux_layer_ids_internal().ids)

    def bound(tokens: int, samples: int) -> int:
        return shard_bytes_bound(tokens, samples, aux_layers, hidden, dtype)

    counts = _token_counts(producers, count)
    shards = plan_stream_shards(counts, int(section.samples_per_shard), bound)
    if not shards:
        raise StreamRefused("every conversation was skipped: no assistant tokens within data.max_length")
    capacity = object_store_stats().capacity_bytes
    cap = int(section.max_bytes_in_flight or capacity * DEFAULT_STORE_SHARE)
    depth = depth_for(cap, capacity, max(s.max_bytes for s in shards), int(config.training.num_workers))
    # A worker holds at most one shuffle window of shards at once: asking further ahead than a window
    # plus its read-ahead only makes memory grow with the data (up to the cap) without feeding it faster.
    depth = min(depth, int(config.training.shuffle_window_shards) + int(config.training.prefetch_shards))
    names: frozenset[str] = frozenset()
    if section.mode == "hybrid" and cache_uri is not None:
        names = frozenset(cache_plan(shards, int(section.storage_budget or 0)))
    streamed = StreamedHiddenStates(
        producers=tuple(producers),
        shards=tuple(shards),
        depth=depth,
        storage_options=storage_options(config),
        cache_uri=cache_uri if names else None,
        cache_names=names,
    )
    LOG.info(
        "streaming %d shards (%d samples) from %d producer(s), %d asked ahead per worker (cap %d bytes)",
        len(shards),
        sum(len(s.conversations) for s in shards),
        len(producers),
        depth,
        cap,
    )
    return HiddenStateStream(streamed, skipped=counts.count(0), max_bytes_in_flight=cap)


def cache_plan(shards: list[StreamShard], budget: int) -> list[str]:
    """The shards hybrid mode stores: in plan order while their bounds fit the budget (so the bytes
    stored never exceed it, whatever the real sizes)."""
    chosen, used = [], 0
    for shard in shards:
        if used + shard.max_bytes > budget:
            break
        chosen.append(shard.name)
        used += shard.max_bytes
    return chosen


def commit_cache(stream: HiddenStateStream, inputs: dict[str, str]) -> Manifest | None:
    """The hybrid cache's manifest, over the shards whose write completed (their sidecars)."""
    hidden = stream.hidden
    if hidden.cache_uri is None:
        return None
    writer = DatasetWriter(hidden.cache_uri, storage_options=hidden.storage_options)
    for name in sorted(hidden.cache_names):
        info = cached_shard_info(hidden.cache_uri, name, hidden.storage_options)
        if info is not None:
            writer.adopt_shard(info)
    stored = sum(info.size for info in writer.shards)
    return writer.commit(
        "hidden-cache", inputs=inputs, summary={"bytes": stored, "shards": len(writer.shards)}
    )
