"""A stage is one declared object; one module-level Prefect task runs any of them; a pipeline orders them.

A stage module (`tasks/<stage>.py`) exports one `Stage`: its name, the config sections and upstream inputs
its cache key hashes, the GPUs it takes, its retries, the figures its log line and summary report, the
typed summary its manifest carries, and `produce`, the work itself. Everything around the work comes from
the declaration, in `run_stage`: the cache lookup (tasks/cache.py), the `gpus` concurrency slots, the
nested MLflow run, progress markers, the log line, the failure with its log excerpt.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError
from pydantic import BaseModel

from draftloop.infra.registry.figures import format_significant
from draftloop.infra.registry.runs import StageRun, Tracker, error_excerpt
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord
from draftloop.infra.runtime.redaction import redact_text
from draftloop.infra.runtime.services import hold_gpus
from draftloop.infra.runtime.stage_log import forwarded_to
from draftloop.infra.runtime.storage import Manifest
from draftloop.tasks.cache import StageError, StageOutcome, StageWork, run_cached
from draftloop.tasks.cycle import CycleContext, StageTiming, run_folder_uri
from draftloop.tasks.retry import is_transient, stage_task_options

SummaryT = TypeVar("SummaryT", bound=BaseModel)


@dataclass(frozen=True)
class Figure:
    """One figure of a stage's summary that people see: dotted key into the summary, and its label."""

    key: str
    label: str
    # How the stage's log line writes it (None: three significant digits, lists item by item).
    shown: Callable[[Any], str] | None = None

    def value(self, summary: Mapping[str, Any]) -> Any:
        value: Any = summary
        for part in self.key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        return value

    def text(self, value: Any) -> str:
        """``value`` as people read it."""
        if self.shown is not None:
            return self.shown(value)
        if isinstance(value, list):
            return "[" + ", ".join(format_significant(v) for v in value) + "]"
        return format_significant(value)


@dataclass(frozen=True)
class StageRequest:
    """What a stage's `produce` is handed: where to write, its keyed inputs, the cycle, its MLflow run."""

    config: ExperimentConfig
    work: StageWork
    inputs: Mapping[str, StageOutcome]  # the declared upstream inputs, by input name
    cycle: CycleContext
    run: StageRun

    @property
    def pids(self) -> PidRecord:
        return self.cycle.pids

    def earlier(self, stage: str) -> StageOutcome | None:
        """The outcome of an earlier stage of this cycle that is not a keyed input (None if left out)."""
        return self.cycle.outcomes.get(stage)


def _no_fields(config: ExperimentConfig) -> Mapping[str, str]:
    return {}


def _no_gpus(config: ExperimentConfig) -> float:
    return 0.0


@dataclass(frozen=True)
class Stage:
    """One stage of a cycle, declared whole (see the module docstring)."""

    name: str
    produce: Callable[[StageRequest], Manifest]
    summary: type[BaseModel]  # the manifest summary's schema, checked when the stage commits
    sections: tuple[str, ...]  # config sections the cache key hashes
    inputs: Mapping[str, str] = field(default_factory=dict)  # input name -> the stage producing it
    key_fields: Callable[[ExperimentConfig], Mapping[str, str]] = _no_fields  # single fields in the key
    gpus: Callable[[ExperimentConfig], float] = _no_gpus  # whole GPUs are held while it runs
    retries: int = 2
    figures: tuple[Figure, ...] = ()
    description: str = ""  # what the stage does, for its per-stage deployment
    # Called with every outcome, a cache hit included (register records the version on this cycle's run).
    on_outcome: Callable[[CycleContext, StageOutcome], None] | None = None

    def gpu_slots(self, config: ExperimentConfig) -> int:
        """Slots of the shared `gpus` limit this stage holds while it runs (its GPUs, rounded up)."""
        return math.ceil(self.gpus(config))

    def figures_of(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        """The declared figures present in `summary`, by label, as stored."""
        shown = {figure.label: figure.value(summary) for figure in self.figures}
        return {label: value for label, value in shown.items() if value is not None}

    def shown_figures(self, summary: Mapping[str, Any]) -> dict[str, str]:
        """The declared figures present in `summary`, by label, as people read them (units, rounded)."""
        values = [(figure, figure.value(summary)) for figure in self.figures]
        return {figure.label: figure.text(value) for figure, value in values if value is not None}

    def report(self, summary: Mapping[str, Any], seconds: float, cache_hit: bool) -> str:
        """One human line for the Prefect log: the declared figures, rounded."""
        if cache_hit:
            return f"{self.name}: reused the finished stage with the same inputs"
        figures = [f"{seconds:.1f} s"]
        figures += [f"{label} {text}" for label, text in self.shown_figures(summary).items()]
        return f"{self.name}: done, " + ", ".join(figures)


def typed_summary(outcome: StageOutcome, model: type[SummaryT]) -> SummaryT:
    """A stage outcome's manifest summary as its declared model."""
    return model.model_validate(outcome.manifest.summary)


@dataclass(frozen=True)
class Pipeline:
    """Stages in cycle order; each stage's inputs come from stages before it."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for stage in self.stages:
            if stage.name in seen:
                raise ValueError(f"pipeline: stage {stage.name!r} appears twice")
            missing = sorted(set(stage.inputs.values()) - seen)
            if missing:
                raise ValueError(
                    f"pipeline: stage {stage.name!r} reads {', '.join(missing)}, "
                    f"which no earlier stage produces (stages before it: {', '.join(sorted(seen)) or 'none'})"
                )
            seen.add(stage.name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(stage.name for stage in self.stages)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ValueError(f"until: unknown stage {name!r}; stages: {', '.join(self.names)}")

    def until(self, name: str) -> Pipeline:
        """The stages up to and including `name` (the per-stage deployments stop early)."""
        last = self.names.index(self.stage(name).name)
        return Pipeline(self.stages[: last + 1])

    def inserted(self, stage: Stage, after: str) -> Pipeline:
        at = self.names.index(self.stage(after).name) + 1
        return Pipeline((*self.stages[:at], stage, *self.stages[at:]))

    def without(self, name: str) -> Pipeline:
        self.stage(name)
        return Pipeline(tuple(stage for stage in self.stages if stage.name != name))


def _metrics(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number of a stage summary, flattened with dots, for the stage's MLflow run."""
    metrics: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            metrics[f"{prefix}{key}"] = float(value)
        elif isinstance(value, Mapping):
            metrics.update(_metrics(value, prefix=f"{prefix}{key}."))
    return metrics


def _log(message: str) -> None:
    with suppress(MissingContextError):  # no Prefect run around (a direct call): nothing to log into
        get_run_logger().info(message)


def execute(stage: Stage, ctx: CycleContext) -> StageOutcome:
    """Run `stage` inside its nested MLflow run, from its declaration: cache, GPU slots, markers, log line.

    The work runs only on a cache miss; then the stage holds its GPUs' slots of the shared `gpus` limit
    until it ends, so two cycles never take the same GPUs. A failure is recorded in MLflow and re-raised
    as a StageError carrying the log excerpt (transient errors keep their type: Prefect retries them).
    """
    ctx.mark(stage.name, "started")
    _log(f"{stage.name}: started")
    started = time.perf_counter()
    inputs = {name: ctx.outcomes[producer] for name, producer in stage.inputs.items()}
    try:
        with ctx.tracker.stage(stage.name) as stage_run, ExitStack() as gpu_slots:

            def on_start(work: StageWork) -> None:
                gpu_slots.enter_context(hold_gpus(stage.gpu_slots(ctx.config)))
                ctx.mark(stage.name, "running")
                stage_run.set_tags({"draftloop.cache_key": work.key, "draftloop.uri": work.uri})

            def body(work: StageWork) -> Manifest:
                manifest = stage.produce(StageRequest(ctx.config, work, inputs, ctx, stage_run))
                stage.summary.model_validate(manifest.summary)  # the declared schema, before anyone reads it
                return manifest

            outcome = run_cached(
                stage.name,
                ctx.config,
                stage.sections,
                {name: upstream.manifest for name, upstream in inputs.items()},
                body,
                on_start=on_start,
                extra_inputs=stage.key_fields(ctx.config),
            )
            if stage.on_outcome is not None:
                stage.on_outcome(ctx, outcome)
            stage_run.set_tags(
                {
                    "draftloop.cache_hit": str(outcome.cache_hit).lower(),
                    "draftloop.cache_key": outcome.key,
                    "draftloop.uri": outcome.uri,
                    "draftloop.manifest_hash": outcome.manifest.content_hash(),
                }
            )
            if not outcome.cache_hit:
                stage_run.log_metrics(_metrics(outcome.manifest.summary))
            stage_run.log_dict(outcome.manifest.model_dump(mode="json"), "manifest.json")
    except BaseException as error:
        with suppress(Exception):
            ctx.mark(stage.name, "failed")
        if isinstance(error, StageError) or not isinstance(error, Exception) or is_transient(error):
            raise  # a transient error keeps its type: Prefect's retry condition looks at it
        excerpt = getattr(error, "log_excerpt", None)
        # Redacted: the message becomes the Prefect state's message and the CLI's error line.
        raise StageError(
            stage.name,
            redact_text(f"{type(error).__name__}: {error}"),
            redact_text(excerpt or error_excerpt(error)),
        ) from error
    ctx.outcomes[stage.name] = outcome
    ctx.timings[stage.name] = StageTiming(
        seconds=round(time.perf_counter() - started, 3),
        cache_hit=outcome.cache_hit,
        figures=stage.figures_of(outcome.manifest.summary),
        shown=stage.shown_figures(outcome.manifest.summary),
    )
    ctx.mark(stage.name, "done")
    _log(stage.report(outcome.manifest.summary, ctx.timings[stage.name].seconds, outcome.cache_hit))
    return outcome


# The one stage task; each call takes its stage's name and retries (`with_options`), so Prefect shows
# `synthesize`, `train`, ... as before.
@task(name="stage", **stage_task_options())
def run_stage(stage: Stage, ctx: CycleContext) -> StageOutcome:
    with forwarded_to(get_run_logger()):  # the stage's progress lines (infra's STAGE_LOG) into its run log
        return execute(stage, ctx)


def submit(stage: Stage, ctx: CycleContext) -> StageOutcome:
    """Run `stage` as its own Prefect task run, named after it, with its declared retries."""
    return run_stage.with_options(name=stage.name, retries=stage.retries)(stage, ctx)


def run_alone(stage: Stage, config: ExperimentConfig, upstream: Mapping[str, StageOutcome]) -> StageOutcome:
    """Run one stage outside a cycle (a benchmark's driver, a test): no parent MLflow run, no Prefect
    task; `upstream` holds the outcomes its inputs name, by producing stage."""
    run_id = f"alone-{uuid.uuid4().hex[:12]}"
    ctx = CycleContext(config, run_id, Tracker.from_config(config), run_folder_uri(config, run_id))
    ctx.outcomes.update(upstream)
    return execute(stage, ctx)
