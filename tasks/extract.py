"""Stage 2, extract: conversations -> hidden-state shards (aux layers + final hidden state) per sample.

Ray actors host the Hugging Face target (`extraction.num_actors`, `num_gpus_per_actor` each); every
actor reads one contiguous slice of the conversations from storage and writes its own shards straight
into the stage's dataset folder, returning only their ShardInfo; the task commits the one manifest, so
no conversation or hidden state passes through the driver or Ray's object store. Capture goes through
kernels.capture (hooks, layer_input ids), packing through kernels.shards, storage through infra.storage.

`extraction.backend: engine` is for targets too large for one process: the engine server computes the
hidden states (infra/extraction/engine.py) and they are repacked into the same shards and manifest.
"""

from __future__ import annotations

import math

import ray

from draftloop.infra.extraction.engine import extract_with_engine
from draftloop.infra.extraction.extractor import ExtractedShards, remote_hidden_state_extractor
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.ray_cluster import ensure_ray, kill_actors
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, storage_options
from draftloop.infra.synthesis.conversations import conversation_count, read_conversations
from draftloop.infra.targets.resolve import ensure_target
from draftloop.tasks.cache import StageError
from draftloop.tasks.stage import Figure, Stage, StageRequest
from draftloop.tasks.summaries import ExtractionSummary


def _slices(count: int, parts: int) -> list[tuple[int, int]]:
    size = math.ceil(count / parts)
    return [(start, min(count, start + size)) for start in range(0, count, size)]


def _extract_in_process(
    config: ExperimentConfig,
    target_path: str,
    conversations: Manifest,
    slices: list[tuple[int, int]],
    writer: DatasetWriter,
) -> list[ExtractedShards]:
    """One Ray actor per slice of the conversations; each reads its slice and writes its shards straight
    into `writer`'s folder, returning their ShardInfo, which `writer` adopts for the manifest."""
    section = config.extraction
    actor_class = remote_hidden_state_extractor(float(section.num_gpus_per_actor))
    layer_ids = config.aux_layer_ids_internal()
    actors = [
        actor_class.remote(
            target_path,
            list(layer_ids.ids),
            "layer_input",
            str(section.dtype),
            trust_remote_code=config.target.trust_remote_code,
        )
        for _ in slices
    ]
    try:
        futures = [
            actors[index].extract_slice.remote(
                conversations,
                start,
                end,
                writer.uri,
                writer.options,
                f"hidden-a{index:02d}",
                int(section.samples_per_shard),
                int(config.data.max_length),
            )
            for index, (start, end) in enumerate(slices)
        ]
        results: list[ExtractedShards] = ray.get(futures)
    finally:
        kill_actors(actors)
    for result in results:
        for info in result.shards:
            writer.adopt_shard(info)
    return results


def produce(request: StageRequest) -> Manifest:
    """Extract hidden states for the synthesized conversations."""
    config = request.config
    ensure_ray(config.ray.address, request.pids)
    options = storage_options(config)
    conversations = request.inputs["conversations"]
    count = conversation_count(conversations.manifest)
    if count == 0:
        raise StageError("extract", f"no conversations in {conversations.uri}")
    target_path = ensure_target(config)
    section = config.extraction
    layer_ids = config.aux_layer_ids_internal()
    writer = DatasetWriter(request.work.uri, storage_options=options)
    if section.backend == "engine":
        rows = read_conversations(conversations.manifest, options)
        engine_result = extract_with_engine(config, target_path, rows, request.pids)
        for name, data, rows_in_shard in engine_result.shards:
            writer.write_shard(name, data, rows=rows_in_shard)
        tokens, seconds = engine_result.tokens, engine_result.seconds
        skipped, skip_examples = len(engine_result.skipped), engine_result.skipped[:3]
        actors = 1
    else:
        slices = _slices(count, max(1, int(section.num_actors)))
        results = _extract_in_process(config, target_path, conversations.manifest, slices, writer)
        tokens = sum(result.tokens for result in results)
        seconds = max(result.seconds for result in results)  # actors run in parallel
        skipped = sum(result.skipped for result in results)
        skip_examples = [example for result in results for example in result.skip_examples]
        actors = len(slices)
    samples = sum(info.rows for info in writer.shards)
    if samples == 0:
        raise StageError("extract", f"every conversation was skipped: {skip_examples[:3]}")
    summary = {
        "target": target_path,
        "samples": samples,
        "tokens": tokens,
        "skipped": skipped,
        "backend": section.backend,
        "actors": actors,
        "aux_layer_ids": list(layer_ids.ids),
        "layer_id_convention": "layer_input",
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
    }
    return writer.commit("extract", inputs=request.work.inputs, summary=summary)


def gpus(config: ExperimentConfig) -> float:
    section = config.extraction
    if section.backend == "engine":
        return float(config.engine.num_gpus)
    return float(section.num_actors * section.num_gpus_per_actor)


STAGE = Stage(
    name="extract",
    produce=produce,
    summary=ExtractionSummary,
    sections=("target", "data", "extraction"),
    inputs={"conversations": "synthesize"},
    gpus=gpus,
    figures=(Figure("samples", "samples"), Figure("tokens", "tokens"), Figure("tokens_per_s", "tokens/s")),
    description=(
        "Synthesize the training conversations, then extract the target's hidden states for training."
    ),
)
