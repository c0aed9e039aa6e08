"""The `sweep` flow: variants of one config as cycles that share their upstream stages, one winner registered.

Each variant is a `sweep-variant` subflow running the cycle up to evaluate, its MLflow run nested under the
sweep's parent run. The variants keep the base config's name, so every stage whose cache key they share
is produced once (an lr sweep synthesizes and extracts once) and reused by the others. Each finished
variant is recorded under `<storage.root>/<name>/sweeps/<sweep key>/variants/`: running the same sweep
again (after a kill) runs only the variants without a record. The winner (infra/registry/sweep_report.py)
is then registered through the gate by running its cycle on to register, in its own MLflow run.
With `parallel` > 1 the variants run in threads against one Ray the sweep starts; every stage still
takes its slots of the `gpus` limit, so the engines and trainers never oversubscribe the machine.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run as current_flow_run
from pydantic import BaseModel, Field

from draftloop.flows.cycle import CycleNesting, TrainAndEvalParams, cycle_flow, run_cycle
from draftloop.flows.form import ConfigPath, Overrides, Parallel, ShippedConfig, SweepGrid, SweepList
from draftloop.infra.registry.cycle_run import mlflow_ui_links, prefect_flow_run_url, source_tags
from draftloop.infra.registry.runs import StageRun, Tracker
from draftloop.infra.registry.sweep_report import (
    VariantResult,
    comparison_markdown,
    comparison_rows,
    winner,
    write_comparison_plot,
)
from draftloop.infra.runtime import ray_cluster
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, pid_records_dir
from draftloop.infra.runtime.storage import exists, join, read_text, storage_options, write_text_atomic
from draftloop.infra.runtime.sweeps import SweepPlan, SweepVariant, plan_sweep
from draftloop.infra.targets.loaded import resolve_auto_classes

DEFAULT_CONFIG = "configs/tiny-llama.yaml"


class SweepSummary(BaseModel):
    """What a sweep produced: every variant's result, the winner and its registration (sweep.json)."""

    sweep_key: str
    config: str
    mlflow_run_id: str
    variants: list[VariantResult]
    ran_now: list[str]  # variant labels run by this invocation (the others were recorded before)
    winner: str | None
    registered_model: dict[str, Any] | None = None
    cache_hits: dict[str, int] = Field(default_factory=dict)  # per stage: variants that reused it
    stage_runs: dict[str, int] = Field(default_factory=dict)  # per stage: variants that produced it
    links: dict[str, str] = Field(default_factory=dict)
    folder: str


def sweep_folder(config: ExperimentConfig, sweep_key: str) -> str:
    return join(str(config.storage.root), config.name, "sweeps", sweep_key)


@cycle_flow("sweep-variant")
def sweep_variant(
    config_path: str, overrides: dict[str, Any], until: str, nesting: CycleNesting
) -> dict[str, Any]:
    """One variant of a sweep: the cycle up to `until`, its MLflow run placed by `nesting`."""
    return run_cycle(
        TrainAndEvalParams(config=config_path, overrides=overrides), until=until, nesting=nesting
    )


def run_sweep(plan: SweepPlan, parallel: int = 1) -> SweepSummary:
    """Run the variants without a record, pick the winner by the gate's measure, register it."""
    logger = get_run_logger()
    base = plan.check()
    key = plan.key
    options = storage_options(base)
    folder = sweep_folder(base, key)
    tracker = Tracker.from_config(base)
    flow_run_id = str(current_flow_run.id) if current_flow_run.id else key
    flow_run_url = prefect_flow_run_url(flow_run_id)
    parent = tracker.parent_run(
        "sweep",
        key,
        run_name=f"{base.name}-sweep-{key[:8]}",
        params={
            "sweep.config": base.name,
            "sweep.variants": len(plan.variants),
            "sweep.swept": ",".join(plan.swept_keys),
            **{f"sweep.base.{k}": v for k, v in plan.base_overrides.items()},
        },
        tags={"prefect.flow_run_id": flow_run_id, **source_tags("sweep", flow_run_url)},
    )
    _kill_orphaned_variant_runs(tracker, parent.run_id)

    def record_uri(variant: SweepVariant) -> str:
        return join(folder, "variants", f"{variant.key}.json")

    recorded: dict[str, VariantResult] = {}
    for variant in plan.variants:
        if exists(record_uri(variant), options):
            result = VariantResult.model_validate_json(read_text(record_uri(variant), options))
            if result.status == "completed":  # a failed variant runs again
                recorded[variant.key] = result
    todo = [variant for variant in plan.variants if variant.key not in recorded]
    logger.info(
        "sweep %s: %d variants of %s over %s; %d finished before, %d to run (%d at a time)",
        key[:8],
        len(plan.variants),
        base.name,
        ", ".join(plan.swept_keys),
        len(recorded),
        len(todo),
        parallel,
    )

    def run_variant(variant: SweepVariant) -> VariantResult:
        nesting = CycleNesting(
            parent_run_id=parent.run_id,
            run_name=variant.label,
            tags={
                "draftloop.sweep_key": key,
                "draftloop.variant": variant.label,
                "draftloop.variant_key": variant.key,
            },
            owns_ray=parallel == 1,
        )
        overrides = {**plan.base_overrides, **variant.overrides}
        logger.info("sweep variant %s: started", variant.label)
        try:
            summary = sweep_variant.with_options(flow_run_name=f"variant {variant.label}")(
                plan.config_path, overrides, "evaluate", nesting
            )
            result = VariantResult.from_summary(variant.key, variant.label, variant.overrides, summary)
        except Exception as error:  # one variant's failure is its row, not the sweep's end
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            result = VariantResult(
                key=variant.key,
                label=variant.label,
                overrides=variant.overrides,
                status="failed",
                error=message,
            )
        write_text_atomic(record_uri(variant), result.model_dump_json(indent=2), options)
        figures = result.figures()
        logger.info(
            "sweep variant %s: %s, AL %s, speedup @ c=1 %s",
            variant.label,
            result.verdict or result.status,
            _rounded(figures["mean_acceptance_length"]),
            _rounded(figures["speedup_c1"]),
        )
        return result

    ran = _run_all(todo, run_variant, parallel, base)
    results = [recorded.get(variant.key) or ran[variant.key] for variant in plan.variants]
    best = winner(results)
    registered: dict[str, Any] | None = None
    if best is not None:
        logger.info("sweep winner %s: registering it through the gate", best.label)
        summary = sweep_variant.with_options(flow_run_name=f"register {best.label}")(
            plan.config_path,
            {**plan.base_overrides, **best.overrides},
            "register",
            CycleNesting(
                resume_run_id=best.mlflow_run_id,
                origin=f"winner of sweep {key[:8]} ({len(plan.variants)} variants over "
                f"{', '.join(plan.swept_keys)}; MLflow run {parent.run_id})",
            ),
        )
        registered = summary.get("registered_model")
    sweep = SweepSummary(
        sweep_key=key,
        config=base.name,
        mlflow_run_id=parent.run_id,
        variants=results,
        ran_now=[variant.label for variant in todo],
        winner=best.label if best else None,
        registered_model=registered,
        cache_hits=_count(results, lambda result, stage: stage in result.cache_hits),
        stage_runs=_count(results, lambda result, stage: stage in result.stages_run),
        links=mlflow_ui_links(
            tracker.tracking_uri,
            tracker.experiment_id,
            parent.run_id,
            (registered or {}).get("name"),
            (registered or {}).get("version"),
            prefect_flow_run=flow_run_url,
        ).mlflow_rows(),
        folder=folder,
    )
    write_text_atomic(join(folder, "sweep.json"), sweep.model_dump_json(indent=2), options)
    _publish(parent, tracker, sweep, base)
    return sweep


def _run_all(
    todo: list[SweepVariant],
    run_variant: Callable[[SweepVariant], VariantResult],
    parallel: int,
    config: ExperimentConfig,
) -> dict[str, VariantResult]:
    """Sequentially (each cycle owns its Ray, as a lone cycle does) or in `parallel` threads sharing one
    Ray this sweep starts and stops (recorded by PID, so a killed sweep's Ray is reaped)."""
    if parallel <= 1 or len(todo) <= 1:
        return {variant.key: run_variant(variant) for variant in todo}
    resolve_auto_classes()  # before the threads: transformers' lazy names are not thread-safe
    pids = PidRecord(pid_records_dir() / f"sweep-{current_flow_run.id or 'cli'}.json")
    pids.claim()
    started = ray_cluster.ensure_ray(config.ray.address, pids)
    try:
        with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="sweep-variant") as pool:
            return {
                variant.key: result for variant, result in zip(todo, pool.map(run_variant, todo), strict=True)
            }
    finally:
        if started:
            ray_cluster.shutdown_ray()
            pids.forget("ray")
        pids.stop_all()


def _kill_orphaned_variant_runs(tracker: Tracker, parent_run_id: str) -> None:
    """Variant runs a killed earlier run of this sweep left RUNNING are marked KILLED (their variants run
    again, in new runs)."""
    orphans = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and attributes.status = 'RUNNING'",
    )
    for run in orphans:
        tracker.client.set_terminated(run.info.run_id, status="KILLED")


def _count(results: list[VariantResult], test: Callable[[VariantResult, str], bool]) -> dict[str, int]:
    stages = dict.fromkeys(stage for result in results for stage in (*result.cache_hits, *result.stages_run))
    return {stage: sum(1 for result in results if test(result, stage)) for stage in stages}


def _publish(parent: StageRun, tracker: Tracker, sweep: SweepSummary, config: ExperimentConfig) -> None:
    """The parent run as people compare variants in MLflow, and the same table and plot in Prefect."""
    gate = config.evaluation.gate
    best = next((result for result in sweep.variants if result.label == sweep.winner), None)
    title = f"sweep of {sweep.config}: {len(sweep.variants)} variants"
    markdown = comparison_markdown(title, sweep.variants, gate, best)
    registered = sweep.registered_model or {}
    if registered:
        markdown += (
            f"\nRegistered: {registered.get('name')} v{registered.get('version')} "
            f"({registered.get('alias_status')})\n"
        )
    markdown += "".join(f"\n[{label}]({url})\n" for label, url in sweep.links.items())
    metrics: dict[str, float] = {
        "variants": float(len(sweep.variants)),
        "variants_completed": float(sum(1 for result in sweep.variants if result.status == "completed")),
        **{f"cache_hits.{stage}": float(n) for stage, n in sweep.cache_hits.items()},
        **{f"stage_runs.{stage}": float(n) for stage, n in sweep.stage_runs.items()},
    }
    if best is not None:
        metrics.update(
            {f"winner.{name}": value for name, value in best.figures().items() if value is not None}
        )
    parent.log_metrics(metrics)
    parent.set_tags({"draftloop.winner": sweep.winner or "none", "mlflow.note.content": markdown[:5000]})
    with tempfile.TemporaryDirectory(prefix="draftloop-sweep-") as scratch:
        plot = write_comparison_plot(sweep.variants, Path(scratch) / "comparison.png")
        (Path(scratch) / "comparison.md").write_text(markdown)
        (Path(scratch) / "sweep.json").write_text(sweep.model_dump_json(indent=2))
        parent.log_artifact(plot, "sweep")
        parent.log_artifact(Path(scratch) / "comparison.md", "sweep")
        parent.log_artifact(Path(scratch) / "sweep.json", "sweep")
    plot_uri = join(parent.artifact_uri, "sweep", "comparison.png")
    create_markdown_artifact(markdown + f"\nPlot: `{plot_uri}`\n", key="draftloop-sweep-summary")
    create_table_artifact(comparison_rows(sweep.variants, gate, best), key="draftloop-sweep-table")
    tracker.client.set_terminated(parent.run_id, status="FINISHED")


def _rounded(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


@cycle_flow("sweep")
def sweep(
    config: ShippedConfig = DEFAULT_CONFIG,
    config_path: ConfigPath = "",
    grid: SweepGrid = {},  # noqa: B006 - a literal so the form shows it; never mutated
    variants: SweepList = [],  # noqa: B006
    overrides: Overrides = {},  # noqa: B006
    parallel: Parallel = 1,
) -> dict[str, Any]:
    """Sweep a config: run its variants as cycles that share their upstream stages, compare them in one
    MLflow parent run, and register the best through the gate.

    Args:
        config: A shipped experiment config (configs/).
        config_path: Another config file (YAML, absolute or from the repository); replaces config when set.
        grid: Values per dotted config key, every combination a variant, e.g. {"training.lr": [0.001, 0.003]}.
        variants: More variants, each a mapping of dotted keys, e.g. [{"training.ttt_length": 5}].
        overrides: Config values every variant shares, by dotted key.
        parallel: Variants run at once (each stage still waits for its GPUs).
    """
    plan = plan_sweep(
        config_path or config, dict(overrides), {k: list(v) for k, v in grid.items()}, list(variants)
    )
    return json.loads(run_sweep(plan, parallel).model_dump_json())
