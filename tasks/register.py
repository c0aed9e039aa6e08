"""Stage 5, register: the drafter becomes an MLflow model version; `champion` moves only past the gate."""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from prefect import task

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.engines.base import get_engine
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, download_shards, storage_options
from draftloop.infra.registry.tracking import (
    CycleResults,
    DrafterCard,
    StageRun,
    Tracker,
    register_drafter,
    target_label,
)
from draftloop.tasks.cache import OnStart, StageOutcome, StageWork, run_cached
from draftloop.tasks.cycle import CycleContext, execute_stage
from draftloop.tasks.retry import stage_task_options

# config.name is part of the stage folder already (tasks/cache.py stage_uri).
SECTIONS = ("tracking", "evaluation")
REGISTRATION_SHARD = "registration.json"


def serving_command(config: ExperimentConfig, drafter_source: str, recommended_k: int | None) -> str:
    """The command serving the target with the registered drafter at the evaluation's recommended k
    (the engine's own k when none was recommended), in the config's engine."""
    engine = get_engine(config.engine.kind, config.engine_settings())
    k = int(recommended_k or config.engine.num_speculative_tokens)
    target = Path(config.target.path)
    target_arg = str(target.resolve()) if target.exists() else str(target)
    local = drafter_source.removeprefix("file://")  # a local artifact store: the folder itself
    if "://" not in local and not local.startswith("mlflow-artifacts:"):
        return engine.user_serving_command(target_arg, local, k)
    # A remote artifact store (S3, an MLflow server): engines load a local folder, so fetch it first.
    folder = f"./{config.name}-drafter"
    download = f"mlflow artifacts download --artifact-uri {shlex.quote(drafter_source)} --dst-path {folder}"
    drafter = f"{folder}/{drafter_source.rstrip('/').rsplit('/', 1)[-1]}"
    return f"{download} && {engine.user_serving_command(target_arg, drafter, k)}"


def run(
    config: ExperimentConfig,
    tracker: Tracker,
    stage_run: StageRun,
    conversations: StageOutcome,
    hidden: StageOutcome,
    drafter: StageOutcome,
    evaluation: StageOutcome,
    on_start: OnStart | None = None,
) -> StageOutcome:
    """Register the drafter of `drafter` with the results of `evaluation` (cached: one version per input)."""

    def body(work: StageWork) -> Manifest:
        options = storage_options(config)
        results = CycleResults.from_dict(evaluation.manifest.summary["results"])
        train_summary = drafter.manifest.summary
        card = DrafterCard(
            target=target_label(str(config.target.path)),
            engine=str(config.engine.kind),
            engine_version=str(evaluation.manifest.summary.get("engine_version", "unknown")),
            aux_layer_ids=train_summary.get("aux_layer_ids"),
            layer_id_convention="layer_input",
            convention_exported=str(train_summary.get("convention_exported", config.engine.kind)),
            hashes={
                "data_hash": conversations.manifest.content_hash(),
                "hidden_hash": hidden.manifest.content_hash(),
                "drafter_hash": drafter.manifest.content_hash(),
            },
        )
        with tempfile.TemporaryDirectory(prefix="draftloop-register-") as scratch:
            folder = download_shards(
                drafter.manifest, Path(scratch) / "drafter", train_summary["drafter_files"], options
            )
            registration = register_drafter(
                tracker,
                stage_run,
                config.registered_model_name,
                config.evaluation.gate,
                results,
                card,
                folder,
                serving_command=lambda source: serving_command(config, source, results.recommended_k),
            )
        writer = DatasetWriter(work.uri, storage_options=options)
        payload = registration.to_dict()
        writer.write_shard(REGISTRATION_SHARD, json.dumps(payload, indent=2).encode(), rows=1)
        return writer.commit("register", inputs=work.inputs, summary=payload)

    upstream = {
        "drafter": drafter.manifest,
        "evaluation": evaluation.manifest,
        "data": conversations.manifest,
    }
    outcome = run_cached("register", config, SECTIONS, upstream, body, on_start=on_start)
    tracker.record_registration(outcome.manifest.summary)  # also when reused: this cycle's run shows it
    return outcome


@task(name="register", **stage_task_options(retries=1))
def register_stage(
    ctx: CycleContext,
    conversations: StageOutcome,
    hidden: StageOutcome,
    drafter: StageOutcome,
    evaluation: StageOutcome,
) -> StageOutcome:
    return execute_stage(
        ctx,
        "register",
        lambda stage_run, on_start: run(
            ctx.config, ctx.tracker, stage_run, conversations, hidden, drafter, evaluation, on_start
        ),
    )
