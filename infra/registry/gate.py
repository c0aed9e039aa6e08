"""The gate: whether a cycle's drafter may become the champion, from its results and the champion's figures.

`CycleResults` is the one typed value the gate and the registry's prose (cards.py) read; `evaluation.gate`
in the config says what a drafter must reach; `evaluate_gate` applies it and says why (reasons when it
fails, notes for the checks it skipped). A version's figures are read back from its logged model, where
registration stores them whole (`RESULTS_TAG`); its six version tags are for people (cards.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from draftloop.infra.registry.challenge import Challenge
from draftloop.infra.registry.figures import format_percent
from draftloop.infra.runtime.config import GateConfig

CHAMPION_ALIAS = "champion"
# The logged model's tag holding a version's `CycleResults` as JSON: what the gate and the leaderboard read.
RESULTS_TAG = "draftloop.results"
EXTERNAL_GATE = "external baseline"  # the `gate` tag of a published drafter's version (external.py)


@dataclass(frozen=True)
class CycleResults:
    """The figures the gate and the model-version description are made of.

    `to_dict` is its JSON shape (the evaluate manifest's summary, summary.json): concurrency keys become
    strings; `from_dict` reads that shape back, so `from_dict(to_dict())` is the same value.
    """

    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_acceptance: list[float] = field(default_factory=list)
    speedup: dict[int, float] = field(default_factory=dict)  # per concurrency
    throughput: dict[int, float] = field(default_factory=dict)  # output tokens/s per concurrency
    # The simulator's on the same text and prompt mix as the engine's counters: what `consistent` compares.
    simulator_acceptance_rate: float | None = None
    consistent: bool | None = None  # engine vs simulator within tolerance
    lossless: bool | None = None
    # Per concurrency: "ok", "inconclusive" (interval contains 1.0) or "measurement_error" (with why).
    speedup_status: dict[int, str] = field(default_factory=dict)
    recommended_k: int | None = None  # the k the evaluation recommends serving
    # The engine's rate as compared with the simulator's (= acceptance_rate unless prompts whose texts
    # diverged were left out of the comparison; None: not compared).
    compared_engine_acceptance_rate: float | None = None
    # The simulator's with every prompt once (its own mix, not the engine's): shown only labelled so.
    simulator_unweighted_acceptance_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "speedup": {str(k): v for k, v in self.speedup.items()},
            "throughput": {str(k): v for k, v in self.throughput.items()},
            "simulator_acceptance_rate": self.simulator_acceptance_rate,
            "consistent": self.consistent,
            "lossless": self.lossless,
            "speedup_status": {str(k): v for k, v in self.speedup_status.items()},
            "recommended_k": self.recommended_k,
            "compared_engine_acceptance_rate": self.compared_engine_acceptance_rate,
            "simulator_unweighted_acceptance_rate": self.simulator_unweighted_acceptance_rate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CycleResults:
        return cls(
            acceptance_rate=data.get("acceptance_rate"),
            mean_acceptance_length=data.get("mean_acceptance_length"),
            per_position_acceptance=list(data.get("per_position_acceptance") or []),
            speedup={int(k): float(v) for k, v in (data.get("speedup") or {}).items()},
            throughput={int(k): float(v) for k, v in (data.get("throughput") or {}).items()},
            simulator_acceptance_rate=data.get("simulator_acceptance_rate"),
            consistent=data.get("consistent"),
            lossless=data.get("lossless"),
            speedup_status={int(k): str(v) for k, v in (data.get("speedup_status") or {}).items()},
            recommended_k=data.get("recommended_k"),
            compared_engine_acceptance_rate=data.get("compared_engine_acceptance_rate"),
            simulator_unweighted_acceptance_rate=data.get("simulator_unweighted_acceptance_rate"),
        )

    @property
    def engine_rate_compared(self) -> float | None:
        """The engine's side of the consistency check (its headline rate when no other was recorded)."""
        if self.compared_engine_acceptance_rate is not None:
            return self.compared_engine_acceptance_rate
        return self.acceptance_rate


@dataclass(frozen=True)
class GateDecision:
    """The gate's answer for one version, with the reasons people read in the registry."""

    passed: bool
    reasons: list[str]  # why it failed (empty when passed)
    notes: list[str]  # checks that were skipped, with why

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reasons": self.reasons, "notes": self.notes}


def evaluate_gate(
    gate: GateConfig,
    results: CycleResults,
    champion_length: float | None,
    champion_version: str | None = None,
    baseline: ChampionFigures | None = None,
    challenge: Challenge | None = None,
) -> GateDecision:
    """Apply `evaluation.gate` to a cycle's results.

    `min_speedup` is checked at concurrency 1 (a single stream is where speculation must pay);
    null means "not gated" and the reason is kept, because tiny CPU targets are compute-bound.
    The champion is beaten at the registry's resolution (3 decimals, what people read); a refresh's
    `challenge` (both drafters measured in the same run on the same new prompts) replaces that
    comparison: the challenger must win beyond its interval.
    """
    reasons: list[str] = []
    notes: list[str] = []
    if gate.min_speedup is None:
        notes.append(
            "min_speedup not gated (evaluation.gate.min_speedup is null: a tiny target on a CPU is "
            "compute-bound, speculation cannot pay there)"
        )
    else:
        speedup = results.speedup.get(1)
        status = results.speedup_status.get(1, "ok")
        if speedup is None:
            reasons.append("no speedup measured at concurrency 1")
        elif not status.startswith("ok"):
            # Never promote on a flagged figure.
            reasons.append(f"speedup at concurrency 1 ({speedup:.2f}x) is flagged: {status}")
        elif speedup < gate.min_speedup:
            reasons.append(f"speedup at concurrency 1 is {speedup:.2f}x < min_speedup {gate.min_speedup}x")
    if gate.require_consistency:
        if results.lossless is False:
            reasons.append("greedy outputs of the speculative server differ from the baseline's")
        if results.consistent is None:
            reasons.append("engine/simulator consistency was not measured")
        elif not results.consistent:
            reasons.append(
                f"engine acceptance {format_percent(results.engine_rate_compared)} disagrees with the "
                f"simulator's {format_percent(results.simulator_acceptance_rate)} on the same prompts "
                "(integration fault)"
            )
    length = results.mean_acceptance_length
    if gate.min_acceptance_length is not None:
        if length is None:
            reasons.append("no mean acceptance length measured")
        elif length < gate.min_acceptance_length:
            reasons.append(
                f"mean acceptance length {length:.2f} < min_acceptance_length {gate.min_acceptance_length}"
            )
    if challenge is not None:
        (notes if challenge.won else reasons).append(challenge.reason)
    elif gate.beat_champion:
        champion = f"champion v{champion_version}" if champion_version else "the champion"
        if champion_length is None:
            notes.append("no current champion to beat")
        elif length is None:
            reasons.append(f"no mean acceptance length to compare with {champion}'s {champion_length:.2f}")
        elif round(length, 3) <= round(champion_length, 3):
            reasons.append(
                f"mean acceptance length {length:.2f} does not beat {champion}'s {champion_length:.2f}"
            )
    if gate.beat is not None:
        named = f"{gate.beat!r}" + (f" (v{baseline.version}{baseline.label})" if baseline is not None else "")
        if baseline is None:
            reasons.append(f"evaluation.gate.beat: no registered version {named} to compare with")
        elif baseline.mean_acceptance_length is None or length is None:
            reasons.append(f"no mean acceptance length to compare with {named}")
        elif round(length, 3) <= round(beaten := baseline.mean_acceptance_length, 3):
            reasons.append(f"mean acceptance length {length:.2f} does not beat {named}'s {beaten:.2f}")
    return GateDecision(passed=not reasons, reasons=reasons, notes=notes)


def tag_float(tags: Mapping[str, str], key: str) -> float | None:
    """A figure stored as a tag, as a number; None when absent or not a number."""
    try:
        return float(tags[key])
    except (KeyError, ValueError):
        return None


def _results_from_old_tags(tags: Mapping[str, str]) -> CycleResults | None:
    """The figures of a version registered before RESULTS_TAG, from its tags (`speedup_c4`, ...)."""
    length = tag_float(tags, "mean_acceptance_length")
    if length is None:
        return None
    speedup: dict[int, float] = {}
    status: dict[int, str] = {}
    for key in tags:
        level = key.removeprefix("speedup_c")
        if key.startswith("speedup_c") and level.isdigit() and (value := tag_float(tags, key)) is not None:
            speedup[int(level)] = value
            status[int(level)] = tags.get(f"{key}_status", "ok")
    return CycleResults(
        acceptance_rate=tag_float(tags, "acceptance_rate"),
        mean_acceptance_length=length,
        speedup=speedup,
        speedup_status=status,
    )


@dataclass(frozen=True)
class VersionRecord:
    """A registered version as stored: the tags of its row, and what its logged model keeps (the card's
    facts, the gate's reasons and the results, RESULTS_TAG)."""

    version: str
    tags: Mapping[str, str]  # the version's own: six short ones (cards.version_tags)
    model_tags: Mapping[str, str]  # the logged model's
    results: CycleResults | None

    @property
    def external(self) -> bool:
        return self.tags.get("gate") == EXTERNAL_GATE or self.tags.get("external") == "true"

    def fact(self, key: str, default: str = "") -> str:
        """A fact of the card (engine_version, source, ...): the logged model's, else a version tag."""
        return self.model_tags.get(key) or self.tags.get(key) or default


def _logged_model_tags(client: MlflowClient, version: ModelVersion) -> dict[str, str]:
    """The tags of the logged model a version was created from: by its id where the store keeps it, else
    among its run's output models by location (MLflow's SQL registry does not store a version's model_id)."""
    try:
        if version.model_id:
            return dict(client.get_logged_model(version.model_id).tags)
        if not version.run_id:
            return {}
        outputs = client.get_run(version.run_id).outputs
        for output in outputs.model_outputs if outputs else []:
            model = client.get_logged_model(output.model_id)
            if model.artifact_location == version.source:
                return dict(model.tags)
    except MlflowException:  # the run or the model was deleted: the version's own tags remain
        pass
    return {}


def read_version(client: MlflowClient, version: ModelVersion) -> VersionRecord:
    """A version with its logged model's record (a version registered before that record: its tags)."""
    model_tags = _logged_model_tags(client, version)
    stored = model_tags.get(RESULTS_TAG)
    results = CycleResults.from_dict(json.loads(stored)) if stored else _results_from_old_tags(version.tags)
    return VersionRecord(str(version.version), dict(version.tags), model_tags, results)


@dataclass(frozen=True)
class ChampionFigures:
    """The current champion as its record tells it (what a challenger is compared with)."""

    version: str
    mean_acceptance_length: float | None
    speedup_c1: float | None
    label: str = ""  # ", external baseline <source>" for a published drafter's version


def version_figures(client: MlflowClient, name: str, ref: str) -> ChampionFigures | None:
    """A registered version named by alias or number, by its record; None when there is no such version."""
    try:
        version = (
            client.get_model_version(name, ref)
            if ref.isdigit()
            else client.get_model_version_by_alias(name, ref)
        )
    except MlflowException:
        return None
    record = read_version(client, version)
    results = record.results
    return ChampionFigures(
        version=record.version,
        mean_acceptance_length=results.mean_acceptance_length if results else None,
        speedup_c1=results.speedup.get(1) if results else None,
        label=f", external baseline {record.fact('source')}".rstrip() if record.external else "",
    )


def current_champion(client: MlflowClient, name: str) -> ChampionFigures | None:
    """The version the `champion` alias points at, by its record; None before the first champion."""
    return version_figures(client, name, CHAMPION_ALIAS)
