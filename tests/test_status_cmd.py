"""`draftloop status`: recent cycles read back from a real SQLite MLflow written through the Tracker."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.commands.status import recent_cycles
from draftloop.infra.registry.runs import Tracker

REPO_ROOT = Path(__file__).resolve().parents[1]


def _summary(
    status: str,
    length: float,
    speedup_c1: float,
    registered: dict[str, Any] | None,
    verdict: str = "lossless_consistent",
    flag: str = "ok",
) -> dict[str, Any]:
    """The keys of flows/cycle.py build_summary that `status` shows."""
    return {
        "status": status,
        "verdict": verdict,
        "mean_acceptance_length": length,
        "speedup": {"1": speedup_c1, "4": speedup_c1 * 0.9},
        "speedup_status": {"1": flag, "4": "ok"},
        "registered_model": registered,
    }


def _cycle(tracker: Tracker, name: str, summary: dict[str, Any] | None, end: str | None, until: str) -> None:
    run = tracker.start_cycle(name, {"data.num_samples": 8}, {"draftloop.until": until})
    if summary is not None:
        run.log_dict(summary, "summary.json")
    if end is not None:
        tracker.end_cycle(end)
    time.sleep(0.02)  # distinct start times: the listing is newest first


@pytest.fixture(scope="module")
def status_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny-llama.yaml tracking into a throwaway SQLite store (made once: its schema takes
    seconds), with three cycles recorded."""
    tmp_path = tmp_path_factory.mktemp("status")
    config: dict[str, Any] = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    config["tracking"].update(
        {
            "mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db",
            "artifact_root": str(tmp_path / "mlartifacts"),
            "experiment": "status-test",
        }
    )
    path = tmp_path / "status.yaml"
    path.write_text(yaml.safe_dump(config))
    tracker = Tracker(config["tracking"]["mlflow_uri"], config["tracking"]["artifact_root"], "status-test")
    champion = {
        "name": "drafter-tiny",
        "version": "1",
        "champion": True,
        "gate": {"passed": True, "reasons": []},
    }
    rejected = {
        "name": "drafter-tiny",
        "version": "2",
        "champion": False,
        "gate": {
            "passed": False,
            "reasons": ["mean acceptance length 1.900 does not beat the champion's 2.240"],
        },
    }
    # Names as the flow gives them (config + run id), a long reason, a flagged speedup: realistic widths.
    weak = {
        "name": "drafter-tiny",
        "version": "3",
        "champion": False,
        "gate": {"passed": False, "reasons": [
            "mean acceptance length 1.06 < min_acceptance_length 1.5",
            "speedup at concurrency 1 (0.77x) is flagged: inconclusive: speedup interval [0.40, 1.30] "
            "contains 1.0",
        ]},
    }  # fmt: skip
    _cycle(
        tracker,
        "tiny-llama-1a2b3c4d",
        _summary("completed", 2.2413, 1.8765, champion),
        "FINISHED",
        "register",
    )
    _cycle(tracker, "tiny-llama-5e6f7a8b", _summary("completed", 1.9, 1.2, rejected), "FINISHED", "register")
    flagged = _summary(
        "completed", 1.06, 0.77, weak, "numeric_mode_mismatch", "inconclusive: interval [0.40, 1.30]"
    )
    _cycle(tracker, "tiny-llama-9c0d1e2f", flagged, "FINISHED", "register")
    _cycle(tracker, "tiny-llama-3a4b5c6d", None, None, "train")  # still running: no summary yet
    return path


def test_status_lists_cycles_newest_first_with_verdicts(status_config: Path) -> None:
    rows = recent_cycles(f"sqlite:///{status_config.parent}/mlflow.db", "status-test", limit=10)
    assert rows is not None
    assert [row.name for row in rows] == [
        "tiny-llama-3a4b5c6d",
        "tiny-llama-9c0d1e2f",
        "tiny-llama-5e6f7a8b",
        "tiny-llama-1a2b3c4d",
    ]
    running, weak, rejected, champion = rows
    assert weak.speedup_c1 == "0.77x (inconclusive)"
    assert (running.status, running.verdict, running.acceptance_length) == ("running", "-", "-")
    assert running.gate == "not registered (until train)"
    assert (champion.status, champion.verdict) == ("finished", "lossless_consistent")
    assert (champion.acceptance_length, champion.speedup_c1) == ("2.24", "1.88x")
    assert (champion.model_version, champion.gate) == ("drafter-tiny v1", "passed: champion")
    assert (rejected.acceptance_length, rejected.speedup_c1) == ("1.90", "1.20x")
    assert rejected.gate == "rejected: mean acceptance length 1.900 does not beat the champion's 2.240"


def test_status_command_prints_the_table_and_honours_limit(status_config: Path) -> None:
    result = CliRunner().invoke(
        app, ["status", "--config", str(status_config), "--limit", "3"], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    assert "tiny-llama-3a4b5c6d" in result.output and "tiny-llama-5e6f7a8b" in result.output
    assert "tiny-llama-1a2b3c4d" not in result.output  # the fourth newest is past --limit 3
    assert "versions of drafter-tiny" in result.output and "1.90" in result.output


def test_status_fits_80_columns_one_line_per_cycle(status_config: Path) -> None:
    result = CliRunner().invoke(app, ["status", "--config", str(status_config)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    print(result.output)
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    rows = {name: [line for line in lines if line.startswith(("1", "0")) and name in line] for name in (
        "tiny-llama-1a2b3c4d", "tiny-llama-5e6f7a8b", "tiny-llama-9c0d1e2f", "tiny-llama-3a4b5c6d"
    )}  # fmt: skip
    assert all(len(found) == 1 for found in rows.values()), rows  # each cycle's cells on one line
    (champion,) = rows["tiny-llama-1a2b3c4d"]
    assert champion.split()[3:] == ["lossless_consistent", "2.24", "1.88x", "v1", "champion"]
    (weak,) = rows["tiny-llama-9c0d1e2f"]
    assert weak.split()[3:] == ["numeric_mode_mismatch", "1.06", "0.77x*", "v3", "rejected"]
    (running,) = rows["tiny-llama-3a4b5c6d"]
    assert running.split()[3:] == ["running", "-", "-", "-", "-"]
    # What the cells leave out: the reasons and the flag, in notes under the table, whole.
    notes = " ".join(line.strip() for line in lines if not line.startswith(("1", "0")))
    assert (
        "tiny-llama-5e6f7a8b: rejected: mean acceptance length 1.900 does not beat the champion's 2.240"
        in notes
    )
    assert "tiny-llama-9c0d1e2f: speedup @ c=1 inconclusive, not a figure to act on" in notes
    assert "speedup interval [0.40, 1.30] contains 1.0" in notes


def test_status_refuses_a_missing_config_with_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = CliRunner().invoke(app, ["status", "--config", str(missing)])
    assert result.exit_code == 2
    assert f"config error: {missing}: no such file" in result.output


def test_status_on_an_empty_store_says_so_without_creating_it(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/absent.db"
    result = CliRunner().invoke(app, ["status", "--tracking-uri", uri])
    assert result.exit_code == 0, result.output
    assert "no cycles recorded yet" in result.output
    assert not (tmp_path / "absent.db").exists()
