"""Drift: the champion's acceptance on new traffic against its own held-out figure, per category.

The champion is simulated (greedy, the evaluation's k and max_tokens) on the new traffic's held-out
prompts before anything is trained; its mean acceptance length there, overall and per category, is set
against the one its registry record holds (measured on the held-out prompts of the data it was trained
on). A refresh retrains only when the overall drop exceeds the configured share, or when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from draftloop.infra.evaluation.simulator import PromptFigures

DEFAULT_RETRAIN_DROP = 0.05  # retrain when the champion's length on new traffic falls by more than 5%


class CategoryAcceptance(BaseModel):
    """Acceptance over some prompts: the drafts, the tokens accepted, and the mean acceptance length
    (vLLM's: 1 + accepted / drafts, the tokens a verification step yields)."""

    category: str
    prompts: int
    drafts: int
    accepted: int

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


def acceptance_by_category(
    figures: Sequence[PromptFigures], categories: Sequence[str]
) -> tuple[CategoryAcceptance, list[CategoryAcceptance]]:
    """(all prompts, each category in name order) from the simulator's per-prompt figures."""
    if len(figures) != len(categories):
        raise ValueError(f"{len(figures)} prompt figures for {len(categories)} categories")

    def over(name: str, chosen: list[PromptFigures]) -> CategoryAcceptance:
        return CategoryAcceptance(
            category=name,
            prompts=len(chosen),
            drafts=sum(figure.num_drafts for figure in chosen),
            accepted=sum(figure.num_accepted_tokens for figure in chosen),
        )

    groups: dict[str, list[PromptFigures]] = {}
    for figure, category in zip(figures, categories, strict=True):
        groups.setdefault(category, []).append(figure)
    return over("all", list(figures)), [over(name, groups[name]) for name in sorted(groups)]


@dataclass(frozen=True)
class DriftPolicy:
    retrain_drop: float  # retrain when the overall length drops by more than this share of the reference
    force: bool = False  # retrain whatever the drop


class DriftReport(BaseModel):
    """The champion on new traffic, and whether the refresh retrains."""

    champion_version: str
    reference_length: float | None  # the champion's own held-out figure (its registry record)
    overall: CategoryAcceptance
    categories: list[CategoryAcceptance]
    retrain_drop: float
    retrain: bool
    reason: str

    @property
    def drop(self) -> float | None:
        """The relative drop of the mean acceptance length, reference to new traffic (negative: a rise)."""
        new = self.overall.mean_acceptance_length
        if new is None or not self.reference_length:
            return None
        return (self.reference_length - new) / self.reference_length

    def markdown(self) -> str:
        reference = f"{self.reference_length:.3f}" if self.reference_length is not None else "n/a"
        lines = [
            f"Champion v{self.champion_version} on new traffic: its own held-out mean acceptance length "
            f"{reference}; decision: {self.reason}",
            "",
            "| category | prompts | drafts | mean acceptance length | change |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in [*self.categories, self.overall]:
            length = row.mean_acceptance_length
            change = (
                f"{(length - self.reference_length) / self.reference_length:+.1%}"
                if length is not None and self.reference_length
                else "n/a"
            )
            shown = f"{length:.3f}" if length is not None else "n/a"
            lines.append(f"| {row.category} | {row.prompts} | {row.drafts} | {shown} | {change} |")
        return "\n".join(lines)


def drift_report(
    champion_version: str,
    reference_length: float | None,
    figures: Sequence[PromptFigures],
    categories: Sequence[str],
    policy: DriftPolicy,
) -> DriftReport:
    overall, rows = acceptance_by_category(figures, categories)
    report = DriftReport(
        champion_version=champion_version,
        reference_length=reference_length,
        overall=overall,
        categories=rows,
        retrain_drop=policy.retrain_drop,
        retrain=False,
        reason="",
    )
    drop = report.drop
    shown = f"{drop:+.1%}" if drop is not None else "unknown"
    if policy.force:
        retrain, reason = True, f"retrain asked for (drop {shown})"
    elif drop is None:
        retrain, reason = True, "retrain: the champion's own figure or the new one is missing"
    elif drop > policy.retrain_drop:
        retrain, reason = True, f"retrain: drop {shown} > refresh drop {policy.retrain_drop:.1%}"
    else:
        retrain, reason = False, f"no retraining: drop {shown} <= refresh drop {policy.retrain_drop:.1%}"
    return report.model_copy(update={"retrain": retrain, "reason": reason})
