"""Stage 5, register: the drafter becomes an MLflow model version; `champion` moves only past the gate."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from draftloop.tasks._stage import StageOutcome, StageWork, run_cached, storage_options

# config.name is part of the stage folder already (see _stage.stage_uri).
SECTIONS = ("tracking", "evaluation")
REGISTRATION_SHARD = "registration.json"


def run(
    config: Any,
    tracker: Any,
    stage_run: Any,
    conversations: StageOutcome,
    hidden: StageOutcome,
    drafter: StageOutcome,
    evaluation: StageOutcome,
    on_start: Any = None,
) -> StageOutcome:
    """Register the drafter of `drafter` with the results of `evaluation` (cached: one version per input)."""
    from draftloop.infra.tracking import CycleResults, register_drafter, registered_model_name
    from draftloop.tasks.train import download_drafter

    def body(work: StageWork) -> Any:
        from draftloop.infra.storage import DatasetWriter

        results = CycleResults.from_dict(evaluation.manifest.summary["results"])
        with tempfile.TemporaryDirectory(prefix="draftloop-register-") as scratch:
            folder = download_drafter(drafter.manifest, Path(scratch) / "drafter", storage_options(config))
            stage_run.log_artifact(folder, "drafter")
        train_summary = drafter.manifest.summary
        tags = {
            "target": str(config.target.path),
            "engine": str(config.engine.kind),
            "engine_version": evaluation.manifest.summary.get("engine_version", "unknown"),
            "aux_layer_ids": json.dumps(train_summary.get("aux_layer_ids")),
            "layer_id_convention": "layer_input",
            "convention_exported": str(train_summary.get("convention_exported", config.engine.kind)),
            "data_hash": conversations.manifest.content_hash(),
            "hidden_hash": hidden.manifest.content_hash(),
            "drafter_hash": drafter.manifest.content_hash(),
            "cycle_run_id": tracker.parent_run_id or "",
        }
        registration = register_drafter(
            tracker,
            stage_run,
            registered_model_name(config),
            config.evaluation.gate,
            results,
            tags,
        )
        writer = DatasetWriter(work.uri, storage_options=storage_options(config))
        payload = registration.to_dict()
        writer.write_shard(REGISTRATION_SHARD, json.dumps(payload, indent=2).encode(), rows=1)
        return writer.commit("register", inputs=work.inputs, summary=payload)

    upstream = {
        "drafter": drafter.manifest,
        "evaluation": evaluation.manifest,
        "data": conversations.manifest,
    }
    return run_cached("register", config, SECTIONS, upstream, body, on_start=on_start)


def _task(
    ctx: Any,
    conversations: StageOutcome,
    hidden: StageOutcome,
    drafter: StageOutcome,
    evaluation: StageOutcome,
) -> StageOutcome:
    from draftloop.tasks._stage import execute_stage

    return execute_stage(
        ctx,
        "register",
        lambda stage_run, on_start: run(
            ctx.config, ctx.tracker, stage_run, conversations, hidden, drafter, evaluation, on_start=on_start
        ),
    )


def register_task() -> Any:
    from prefect import task

    from draftloop.tasks._stage import task_options

    return task(name="register", **task_options(retries=1))(_task)
