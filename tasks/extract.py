"""Stage 2, extract: conversations -> hidden-state shards (aux layers + final hidden state) per sample.

Ray actors host the Hugging Face target (`extraction.num_actors`, `num_gpus_per_actor` each); every
actor owns one contiguous slice of the conversations and so one set of shards. Capture goes through
kernels.capture (hooks, layer_input ids), packing through kernels.shards, storage through infra.storage.

`extraction.backend: engine` is for targets too large for one process: the engine server computes the
hidden states (infra/engine_extraction.py) and they are repacked into the same shards and manifest.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import ray
from prefect import task

from draftloop.infra.actors import ensure_ray, kill_actors, remote_hidden_state_extractor
from draftloop.infra.config import ExperimentConfig
from draftloop.infra.conversations import read_conversations
from draftloop.infra.engine_extraction import extract_with_engine
from draftloop.infra.processes import PidRecord
from draftloop.infra.storage import DatasetWriter, Manifest, storage_options
from draftloop.infra.targets import ensure_target
from draftloop.tasks.cache import OnStart, StageError, StageOutcome, StageWork, run_cached
from draftloop.tasks.cycle import CycleContext, execute_stage
from draftloop.tasks.retry import stage_task_options

SECTIONS = ("target", "data", "extraction")


def _slices(count: int, parts: int) -> list[tuple[int, int]]:
    size = math.ceil(count / parts)
    return [(start, min(count, start + size)) for start in range(0, count, size)]


def _extract_in_process(
    config: ExperimentConfig, target_path: str, rows: list[dict[str, Any]], slices: list[tuple[int, int]]
) -> list[dict[str, Any]]:
    """One Ray actor per slice of `rows`: {"shards", "tokens", "skipped", "seconds"} each."""
    section = config.extraction
    actor_class = remote_hidden_state_extractor(float(section.num_gpus_per_actor))
    layer_ids = config.aux_layer_ids_internal()
    actors = [
        actor_class.remote(target_path, list(layer_ids.ids), "layer_input", str(section.dtype))
        for _ in slices
    ]
    try:
        futures = [
            actors[index].extract.remote(
                rows[start:end],
                f"hidden-a{index:02d}",
                int(section.samples_per_shard),
                int(config.data.max_length),
            )
            for index, (start, end) in enumerate(slices)
        ]
        results: list[dict[str, Any]] = ray.get(futures)
        return results
    finally:
        kill_actors(actors)


def run(
    config: ExperimentConfig,
    conversations: StageOutcome,
    on_start: OnStart | None = None,
    pids: PidRecord | None = None,
) -> StageOutcome:
    """Extract hidden states for the conversations of `conversations` (cached on its manifest hash)."""

    def body(work: StageWork) -> Manifest:
        ensure_ray(config.ray.address)
        options = storage_options(config)
        rows = read_conversations(conversations.manifest, options)
        if not rows:
            raise StageError("extract", f"no conversations in {conversations.uri}")
        target_path = ensure_target(config)
        section = config.extraction
        layer_ids = config.aux_layer_ids_internal()
        if section.backend == "engine":
            engine_result = extract_with_engine(config, target_path, rows, pids)
            results = [asdict(engine_result)]
            slices = [(0, len(rows))]
        else:
            slices = _slices(len(rows), max(1, int(section.num_actors)))
            results = _extract_in_process(config, target_path, rows, slices)
        writer = DatasetWriter(work.uri, storage_options=options)
        tokens = 0
        skipped: list[dict[str, str]] = []
        samples = 0
        seconds = 0.0
        for result in results:
            for name, data, count in result["shards"]:
                writer.write_shard(name, data, rows=count)
                samples += count
            tokens += int(result["tokens"])
            skipped.extend(result["skipped"])
            seconds = max(seconds, float(result["seconds"]))  # actors run in parallel
        if samples == 0:
            raise StageError("extract", f"every conversation was skipped: {skipped[:3]}")
        summary = {
            "target": target_path,
            "samples": samples,
            "tokens": tokens,
            "skipped": len(skipped),
            "backend": section.backend,
            "actors": len(slices),
            "aux_layer_ids": list(layer_ids.ids),
            "layer_id_convention": "layer_input",
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
        }
        return writer.commit("extract", inputs=work.inputs, summary=summary)

    return run_cached(
        "extract", config, SECTIONS, {"conversations": conversations.manifest}, body, on_start=on_start
    )


@task(name="extract", **stage_task_options())
def extract_stage(ctx: CycleContext, conversations: StageOutcome) -> StageOutcome:
    return execute_stage(
        ctx, "extract", lambda _run, on_start: run(ctx.config, conversations, on_start, ctx.pids)
    )
