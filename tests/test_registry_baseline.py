"""A published drafter registered as an external baseline (`diagnose --register`), shown on the leaderboard
beside trained versions, and a gate that requires a trained drafter to beat it (`evaluation.gate.beat`).
Against a real SQLite MLflow; the diagnosis is given (the diagnoses themselves: tests/test_engine_vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures_registry import drafter_card, fake_drafter

from draftloop.infra.evaluation.diagnose import Diagnosis, FolderReading, Reading, ReadingFigures
from draftloop.infra.registry.external import register_external
from draftloop.infra.registry.gate import CHAMPION_ALIAS, CycleResults, version_figures
from draftloop.infra.registry.models import register_drafter
from draftloop.infra.registry.runs import Tracker
from draftloop.infra.runtime.config import GateConfig

NAME = "drafter-tiny"


@pytest.fixture()
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"), "test-baselines")


def _diagnosis(folder: Path, length: float) -> Diagnosis:
    rate = (length - 1) / 3
    reading = Reading("vllm reads [1, 3, 5] as layer_input", (1, 3, 5), engine_reads=True, trained=True)
    return Diagnosis(
        verdict="ok",
        reasons=[],
        folder=FolderReading(str(folder), "speculators", [1, 3, 5], None, "speculators format"),
        engine={"acceptance_rate": rate, "mean_acceptance_length": length, "per_position": []},
        simulator={"acceptance_rate": rate, "mean_acceptance_length": length, "per_position": []},
        readings=[ReadingFigures(reading, rate, length, [])],
        speedup={"1": {"speedup": 1.25, "status": "ok"}},
        served_command="vllm serve ...",
    )


def _trained(tracker: Tracker, tmp_path: Path, length: float, tag: str, gate: GateConfig) -> object:
    rate = (length - 1) / 3
    results = CycleResults(
        acceptance_rate=rate, mean_acceptance_length=length, speedup={1: 1.1}, consistent=True, lossless=True
    )
    with tracker.stage("register") as run:
        return register_drafter(
            tracker, run, NAME, gate, results, drafter_card("tiny", tag),
            fake_drafter(tmp_path / tag / "drafter"), serving_command=lambda drafter: f"serve {drafter}",
        )  # fmt: skip


def test_an_external_baseline_is_listed_and_a_gate_can_require_beating_it(
    tracker: Tracker, tmp_path: Path
) -> None:
    published = fake_drafter(tmp_path / "published")
    baseline = register_external(tracker, NAME, _diagnosis(published, 2.40), "vllm", 3, alias="baseline")
    client = tracker.client
    version = client.get_model_version(NAME, baseline.version)
    assert version.tags == {
        "engine": "vllm",
        "AL": "2.40",
        "speedup_c1": "1.25x",
        "gate": "external baseline",
        "target": "",
        "variant": "unknown",
    }
    assert version.description.startswith("AL 2.40 · 1.25x @ c=1 · vLLM · external baseline: ok")
    logged = client.get_logged_model(baseline.model_id).tags
    assert logged["external"] == "true" and logged["source"] == str(published) and logged["verdict"] == "ok"
    assert str(client.get_model_version_by_alias(NAME, "baseline").version) == baseline.version
    figures = version_figures(client, NAME, "baseline")
    assert (
        figures is not None and figures.mean_acceptance_length == 2.4 and "external baseline" in figures.label
    )

    gate = GateConfig(min_acceptance_length=1.5, beat="baseline")
    weaker = _trained(tracker, tmp_path, 2.10, "weaker", gate)
    assert not weaker.champion  # type: ignore[attr-defined]
    rejected = client.get_model_version(NAME, weaker.version)  # type: ignore[attr-defined]
    assert rejected.tags["gate"] == "rejected"
    reason = rejected.description.splitlines()[0]
    assert "does not beat 'baseline'" in reason and "2.40" in reason, reason
    better = _trained(tracker, tmp_path, 2.70, "better", gate)
    assert better.champion  # type: ignore[attr-defined]
    assert str(client.get_model_version_by_alias(NAME, CHAMPION_ALIAS).version) == better.version  # type: ignore[attr-defined]

    # The leaderboard: the baseline's row beside the trained ones, marked external, never champion.
    board = client.get_registered_model(NAME).description
    rows = {line.split(" | ")[0].strip("| "): line for line in board.splitlines() if line.startswith("| v")}
    assert "external baseline" in rows[f"v{baseline.version}"] and "2.40" in rows[f"v{baseline.version}"]
    assert "champion" in rows[f"v{better.version}"]  # type: ignore[attr-defined]
    assert "rejected" in rows[f"v{weaker.version}"]  # type: ignore[attr-defined]


def test_a_gate_naming_a_missing_version_rejects_by_name(tracker: Tracker, tmp_path: Path) -> None:
    result = _trained(tracker, tmp_path, 2.5, "lonely", GateConfig(beat="baseline"))
    assert not result.champion  # type: ignore[attr-defined]
    reasons = result.gate.reasons  # type: ignore[attr-defined]
    assert reasons == ["evaluation.gate.beat: no registered version 'baseline' to compare with"]
