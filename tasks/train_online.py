"""Stage 3, online: conversations -> a drafter, the hidden states streamed from producers, none stored.

In `extraction.mode: online | hybrid` the pipeline has no extract stage (flows/pipeline.py): this
stage starts the producer actors (in-process targets, or clients of an engine server in its
extraction mode), and the Ray Train workers ask them for the shards they train, through Ray's object
store, a bounded number ahead (infra/training/stream.py says why this and not Ray Data). Hybrid mode
also stores the shards that fit `extraction.storage_budget` during epoch 0, for later epochs to read
back; its cache is an ordinary dataset with a manifest, beside the stage's output.
"""

from __future__ import annotations

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import Manifest, join
from draftloop.infra.training.fit import drafter_key_fields, fit, store_drafter, trainer_gpus, work_dir
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.stream import StreamRefused, StreamReport, commit_cache, hidden_state_stream
from draftloop.kernels.contract import contract_record
from draftloop.kernels.shards import LAST_HIDDEN_AFTER_FINAL_NORM
from draftloop.tasks.cache import StageError
from draftloop.tasks.stage import Figure, Stage, StageRequest
from draftloop.tasks.summaries import TRAINING_FIGURES, StreamSummary, TrainingSummary


def cache_uri(config: ExperimentConfig, key: str) -> str | None:
    """Hybrid mode's stored shards: `<storage.root>/<name>/hidden-cache/<train key>/`."""
    if config.extraction.mode != "hybrid":
        return None
    return join(str(config.storage.root), config.name, "hidden-cache", key)


def stream_summary(config: ExperimentConfig, report: StreamReport, traffic: dict[str, int]) -> StreamSummary:
    """The stream block of the train summary: the driver's report and what the workers received."""
    producers = report.producers
    stored = int(report.cache_manifest.summary["bytes"]) if report.cache_manifest else 0
    return StreamSummary(
        mode=config.extraction.mode,
        backend=config.extraction.backend,
        producers=len(producers),
        shards=report.shards,
        samples=report.samples,
        skipped=report.skipped,
        asked_ahead_per_worker=report.depth,
        max_bytes_in_flight=report.max_bytes_in_flight,
        peak_object_store_bytes=report.watch.peak_used_bytes,
        object_store_bytes=report.watch.capacity_bytes,
        spilled_bytes=report.watch.spilled_bytes,
        target_forward_passes=sum(p.samples for p in producers),
        produced_shards=sum(p.shards for p in producers),
        hidden_state_bytes_stored=stored,
        storage_budget=int(config.extraction.storage_budget) if config.extraction.storage_budget else None,
        budget_for_zero_recompute=report.bytes_all_shards,
        cache_uri=report.cache_manifest.uri if report.cache_manifest else None,
        bytes_received=traffic.get("bytes_received"),
        bytes_from_other_nodes=traffic.get("bytes_from_other_nodes"),
        bytes_read_from_cache=traffic.get("bytes_read_from_cache"),
        engine_restarts=report.engine_restarts,
    )


def produce(request: StageRequest) -> Manifest:
    """Train the drafter on hidden states streamed from the producers; store only the drafter."""
    config, work, conversations = request.config, request.work, request.inputs["conversations"]
    folder = work_dir(config, work.key)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = str(config.extraction.dtype if config.extraction.backend == "in_process" else config.engine.dtype)
    record = contract_record(
        config.target.path, target_dtype=dtype, last_hidden_state=LAST_HIDDEN_AFTER_FINAL_NORM
    )
    try:
        with hidden_state_stream(
            config, conversations.manifest, cache_uri(config, work.key), request.pids
        ) as stream:
            with stream.watch:
                job = TrainingJob.from_config(config, stream.hidden, folder, record)
                final = fit(config, job, work.key, request.pids, request.run)
            report = stream.report(commit_cache(stream, work.inputs))
    except StreamRefused as error:
        raise StageError("train", str(error)) from error
    stored = store_drafter(config, final, work.uri, request.run)
    streamed = stream_summary(config, report, stored.result.get("stream") or {})
    if streamed.spilled_bytes:
        request.run.log_text(
            f"{streamed.spilled_bytes} bytes of hidden states spilled from Ray's object store to disk: "
            "lower extraction.max_bytes_in_flight",
            "stream-warning.txt",
        )
    summary = {**stored.summary, "extraction_mode": config.extraction.mode, "stream": streamed.model_dump()}
    return stored.writer.commit("train", inputs=work.inputs, summary=summary)


def key_fields(config: ExperimentConfig) -> dict[str, str]:
    # The fields of the extraction section that change the hidden states (not where producers run);
    # the engine's for backend engine (its numerics make them).
    section = config.extraction
    fields = {
        **drafter_key_fields(config),
        "extraction.backend": section.backend,
        "extraction.mode": section.mode,
        "extraction.aux_layer_ids": str(list(config.aux_layer_ids_internal().ids)),
        "extraction.samples_per_shard": str(section.samples_per_shard),
        "extraction.dtype": section.dtype,
        "extraction.storage_budget": str(section.storage_budget),
    }
    if section.backend == "engine":
        fields["engine"] = config.section_hash("engine")
    return fields


def stream_gpus(config: ExperimentConfig) -> float:
    """The trainers' GPUs and the producers' (or the engine server's) together."""
    section = config.extraction
    producers = (
        config.engine.num_gpus
        if section.backend == "engine"
        else section.num_actors * section.num_gpus_per_actor
    )
    return trainer_gpus(config) + float(producers)


STAGE = Stage(
    name="train",
    produce=produce,
    summary=TrainingSummary,
    sections=("target", "data", "training"),
    inputs={"conversations": "synthesize"},
    key_fields=key_fields,
    gpus=stream_gpus,
    retries=1,  # training resumes from its checkpoints, the stream from the checkpoint's position
    figures=(*TRAINING_FIGURES, Figure("stream.peak_object_store_bytes", "peak object store bytes")),
    description=(
        "Everything up to a trained drafter (synthesize, extract, train), no serving or registration."
    ),
)
