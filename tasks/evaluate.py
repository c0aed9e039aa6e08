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

from draftloop.infra.engines.actors import server_starter
from draftloop.infra.engines.base import get_engine
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.results import evaluation_summary, level_metrics
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.registry.figures import format_percent
from draftloop.infra.runtime.processes import state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, download_shards, storage_options
from draftloop.infra.synthesis.conversations import read_eval_prompts
from draftloop.infra.synthesis.long_context import long_context_key_fields, long_context_rows
from draftloop.infra.targets.resolve import ensure_target
from draftloop.tasks.stage import Figure, Stage, StageRequest
from draftloop.tasks.summaries import EvaluationSummary

REPORT_SHARD = "eval_report.json"


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
    # the held-out prompts, then the long-context set when the evaluation asks for one
    rows = read_eval_prompts(conversations.manifest, options) + long_context_rows(config, target_path)
    prompts = [row["prompt"] for row in rows]
    categories = [row.get("category") or "uncategorized" for row in rows]
    engine = get_engine(config.engine.kind, config.engine_settings())
    ensure_ray(config.ray.address, request.pids)
    start_server = server_starter(engine, target_path, run_dir, request.pids)
    try:
        report = evaluate(
            engine,
            EvaluationPlan.from_config(config),
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
    request.run.log_metrics(level_metrics(report))
    request.run.log_artifact(run_dir / "eval_report.json")
    request.run.log_artifact(run_dir / "plots", "plots")
    writer = DatasetWriter(request.work.uri, storage_options=options)
    writer.write_shard(REPORT_SHARD, json.dumps(data, indent=2, sort_keys=True).encode(), rows=len(prompts))
    for plot in sorted((run_dir / "plots").glob("*.png")):
        writer.write_shard(f"plot-{plot.name}", plot.read_bytes(), rows=0)
    summary = evaluation_summary(report)
    return writer.commit("evaluate", inputs=request.work.inputs, summary=summary)


STAGE = Stage(
    name="evaluate",
    produce=produce,
    summary=EvaluationSummary,
    sections=("target", "engine", "evaluation"),
    inputs={"drafter": "train", "conversations": "synthesize"},
    key_fields=long_context_key_fields,  # the long-context set's text, when it is on
    gpus=lambda config: float(config.engine.num_gpus),  # the baseline server, then the speculative one
    figures=(
        Figure("verdict", "verdict"),
        Figure("engine", "engine"),
        Figure("results.mean_acceptance_length", "acceptance length"),
        Figure("results.acceptance_rate", "acceptance", format_percent),
        Figure("results.speedup.1", "speedup @ c=1", lambda speedup: f"{speedup:.2f}x"),
        Figure(
            "recommended_k",
            "recommended k",
            lambda by_level: ", ".join(f"{k} @ c={c}" for c, k in by_level.items()),
        ),
    ),
    description=(
        "Everything up to the evaluation report: train, serve and benchmark the drafter, "
        "without registering it."
    ),
)
