"""The `train-and-eval` flow: one full EAGLE-3 drafter cycle as one retryable Prefect run.

Only composition lives here: which stage feeds which, the cycle's MLflow parent run, Ray's lifetime,
the summary. Caching is per stage (committed manifests keyed by config section + upstream hashes,
see tasks/_stage.py), so re-running after a failure resumes at the failed stage.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from draftloop.tasks._stage import STAGES, CycleContext, run_folder_uri, stop_recorded_pids, write_text

# Environment traps (stack.md) that must be set before Prefect/MLflow/Ray start in this process.
_ENV_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "TOKENIZERS_PARALLELISM": "false",
}
for _key, _value in _ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)


class TrainAndEvalParams(BaseModel):
    """The flow's form in the Prefect UI: a config file plus the overrides people change most."""

    config: str = Field(default="configs/tiny-llama.yaml", description="Experiment config (YAML path)")
    target_path: str | None = Field(default=None, description="target.path: Hugging Face model folder")
    drafter_init: str | None = Field(
        default=None, description="training.drafter_init: drafter folder to fine-tune"
    )
    engine_kind: str | None = Field(default=None, description="engine.kind (a registered engine)")
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, le=16, description="engine.num_speculative_tokens"
    )
    num_samples: int | None = Field(
        default=None, ge=1, description="data.num_samples: conversations to synthesize"
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description='More overrides: dotted keys, e.g. {"training.epochs": 2}'
    )

    def config_overrides(self) -> dict[str, Any]:
        """All overrides as dotted keys, the form `ExperimentConfig.load` takes."""
        named = {
            "target.path": self.target_path,
            "training.drafter_init": self.drafter_init,
            "engine.kind": self.engine_kind,
            "engine.num_speculative_tokens": self.num_speculative_tokens,
            "data.num_samples": self.num_samples,
        }
        return {**{k: v for k, v in named.items() if v is not None}, **self.overrides}


def load_config(params: TrainAndEvalParams) -> Any:
    from draftloop.infra.config import ExperimentConfig

    return ExperimentConfig.load(params.config, params.config_overrides())


def _run_id() -> str:
    try:
        from prefect.runtime import flow_run

        if flow_run.id:
            return str(flow_run.id)
    except Exception:
        pass
    return uuid.uuid4().hex


def _config_dump(config: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = config.model_dump(mode="json")
    return dumped


def _record_ray_pids(ctx: CycleContext) -> None:
    """Ray's head processes started by this driver, so a cancelled/crashed run can stop them by PID."""
    try:
        import ray._private.worker as ray_worker

        node: Any = ray_worker._global_node
        pids = [info.process.pid for infos in node.all_processes.values() for info in infos if info.process]
        ctx.record_pids("ray", pids)
    except Exception:
        pass


def build_summary(ctx: CycleContext, started: float, status: str) -> dict[str, Any]:
    """summary.json: acceptance, speedup per concurrency, registered version, stage timings, cache hits."""
    evaluation = ctx.outcomes.get("evaluate")
    registration = ctx.outcomes.get("register")
    results = evaluation.manifest.summary.get("results", {}) if evaluation else {}
    return {
        "run_id": ctx.run_id,
        "config": ctx.config.name,
        "status": status,
        "mlflow_run_id": ctx.tracker.parent_run_id,
        "acceptance_rate": results.get("acceptance_rate"),
        "mean_acceptance_length": results.get("mean_acceptance_length"),
        "per_position_acceptance": results.get("per_position_acceptance"),
        "simulator_acceptance_rate": results.get("simulator_acceptance_rate"),
        "consistent": results.get("consistent"),
        "speedup": results.get("speedup"),
        "throughput": results.get("throughput"),
        "registered_model": registration.manifest.summary if registration else None,
        "stages": {name: {**ctx.timings[name], "uri": ctx.outcomes[name].uri} for name in ctx.timings},
        "cache_hits": sorted(name for name, timing in ctx.timings.items() if timing["cache_hit"]),
        "total_seconds": round(time.perf_counter() - started, 3),
        "run_folder": ctx.run_uri,
    }


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# draftloop cycle `{summary['config']}`: {summary['status']}",
        "",
        "| stage | seconds | cache |",
    ]
    lines.append("|---|---|---|")
    for name, timing in summary["stages"].items():
        lines.append(f"| {name} | {timing['seconds']} | {'hit' if timing['cache_hit'] else 'run'} |")
    lines += ["", "| result | value |", "|---|---|"]
    lines.append(f"| acceptance rate | {summary.get('acceptance_rate')} |")
    lines.append(f"| mean acceptance length | {summary.get('mean_acceptance_length')} |")
    for concurrency, speedup in (summary.get("speedup") or {}).items():
        lines.append(f"| speedup @ {concurrency} | {speedup} |")
    registered = summary.get("registered_model") or {}
    if registered:
        lines.append(
            f"| model version | {registered.get('name')} v{registered.get('version')} "
            f"({registered.get('alias_status')}) |"
        )
    return "\n".join(lines) + "\n"


def run_cycle(params: TrainAndEvalParams, until: str = "register") -> dict[str, Any]:
    """The cycle's body, up to and including stage `until` (the per-stage flows stop early)."""
    from draftloop.infra import actors
    from draftloop.infra.tracking import Tracker, flatten_params
    from draftloop.tasks import evaluate, extract, register, synthesize, train

    logger = get_run_logger()
    started = time.perf_counter()
    config = load_config(params)
    run_id = _run_id()
    tracker = Tracker.from_config(config)
    ctx = CycleContext(config=config, run_id=run_id, tracker=tracker, run_uri=run_folder_uri(config, run_id))
    dumped = _config_dump(config)
    cycle_run = tracker.start_cycle(
        run_name=f"{config.name}-{run_id[:8]}",
        params=flatten_params(dumped),
        tags={"draftloop.config": config.name, "prefect.flow_run_id": run_id, "draftloop.until": until},
    )
    cycle_run.log_dict(dumped, "config.json")
    write_text(f"{ctx.run_uri}/config.json", json.dumps(dumped, indent=2), config)
    status = "failed"

    def record_ray() -> None:
        _record_ray_pids(ctx)

    # Ray starts lazily, in the first stage that really runs (a fully cached cycle never pays for it).
    actors.RAY_START_CALLBACKS.append(record_ray)
    try:
        last = STAGES.index(until)
        conversations = synthesize.synthesize_task()(ctx)
        if last >= 1:
            hidden = extract.extract_task()(ctx, conversations)
        if last >= 2:
            drafter = train.train_task()(ctx, hidden)
        if last >= 3:
            evaluation = evaluate.evaluate_task()(ctx, conversations, drafter)
        if last >= 4:
            register.register_task()(ctx, conversations, hidden, drafter, evaluation)
        status = "completed"
    except BaseException as error:
        tracker.end_cycle("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED", error=str(error))
        raise
    finally:
        actors.RAY_START_CALLBACKS.remove(record_ray)
        if actors.started_here():
            actors.shutdown_ray()
            ctx.forget_pids("ray")
        stop_recorded_pids(run_id)  # anything a stage left behind (engine servers)
        summary = build_summary(ctx, started, status)
        write_text(f"{ctx.run_uri}/summary.json", json.dumps(summary, indent=2), config)
        try:
            cycle_run.log_dict(summary, "summary.json")
            _publish_artifact(summary)
        except Exception as error:  # reporting must not mask the cycle's own outcome
            logger.warning("could not publish the summary: %s", error)
    tracker.end_cycle("FINISHED")
    _log_cycle_metrics(cycle_run, summary)
    logger.info("cycle %s done: %s", run_id, json.dumps({k: summary[k] for k in ("stages", "speedup")}))
    return summary


def _log_cycle_metrics(cycle_run: Any, summary: dict[str, Any]) -> None:
    metrics: dict[str, float] = {}
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if isinstance(summary.get(key), int | float):
            metrics[key] = float(summary[key])
    for concurrency, value in (summary.get("speedup") or {}).items():
        metrics[f"speedup_c{concurrency}"] = float(value)
    for stage, timing in summary["stages"].items():
        metrics[f"stage_seconds.{stage}"] = float(timing["seconds"])
    cycle_run.log_metrics(metrics)


def _publish_artifact(summary: dict[str, Any]) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(
        summary_markdown(summary), key="draftloop-cycle-summary", description="draftloop cycle summary"
    )


def stop_started_resources(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed: stop engine servers and Ray processes this run recorded."""
    stop_recorded_pids(str(flow_run.id))


@flow(
    name="train-and-eval",
    on_cancellation=[stop_started_resources],
    on_crashed=[stop_started_resources],
    log_prints=True,
)
def train_and_eval(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Synthesize -> extract -> train -> deploy+evaluate -> register, each stage cached on its inputs."""
    return run_cycle(params or TrainAndEvalParams())


def main(argv: list[str] | None = None) -> None:
    """`python -m draftloop.flows.train_and_eval [PARAMS_JSON [UNTIL]]`: run one cycle in this process."""
    import sys

    # Under `python -m` this file is `__main__`: use the package's own classes, not this module's copies.
    from draftloop.flows import stages
    from draftloop.flows import train_and_eval as package

    args = sys.argv[1:] if argv is None else argv
    params = package.TrainAndEvalParams.model_validate_json(args[0]) if args else package.TrainAndEvalParams()
    until = args[1] if len(args) > 1 else "register"
    chosen: Any = package.train_and_eval if until == "register" else getattr(stages, f"{until}_flow")
    chosen(params)


if __name__ == "__main__":
    main()
