"""`draftloop run CONFIG [--set ...] [--until STAGE]`: a refusal creates nothing; --until stops there."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.commands.run import DEMO_CONFIG

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venvs" / "vllm" / "bin" / "python"


def _listing(folder: Path) -> list[tuple[str, str]]:
    """Every path under `folder` with its content hash (folders: "dir"): a byte-for-byte snapshot."""
    return sorted(
        (
            str(path.relative_to(folder)),
            "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in folder.rglob("*")
    )


@pytest.mark.parametrize(
    "args",
    [
        ["run", "bad.yaml"],  # training.lr: -1
        ["run", "missing.yaml"],
        ["run", str(DEMO_CONFIG), "--set", "training.epochs=0"],
        ["run", str(DEMO_CONFIG), "--set", "no-equals-sign"],
        ["run", str(DEMO_CONFIG), "--set", "engine.kind=no-such-engine"],
        ["demo", "--set", "extraction.aux_layer_ids=[1, 3, 99]"],
        ["run", str(DEMO_CONFIG), "--until", "deploy"],
    ],
)
def test_a_refused_config_exits_2_and_leaves_the_directory_as_it_was(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DRAFTLOOP_STATE_DIR", raising=False)  # state would land in ./.draftloop
    for key in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_LOGGING_LEVEL", "DRAFTLOOP_RAY_LOG_TO_DRIVER"):
        monkeypatch.delenv(key, raising=False)  # restored after the test, whatever the command sets
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["training"]["lr"] = -1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("untouched")
    before = _listing(tmp_path)

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 2, result.output
    assert "config error" in result.output or "--until: unknown stage 'deploy'" in result.output
    assert _listing(tmp_path) == before


@pytest.mark.slow
def test_until_synthesize_runs_only_that_stage(tmp_path: Path) -> None:
    """The real flow in a fresh directory: ephemeral Prefect, local Ray, SQLite MLflow under ./.draftloop."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["name"] = "cli-run"
    config["data"].update({"num_samples": 6, "eval_prompts": 2})
    config["synthesis"].update({"max_new_tokens": 8})
    config["engine"]["python"] = str(VLLM_PYTHON)
    (tmp_path / "cli-run.yaml").write_text(yaml.safe_dump(config))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PREFECT_", "DRAFTLOOP_", "MLFLOW_"))
    }
    done = subprocess.run(
        [sys.executable, "-m", "draftloop", "run", "cli-run.yaml", "--until", "synthesize"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

    state = tmp_path / ".draftloop"
    # the ephemeral Prefect's home, its database in it: the run's settings were read by Prefect
    assert (state / "prefect" / "prefect.db").is_file()
    runs = state / "runs" / "cli-run"
    assert sorted(path.name for path in runs.iterdir()) == ["cycles", "synthesize"]
    (manifest,) = runs.glob("synthesize/*/manifest.json")
    assert json.loads(manifest.read_text())["summary"]["rows"] > 0
    (summary_path,) = runs.glob("cycles/*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed"
    assert list(summary["stages"]) == ["synthesize"]
    markers = sorted(path.name for path in summary_path.parent.glob("stages/*"))
    assert markers == ["synthesize.done", "synthesize.running", "synthesize.started"]
