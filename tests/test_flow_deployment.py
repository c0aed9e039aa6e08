"""`draftloop up` + `prefect deployment run`: the cycle through a real local Prefect server and worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures_flow import REPO_ROOT, FlowEnv, local_services

pytestmark = pytest.mark.slow


def test_deployment_run_completes_the_cycle(
    flow_env: FlowEnv,
    first_cycle: tuple[dict[str, Any], float],
    tmp_path: Path,
) -> None:
    from draftloop.infra.runtime.services import read_services

    first, _ = first_cycle
    config_uri = first["run_folder"]
    with local_services(flow_env, tmp_path / "state") as services:
        assert set(services) == {"prefect-server", "prefect-worker", "mlflow"}
        recorded = read_services(REPO_ROOT)
        assert {name: svc.pid for name, svc in recorded.items()} == {n: s.pid for n, s in services.items()}
        api = f"{services['prefect-server'].url}/api"
        env = {
            **flow_env.env,
            "PREFECT_API_URL": api,
            "DRAFTLOOP_STATE_DIR": flow_env.env["DRAFTLOOP_STATE_DIR"],
        }
        prefect = str(Path(sys.executable).parent / "prefect")
        params = json.dumps({"config_path": str(flow_env.config_path)})
        done = subprocess.run(
            [prefect, "deployment", "run", "train-and-eval/train-and-eval", "--params", params, "--watch"],
            env={**os.environ, **env, "COLUMNS": "1000"},  # rich wraps at the width
            cwd=str(REPO_ROOT),
            capture_output=True,
            text=True,
            timeout=480,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert "Completed" in output, output[-3000:]
        # --watch shows the last log line: the links into the MLflow server `up` started (its SQLite file).
        # (rich breaks a long line at its spaces: read the words)
        words = " ".join(output.split())
        assert f"MLflow run: {services['mlflow'].url}/#/experiments/" in words, output[-3000:]
        assert f"MLflow model version: {services['mlflow'].url}/#/models/" in words, output[-3000:]
        # The worker's run wrote its summary next to the session's first cycle: every stage a cache hit.
        cycles = Path(config_uri).parent
        summaries = sorted(cycles.glob("*/summary.json"), key=lambda path: path.stat().st_mtime)
        latest = json.loads(summaries[-1].read_text())
        assert latest["status"] == "completed"
        assert sorted(latest["cache_hits"]) == sorted(first["stages"])
