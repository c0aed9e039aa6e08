"""What the evaluate stage takes from an EvalReport: the gate's figures (CycleResults), the MLflow
metrics, and the stage summary (tasks/summaries.py EvaluationSummary: same field names and values)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from draftloop.infra.evaluation.report import EvalReport
from draftloop.infra.evaluation.verdict import SPEEDUP_OK
from draftloop.infra.registry.gate import CycleResults


def cycle_results(report: EvalReport) -> CycleResults:
    """The figures the gate, the registry and summary.json use; consistency by the report's own
    tolerance (the plan's)."""
    acceptance = report.engine_acceptance or {}
    simulator = report.simulator or {}
    compared = report.consistency or {}  # verdict.AcceptanceComparison.to_json()
    unweighted = simulator.get("acceptance_rate")
    return CycleResults(
        acceptance_rate=acceptance.get("acceptance_rate"),
        mean_acceptance_length=acceptance.get("mean_acceptance_length"),
        per_position_acceptance=list(acceptance.get("per_position_acceptance") or []),
        speedup={int(k): float(v) for k, v in report.speedup.items() if v is not None},
        throughput={
            int(level.concurrency): float(level.output_tokens_per_s) for level in report.speculative.levels
        },
        # The simulator on the engine's prompt mix, as the consistency check compares it (its unweighted
        # rate only when nothing was compared).
        simulator_acceptance_rate=compared.get("simulator_rate", unweighted),
        consistent=report.consistent,
        lossless=bool(report.lossless),
        speedup_status={
            int(level.concurrency): (
                level.status if level.status == SPEEDUP_OK else f"{level.status}: {'; '.join(level.reasons)}"
            )
            for level in report.speedup_levels
        },
        recommended_k=report.serving_k,
        compared_engine_acceptance_rate=compared.get("engine_rate"),
        simulator_unweighted_acceptance_rate=unweighted,
    )


def level_metrics(report: EvalReport) -> dict[str, float]:
    """The report's figures as MLflow metrics: per server and concurrency, per k, per category."""
    metrics: dict[str, float] = {}
    for role, run in (("baseline", report.baseline), ("speculative", report.speculative)):
        for level in run.levels:
            prefix = f"{role}.c{level.concurrency}"
            metrics[f"{prefix}.output_tokens_per_s"] = float(level.output_tokens_per_s)
            spreads = (
                ("throughput", level.throughput),
                ("ttft_s", level.ttft_s),
                ("tpot_s", level.tpot_s),
                ("itl_s", level.itl_s),
            )
            for figure, spread in spreads:
                for statistic, value in (spread or {}).items():
                    if value is not None:
                        metrics[f"{prefix}.{figure}.{statistic}"] = float(value)
        if run.startup_s is not None:
            metrics[f"{role}.startup_s"] = float(run.startup_s)
    for entry in report.k_sweep:
        for speedup in entry.levels:
            for key, value in (("speedup", speedup.speedup), ("low", speedup.low), ("high", speedup.high)):
                if value is not None:
                    metrics[f"k{entry.k}.speedup.c{speedup.concurrency}.{key}"] = float(value)
        for key, value in (
            ("predicted_mean_acceptance_length", entry.predicted_mean_acceptance_length),
            ("measured_mean_acceptance_length", entry.measured_mean_acceptance_length),
        ):
            if value is not None:
                metrics[f"k{entry.k}.{key}"] = float(value)
    for level in report.speedup_levels:
        if level.speedup is not None:
            metrics[f"speedup.c{level.concurrency}"] = float(level.speedup)
    for category, figures in report.category_acceptance.items():
        for source in ("simulator", "engine"):
            for key, value in (figures.get(source) or {}).items():
                if value is not None:
                    metrics[f"category.{category}.{source}.{key}"] = float(value)
    acceptance = report.engine_acceptance or {}
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if acceptance.get(key) is not None:
            metrics[f"engine.{key}"] = float(acceptance[key])
    for position, value in enumerate(acceptance.get("per_position_acceptance") or []):
        metrics[f"engine.acceptance_pos{position}"] = float(value)
    simulator = report.simulator or {}
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if simulator.get(key) is not None:
            metrics[f"simulator.{key}"] = float(simulator[key])
    return metrics


def evaluation_summary(report: EvalReport) -> dict[str, Any]:
    """The evaluate manifest's summary (EvaluationSummary's fields): the gate's results and the report's
    headline figures, as JSON."""
    data = report.to_json()
    return {
        "results": cycle_results(report).to_dict(),
        "verdict": report.verdict,
        "reasons": list(report.reasons),
        "lossless": report.lossless,
        "engine": report.engine,
        "engine_version": report.engine_version or "unknown",
        "num_prompts": report.num_prompts,
        "num_speculative_tokens": report.num_speculative_tokens,
        "engine_layer_ids": report.engine_layer_ids,
        "startup_s": {"baseline": report.baseline.startup_s, "speculative": report.speculative.startup_s},
        "speedup_levels": data["speedup_levels"],
        "k_sweep": [
            {key: value for key, value in asdict(entry).items() if key != "server"}
            for entry in report.k_sweep
        ],
        "recommended_k": data["recommended_k"],
        "serving_k": report.serving_k,
        "category_acceptance": data["category_acceptance"],
    }
