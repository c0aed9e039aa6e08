"""The cycle's body, run by the `train-and-eval` flow (whole, or up to one stage).

Only composition lives here: the pipeline's stages run in order (flows/pipeline.py), inside the
cycle's MLflow parent run; Ray's lifetime; the summary. Caching is per stage (committed manifests keyed
by config sections + upstream hashes, tasks/cache.py), so re-running after a failure resumes at the
failed stage.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import yaml
from prefect import Flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import deployment as current_deployment
from prefect.runtime import flow_run as current_flow_run
from prefect.states import State
from pydantic import BaseModel, Field

from draftloop.flows.cycle_report import final_log_line, summary_markdown
from draftloop.flows.form import EngineKind, Epochs, NumSamples, NumSpeculativeTokens
from draftloop.flows.pipeline import CYCLE, pipeline_for
from draftloop.infra.registry.challenge import Challenge
from draftloop.infra.registry.cycle_run import (
    CycleRecord,
    mlflow_ui_links,
    prefect_flow_run_url,
    publish_cycle_run,
    running_description,
    source_tags,
    stage_plots,
)
from draftloop.infra.registry.runs import StageRun, Tracker, flatten_params
from draftloop.infra.runtime import ray_cluster
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
from draftloop.infra.runtime.internals import ephemeral_prefect_server_pids
from draftloop.infra.runtime.processes import PidRecord, pid_records_dir, reap_dead_records
from draftloop.infra.runtime.redaction import install_log_redaction, redact, register_secrets, secret_values
from draftloop.infra.runtime.storage import storage_options
from draftloop.tasks.cycle import CycleContext, cycle_pids, run_folder_uri
from draftloop.tasks.stage import Pipeline, submit, typed_summary
from draftloop.tasks.summaries import EvaluationSummary, RegistrationSummary, TrainingSummary

# Tokenizers must not start a thread pool in every Ray worker (read when a tokenizer first runs).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_CONFIG = "configs/tiny-llama.yaml"
# The form shows the default config's own values (read once at import, so they never drift from the file).
_DEFAULT_CONFIG_VALUES: dict[str, Any] = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / DEFAULT_CONFIG).read_text()
)
DEFAULT_NUM_SAMPLES: int = _DEFAULT_CONFIG_VALUES["data"]["num_samples"]
DEFAULT_NUM_SPECULATIVE_TOKENS: int = _DEFAULT_CONFIG_VALUES["engine"]["num_speculative_tokens"]
DEFAULT_ENGINE_KIND: EngineKind = _DEFAULT_CONFIG_VALUES["engine"]["kind"]
DEFAULT_EPOCHS: int = _DEFAULT_CONFIG_VALUES["training"]["epochs"]
DEFAULT_TARGET_PATH: str = _DEFAULT_CONFIG_VALUES["target"]["path"]


class TrainAndEvalParams(BaseModel):
    """What a cycle runs with: a config file plus the overrides people change most (the flows' form)."""

    config: str = DEFAULT_CONFIG
    target_path: str = DEFAULT_TARGET_PATH
    num_samples: NumSamples = DEFAULT_NUM_SAMPLES  # types with limits: flows/form.py
    epochs: Epochs = DEFAULT_EPOCHS
    engine_kind: EngineKind = DEFAULT_ENGINE_KIND
    num_speculative_tokens: NumSpeculativeTokens = DEFAULT_NUM_SPECULATIVE_TOKENS
    drafter_init: str = ""
    overrides: dict[str, Any] = Field(default_factory=dict)

    def config_overrides(self) -> dict[str, Any]:
        """The overrides as dotted keys, the form `ExperimentConfig.load` takes; named fields left at
        their defaults are not overrides (the chosen config keeps its own values)."""
        named: dict[str, tuple[Any, Any]] = {
            "target.path": (self.target_path, DEFAULT_TARGET_PATH),
            "data.num_samples": (self.num_samples, DEFAULT_NUM_SAMPLES),
            "training.epochs": (self.epochs, DEFAULT_EPOCHS),
            "training.drafter_init": (self.drafter_init or None, None),
            "engine.kind": (self.engine_kind, DEFAULT_ENGINE_KIND),
            "engine.num_speculative_tokens": (self.num_speculative_tokens, DEFAULT_NUM_SPECULATIVE_TOKENS),
        }
        changed = {key: value for key, (value, default) in named.items() if value != default}
        return {**changed, **self.overrides}

    def load_config(self) -> ExperimentConfig:
        return ExperimentConfig.load(self.config, self.config_overrides())


class CycleNesting(BaseModel):
    """Where a cycle's MLflow run goes when it is part of a sweep or a refresh (flows/sweep.py,
    flows/refresh.py): nested under their run, or `resume_run_id` (the winner's or challenger's own run,
    running on to register); with `owns_ray` False, Ray is the sweep's to stop (its variants run at
    once)."""

    parent_run_id: str | None = None
    resume_run_id: str | None = None
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    owns_ray: bool = True
    origin: str | None = None  # the registry card's origin row (CycleContext.origin)
    challenge: Challenge | None = None  # a refresh's champion against this drafter (the gate reads it)


def _run_id() -> str:
    """The Prefect flow run's id (cancellation hooks find the run's PID record by it)."""
    return str(current_flow_run.id) if current_flow_run.id else uuid.uuid4().hex


def _record_driver_services() -> None:
    """Record the ephemeral Prefect server this driver started (Prefect runs one per process when no
    PREFECT_API_URL is set), so that the next run stops it if this driver is killed."""
    pids = ephemeral_prefect_server_pids()
    if pids:
        PidRecord(pid_records_dir() / f"driver-{os.getpid()}.json").add("prefect-server", pids)


def build_summary(ctx: CycleContext, started: float, status: str) -> dict[str, Any]:
    """summary.json: acceptance, speedup per concurrency, registered version, stage timings, cache hits."""
    evaluation = ctx.outcomes.get("evaluate")
    registration = ctx.outcomes.get("register")
    training = ctx.outcomes.get("train")
    evaluated = typed_summary(evaluation, EvaluationSummary) if evaluation else None
    registered = typed_summary(registration, RegistrationSummary) if registration else None
    trained = typed_summary(training, TrainingSummary) if training else None
    results: dict[str, Any] = evaluated.results if evaluated else {}
    return {
        "run_id": ctx.run_id,
        "config": ctx.config.name,
        "status": status,
        "mlflow_run_id": ctx.tracker.parent_run_id,
        "acceptance_rate": results.get("acceptance_rate"),
        "mean_acceptance_length": results.get("mean_acceptance_length"),
        "per_position_acceptance": results.get("per_position_acceptance"),
        # On the engine's prompt mix, beside the engine's rate as compared: the consistency check's pair.
        "simulator_acceptance_rate": results.get("simulator_acceptance_rate"),
        "compared_engine_acceptance_rate": results.get("compared_engine_acceptance_rate"),
        "consistent": results.get("consistent"),
        "lossless": results.get("lossless"),
        "verdict": evaluated.verdict if evaluated else None,
        "speedup": results.get("speedup"),
        "speedup_status": results.get("speedup_status"),
        "throughput": results.get("throughput"),
        "recommended_k": results.get("recommended_k"),
        "k_sweep": evaluated.k_sweep if evaluated else None,
        # The drafter evaluated and registered: the training epoch with the best held-out acceptance.
        "drafter_epoch": {
            "exported_epoch": trained.exported_epoch,
            "held_out_acceptance_length": trained.exported_held_out_acceptance_length,
            "per_epoch": trained.held_out_acceptance_length,
        }
        if trained
        else None,
        "registered_model": registered.model_dump(mode="json") if registered else None,
        "stages": {
            name: {
                "seconds": timing.seconds,
                "cache_hit": timing.cache_hit,
                "uri": ctx.outcomes[name].uri,
                "rows": ctx.outcomes[name].manifest.rows,
                "figures": timing.figures,
                "shown": timing.shown,
            }
            for name, timing in ctx.timings.items()
        },
        "cache_hits": sorted(name for name, timing in ctx.timings.items() if timing.cache_hit),
        "total_seconds": round(time.perf_counter() - started, 3),
        "run_folder": ctx.run_uri,
        "links": mlflow_links(
            ctx.tracker.tracking_uri,
            ctx.tracker.experiment_id,
            ctx.tracker.parent_run_id,
            registered.name if registered else None,
            registered.version if registered else None,
        ),
    }


def mlflow_links(
    tracking_uri: str, experiment_id: str, run_id: str | None, model: str | None, version: str | None = None
) -> dict[str, str]:
    """Links into the MLflow UI by label (infra/registry/cycle_run.py) when the tracking store is an
    MLflow server (a file store has no UI URL)."""
    return mlflow_ui_links(tracking_uri, experiment_id, run_id, model, version).mlflow_rows()


def run_cycle(
    params: TrainAndEvalParams,
    until: str | None = None,
    pipeline: Pipeline | None = None,
    nesting: CycleNesting | None = None,
) -> dict[str, Any]:
    """The pipeline's stages up to and including `until` (default: all of them; the per-stage
    deployments stop early). `pipeline`: the config's (`pipeline_for`) unless given; `nesting`: a
    sweep's variant (its MLflow run's place, who stops Ray)."""
    nesting = nesting or CycleNesting()
    if until:  # an unknown stage: refused before anything starts
        (pipeline or CYCLE).stage(until)
    install_log_redaction()
    logger = get_run_logger()
    reaped = reap_dead_records()  # what a killed earlier run left running (its driver is gone)
    if reaped:
        logger.info("stopped %d process(es) left by a run whose driver died: %s", len(reaped), reaped)
    _record_driver_services()
    started = time.perf_counter()
    config = params.load_config()
    pipeline = pipeline or pipeline_for(config)
    if until and until not in pipeline.names:
        raise ConfigError(
            "until",
            f"stage {until!r} is not in this pipeline ({', '.join(pipeline.names)}): "
            f"extraction.mode {config.extraction.mode} has no extract stage",
        )
    stages = pipeline.until(until) if until else pipeline
    run_id = _run_id()
    tracker = Tracker.from_config(config)
    ctx = CycleContext(
        config=config,
        run_id=run_id,
        tracker=tracker,
        run_uri=run_folder_uri(config, run_id),
        origin=nesting.origin,
        challenge=nesting.challenge,
    )
    ctx.pids.claim()
    register_secrets(secret_values(config.model_dump(mode="json")))
    dumped = redact(config.model_dump(mode="json"))  # what is shown (params, config.json): no secrets
    flow_run_url = prefect_flow_run_url(run_id)
    deployment = current_deployment.name
    source = f"{current_flow_run.flow_name}/{deployment}" if deployment else f"draftloop run {params.config}"
    cycle_run = tracker.start_cycle(
        run_name=nesting.run_name or f"{config.name}-{run_id[:8]}",
        params=flatten_params(dumped),
        tags={
            "draftloop.config": config.name,
            "prefect.flow_run_id": run_id,
            "draftloop.until": stages.names[-1],
            **source_tags(source, flow_run_url),
            **nesting.tags,
        },
        parent_run_id=nesting.parent_run_id,
        resume_run_id=nesting.resume_run_id,
    )
    tracker.describe_cycle(running_description(config.name, stages.names[-1], flow_run_url))
    cycle_run.log_dict(dumped, "config.json")
    ctx.write_text("config.json", json.dumps(dumped, indent=2))
    status = "failed"

    try:
        for stage in stages.stages:
            submit(stage, ctx)
        status = "completed"
    except BaseException as error:
        tracker.end_cycle("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED", error=str(error))
        raise
    finally:
        # Ray starts lazily, in the first stage that really runs (a fully cached cycle never pays for it).
        if ray_cluster.started_here() and nesting.owns_ray:
            ray_cluster.shutdown_ray()
            ctx.pids.forget("ray")
        ctx.pids.stop_all()  # anything a stage left behind (engine servers)
        summary = build_summary(ctx, started, status)
        ctx.write_text("summary.json", json.dumps(summary, indent=2))
        try:
            cycle_run.log_dict(summary, "summary.json")
            create_markdown_artifact(summary_markdown(summary), key="draftloop-cycle-summary")
            _publish_cycle_run(ctx, cycle_run, summary, pipeline.names[-1], flow_run_url)
        except Exception as error:  # reporting must not mask the cycle's own outcome
            logger.warning("could not publish the summary: %s", error)
    tracker.end_cycle("FINISHED")
    _log_cycle_metrics(cycle_run, summary)
    logger.info("%s", final_log_line(summary))
    return summary


def _publish_cycle_run(
    ctx: CycleContext, cycle_run: StageRun, summary: dict[str, Any], last: str, flow_run_url: str | None
) -> None:
    """The cycle run as people read it in MLflow: the verdict as its description, the runs table's
    columns, the stages' plots (infra/registry/cycle_run.py)."""
    registered = summary.get("registered_model") or {}
    links = mlflow_ui_links(
        ctx.tracker.tracking_uri,
        ctx.tracker.experiment_id,
        ctx.tracker.parent_run_id,
        registered.get("name"),
        registered.get("version"),
        prefect_flow_run=flow_run_url,
    )
    record = CycleRecord.from_summary(summary, last, links)
    manifests = {name: outcome.manifest for name, outcome in ctx.outcomes.items()}
    publish_cycle_run(ctx.tracker, cycle_run, record, stage_plots(manifests, storage_options(ctx.config)))


def _log_cycle_metrics(cycle_run: StageRun, summary: dict[str, Any]) -> None:
    """Each stage's time (the figures the runs table shows are `_publish_cycle_run`'s)."""
    cycle_run.log_metrics(
        {f"stage_seconds.{stage}": round(float(t["seconds"]), 1) for stage, t in summary["stages"].items()}
    )


def stop_started_resources(flow: Flow[Any, Any], flow_run: FlowRun, state: State[Any]) -> None:
    """on_cancellation / on_crashed: stop engine servers and Ray processes this run recorded."""
    cycle_pids(str(flow_run.id)).stop_all()


# Every cycle flow stops what its run started when the run is cancelled or crashes.
CYCLE_FLOW_HOOKS: dict[str, Any] = {
    "on_cancellation": [stop_started_resources],
    "on_crashed": [stop_started_resources],
}


class CycleFlow(Flow[P, R]):
    """A cycle flow: its parameters are stored in Prefect's API with secrets redacted (`--set
    engine.api_key=...` reaches the run, not the UI), and it stops what its run started when the run
    is cancelled or crashes."""

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        shown: dict[str, Any] = redact(super().serialize_parameters(parameters))
        return shown


def cycle_flow(name: str) -> Callable[[Callable[P, R]], CycleFlow[P, R]]:
    """`@flow(name=..., log_prints=True)` for a cycle flow (a `CycleFlow` with CYCLE_FLOW_HOOKS)."""

    def make(fn: Callable[P, R]) -> CycleFlow[P, R]:
        return CycleFlow(fn, name=name, log_prints=True, **CYCLE_FLOW_HOOKS)

    return make
