"""The evaluation's record: eval_report.json (what the evaluate stage stores, logs and gates on), made
from the plan, the measurements and the judgement."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, read_json
from draftloop.infra.evaluation.benchmark import ServerRun
from draftloop.infra.evaluation.judge import Judgement, KSweepEntry
from draftloop.infra.evaluation.measure import Measurements
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.verdict import LevelSpeedup
from draftloop.kernels.checkpoint import served_drafter_kind, trained_drafter_kind
from draftloop.kernels.variants.base import UnsupportedVariantError


@dataclass
class EvalReport:
    engine: str
    engine_version: str | None
    target: str
    drafter: str
    num_speculative_tokens: int
    max_tokens: int
    num_prompts: int
    concurrency: list[int]
    baseline: ServerRun
    speculative: ServerRun
    speedup: dict[int, float | None]
    lossless: bool
    mismatched_prompts: list[int]  # greedy outputs differ beyond a numerical tie
    engine_acceptance: dict[str, Any] | None
    simulator: dict[str, Any] | None
    acceptance_gap: float | None  # |engine - simulator| acceptance rate on the same text (consistency)
    acceptance_tolerance: float  # the plan's: the one the verdict and `consistent` are judged by
    verdict: str
    reasons: list[str]
    serving_k: int  # the k to serve: the best at the lowest concurrency, else the engine's k
    engine_layer_ids: dict[str, Any] | None = None
    plots: list[str] = field(default_factory=list)
    # Prompts whose greedy outputs differ only from a numerical tie at the first divergence (see
    # verdict.numeric_tie_at_divergence): prompt index -> {position, baseline, speculative, gap_nats}.
    numeric_ties: dict[int, dict[str, Any]] = field(default_factory=dict)
    # {"engine": NumericMode, "simulator": NumericMode, "mismatch": what the simulator does not reproduce}
    numeric_modes: dict[str, Any] = field(default_factory=dict)
    # verdict.AcceptanceComparison.to_json(): how acceptance was paired, divergent / excluded prompts.
    consistency: dict[str, Any] = field(default_factory=dict)
    # Per concurrency at the engine's k: speedup, interval, status, reasons.
    speedup_levels: list[LevelSpeedup] = field(default_factory=list)
    benchmark_plan: dict[str, Any] = field(default_factory=dict)
    # Per k served: predicted (simulator) and measured AL, and its LevelSpeedup list.
    k_sweep: list[KSweepEntry] = field(default_factory=list)
    sweep_runs: dict[int, ServerRun] = field(default_factory=dict)  # the other k's servers
    recommended_k: dict[int, int | None] = field(default_factory=dict)  # per concurrency
    # category -> {prompts, simulator: {acceptance_rate, mean_acceptance_length}, engine: same or None}
    category_acceptance: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The drafter's layer as trained (its record; else as the engine reads it), e.g. "eagle3.1 (fc_norm,
    # norm_output)": what the verdict, the registry card and the MLflow model name.
    drafter_variant: str = "eagle3"

    @property
    def consistent(self) -> bool | None:
        """Engine and simulator acceptance within the tolerance (None: no simulator to compare with)."""
        if not self.simulator:
            return None
        return self.acceptance_gap is not None and self.acceptance_gap <= self.acceptance_tolerance

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["speedup"] = {str(k): v for k, v in self.speedup.items()}
        data["sweep_runs"] = {str(k): v for k, v in data["sweep_runs"].items()}
        data["recommended_k"] = {str(c): k for c, k in self.recommended_k.items()}
        return data

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path


def make_report(
    engine: Engine,
    plan: EvaluationPlan,
    target_dir: Path,
    drafter_dir: Path,
    num_prompts: int,
    measured: Measurements,
    judged: Judgement,
) -> EvalReport:
    """The record of one evaluation (plots not drawn yet: run.py adds them)."""
    k = plan.num_speculative_tokens
    engine_ids = engine.drafter_layer_ids(drafter_dir)
    try:
        version: str | None = engine.version()
    except Exception:
        version = None
    simulator = measured.simulator
    return EvalReport(
        engine=engine.kind,
        engine_version=version,
        target=str(target_dir),
        drafter=str(drafter_dir),
        num_speculative_tokens=k,
        max_tokens=plan.max_tokens,
        num_prompts=num_prompts,
        concurrency=list(plan.concurrency),
        baseline=measured.baseline,
        speculative=measured.runs[k],
        speedup={level.concurrency: level.speedup for level in judged.speedups[k]},
        lossless=judged.lossless,
        mismatched_prompts=judged.mismatched_prompts,
        numeric_ties=judged.numeric_ties,
        engine_acceptance=judged.acceptance,
        simulator=asdict(simulator) if simulator is not None else None,
        acceptance_gap=judged.comparison.gap,
        acceptance_tolerance=plan.acceptance_tolerance,
        verdict=judged.verdict,
        reasons=judged.reasons,
        engine_layer_ids=(
            {
                "ids": list(engine_ids.ids),
                "convention": engine_ids.convention,
                "layer_input": list(engine_ids.as_input()),
            }
            if engine_ids is not None
            else None
        ),
        numeric_modes={
            "engine": measured.engine_mode.to_json(),
            "simulator": simulator.numeric_mode if simulator is not None else None,
            "mismatch": measured.mode_mismatch,
        },
        consistency=judged.comparison.to_json(),
        speedup_levels=judged.speedups[k],
        benchmark_plan=plan.benchmark.to_json(),
        k_sweep=judged.k_sweep,
        sweep_runs={value: run for value, run in measured.runs.items() if value != k},
        recommended_k=judged.recommended_k,
        serving_k=judged.serving_k,
        category_acceptance=judged.category_acceptance,
        drafter_variant=drafter_variant(drafter_dir),
    )


def drafter_variant(drafter_dir: Path) -> str:
    """The drafter's variant as trained (its draftloop record), else as an engine reads its fields."""
    config = read_json(Path(drafter_dir) / "config.json")
    kind = trained_drafter_kind(config)
    try:
        return str(kind or served_drafter_kind(config))
    except UnsupportedVariantError as error:
        return f"unknown ({error})"
