"""Judge: what an evaluation's measurements mean, for the plan they were measured by.

Lossless (greedy outputs of baseline and speculative servers, up to numerical ties), the engine's
acceptance against the simulator's on the same text, the verdict (verdict.py: integration fault before
the excused gaps before a weak drafter), the speedup of every k with its interval and physical bounds,
the sweep's predicted and measured acceptance length, the k to serve, and the acceptance per prompt
category.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from draftloop.infra.evaluation.benchmark import ServerRun
from draftloop.infra.evaluation.measure import Measurements
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.simulator import SimulatorFigures
from draftloop.infra.evaluation.verdict import (
    SPEEDUP_MEASUREMENT_ERROR,
    SPEEDUP_UNMEASURED,
    AcceptanceComparison,
    LevelSpeedup,
    compare_acceptance,
    compare_outputs,
    decide_verdict,
    engine_acceptance,
    level_speedups,
)


@dataclass(frozen=True)
class KSweepEntry:
    """One k served: the simulator's predicted and the engine's measured acceptance, and its speedups."""

    k: int
    server: str
    predicted_mean_acceptance_length: float | None
    measured_mean_acceptance_length: float | None
    measured_acceptance_rate: float | None
    levels: list[LevelSpeedup]


@dataclass(frozen=True)
class Judgement:
    """The verdict and the figures derived from one evaluation's measurements."""

    mismatched_prompts: list[int]  # greedy outputs differ beyond a numerical tie
    numeric_ties: dict[int, dict[str, Any]]  # prompts excused by a tie at their first divergence
    acceptance: dict[str, Any] | None  # the engine's, at the engine's k (verdict.engine_acceptance)
    comparison: AcceptanceComparison
    verdict: str
    reasons: list[str]
    speedups: dict[int, list[LevelSpeedup]]  # per k served
    k_sweep: list[KSweepEntry]
    recommended_k: dict[int, int | None]  # per concurrency
    serving_k: int  # the k to serve: the best at the lowest concurrency, else the engine's k
    category_acceptance: dict[str, dict[str, Any]]

    @property
    def lossless(self) -> bool:
        return not self.mismatched_prompts


def predicted_acceptance_length(per_position: Sequence[float | None], k: int) -> float | None:
    """AL at k from the unconditional per-position acceptance (position i accepted = positions 0..i
    were): 1 + sum of the first k. Chain drafting proposes the same first tokens whatever k is, so one
    simulation at the largest k predicts every smaller k."""
    head = list(per_position[:k])
    if len(head) < k or any(value is None for value in head):
        return None
    return 1.0 + sum(float(value) for value in head if value is not None)


def category_acceptance(
    categories: Sequence[str], simulator: SimulatorFigures | None, speculative: ServerRun
) -> dict[str, dict[str, Any]]:
    """Acceptance rate and AL per prompt category: the simulator's (per prompt, on the engine's own text
    when it replayed it) and the engine's where it reports counters per request."""
    engine_prompts = speculative.prompt_counters()
    figures: dict[str, dict[str, Any]] = {}
    for category in sorted(set(categories)):
        members = [i for i, c in enumerate(categories) if c == category]
        entry: dict[str, Any] = {"prompts": len(members), "simulator": None, "engine": None}
        if simulator is not None and len(simulator.prompts) == len(categories):
            chosen = [simulator.prompts[i] for i in members]
            entry["simulator"] = _acceptance(
                sum(p.num_drafts for p in chosen),
                sum(p.num_draft_tokens for p in chosen),
                sum(p.num_accepted_tokens for p in chosen),
            )
        if engine_prompts is not None and len(engine_prompts) == len(categories):
            counted = [engine_prompts[i] for i in members]
            entry["engine"] = _acceptance(
                sum(c.num_drafts for c in counted),
                sum(c.num_draft_tokens for c in counted),
                sum(c.num_accepted_tokens for c in counted),
            )
        figures[category] = entry
    return figures


def _acceptance(drafts: float, draft_tokens: float, accepted: float) -> dict[str, float | None]:
    return {
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
    }


def recommend_k(sweep: Mapping[int, Sequence[LevelSpeedup]]) -> dict[int, int | None]:
    """Per concurrency, the k of the highest speedup among the figures not flagged measurement_error
    (None when every k is flagged or unmeasured there)."""
    best: dict[int, tuple[float, int] | None] = {}
    for k, levels in sorted(sweep.items()):
        for level in levels:
            best.setdefault(level.concurrency, None)
            if level.speedup is None or level.status in (SPEEDUP_MEASUREMENT_ERROR, SPEEDUP_UNMEASURED):
                continue
            current = best[level.concurrency]
            if current is None or level.speedup > current[0]:
                best[level.concurrency] = (level.speedup, k)
    return {c: (choice[1] if choice is not None else None) for c, choice in sorted(best.items())}


def judge(
    plan: EvaluationPlan,
    measured: Measurements,
    *,
    categories: Sequence[str] | None,
    contract_warnings: Sequence[str] = (),
) -> Judgement:
    """The verdict and figures of `measured` (see the module's docstring); `contract_warnings` (the
    pairing check's: served dtype or quantization other than trained on) become verdict reasons."""
    k = plan.num_speculative_tokens
    baseline, speculative, simulator = measured.baseline, measured.runs[k], measured.simulator
    mismatched, numeric_ties = compare_outputs(baseline, speculative)
    acceptance = engine_acceptance(speculative)
    comparison = compare_acceptance(acceptance, speculative, simulator)
    verdict, reasons = decide_verdict(
        engine_rate=comparison.engine_rate,
        simulator_rate=comparison.simulator_rate,
        tolerance=plan.acceptance_tolerance,
        lossless=not mismatched,
        mean_acceptance_length=acceptance.get("mean_acceptance_length") if acceptance else None,
        min_acceptance_length=plan.min_acceptance_length,
        export_mismatch=measured.export_mismatch,
        numeric_mode_mismatch=measured.mode_mismatch,
        comparable=comparison.comparable,
    )
    speedups = {
        value: level_speedups(
            measured.paired_baselines.get(value, baseline),
            run,
            acceptance_length=(engine_acceptance(run) or {}).get("mean_acceptance_length"),
            bound_tolerance=plan.speedup_bound_tolerance,
            consistency_factor=plan.throughput_consistency_factor,
        )
        for value, run in measured.runs.items()
    }
    predictor = measured.prediction or simulator
    per_position = predictor.per_position if predictor is not None else []
    sweep = [
        KSweepEntry(
            k=value,
            server=measured.runs[value].name,
            predicted_mean_acceptance_length=predicted_acceptance_length(per_position, value),
            measured_mean_acceptance_length=(engine_acceptance(measured.runs[value]) or {}).get(
                "mean_acceptance_length"
            ),
            measured_acceptance_rate=(engine_acceptance(measured.runs[value]) or {}).get("acceptance_rate"),
            levels=speedups[value],
        )
        for value in plan.ks
    ]
    recommended = recommend_k(speedups)
    return Judgement(
        mismatched_prompts=mismatched,
        numeric_ties=numeric_ties,
        acceptance=acceptance,
        comparison=comparison,
        verdict=verdict,
        reasons=[*reasons, *(f"contract warning: {warning}" for warning in contract_warnings)],
        speedups=speedups,
        k_sweep=sweep,
        recommended_k=recommended,
        # Where speculation pays most; the engine's k when no figure there is trustworthy.
        serving_k=recommended.get(min(plan.concurrency)) or k,
        category_acceptance=(
            category_acceptance(categories, simulator, speculative) if categories is not None else {}
        ),
    )
