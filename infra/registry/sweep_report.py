"""A sweep's results as people compare them: one `VariantResult` per variant, the winner, the table.

The winner is chosen by the gate's own measure (infra/registry/gate.py: mean acceptance length, the figure
it compares champions by): among the variants whose figures can be trusted (completed, lossless, engine
and simulator consistent), the highest mean acceptance length, then the higher speedup at concurrency 1.
It is then registered through the gate like any cycle's drafter: the gate's thresholds and the champion
decide whether the alias moves, and a rejected winner is registered as rejected with the reasons.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from draftloop.infra.evaluation.plots import plot_sweep
from draftloop.infra.registry.figures import format_percent
from draftloop.infra.registry.gate import CycleResults, evaluate_gate
from draftloop.infra.runtime.config import GateConfig

# The figures compared, by the name the table, the plot and the parent run's metrics use.
FIGURES = ("mean_acceptance_length", "acceptance_rate", "speedup_c1")


class VariantResult(BaseModel):
    """What one variant's cycle (up to evaluate) produced, as the sweep records it (variants/<key>.json)."""

    key: str
    label: str
    overrides: dict[str, Any]
    status: str  # "completed" | "failed"
    mlflow_run_id: str | None = None
    run_folder: str | None = None
    error: str | None = None
    verdict: str | None = None
    results: dict[str, Any] = Field(default_factory=dict)  # CycleResults.to_dict()
    cache_hits: list[str] = Field(default_factory=list)
    stages_run: list[str] = Field(default_factory=list)  # the stages this variant really ran

    @classmethod
    def from_summary(
        cls, key: str, label: str, overrides: dict[str, Any], summary: dict[str, Any]
    ) -> VariantResult:
        """From a cycle's summary.json (flows/cycle.py:build_summary)."""
        # summary.json carries the evaluation's results under CycleResults' own names (build_summary).
        results = CycleResults.from_dict(summary)
        stages = summary.get("stages") or {}
        return cls(
            key=key,
            label=label,
            overrides=overrides,
            status=str(summary.get("status")),
            mlflow_run_id=summary.get("mlflow_run_id"),
            run_folder=summary.get("run_folder"),
            verdict=summary.get("verdict"),
            results=results.to_dict(),
            cache_hits=list(summary.get("cache_hits") or []),
            stages_run=[name for name, timing in stages.items() if not timing.get("cache_hit")],
        )

    @property
    def cycle_results(self) -> CycleResults:
        return CycleResults.from_dict(self.results)

    def figures(self) -> dict[str, float | None]:
        results = self.cycle_results
        return {
            "mean_acceptance_length": results.mean_acceptance_length,
            "acceptance_rate": results.acceptance_rate,
            "speedup_c1": results.speedup.get(1),
        }

    def untrusted(self) -> list[str]:
        """Why this variant's figures cannot be compared (empty: it may win): a failed cycle, or what the
        gate's consistency check refuses (lossy outputs, engine and simulator apart)."""
        if self.status != "completed":
            return [f"the variant's cycle {self.status}: {self.error or 'no result'}"]
        consistency = GateConfig(min_speedup=None, min_acceptance_length=None, beat_champion=False)
        return evaluate_gate(consistency, self.cycle_results, champion_length=None).reasons

    def gate_reasons(self, gate: GateConfig) -> list[str]:
        """What the gate's thresholds would say of this variant (the champion comparison is
        registration's): shown in the comparison table."""
        if self.untrusted():
            return self.untrusted()
        thresholds = gate.model_copy(update={"beat_champion": False, "beat": None})
        return evaluate_gate(thresholds, self.cycle_results, champion_length=None).reasons


def winner(variants: Sequence[VariantResult]) -> VariantResult | None:
    """The best variant by the gate's measure, or None when no variant's figures can be trusted."""
    eligible = [variant for variant in variants if not variant.untrusted()]

    def measure(variant: VariantResult) -> tuple[float, float]:
        figures = variant.figures()
        return (figures["mean_acceptance_length"] or 0.0, figures["speedup_c1"] or 0.0)

    return max(eligible, key=measure, default=None)


def comparison_rows(
    variants: Sequence[VariantResult], gate: GateConfig, best: VariantResult | None
) -> list[dict[str, str]]:
    """One row per variant (swept values, figures rounded as the registry shows them, the gate)."""
    swept = list(dict.fromkeys(key for variant in variants for key in variant.overrides))
    rows = []
    for variant in variants:
        figures = variant.figures()
        reasons = variant.gate_reasons(gate)
        length, speedup = figures["mean_acceptance_length"], figures["speedup_c1"]
        rows.append(
            {
                **{key: _shown(variant.overrides.get(key, "")) for key in swept},
                "AL": f"{length:.2f}" if length is not None else "n/a",
                "acceptance": format_percent(figures["acceptance_rate"]),
                "speedup @ c=1": f"{speedup:.2f}x" if speedup is not None else "n/a",
                "verdict": variant.verdict or variant.status,
                "gate": reasons[0] if reasons else "passes",
                "winner": "yes" if variant is best else "",
            }
        )
    return rows


def comparison_markdown(
    title: str, variants: Sequence[VariantResult], gate: GateConfig, best: VariantResult | None
) -> str:
    rows = comparison_rows(variants, gate, best)
    header = list(rows[0]) if rows else []
    lines = [f"# {title}", ""]
    lines.append(
        f"**Winner: {best.label}**" if best else "**No winner**: no variant's figures can be trusted"
    )
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row[column] for column in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_comparison_plot(variants: Sequence[VariantResult], path: Path) -> Path:
    """AL, acceptance and speedup @ c=1 against each swept value (infra/evaluation/plots.py)."""
    points = [
        (key, value, variant.figures())
        for variant in variants
        if variant.status == "completed"
        for key, value in variant.overrides.items()
    ]
    return plot_sweep(points, path)


def _shown(value: Any) -> str:
    return str(value)
