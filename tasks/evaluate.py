"""Stage 4, deploy + evaluate: serve the drafter in the engine, measure it against no speculation.

Each engine server (baseline, then speculative) runs inside a Ray actor (infra/engines/actors.py, with
the engine section's GPU request); infra/evaluation benchmarks both over HTTP on the held-out prompts,
differences the engine's speculative counters, and runs the simulator on the same prompts. The stage
stores the EvalReport JSON and its plots; MLflow gets the figures, the plots and the engine logs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from draftloop.infra.engines.actors import server_starter
from draftloop.infra.engines.base import get_engine
from draftloop.infra.evaluation.run import evaluate_from_config
from draftloop.infra.registry.tracking import CycleResults
from draftloop.infra.runtime.processes import state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, download_shards, storage_options
from draftloop.infra.synthesis.conversations import read_eval_prompts
from draftloop.infra.targets.resolve import ensure_target
from draftloop.tasks.stage import Figure, Stage, StageRequest
from draftloop.tasks.summaries import EvaluationSummary

REPORT_SHARD = "eval_report.json"


def results_from_report(report: dict[str, Any]) -> dict[str, Any]:
    """EvalReport JSON -> the CycleResults the gate, the registry and summary.json use."""
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
        speedup_status={
            int(level["concurrency"]): (
                level["status"]
                if level["status"] == "ok"
                else f"{level['status']}: {'; '.join(level['reasons'])}"
            )
            for level in report.get("speedup_levels") or []
        },
        recommended_k=report.get("serving_k"),
    )
    return results.to_dict()


def _level_metrics(report: dict[str, Any]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for run in ("baseline", "speculative"):
        for level in report[run]["levels"]:
            prefix = f"{run}.c{level['concurrency']}"
            metrics[f"{prefix}.output_tokens_per_s"] = float(level["output_tokens_per_s"])
            for figure in ("throughput", "ttft_s", "tpot_s", "itl_s"):
                for statistic, value in (level.get(figure) or {}).items():
                    if value is not None:
                        metrics[f"{prefix}.{figure}.{statistic}"] = float(value)
        if report[run].get("startup_s") is not None:
            metrics[f"{run}.startup_s"] = float(report[run]["startup_s"])
    for entry in report.get("k_sweep") or []:
        for level in entry["levels"]:
            for key in ("speedup", "low", "high"):
                if level.get(key) is not None:
                    metrics[f"k{entry['k']}.speedup.c{level['concurrency']}.{key}"] = float(level[key])
        for key in ("predicted_mean_acceptance_length", "measured_mean_acceptance_length"):
            if entry.get(key) is not None:
                metrics[f"k{entry['k']}.{key}"] = float(entry[key])
    for level in report.get("speedup_levels") or []:
        if level.get("speedup") is not None:
            metrics[f"speedup.c{level['concurrency']}"] = float(level["speedup"])
    for category, figures in (report.get("category_acceptance") or {}).items():
        for source in ("simulator", "engine"):
            for key, value in (figures.get(source) or {}).items():
                if value is not None:
                    metrics[f"category.{category}.{source}.{key}"] = float(value)
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


def produce(request: StageRequest) -> Manifest:
    """Deploy the trained drafter and evaluate it on the held-out prompts of the synthesized data."""
    config, drafter, conversations = (
        request.config,
        request.inputs["drafter"],
        request.inputs["conversations"],
    )
    options = storage_options(config)
    target_path = ensure_target(config)
    run_dir = state_dir() / "work" / str(config.name) / "evaluate" / request.work.key
    shutil.rmtree(run_dir / "plots", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    drafter_dir = download_shards(
        drafter.manifest, run_dir / "drafter", drafter.manifest.summary["drafter_files"], options
    )
    rows = read_eval_prompts(conversations.manifest, options)
    prompts = [row["prompt"] for row in rows]
    categories = [row.get("category") or "uncategorized" for row in rows]
    engine = get_engine(config.engine.kind, config.engine_settings())
    ensure_ray(config.ray.address, request.pids)
    start_server = server_starter(engine, target_path, run_dir, request.pids)
    try:
        report = evaluate_from_config(
            config,
            engine,
            Path(target_path),
            drafter_dir,
            prompts,
            run_dir,
            start_server=start_server,
            categories=categories,
        )
    finally:
        for log in sorted(run_dir.glob("server-*.log")):  # also (above all) when the evaluation failed
            request.run.log_artifact(log, "engine_logs")
    data = report.to_json()
    request.run.log_metrics(_level_metrics(data))
    request.run.log_artifact(run_dir / "eval_report.json")
    request.run.log_artifact(run_dir / "plots", "plots")
    writer = DatasetWriter(request.work.uri, storage_options=options)
    writer.write_shard(REPORT_SHARD, json.dumps(data, indent=2, sort_keys=True).encode(), rows=len(prompts))
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
        "speedup_levels": data["speedup_levels"],
        "k_sweep": [
            {key: value for key, value in entry.items() if key != "server"} for entry in data["k_sweep"]
        ],
        "recommended_k": data["recommended_k"],
        "serving_k": data["serving_k"],
        "category_acceptance": data["category_acceptance"],
    }
    return writer.commit("evaluate", inputs=request.work.inputs, summary=summary)


STAGE = Stage(
    name="evaluate",
    produce=produce,
    summary=EvaluationSummary,
    sections=("target", "engine", "evaluation"),
    inputs={"drafter": "train", "conversations": "synthesize"},
    gpus=lambda config: float(config.engine.num_gpus),  # the baseline server, then the speculative one
    figures=(
        Figure("verdict", "verdict"),
        Figure("engine", "engine"),
        Figure("results.mean_acceptance_length", "acceptance length"),
        Figure("results.acceptance_rate", "acceptance rate"),
        Figure("results.speedup.1", "speedup @ concurrency 1 (x)"),
        Figure("recommended_k", "recommended k"),
    ),
    description=(
        "Everything up to the evaluation report: train, serve and benchmark the drafter, "
        "without registering it."
    ),
)
