"""MLflow tracking, registry and gate (no engine, no flow): infra/registry/ against a real SQLite MLflow."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from fixtures_registry import drafter_card, fake_drafter

from draftloop.infra.evaluation.plots import plot_training_curves
from draftloop.infra.registry.gate import CHAMPION_ALIAS, CycleResults, evaluate_gate
from draftloop.infra.registry.models import register_drafter
from draftloop.infra.registry.runs import Tracker, flatten_params
from draftloop.infra.runtime.config import GateConfig


def _gate(**overrides: Any) -> GateConfig:
    fields: dict[str, Any] = {
        "min_speedup": None,
        "min_acceptance_length": 1.5,
        "require_consistency": True,
        "beat_champion": True,
    }
    fields.update(overrides)
    return GateConfig(**fields)


def _results(length: float, consistent: bool = True, speedup_c1: float = 0.8) -> CycleResults:
    rate = (length - 1) / 3
    return CycleResults(
        acceptance_rate=rate,
        mean_acceptance_length=length,
        per_position_acceptance=[min(1.0, rate * 1.5), rate, rate / 2],
        speedup={1: speedup_c1, 4: speedup_c1 * 0.9},
        throughput={1: 100.0, 4: 300.0},
        simulator_acceptance_rate=rate,
        consistent=consistent,
    )


@pytest.fixture()
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"), "test-tracking")


def _register(tracker: Tracker, tmp_path: Path, name: str, results: CycleResults, tag: str) -> object:
    with tracker.stage("register") as run:
        return register_drafter(
            tracker,
            run,
            name,
            _gate(),
            results,
            drafter_card("tiny", tag),
            fake_drafter(tmp_path / tag / "drafter"),
            serving_command=lambda drafter: f"serve {drafter}",
        )


def test_gate_promotes_passing_and_rejects_failing_drafters(tracker: Tracker, tmp_path: Path) -> None:
    tracker.start_cycle("cycle", {"a": 1}, {})
    name = "drafter-test"
    client = tracker.client

    first = _register(tracker, tmp_path, name, _results(2.2), "trained")
    assert first.champion and first.gate.passed  # type: ignore[attr-defined]
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == first.version  # type: ignore[attr-defined]
    version = client.get_model_version(name, first.version)  # type: ignore[attr-defined]
    assert "| mean acceptance length | 2.200 tokens/step |" in version.description
    assert "| speedup @ concurrency 1 | 0.800x" in version.description
    # The registered source is the logged model (MLmodel + the drafter folder), and it downloads; it
    # keeps the card's facts (the version keeps six short tags).
    logged = client.get_logged_model(first.model_id)  # type: ignore[attr-defined]
    assert logged.tags["data_hash"] == "trained" and "data_hash" not in version.tags
    assert json.loads(logged.tags["mlflow.modelVersions"]) == [{"name": name, "version": first.version}]  # type: ignore[attr-defined]
    assert version.source == logged.artifact_location
    local = Path(
        __import__("mlflow").artifacts.download_artifacts(
            artifact_uri=version.source, dst_path=str(tmp_path / "dl"), tracking_uri=tracker.tracking_uri
        )
    )
    assert (local / "MLmodel").exists() and (local / "drafter" / "config.json").exists()

    # An untrained drafter: acceptance length ~1 -> registered, tagged rejected, champion unchanged.
    untrained = _register(tracker, tmp_path, name, _results(1.02), "untrained")
    assert not untrained.champion  # type: ignore[attr-defined]
    rejected = client.get_model_version(name, untrained.version)  # type: ignore[attr-defined]
    assert rejected.tags["gate"] == "rejected" and rejected.tags["AL"] == "1.02"
    assert "min_acceptance_length" in rejected.description.splitlines()[0]
    reasons = client.get_logged_model(untrained.model_id).tags["gate_reasons"]  # type: ignore[attr-defined]
    assert "min_acceptance_length" in reasons
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == first.version  # type: ignore[attr-defined]

    # Above the threshold but below the champion: beat_champion rejects it.
    weaker = _register(tracker, tmp_path, name, _results(1.9), "weaker")
    assert not weaker.champion  # type: ignore[attr-defined]
    weaker_line = client.get_model_version(name, weaker.version).description.splitlines()[0]  # type: ignore[attr-defined]
    assert "does not beat champion v1's 2.20" in weaker_line and "AL 1.90 vs 2.20" in weaker_line

    # Inconsistent engine vs simulator: an integration fault, never promoted.
    faulty = _register(tracker, tmp_path, name, _results(3.0, consistent=False), "faulty")
    assert not faulty.champion  # type: ignore[attr-defined]

    better = _register(tracker, tmp_path, name, _results(2.6), "better")
    assert better.champion  # type: ignore[attr-defined]
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == better.version  # type: ignore[attr-defined]
    assert better.previous_champion == first.version  # type: ignore[attr-defined]


def test_gate_min_speedup_null_is_recorded_not_gated() -> None:
    not_gated = evaluate_gate(_gate(), _results(2.0, speedup_c1=0.5), champion_length=None)
    assert not_gated.passed
    assert any("not gated" in note for note in not_gated.notes)
    gated = evaluate_gate(_gate(min_speedup=1.1), _results(2.0, speedup_c1=0.5), champion_length=None)
    assert not gated.passed
    assert "min_speedup" in gated.reasons[0]
    fast = evaluate_gate(_gate(min_speedup=1.1), _results(2.0, speedup_c1=1.3), champion_length=None)
    assert fast.passed


def test_stage_failure_is_recorded_and_reraised(tracker: Tracker) -> None:
    parent = tracker.start_cycle("cycle", {}, {})
    with pytest.raises(RuntimeError, match="engine died"), tracker.stage("evaluate") as run:
        run_id = run.run_id
        raise RuntimeError("engine died")
    stage = tracker.client.get_run(run_id)
    assert stage.info.status == "FAILED"
    assert stage.data.tags["draftloop.status"] == "failed"
    assert stage.data.tags["mlflow.parentRunId"] == parent.run_id
    assert "error.txt" in [item.path for item in tracker.client.list_artifacts(run_id)]
    assert tracker.client.get_run(parent.run_id).data.tags["draftloop.failed_stage"] == "evaluate"


def test_metrics_params_and_plots(tracker: Tracker, tmp_path: Path) -> None:
    params = flatten_params({"training": {"lr": 0.003, "epochs": 2}, "evaluation": {"concurrency": [1, 4]}})
    assert params == {"training.lr": "0.003", "training.epochs": "2", "evaluation.concurrency": "[1, 4]"}
    history = [
        {"step": step, "loss": 5.0 - step, "acc_0": 0.1 * step, "acc_1": 0.05 * step} for step in range(4)
    ]
    with tracker.stage("train") as run:
        run.log_params(params)
        run.log_metric_history(history)
        run.log_artifact(plot_training_curves(history, tmp_path / "plots" / "training_curves.png"), "plots")
        run_id = run.run_id
    client = tracker.client
    losses = client.get_metric_history(run_id, "loss")
    assert [metric.value for metric in sorted(losses, key=lambda m: m.step)] == [5.0, 4.0, 3.0, 2.0]
    assert len(client.get_metric_history(run_id, "acc_1")) == 4
    assert client.get_run(run_id).data.params["training.lr"] == "0.003"
    plots = {Path(item.path).name for item in client.list_artifacts(run_id, "plots")}
    assert plots == {"training_curves.png"}
    assert (tmp_path / "plots" / "training_curves.png").stat().st_size > 1000


def test_cycle_results_are_frozen_and_read_back_from_their_json_shape() -> None:
    results = dataclasses.replace(
        _results(2.2), lossless=True, speedup_status={1: "ok", 4: "inconclusive: [0.9, 1.4]"}, recommended_k=3
    )
    shape = results.to_dict()
    assert list(shape) == [
        "acceptance_rate",
        "mean_acceptance_length",
        "per_position_acceptance",
        "speedup",
        "throughput",
        "simulator_acceptance_rate",
        "consistent",
        "lossless",
        "speedup_status",
        "recommended_k",
        "compared_engine_acceptance_rate",
        "simulator_unweighted_acceptance_rate",
    ]
    assert shape["speedup"] == {"1": 0.8, "4": 0.8 * 0.9}  # JSON object keys: concurrency as text
    stored = json.loads(json.dumps(shape))
    assert CycleResults.from_dict(stored) == results
    assert CycleResults.from_dict(stored).to_dict() == shape
    with pytest.raises(dataclasses.FrozenInstanceError):
        results.mean_acceptance_length = 3.0  # type: ignore[misc]
