"""Stage cache keys and committed-manifest lookup (fast: no Ray, no Prefect, no engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.tasks import evaluate, extract, synthesize, train
from draftloop.tasks.cache import cache_key, find_committed, run_cached, stage_uri

REPO_ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path, **overrides: Any) -> ExperimentConfig:
    base = {"storage.root": str(tmp_path / "runs"), "target.path": str(tmp_path / "target")}
    return ExperimentConfig.load(
        REPO_ROOT / "configs" / "tiny-llama.yaml", {**base, **overrides}, check_environment=False
    )


def _keys(config: ExperimentConfig, upstream: Any) -> dict[str, str]:
    """Each stage's key from its declaration, every input given the same upstream manifest (the
    synthesize stage's own file fingerprints left out: this target folder does not exist)."""
    keys = {"synthesize": cache_key("synthesize", config, synthesize.STAGE.sections, {})[0]}
    for stage in (extract.STAGE, train.STAGE, evaluate.STAGE):
        inputs = {name: upstream for name in stage.inputs}
        keys[stage.name] = cache_key(stage.name, config, stage.sections, inputs, stage.key_fields(config))[0]
    return keys


class _Manifest:
    def __init__(self, digest: str) -> None:
        self.digest = digest

    def content_hash(self) -> str:
        return self.digest


def test_keys_follow_exactly_the_inputs_a_stage_reads(tmp_path: Path) -> None:
    upstream = _Manifest("a" * 64)
    base = _keys(_config(tmp_path), upstream)
    assert base == _keys(_config(tmp_path), upstream)  # deterministic

    lr = _keys(_config(tmp_path, **{"training.lr": 1e-3}), upstream)
    assert lr["train"] != base["train"]
    assert (lr["synthesize"], lr["extract"], lr["evaluate"]) == (
        base["synthesize"],
        base["extract"],
        base["evaluate"],
    )

    k = _keys(_config(tmp_path, **{"engine.num_speculative_tokens": 5}), upstream)
    assert k["evaluate"] != base["evaluate"]
    assert k["train"] == base["train"]  # training does not depend on how many tokens are drafted

    samples = _keys(_config(tmp_path, **{"data.num_samples": 32}), upstream)
    assert samples["synthesize"] != base["synthesize"]

    other_data = _keys(_config(tmp_path), _Manifest("b" * 64))
    assert other_data["synthesize"] == base["synthesize"]
    assert other_data["extract"] != base["extract"]
    assert other_data["train"] != base["train"]


def test_only_a_committed_manifest_with_the_same_key_is_a_cache_hit(tmp_path: Path) -> None:
    from draftloop.infra.runtime.storage import DatasetWriter

    config = _config(tmp_path)
    calls: list[str] = []

    def body(work: Any) -> Any:
        calls.append(work.key)
        writer = DatasetWriter(work.uri)
        writer.write_shard("registration.json", b"{}", rows=1)
        return writer.commit("register", inputs=work.inputs, summary={"n": len(calls)})

    first = run_cached("register", config, ("tracking",), {}, body)
    second = run_cached("register", config, ("tracking",), {}, body)
    assert not first.cache_hit and second.cache_hit
    assert calls == [first.key]
    assert second.manifest.summary == {"n": 1}
    assert find_committed(stage_uri(config, "register", first.key), "another-key") is None

    # A stage that died before its commit left no manifest: the next run redoes it.
    def dies(work: Any) -> Any:
        writer = DatasetWriter(work.uri)
        writer.write_shard("partial.json", b"{}", rows=1)
        raise RuntimeError("killed")

    changed = _config(tmp_path, **{"tracking.experiment": "other"})
    with pytest.raises(RuntimeError, match="killed"):
        run_cached("register", changed, ("tracking",), {}, dies)
    redone = run_cached("register", changed, ("tracking",), {}, body)
    assert not redone.cache_hit


def test_cancellation_hook_stops_recorded_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """on_cancellation/on_crashed: processes a cycle recorded (engine servers, Ray) are stopped by PID."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from draftloop.flows.cycle import stop_started_resources
    from draftloop.tasks.cycle import CycleContext

    monkeypatch.setenv("DRAFTLOOP_STATE_DIR", str(tmp_path / "state"))
    config = _config(tmp_path)
    # A stand-in for an engine server: its own process group, with a child, like vLLM's API server.
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen(['sleep', '300']); time.sleep(300)",
        ],
        start_new_session=True,
    )
    ctx = CycleContext(config=config, run_id="run-1", tracker=None, run_uri=str(tmp_path / "run"))
    ctx.pids.add("engine-baseline", [server.pid])
    assert server.poll() is None
    stop_started_resources(None, SimpleNamespace(id="run-1"), None)
    assert server.wait(timeout=15) is not None
    # The whole group went, and the record is gone (a second hook call is a no-op).
    group_alive = subprocess.run(
        ["pgrep", "-g", str(server.pid)], capture_output=True, text=True
    ).stdout.strip()
    assert group_alive == ""
    assert not ctx.pids.path.exists()
    stop_started_resources(None, SimpleNamespace(id="run-1"), None)


def test_only_transient_failures_are_retried() -> None:
    from draftloop.infra.engines.server import EngineStartError
    from draftloop.tasks.retry import is_transient

    def raised_from(cause: BaseException) -> BaseException:
        try:
            try:
                raise cause
            except BaseException as inner:
                raise RuntimeError("stage body failed") from inner
        except RuntimeError as outer:
            return outer

    assert is_transient(raised_from(ConnectionError("S3 went away")))
    # The MLflow server killed mid-response: the client's requests error, not a refused connection.
    import urllib3.exceptions

    assert is_transient(raised_from(urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead")))
    assert is_transient(EngineStartError("not ready within 600 s"))  # may come up next time
    assert not is_transient(EngineStartError("died", pattern="unsupported model type"))  # never will
    assert not is_transient(raised_from(ValueError("a bug")))
    assert not is_transient(None)


_CONCURRENT_RUN = """
import json, sys, time
from pathlib import Path
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import DatasetWriter
from draftloop.tasks.cache import run_cached

config_path, root, counter = sys.argv[1:4]
config = ExperimentConfig.load(config_path, {"storage.root": root}, check_environment=False)

def body(work):
    with open(counter, "a") as handle:
        handle.write(work.key + "\\n")
    time.sleep(3)  # long enough for the other run to arrive while this one holds the stage
    writer = DatasetWriter(work.uri)
    writer.write_shard("registration.json", b"{}", rows=1)
    return writer.commit("register", inputs=work.inputs)

outcome = run_cached("register", config, ("tracking",), {}, body)
print(json.dumps({"hit": outcome.cache_hit, "hash": outcome.manifest.content_hash()}))
"""


def test_two_concurrent_runs_of_one_config_produce_a_stage_once(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    counter = tmp_path / "bodies.txt"
    env = {**os.environ, "DRAFTLOOP_STATE_DIR": str(tmp_path / "state"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    args = [str(REPO_ROOT / "configs" / "tiny-llama.yaml"), str(tmp_path / "runs"), str(counter)]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_RUN, *args], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [json.loads(run.communicate(timeout=120)[0].strip().splitlines()[-1]) for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert len(counter.read_text().splitlines()) == 1  # the second run waited, then found the output
    assert sorted(o["hit"] for o in outputs) == [False, True]
    assert outputs[0]["hash"] == outputs[1]["hash"]
