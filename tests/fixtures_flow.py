"""Session fixtures for the flow tests: one Prefect test server, one small config, one shared cycle.

Imported by tests/conftest.py. The first cycle is run once per session and shared: the cache test
re-runs it, the full-cycle test reads its summary, the deployment test re-runs it through a worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venvs" / "vllm" / "bin" / "python"


@dataclass
class FlowEnv:
    workdir: Path
    config_path: Path
    api_url: str
    env: dict[str, str]  # what a subprocess needs to reach the same Prefect server and state


def small_config(workdir: Path, target_dir: Path) -> dict[str, Any]:
    """configs/tiny-llama.yaml shrunk so a whole cycle takes a few CPU minutes."""
    config: dict[str, Any] = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    config["name"] = "flow-test"
    config["target"]["path"] = str(target_dir)
    config["data"].update({"num_samples": 24, "eval_prompts": 4})
    config["synthesis"].update({"max_new_tokens": 32})
    config["extraction"].update({"samples_per_shard": 8})
    # The EAGLE 3.1 layer (fc_norm + norm_output): the session's cycles train and serve it; plain EAGLE-3
    # (the default) is the fault suite's and the engine tests' drafter.
    config["training"].update({"epochs": 2, "batch_size": 8, "ttt_length": 3, "drafter": "eagle3.1"})
    config["engine"]["python"] = str(VLLM_PYTHON)
    config["evaluation"].update({"max_tokens": 32, "concurrency": [1, 4]})
    config["storage"]["root"] = str(workdir / "runs")
    config["tracking"].update(
        {"mlflow_uri": f"sqlite:///{workdir}/mlflow.db", "artifact_root": str(workdir / "mlartifacts")}
    )
    return config


def drain_prefect_workers(timeout: float = 30) -> None:
    """Send what Prefect's events and API-log workers hold, and drop them. A worker outlives the server it
    was made for (the events worker is kept per client type, not per API URL): a test that runs a flow on
    a server of its own drains them before that server stops, and a test that reads its flow's records
    waits for them here, bounded (an unbounded wait hung CI for 25 minutes on a dead server's worker)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        worker.drain_all(timeout=timeout)


@pytest.fixture(scope="session")
def flow_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlowEnv]:
    """A Prefect test server and an isolated state folder for every flow test of the session."""
    workdir = tmp_path_factory.mktemp("flow")
    env = {
        "DRAFTLOOP_STATE_DIR": str(workdir / "state"),
        "PREFECT_HOME": str(workdir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }
    (workdir / "prefect").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        from prefect.settings import PREFECT_API_URL
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            api_url = str(PREFECT_API_URL.value())
            config_path = workdir / "flow-test.yaml"
            config_path.write_text(yaml.safe_dump(small_config(workdir, workdir / "models" / "tiny-llama")))
            yield FlowEnv(workdir, config_path, api_url, {**env, "PREFECT_API_URL": api_url})


def run_cycle_in_process(
    env: FlowEnv, overrides: dict[str, Any] | None = None, until: str = "register"
) -> tuple[dict[str, Any], float]:
    """Run the cycle up to `until` through the real flow; (summary, seconds)."""
    from draftloop.flows.train_and_eval import train_and_eval

    started = time.perf_counter()
    summary = train_and_eval(config_path=str(env.config_path), overrides=overrides or {}, until=until)
    return summary, time.perf_counter() - started


@pytest.fixture(scope="session")
def first_cycle(flow_env: FlowEnv) -> tuple[dict[str, Any], float]:
    """The session's one uncached cycle."""
    return run_cycle_in_process(flow_env)


@contextmanager
def local_services(flow_env: FlowEnv, state: Path) -> Iterator[dict[str, Any]]:
    """`draftloop up` for the session: a Prefect server with prefect.yaml deployed, a process worker and
    an MLflow server on the session's tracking store, its records under `state`. On exit every service
    is stopped by its recorded PID; after a passing body, each must have been alive until then."""
    from draftloop.infra.runtime.processes import is_alive
    from draftloop.infra.runtime.services import down, read_services, up

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTLOOP_STATE_DIR", str(state))
        services = up(
            REPO_ROOT,
            mlflow_uri=f"sqlite:///{flow_env.workdir}/mlflow.db",
            artifact_root=str(flow_env.workdir / "mlartifacts"),
        )
        try:
            yield services
        finally:
            recorded = read_services(REPO_ROOT)
            stopped = down(REPO_ROOT)
    assert set(stopped) == set(recorded) == {"prefect-server", "prefect-worker", "mlflow"}
    assert not [service.name for service in recorded.values() if is_alive(service.pid)]


def no_ray_left(pgid: int) -> list[str]:
    """Processes still alive in process group `pgid` (what a SIGKILL test must not leave behind)."""
    alive = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:120]!r}")
    return alive


def subprocess_env(env: FlowEnv) -> dict[str, str]:
    return {**os.environ, **env.env}
