"""Online extraction's producers: Ray actors that compute one hidden-state shard when a trainer asks.

In `extraction.mode: online | hybrid` nothing extracts ahead of training. The train stage plans the
shards (`plan_stream_shards`: which conversations each holds, from token counts the producers
measure), starts `extraction.num_actors` producers, and every training worker asks them for the
shards it trains, a bounded number ahead (infra/training/stream.py). A producer answers with the
shard's bytes in the stored shard format (kernels/shards.py): through Ray's object store, read by the
same decoder as a stored shard, so online and offline training see the same samples.

Two backends, as for the extract stage: `in_process` hosts the Hugging Face target
(`HiddenStateExtractor.capture_shard`: the extract stage's forward batches and capture), `engine` asks
an engine server started in its extraction mode (infra/extraction/engine.py; the connector's files
are read and deleted as each reply arrives). In hybrid mode a producer also stores the shards it is
asked to cache: written atomically, then a sidecar with their size and sha256, which is what later
epochs and the stage's manifest trust.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from draftloop.infra.engines.base import Engine
from draftloop.infra.extraction.engine import load_final_norm, request_hidden_states, sample_from_engine
from draftloop.infra.extraction.extractor import HiddenStateExtractor
from draftloop.infra.extraction.tokenize import token_sample, tokenize_conversation
from draftloop.infra.runtime.ray_cluster import remote_options
from draftloop.infra.runtime.storage import (
    DatasetWriter,
    Manifest,
    ShardInfo,
    StorageOptions,
    exists,
    join,
    read_text,
    write_text_atomic,
)
from draftloop.infra.synthesis.conversations import iter_conversations
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import TARGET_DTYPE_KEY, pack_hidden_shard, shard_metadata, shard_to_bytes

FORWARD_BATCH = 4  # conversations per target forward: the extract stage's, so shards agree with its
# How often one shard asks again after the engine server died and was started again.
ENGINE_RESTARTS = 2
SIDECAR_SUFFIX = ".info.json"  # a cached shard's ShardInfo, written after the shard


@dataclass(frozen=True)
class StreamShard:
    """One shard of the stream: the kept conversations it holds, in dataset order."""

    name: str
    conversations: tuple[int, ...]  # indices into the synthesized conversations
    tokens: int
    max_bytes: int  # an upper bound of its encoded size (the byte cap and the storage budget use it)


@dataclass(frozen=True)
class ProducedShard:
    name: str
    data: bytes  # the shard file's bytes
    samples: int
    node_id: str  # the Ray node that computed it (bytes that crossed nodes are counted by trainers)
    cached: bool  # stored for later epochs (hybrid)


@dataclass(frozen=True)
class EngineEndpoint:
    """The engine server a producer asks (backend engine): its extraction-mode engine and address."""

    engine: Engine
    base_url: str
    model: str
    server: Any = None  # its EngineServerActor: asked to start the server again if it died


@dataclass(frozen=True)
class ProducerSpec:
    """What every producer of one train stage needs (pickled to each actor)."""

    conversations: Manifest
    storage_options: StorageOptions
    target_path: str
    aux_layer_ids: LayerIds  # layer_input
    dtype: str  # the dtype hidden states are computed and sent in
    max_length: int
    trust_remote_code: bool
    endpoint: EngineEndpoint | None  # None: the in-process target


@dataclass(frozen=True)
class ProducerStats:
    shards: int
    samples: int  # target forward passes spent (one per sample)
    tokens: int
    cached_shards: int
    cached_bytes: int
    seconds: float  # computing


def shard_bytes_bound(tokens: int, samples: int, aux_layers: int, hidden: int, dtype: torch.dtype) -> int:
    """An upper bound of a hidden-state shard's encoded size: aux and last hidden states, ids (int64),
    mask (uint8), offsets (int64) and a safetensors header of at most 8 KiB."""
    element = torch.empty((), dtype=dtype).element_size()
    return tokens * ((aux_layers + 1) * hidden * element + 8 + 1) + (samples + 1) * 8 + 8192


def plan_stream_shards(
    token_counts: list[int], samples_per_shard: int, bytes_of: Any, prefix: str = "hidden-s00"
) -> list[StreamShard]:
    """The stream's shards over conversations whose token counts are `token_counts` (0: skipped, no
    assistant token within max_length): consecutive kept conversations, `samples_per_shard` rounded up
    to whole forward batches per shard, as one extraction actor cuts them. ``bytes_of(tokens, samples)``
    bounds a shard's size."""
    size = -(-samples_per_shard // FORWARD_BATCH) * FORWARD_BATCH
    kept = [index for index, tokens in enumerate(token_counts) if tokens > 0]
    shards = []
    for number, start in enumerate(range(0, len(kept), size)):
        members = tuple(kept[start : start + size])
        tokens = sum(token_counts[i] for i in members)
        name = f"{prefix}-{number:05d}.safetensors"
        shards.append(StreamShard(name, members, tokens, int(bytes_of(tokens, len(members)))))
    return shards


def cached_shard_info(cache_uri: str, name: str, options: StorageOptions) -> ShardInfo | None:
    """The cached shard's ShardInfo if its write completed (the sidecar is written after the shard)."""
    sidecar = join(cache_uri, name + SIDECAR_SUFFIX)
    if not exists(sidecar, options):
        return None
    return ShardInfo.model_validate_json(read_text(sidecar, options))


class HiddenStateProducer:
    """Computes stream shards on request (a Ray actor; Ray restarts it, and retries its call, if its
    process dies)."""

    def __init__(self, spec: ProducerSpec) -> None:
        self.spec = spec
        self.extractor: HiddenStateExtractor | None = None
        if spec.endpoint is None:
            self.extractor = HiddenStateExtractor(
                spec.target_path,
                list(spec.aux_layer_ids.ids),
                "layer_input",
                spec.dtype,
                trust_remote_code=spec.trust_remote_code,
            )
            self.tokenizer: Any = self.extractor.tokenizer
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                spec.target_path, trust_remote_code=spec.trust_remote_code
            )
            self.final_norm = load_final_norm(
                Path(spec.target_path), getattr(torch, spec.dtype), trust_remote_code=spec.trust_remote_code
            )
        self._stats = {"shards": 0, "samples": 0, "tokens": 0, "cached_shards": 0, "cached_bytes": 0}
        self._seconds = 0.0
        self._engine_starts = 1  # the engine server's start count this producer's requests went to

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this producer runs on."""
        return str(ray.get_runtime_context().get_node_id())

    def token_counts(self, start: int, end: int) -> list[int]:
        """Tokens of each conversation `start`..`end` as trained (0: no assistant token, skipped)."""
        counts = []
        for row in iter_conversations(self.spec.conversations, start, end, self.spec.storage_options):
            ids, mask = tokenize_conversation(self.tokenizer, row["messages"], self.spec.max_length)
            counts.append(len(ids) if sum(mask) else 0)
        return counts

    def _rows(self, shard: StreamShard) -> list[dict[str, Any]]:
        first, last = shard.conversations[0], shard.conversations[-1] + 1
        wanted = set(shard.conversations)
        rows = iter_conversations(self.spec.conversations, first, last, self.spec.storage_options)
        return [row for index, row in enumerate(rows, start=first) if index in wanted]

    def token_samples(self, shard: StreamShard) -> list[dict[str, torch.Tensor]]:
        """The shard's samples' input ids and loss masks only (no forward pass: vocabulary counts)."""
        rows = self._rows(shard)
        return [token_sample(self.tokenizer, row["messages"], self.spec.max_length) for row in rows]

    def produce(self, shard: StreamShard, cache_uri: str | None = None) -> ProducedShard:
        """The shard's bytes; with `cache_uri` (hybrid), also stored there with its sidecar."""
        started = time.perf_counter()
        rows = self._rows(shard)
        if self.extractor is not None:
            data, tokens = self.extractor.capture_shard(rows, self.spec.max_length, FORWARD_BATCH)
        else:
            data, tokens = self._through_engine(rows)
        cached = False
        if cache_uri is not None and len(data) <= shard.max_bytes:
            info = DatasetWriter(cache_uri, storage_options=self.spec.storage_options).write_shard(
                shard.name, data, rows=len(rows)
            )
            sidecar = join(cache_uri, shard.name + SIDECAR_SUFFIX)
            write_text_atomic(sidecar, info.model_dump_json(), self.spec.storage_options)
            self._stats["cached_shards"] += 1
            self._stats["cached_bytes"] += len(data)
            cached = True
        self._stats["shards"] += 1
        self._stats["samples"] += len(rows)
        self._stats["tokens"] += tokens
        self._seconds += time.perf_counter() - started
        return ProducedShard(shard.name, data, len(rows), ray.get_runtime_context().get_node_id(), cached)

    def _through_engine(self, rows: list[dict[str, Any]]) -> tuple[bytes, int]:
        endpoint = self.spec.endpoint
        assert endpoint is not None
        dtype = getattr(torch, self.spec.dtype)
        tokenized = [
            tokenize_conversation(self.tokenizer, row["messages"], self.spec.max_length) for row in rows
        ]
        for _restart in range(ENGINE_RESTARTS + 1):
            replies = asyncio.run(
                request_hidden_states(
                    endpoint.engine,
                    endpoint.base_url,
                    endpoint.model,
                    [ids for ids, _ in tokenized],
                    endpoint.engine.settings.max_num_seqs,
                )
            )
            if all(not isinstance(reply, str) for reply in replies) or not self._engine_restarted():
                break
        samples = []
        for row, (ids, mask), reply in zip(rows, tokenized, replies, strict=True):
            if isinstance(reply, str):  # the shard cannot be produced: the stage fails (and resumes)
                raise RuntimeError(f"engine extraction of conversation {row['id']!r} failed: {reply}")
            samples.append(sample_from_engine(reply, ids, mask, self.final_norm, dtype))
        metadata = shard_metadata(
            self.spec.aux_layer_ids,
            self.spec.target_path,
            extraction_backend=f"engine:{endpoint.engine.kind}",
            **{TARGET_DTYPE_KEY: endpoint.engine.settings.dtype},
        )
        return shard_to_bytes(pack_hidden_shard(samples), metadata), sum(len(ids) for ids, _ in tokenized)

    def _engine_restarted(self) -> bool:
        """After a failed request: whether the engine server was started again since this producer's
        requests went to it (it had died: restarted now, or by another producer's call); ask again then.
        Files its dead process left in the connector folder are never read: only replies name files."""
        server = self.spec.endpoint.server if self.spec.endpoint is not None else None
        if server is None:
            return False
        starts = int(ray.get(server.ensure_running.remote()))
        restarted, self._engine_starts = starts > self._engine_starts, starts
        return restarted

    def stats(self) -> ProducerStats:
        return ProducerStats(**self._stats, seconds=round(self._seconds, 3))


def remote_producer(num_gpus: float, resource: str | None) -> Any:
    """The producer actor class: restarted by Ray if its process dies, its pending calls retried (a
    produced shard is a pure function of its plan, so a retry gives the same bytes)."""
    # No CPU asked: the pool's size is the config's num_actors, and what limits a producer is its
    # accelerator or engine server, not a CPU slot the trainers need (2 trainers + 1 producer fit 2 CPUs).
    options = remote_options(num_gpus, num_cpus=0)
    if resource:
        options["resources"] = {resource: 0.001}
    return ray.remote(max_restarts=-1, max_task_retries=-1, **options)(HiddenStateProducer)
