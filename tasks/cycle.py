"""One run of the cycle as its stages see it: the context, stage bookkeeping and the MLflow glue.

The flow builds a `CycleContext` and hands it to every stage task; `execute_stage` wraps a stage's
work in its nested MLflow run, writes progress markers to the run folder and turns failures into a
`StageError` carrying the log excerpt (transient ones keep their type, so Prefect can retry them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, pid_records_dir
from draftloop.infra.runtime.redaction import redact_text
from draftloop.infra.runtime.services import hold_gpus, stage_gpus
from draftloop.infra.runtime.storage import join, storage_options, write_text_atomic
from draftloop.infra.registry.tracking import StageRun, Tracker, error_excerpt
from draftloop.tasks.cache import OnStart, StageError, StageOutcome, StageWork
from draftloop.tasks.retry import is_transient

# In-process observers of stage events ("started", "running", "done", "failed"): the CLI's progress bars.
PROGRESS_LISTENERS: list[Callable[[str, str], None]] = []


def run_folder_uri(config: ExperimentConfig, run_id: str) -> str:
    """`<storage.root>/<name>/cycles/<run id>`: the run's config, progress markers and summary."""
    return join(str(config.storage.root), config.name, "cycles", run_id)


def cycle_pids(run_id: str) -> PidRecord:
    """The processes run `run_id` started (engine servers, its Ray head), for cancellation hooks and
    for the reaper of the next run (`reap_dead_records`) should its driver die."""
    return PidRecord(pid_records_dir() / f"cycle-{run_id}.json")


@dataclass
class StageTiming:
    seconds: float
    cache_hit: bool


@dataclass
class CycleContext:
    """One flow run: its config, tracker, run folder, stage timings and what it started."""

    config: ExperimentConfig
    run_id: str
    tracker: Tracker
    run_uri: str
    timings: dict[str, StageTiming] = field(default_factory=dict)
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)

    @property
    def pids(self) -> PidRecord:
        return cycle_pids(self.run_id)

    def write_text(self, name: str, text: str) -> None:
        """Write `<run folder>/<name>` (atomically, on any storage)."""
        write_text_atomic(join(self.run_uri, name), text, storage_options(self.config))

    def mark(self, stage: str, event: str) -> None:
        """`<run folder>/stages/<stage>.<event>`: progress anyone can watch (tests, people, the CLI)."""
        self.write_text(f"stages/{stage}.{event}", time.strftime("%Y-%m-%dT%H:%M:%S"))
        for listener in list(PROGRESS_LISTENERS):
            with suppress(Exception):  # a broken progress bar must not fail a stage
                listener(stage, event)


def _numeric(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    metrics: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            metrics[f"{prefix}{key}"] = float(value)
        elif isinstance(value, Mapping):
            metrics.update(_numeric(value, prefix=f"{prefix}{key}."))
    return metrics


# What each stage's Prefect log line reports: (summary key, dotted for nested, label), in that order.
KEY_FIGURES: dict[str, tuple[tuple[str, str], ...]] = {
    "synthesize": (
        ("rows", "conversations"),
        ("rejected", "rejected"),
        ("rows_per_s", "rows/s"),
        ("tokens_per_s", "tokens/s"),
    ),
    "extract": (("samples", "samples"), ("tokens", "tokens"), ("tokens_per_s", "tokens/s")),
    "train": (
        ("epochs", "epochs"),
        ("final_loss", "final loss"),
        ("loss_per_epoch", "loss per epoch"),
        ("final_accuracy", "final accuracy"),
        ("held_out_acceptance_length", "held-out AL per epoch"),
        ("exported_epoch", "exported epoch"),
        ("tokens_per_s", "tokens/s"),
    ),
    "evaluate": (
        ("verdict", "verdict"),
        ("engine", "engine"),
        ("results.mean_acceptance_length", "acceptance length"),
        ("results.acceptance_rate", "acceptance rate"),
        ("results.speedup.1", "speedup @ concurrency 1 (x)"),
        ("recommended_k", "recommended k"),
    ),
    "register": (("name", "model"), ("version", "version"), ("alias_status", "status")),
}


def _figure(value: Any) -> str:
    """Three significant digits, without exponents for large figures (tokens/s 1,035, not 1.03e+03)."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def stage_report(stage: str, summary: Mapping[str, Any], seconds: float, cache_hit: bool) -> str:
    """One human line for the Prefect log: the stage's key figures, rounded, from its manifest summary."""
    if cache_hit:
        return f"{stage}: reused the finished stage with the same inputs"
    figures = [f"{seconds:.1f} s"]
    for key, label in KEY_FIGURES.get(stage, ()):
        value: Any = summary
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is None:
            continue
        if isinstance(value, list):
            shown = "[" + ", ".join(_figure(v) for v in value) + "]"
        else:
            shown = _figure(value)
        figures.append(f"{label} {shown}")
    return f"{stage}: done, " + ", ".join(figures)


def execute_stage(
    ctx: CycleContext, stage: str, produce: Callable[[StageRun, OnStart], StageOutcome]
) -> StageOutcome:
    """Run one stage inside its nested MLflow run: markers, timings, cache-hit tag, summary metrics.

    `produce(stage_run, on_start)` returns the StageOutcome (through `run_cached`); `on_start` is called
    only when the stage really runs (not on a cache hit). A failure is recorded in MLflow and re-raised
    as a StageError carrying the log excerpt, so Prefect shows it too.
    """
    ctx.mark(stage, "started")
    with suppress(MissingContextError):
        get_run_logger().info(f"{stage}: started")
    started = time.perf_counter()
    try:
        with ctx.tracker.stage(stage) as stage_run, ExitStack() as gpu_slots:

            def on_start(work: StageWork) -> None:
                # A stage that really runs (not a cache hit) holds its GPUs' slots of the shared `gpus`
                # limit until it ends, so two cycles never take the same GPUs.
                gpu_slots.enter_context(hold_gpus(stage_gpus(ctx.config, stage)))
                ctx.mark(stage, "running")
                stage_run.set_tags({"draftloop.cache_key": work.key, "draftloop.uri": work.uri})

            outcome = produce(stage_run, on_start)
            stage_run.set_tags(
                {
                    "draftloop.cache_hit": str(outcome.cache_hit).lower(),
                    "draftloop.cache_key": outcome.key,
                    "draftloop.uri": outcome.uri,
                    "draftloop.manifest_hash": outcome.manifest.content_hash(),
                }
            )
            if not outcome.cache_hit:
                stage_run.log_metrics(_numeric(outcome.manifest.summary))
            stage_run.log_dict(outcome.manifest.model_dump(mode="json"), "manifest.json")
    except BaseException as error:
        with suppress(Exception):
            ctx.mark(stage, "failed")
        if isinstance(error, StageError) or not isinstance(error, Exception) or is_transient(error):
            raise  # a transient error keeps its type: Prefect's retry condition looks at it
        excerpt = getattr(error, "log_excerpt", None)
        # Redacted: the message becomes the Prefect state's message and the CLI's error line.
        raise StageError(
            stage,
            redact_text(f"{type(error).__name__}: {error}"),
            redact_text(excerpt or error_excerpt(error)),
        ) from error
    ctx.outcomes[stage] = outcome
    ctx.timings[stage] = StageTiming(
        seconds=round(time.perf_counter() - started, 3), cache_hit=outcome.cache_hit
    )
    ctx.mark(stage, "done")
    with suppress(MissingContextError):  # no Prefect run around (a direct call): nothing to log into
        get_run_logger().info(
            stage_report(stage, outcome.manifest.summary, ctx.timings[stage].seconds, outcome.cache_hit)
        )
    return outcome
