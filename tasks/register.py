"""Stage 5, register: the drafter becomes an MLflow model version; `champion` moves only past the gate."""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from draftloop.infra.engines.base import get_engine
from draftloop.infra.registry.cards import DrafterCard, target_label
from draftloop.infra.registry.models import register_drafter
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, download_shards, storage_options
from draftloop.tasks.cache import StageOutcome
from draftloop.tasks.cycle import CycleContext
from draftloop.tasks.stage import Figure, Stage, StageRequest, typed_summary
from draftloop.tasks.summaries import EvaluationSummary, RegistrationSummary, TrainingSummary

REGISTRATION_SHARD = "registration.json"


def serving_command(config: ExperimentConfig, drafter_source: str, k: int) -> str:
    """The command serving the target with the registered drafter at `k` (the evaluation's serving k),
    in the config's engine."""
    engine = get_engine(config.engine.kind, config.engine_settings())
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


def produce(request: StageRequest) -> Manifest:
    """Register the trained drafter with the evaluation's results (one version per input)."""
    config = request.config
    drafter, evaluation, conversations = (request.inputs[name] for name in ("drafter", "evaluation", "data"))
    hidden = request.earlier("extract")
    options = storage_options(config)
    evaluated = typed_summary(evaluation, EvaluationSummary)
    results = evaluated.cycle_results()
    trained = typed_summary(drafter, TrainingSummary)
    card = DrafterCard(
        target=target_label(str(config.target.path)),
        engine=str(config.engine.kind),
        engine_version=evaluated.engine_version,
        aux_layer_ids=trained.aux_layer_ids,
        layer_id_convention="layer_input",
        convention_exported=trained.convention_exported or str(config.engine.kind),
        variant=str(config.training.drafter),
        origin=request.cycle.origin,
        hashes={
            "data_hash": conversations.manifest.content_hash(),
            # a pipeline without stored hidden states (online training) has no extract manifest
            **({"hidden_hash": hidden.manifest.content_hash()} if hidden is not None else {}),
            "drafter_hash": drafter.manifest.content_hash(),
        },
    )
    with tempfile.TemporaryDirectory(prefix="draftloop-register-") as scratch:
        folder = download_shards(drafter.manifest, Path(scratch) / "drafter", trained.drafter_files, options)
        registration = register_drafter(
            request.cycle.tracker,
            request.run,
            config.registered_model_name,
            config.evaluation.gate,
            results,
            card,
            folder,
            serving_command=lambda source: serving_command(config, source, evaluated.serving_k),
            challenge=request.cycle.challenge,
        )
    writer = DatasetWriter(request.work.uri, storage_options=options)
    payload = registration.to_dict()
    writer.write_shard(REGISTRATION_SHARD, json.dumps(payload, indent=2).encode(), rows=1)
    return writer.commit("register", inputs=request.work.inputs, summary=payload)


def record_on_cycle_run(ctx: CycleContext, outcome: StageOutcome) -> None:
    """Also when reused: this cycle's MLflow run shows the version and the gate."""
    registered = typed_summary(outcome, RegistrationSummary)
    ctx.tracker.record_registration(registered.name, registered.version, registered.champion)


STAGE = Stage(
    name="register",
    produce=produce,
    summary=RegistrationSummary,
    sections=("tracking", "evaluation"),  # config.name is part of the stage folder already
    inputs={"drafter": "train", "evaluation": "evaluate", "data": "synthesize"},
    retries=1,
    figures=(Figure("name", "model"), Figure("version", "version"), Figure("alias_status", "status")),
    description="Register the drafter in MLflow; the champion alias moves only if it passes the gate.",
    on_outcome=record_on_cycle_run,
)
