"""Stage 4, deploy + evaluate: serve the drafter in the engine, measure it against no speculation.

Each engine server (baseline, then speculative) runs inside a Ray actor (`EngineServerActor`, with the
engine section's GPU request); infra/evaluate.py benchmarks both over HTTP on the held-out prompts,
differences the engine's speculative counters, and runs the simulator on the same prompts. The stage
stores the EvalReport JSON and its plots; MLflow gets the figures, the plots and the engine logs.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftloop.tasks._stage import (
    StageOutcome,
    StageWork,
    local_state_dir,
    run_cached,
    storage_options,
)

SECTIONS = ("target", "engine", "evaluation")
REPORT_SHARD = "eval_report.json"


@dataclass
class ServerProxy:
    """What infra.evaluate needs of a server (its ServerHandle protocol), backed by a Ray actor."""

    actor: Any
    base_url: str
    startup_s: float | None
    log_path: Path
    model_name: str = "target"

    def metrics_text(self) -> str:
        import ray

        text: str = ray.get(self.actor.metrics_text.remote())
        return text

    def smoke_test(self) -> Any:
        import ray

        from draftloop.infra.engines.server import SmokeResult

        result = ray.get(self.actor.smoke_test.remote())
        if not isinstance(result, dict):  # the actor answers a SmokeResult
            return result
        return SmokeResult(
            content=result["content"], reasoning=result["reasoning"], latency_s=result["latency_s"]
        )

    def stop(self) -> None:
        import ray

        from draftloop.infra.actors import kill_actors

        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=60)
        kill_actors([self.actor])


def _engine(config: Any) -> Any:
    from draftloop.infra.engines.base import EngineSettings, get_engine

    return get_engine(str(config.engine.kind), EngineSettings.from_config(config.engine))


def _record_server_pid(run_dir: Path, name: str, cleanup: Any) -> None:
    """Remember the server's process group so cancellation hooks can stop it if this process dies."""
    from draftloop.infra.engines.server import PIDFILE_DIR_NAME

    record = run_dir / PIDFILE_DIR_NAME / f"{name}.json"
    if cleanup is not None and record.exists():
        cleanup.record_pids(f"engine-{name}", [int(json.loads(record.read_text())["pid"])])


def start_server_actor(
    config: Any, target_path: str, run_dir: Path, name: str, drafter_dir: str | None, cleanup: Any = None
) -> ServerProxy:
    """Start one engine server in a Ray actor and wait until it is ready."""
    import ray

    from draftloop.infra.actors import ensure_ray, kill_actors
    from draftloop.infra.engines.server import EngineServerActor, clean_stale_servers

    ensure_ray(config.ray.address)
    engine = _engine(config)
    clean_stale_servers(run_dir)  # a previous attempt killed mid-way may have left one behind
    actor = EngineServerActor.options_for(engine.settings).remote(
        engine,
        str(target_path),
        str(run_dir),
        name=name,
        drafter_dir=drafter_dir,
        num_speculative_tokens=int(config.engine.num_speculative_tokens) if drafter_dir else None,
    )
    try:
        info = ray.get(actor.start.remote())
    except BaseException as error:
        kill_actors([actor])
        cause = getattr(error, "cause", None) or error  # RayTaskError wraps the actor's exception
        if isinstance(cause, Exception) and cause is not error:
            raise cause from error
        raise
    _record_server_pid(run_dir, name, cleanup)
    return ServerProxy(
        actor=actor, base_url=info["url"], startup_s=info["startup_s"], log_path=Path(info["log_path"])
    )


def start_engine(config: Any, target_path: str, drafter_dir: str | None, cleanup: Any = None) -> ServerProxy:
    """A baseline server for synthesis (synthesis.backend = engine)."""
    run_dir = local_state_dir() / "work" / str(config.name) / "synthesize-engine"
    run_dir.mkdir(parents=True, exist_ok=True)
    return start_server_actor(config, target_path, run_dir, "synthesis", drafter_dir, cleanup)


def results_from_report(report: dict[str, Any]) -> dict[str, Any]:
    """EvalReport JSON -> the CycleResults the gate, the registry and summary.json use."""
    from draftloop.infra.tracking import CycleResults

    acceptance = report.get("engine_acceptance") or {}
    simulator = report.get("simulator") or {}
    gap = report.get("acceptance_gap")
    tolerance = float(report.get("acceptance_tolerance", 0.05))
    results = CycleResults(
        acceptance_rate=acceptance.get("acceptance_rate"),
        mean_acceptance_length=acceptance.get("mean_acceptance_length"),
        per_position_acceptance=list(acceptance.get("per_position_acceptance") or []),
        speedup={int(k): float(v) for k, v in (report.get("speedup") or {}).items() if v is not None},
        throughput={
            int(level["concurrency"]): float(level["output_tokens_per_s"])
            for level in report["speculative"]["levels"]
        },
        simulator_acceptance_rate=simulator.get("acceptance_rate"),
        consistent=(gap is not None and gap <= tolerance) if simulator else None,
        lossless=bool(report.get("lossless")),
    )
    return results.to_dict()


def _level_metrics(report: dict[str, Any]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for run in ("baseline", "speculative"):
        for level in report[run]["levels"]:
            prefix = f"{run}.c{level['concurrency']}"
            for key in ("output_tokens_per_s", "ttft_mean_s", "tpot_mean_s", "ttft_p50_s", "tpot_p50_s"):
                if level.get(key) is not None:
                    metrics[f"{prefix}.{key}"] = float(level[key])
        if report[run].get("startup_s") is not None:
            metrics[f"{run}.startup_s"] = float(report[run]["startup_s"])
    for concurrency, value in (report.get("speedup") or {}).items():
        if value is not None:
            metrics[f"speedup.c{concurrency}"] = float(value)
    acceptance = report.get("engine_acceptance") or {}
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if acceptance.get(key) is not None:
            metrics[f"engine.{key}"] = float(acceptance[key])
    for position, value in enumerate(acceptance.get("per_position_acceptance") or []):
        metrics[f"engine.acceptance_pos{position}"] = float(value)
    simulator = report.get("simulator") or {}
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if simulator.get(key) is not None:
            metrics[f"simulator.{key}"] = float(simulator[key])
    return metrics


def run(
    config: Any,
    conversations: StageOutcome,
    drafter: StageOutcome,
    stage_run: Any = None,
    cleanup: Any = None,
    on_start: Any = None,
) -> StageOutcome:
    """Deploy the drafter of `drafter` and evaluate it on the held-out prompts of `conversations`."""

    def body(work: StageWork) -> Any:
        from draftloop.infra.evaluate import evaluate_from_config
        from draftloop.infra.storage import DatasetWriter
        from draftloop.tasks.synthesize import ensure_target, read_eval_prompts
        from draftloop.tasks.train import download_drafter

        options = storage_options(config)
        target_path = ensure_target(config)
        run_dir = local_state_dir() / "work" / str(config.name) / "evaluate" / work.key
        shutil.rmtree(run_dir / "plots", ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        drafter_dir = download_drafter(drafter.manifest, run_dir / "drafter", options)
        prompts = [row["prompt"] for row in read_eval_prompts(conversations.manifest, options)]
        servers: list[ServerProxy] = []

        @contextlib.contextmanager
        def start_server(name: str, folder: Path | None) -> Iterator[ServerProxy]:
            server = start_server_actor(
                config, target_path, run_dir, name, str(folder) if folder else None, cleanup
            )
            servers.append(server)
            try:
                yield server
            finally:
                server.stop()
                if cleanup is not None:
                    cleanup.forget_pids(f"engine-{name}")

        try:
            report = evaluate_from_config(
                config,
                _engine(config),
                Path(target_path),
                drafter_dir,
                prompts,
                run_dir,
                start_server=start_server,
            )
        finally:
            if stage_run is not None:  # engine logs, also (above all) when the evaluation failed
                for log in sorted(run_dir.glob("server-*.log")):
                    stage_run.log_artifact(log, "engine_logs")
        data = report.to_json()
        if stage_run is not None:
            stage_run.log_metrics(_level_metrics(data))
            stage_run.log_artifact(run_dir / "eval_report.json")
            stage_run.log_artifact(run_dir / "plots", "plots")
        writer = DatasetWriter(work.uri, storage_options=options)
        writer.write_shard(
            REPORT_SHARD, json.dumps(data, indent=2, sort_keys=True).encode(), rows=len(prompts)
        )
        for plot in sorted((run_dir / "plots").glob("*.png")):
            writer.write_shard(f"plot-{plot.name}", plot.read_bytes(), rows=0)
        summary = {
            "results": results_from_report(data),
            "verdict": data["verdict"],
            "reasons": data["reasons"],
            "lossless": data["lossless"],
            "engine": data["engine"],
            "engine_version": data.get("engine_version") or "unknown",
            "num_prompts": data["num_prompts"],
            "num_speculative_tokens": data["num_speculative_tokens"],
            "engine_layer_ids": data.get("engine_layer_ids"),
            "startup_s": {name: data[name].get("startup_s") for name in ("baseline", "speculative")},
        }
        return writer.commit("evaluate", inputs=work.inputs, summary=summary)

    upstream = {"drafter": drafter.manifest, "conversations": conversations.manifest}
    return run_cached("evaluate", config, SECTIONS, upstream, body, on_start=on_start)


def _task(ctx: Any, conversations: StageOutcome, drafter: StageOutcome) -> StageOutcome:
    from draftloop.tasks._stage import execute_stage

    return execute_stage(
        ctx,
        "evaluate",
        lambda stage_run, on_start: run(
            ctx.config, conversations, drafter, stage_run=stage_run, cleanup=ctx, on_start=on_start
        ),
    )


def evaluate_task() -> Any:
    from prefect import task

    from draftloop.tasks._stage import task_options

    return task(name="evaluate", **task_options())(_task)
