"""The Hugging Face target capturing aux + final hidden states into shards (a Ray actor in the flow)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from draftloop.infra.extraction.tokenize import token_sample
from draftloop.infra.runtime.ray_cluster import remote_options
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, ShardInfo, StorageOptions
from draftloop.infra.synthesis.conversations import iter_conversations
from draftloop.infra.targets.loaded import load_target
from draftloop.kernels.extract import extract_hidden_states
from draftloop.kernels.layer_ids import LayerIds, normalize_convention
from draftloop.kernels.shards import shard_chunks, shard_to_bytes

_SKIP_EXAMPLES = 3


@dataclass(frozen=True)
class ExtractedShards:
    """What an extraction actor returns: the shards it wrote (their ShardInfo, never their bytes)."""

    shards: list[ShardInfo]
    tokens: int
    skipped: int  # conversations with no assistant token within data.max_length
    skip_examples: list[dict[str, str]]  # the first few of them, {"id", "reason"}
    seconds: float


class HiddenStateExtractor:
    """Hosts the HF target and captures aux + final hidden states (a Ray actor in the flow)."""

    def __init__(
        self,
        target_path: str,
        aux_layer_ids: Sequence[int],
        convention: str,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,  # run the folder's own code: only for a target.trust_remote_code
    ) -> None:
        target = load_target(target_path, dtype, device, trust_remote_code)
        self.device, self.dtype, self.target_path = target.device, target.dtype, target_path
        self.tokenizer: Any = target.tokenizer
        self.model: Any = target.model
        self.layer_ids = LayerIds(tuple(int(i) for i in aux_layer_ids), normalize_convention(convention)).to(
            "layer_input"
        )
        # Hooks capture from one process; keep the thread count to what Ray gave this actor.
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    def extract_slice(
        self,
        conversations: Manifest,
        start: int,
        end: int,
        dataset_uri: str,
        options: StorageOptions,
        shard_prefix: str,
        samples_per_shard: int,
        max_length: int,
        batch_size: int = 4,
    ) -> ExtractedShards:
        """As :meth:`extract` over conversations `start`..`end` of a synthesize dataset, read here from
        storage one shard at a time (so the driver never holds the conversations either)."""
        rows = iter_conversations(conversations, start, end, options)
        return self.extract(
            rows, dataset_uri, options, shard_prefix, samples_per_shard, max_length, batch_size
        )

    def extract(
        self,
        conversations: Iterable[dict[str, Any]],
        dataset_uri: str,
        options: StorageOptions,
        shard_prefix: str,
        samples_per_shard: int,
        max_length: int,
        batch_size: int = 4,
    ) -> ExtractedShards:
        """Capture every conversation and write its shards into the dataset folder `dataset_uri`.

        Conversations are tokenized as the batches are consumed; forward passes, device-to-host copies
        and shard writes overlap (kernels.extract), and each shard is streamed from host memory to
        storage. Only the shards' ShardInfo come back: the driver lists them in the one manifest it
        commits, so no hidden state passes through it or Ray's object store.
        """
        skipped = 0
        skip_examples: list[dict[str, str]] = []

        def on_skip(row: dict[str, Any]) -> None:
            nonlocal skipped
            skipped += 1
            if len(skip_examples) < _SKIP_EXAMPLES:
                skip_examples.append(
                    {"id": row["id"], "reason": "no assistant tokens within data.max_length"}
                )

        # Never commits: the driver adopts these shards into its own writer and writes the manifest.
        writer = DatasetWriter(dataset_uri, storage_options=options)

        def sink(name: str, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
            rows = int(tensors["seq_offsets"].shape[0]) - 1
            writer.write_shard_chunks(name, shard_chunks(tensors, metadata), rows=rows)

        stats = extract_hidden_states(
            self.model,
            self.batches(conversations, max_length, batch_size, on_skip),
            self.layer_ids,
            sink,
            target_name=self.target_path,
            samples_per_shard=samples_per_shard,
            shard_prefix=shard_prefix,
            store_dtype=self.dtype,
        )
        return ExtractedShards(
            shards=sorted(writer.shards, key=lambda info: info.name),
            tokens=stats.tokens,
            skipped=skipped,
            skip_examples=skip_examples,
            seconds=stats.seconds,
        )

    def batches(
        self,
        conversations: Iterable[dict[str, Any]],
        max_length: int,
        batch_size: int,
        on_skip: Callable[[dict[str, Any]], None],
    ) -> Iterator[list[dict[str, Any]]]:
        """The conversations tokenized (chat template, assistant mask) in forward batches of
        `batch_size`; one with no assistant token within `max_length` goes to `on_skip` instead."""
        batch: list[dict[str, Any]] = []
        for row in conversations:
            sample = token_sample(self.tokenizer, row["messages"], max_length)
            if not sample["loss_mask"].any():
                on_skip(row)
                continue
            batch.append(sample)
            if len(batch) == batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def capture_shard(
        self, conversations: Sequence[dict[str, Any]], max_length: int, batch_size: int = 4
    ) -> tuple[bytes, int]:
        """(one shard's bytes, its tokens) for `conversations`, kept in memory: the online path's unit.
        The same forward batches, capture and shard format as :meth:`extract`."""
        captured: list[bytes] = []

        def sink(name: str, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
            captured.append(shard_to_bytes(tensors, metadata))

        def refuse(row: dict[str, Any]) -> None:
            raise ValueError(f"conversation {row['id']!r} has no assistant tokens within {max_length}")

        stats = extract_hidden_states(
            self.model,
            self.batches(conversations, max_length, batch_size, refuse),
            self.layer_ids,
            sink,
            target_name=self.target_path,
            samples_per_shard=len(conversations),
            store_dtype=self.dtype,
        )
        if len(captured) != 1:
            raise RuntimeError(f"capture of {len(conversations)} conversations gave {len(captured)} shards")
        return captured[0], stats.tokens


def remote_hidden_state_extractor(num_gpus: float) -> Any:
    return ray.remote(**remote_options(num_gpus))(HiddenStateExtractor)
