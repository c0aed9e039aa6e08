"""The cycle's MLflow parent run as a person reads it (infra/registry/cycle_run.py), on a SQLite store:
its description, Source and Prefect link, its runs-table columns and plots; the links both ways; and
tracking through `draftloop up`'s MLflow server only when it serves the same file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NOTE, MLFLOW_SOURCE_NAME

from draftloop.infra.registry.cycle_run import (
    PREFECT_FLOW_RUN_TAG,
    CycleRecord,
    mlflow_ui_links,
    publish_cycle_run,
    source_tags,
)
from draftloop.infra.registry.runs import Tracker
from draftloop.infra.runtime.mlflow_landing import landing_page
from draftloop.infra.runtime.services import Service, served_tracking_uri

PREFECT_RUN = "http://127.0.0.1:4200/runs/flow-run/abc"


def _summary(**changes: Any) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "config": "tiny-llama",
        "status": "completed",
        "verdict": "ok",
        "acceptance_rate": 0.412345,
        "mean_acceptance_length": 2.23712,
        "speedup": {"1": 0.66056, "4": 1.8093},
        "speedup_status": {"1": "inconclusive: interval [0.38, 1.33] contains 1.0", "4": "ok"},
        "registered_model": {
            "name": "drafter-tiny-llama",
            "version": "2",
            "alias_status": "rejected",
            "verdict": "AL 2.24 · 0.66x @ c=1 (inconclusive) · rejected",
        },
        "stages": {name: {"uri": f"/runs/{name}/k"} for name in ("synthesize", "train", "register")},
    }
    summary.update(changes)
    return summary


def test_a_whole_cycle_run_reads_verdict_figures_links_and_columns(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"), "cycle-run")
    run = tracker.start_cycle("c", {}, source_tags("train-and-eval/train-and-eval", PREFECT_RUN))
    links = mlflow_ui_links("http://127.0.0.1:5000", "1", "r1", "drafter-tiny-llama", "2", PREFECT_RUN)
    record = CycleRecord.from_summary(_summary(), "register", links)
    publish_cycle_run(tracker, run, record, [("loss.png", b"\x89PNG fake"), ("speedup.png", b"\x89PNG")])

    stored = tracker.client.get_run(run.run_id).data
    description = stored.tags[MLFLOW_RUN_NOTE]
    assert description.splitlines()[0] == "**AL 2.24 · 0.66x @ c=1 (inconclusive) · rejected**"
    assert "AL 2.24 · acceptance 41.2 % · 0.66x @ c=1 (inconclusive)" in description
    assert (
        "[drafter-tiny-llama v2](http://127.0.0.1:5000/#/models/drafter-tiny-llama/versions/2)" in description
    )
    assert f"Prefect flow run: [{PREFECT_RUN}]({PREFECT_RUN})" in description
    assert "Produced:" not in description  # a whole cycle's outputs are the version
    assert stored.tags[PREFECT_FLOW_RUN_TAG] == PREFECT_RUN
    assert stored.tags[MLFLOW_SOURCE_NAME] == "train-and-eval/train-and-eval"
    assert stored.tags["mlflow.source.type"] == "JOB"
    assert len(stored.tags["mlflow.source.git.commit"]) == 40
    assert stored.metrics["mean_acceptance_length"] == 2.24
    assert stored.metrics["acceptance_pct"] == 41.2
    assert (stored.metrics["speedup_c1"], stored.metrics["speedup_c4"]) == (0.66, 1.81)
    assert stored.tags["gate"] == "rejected" and stored.tags["verdict"].startswith("AL 2.24")
    plots = {item.path for item in tracker.client.list_artifacts(run.run_id, "plots")}
    assert plots == {"plots/loss.png", "plots/speedup.png"}


def test_a_partial_run_says_what_it_produced_and_where(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"), "cycle-run")
    run = tracker.start_cycle("c", {}, {})
    stages = {"synthesize": {"uri": "/runs/x/synthesize/k1"}, "extract": {"uri": "/runs/x/extract/k2"}}
    summary = _summary(registered_model=None, verdict=None, stages=stages, speedup={})
    summary.update(acceptance_rate=None, mean_acceptance_length=None)
    publish_cycle_run(
        tracker, run, CycleRecord.from_summary(summary, "register", mlflow_ui_links("", "", None)), []
    )
    stored = tracker.client.get_run(run.run_id).data
    description = stored.tags[MLFLOW_RUN_NOTE]
    assert description.startswith("**Partial cycle** of `tiny-llama`, up to extract")
    assert "- synthesize: `/runs/x/synthesize/k1`" in description
    assert "- extract: `/runs/x/extract/k2`" in description
    assert stored.tags["verdict"] == "partial: up to extract" and "gate" not in stored.tags


def test_links_exist_only_behind_an_mlflow_server() -> None:
    assert mlflow_ui_links("sqlite:///x.db", "1", "r").mlflow_rows() == {}
    rows = mlflow_ui_links("http://h:5000/", "1", "r", "m", "3").mlflow_rows()
    assert rows == {
        "MLflow run": "http://h:5000/#/experiments/1/runs/r",
        "MLflow model version": "http://h:5000/#/models/m/versions/3",
        "MLflow model": "http://h:5000/#/models/m",
    }


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_tracking_goes_through_ups_server_only_for_the_file_it_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answering_server: str
) -> None:
    import os

    monkeypatch.setenv("DRAFTLOOP_STATE_DIR", str(tmp_path / "state"))
    served = tmp_path / "mlflow.db"
    record = Service("mlflow", os.getpid(), answering_server, "m.log", store=f"sqlite:///{served}")
    (tmp_path / "state" / "services").mkdir(parents=True)
    (tmp_path / "state" / "services" / "mlflow.json").write_text(json.dumps(record.__dict__))
    assert served_tracking_uri(f"sqlite:///{served}") == answering_server
    assert served_tracking_uri(f"sqlite:///{tmp_path}/other.db") is None
    assert served_tracking_uri("http://elsewhere:5000") is None
    dead = Service("mlflow", 0, answering_server, "m.log", store=f"sqlite:///{served}")
    (tmp_path / "state" / "services" / "mlflow.json").write_text(json.dumps(dead.__dict__))
    assert served_tracking_uri(f"sqlite:///{served}") is None  # a server `up` started that is gone


def test_the_root_page_opens_model_training_on_the_experiment() -> None:
    page = landing_page("<html><head><title>MLflow</title></head></html>", "4")
    script = page.split("<head>", 1)[1].split("<title>", 1)[0]
    defaults = json.loads(script.split("var defaults=", 1)[1].split(";", 1)[0])
    assert json.loads(defaults["mlflow.workflowType_v1"]) == "machine_learning"
    assert json.loads(defaults["mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"]) is True
    view = json.loads(defaults['MLflowLocalStorage-1.1-ExperimentPage-["4"]-ReactComponentState'])
    assert "metrics.`mean_acceptance_length`" in view["selectedColumns"]
    assert (
        "if(!localStorage.getItem(key))localStorage.setItem(key,defaults[key])" in script
    )  # a browser's own choice is kept
    assert 'var route="#/experiments/4/runs"' in script
    assert "var route=null" in landing_page("<head></head>", None)
