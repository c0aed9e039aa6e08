"""Fault suite: a run that dies costs nothing but time, and nothing half-written is ever read.

Each test injects real faults and records what it saw in one ledger; the module's last test prints
`faults tried: N, runs completed after them: N, rows lost: 0, partial artifacts read: 0`.

- The driver (`draftloop run CONFIG --until ...`, a subprocess) is SIGKILLed while synthesize, extract and
  train run; the next run resumes (training from its last checkpoint), reproduces the uninterrupted
  reference run's shards and drafter, and no process of a killed run is left.
- The baseline engine server (a real vLLM) is killed during evaluation: the stage fails with the error,
  Prefect retries it, the retry succeeds.
- The MLflow server is stopped at registration: the run fails, the next run reuses every finished stage
  and registers the drafter once.
- The S3 endpoint (a moto server process) is stopped mid-upload and restarted: the write is retried with
  backoff and no reader ever sees a partial object.
- The disk fills up during extraction (a small tmpfs): a clear error, nothing committed; with room again
  the same write commits.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from fault_harness import (
    ByteCountingRelay,
    Driver,
    FaultLedger,
    descendants,
    driver_env,
    lost_rows,
    manifests,
    mlflow_server,
    moto_server,
    new_markers,
    partial_artifacts_used,
    processes_naming,
    ray_train_workers,
    recorded_pids,
    restartable,
    rows_unaccounted,
    shard_hashes,
    start_driver,
    still_running,
    uncommitted_files,
    wait_for,
)
from fixtures_flow import FlowEnv
from moto_s3 import DUMMY_CREDENTIALS

from draftloop.infra.runtime.storage import (
    DatasetWriter,
    ManifestNotFoundError,
    read_manifest,
    read_shard,
    storage_options,
)
from draftloop.infra.training.worker import CHECKPOINT_DONE
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import pack_hidden_shard, shard_chunks, shard_metadata

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venvs" / "vllm" / "bin" / "python"
NAME = "faults"
DRAFTER_FILES = ("config.json", "model.safetensors")
# MLflow's client retries a refused request 7 times over minutes by default; a stopped server should
# fail the stage in seconds here (Prefect then retries the stage).
FAST_MLFLOW_CLIENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}

LEDGER = FaultLedger()


@pytest.fixture(scope="module")
def ledger() -> FaultLedger:
    return LEDGER


# ---------------------------------------------------------------------------------------------
# The driver: SIGKILL in synthesize, extract, train; engine killed in evaluate; MLflow at register


def _config(workdir: Path, mlflow_url: str) -> Path:
    """configs/tiny-llama.yaml at its smallest: 6 conversations of 8 tokens, 6 one-sample training steps
    (a checkpoint after each), one concurrency level of 8 tokens, no warm-up or repeats."""
    config: dict[str, Any] = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    config["name"] = NAME
    config["target"]["path"] = str(workdir / ".draftloop" / "models" / "tiny-llama")
    config["data"].update({"num_samples": 6, "eval_prompts": 2})
    config["synthesis"].update({"max_new_tokens": 8})
    config["extraction"].update({"samples_per_shard": 2})
    config["training"].update(
        {"epochs": 1, "batch_size": 1, "ttt_length": 2, "checkpoint_every_steps": 1, "held_out_samples": 1}
    )
    config["engine"].update({"python": str(VLLM_PYTHON), "max_model_len": 256})
    config["evaluation"].update(
        {
            "max_tokens": 8,
            "concurrency": [1],
            "repeats": 1,
            "min_output_tokens": 0,
            "min_seconds": 0,
            "warmup_rounds": 0,
        }
    )
    config["storage"]["root"] = str(workdir / "runs")
    config["tracking"].update({"mlflow_uri": mlflow_url, "artifact_root": str(workdir / "mlartifacts")})
    path = workdir / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Chain:
    """The runs of one working folder, each started as a user would, and what they left."""

    def __init__(self, workdir: Path, config: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.config = config
        self.env = env
        self.state = workdir / ".draftloop"
        self.root = workdir / "runs"
        self.cycles = self.root / NAME / "cycles"
        self.runs = 0
        self.left_by_kills: dict[str, tuple[int, int, int]] = {}
        self.killed_processes: dict[str, dict[int, int | None]] = {}

    def known_runs(self) -> set[str]:
        return {path.name for path in self.cycles.glob("*")}

    def start(self, until: str, env: dict[str, str] | None = None) -> tuple[Driver, set[str]]:
        known = self.known_runs()
        self.runs += 1
        return start_driver(self.workdir, self.config, until, f"run-{self.runs}", env or self.env), known

    def complete(self, until: str, timeout_s: float = 900) -> tuple[Driver, dict[str, Any]]:
        driver, known = self.start(until)
        code = driver.wait(timeout_s)
        assert code == 0, driver.output()[-4000:]
        (summary_path,) = [
            path for path in self.cycles.glob("*/summary.json") if path.parent.name not in known
        ]
        return driver, json.loads(summary_path.read_text())

    def kill_in(self, stage: str, ready: Any, env: dict[str, str] | None = None) -> Driver:
        """Start a run up to train, wait until `stage` runs and `ready()` holds, SIGKILL its driver."""
        driver, known = self.start("train", env)
        wait_for(lambda: new_markers(self.cycles, known, f"{stage}.running"), driver, 300, f"{stage} running")
        wait_for(ready, driver, 300, f"{stage} far enough to kill")
        processes = {**descendants(driver.process.pid), **recorded_pids(self.state)}
        driver.kill()
        assert not new_markers(self.cycles, known, f"{stage}.done"), f"{stage} finished before the kill"
        self.killed_processes[stage] = processes
        self.left_by_kills.update(uncommitted_files(self.root))
        return driver


def _stage_manifest(root: Path, stage: str) -> Any:
    found = [manifest for where, manifest in manifests(root).items() if where.split("/")[0] == stage]
    assert len(found) == 1, f"{stage}: {len(found)} committed datasets"
    return found[0]


def _results(root: Path) -> dict[str, dict[str, str]]:
    """What the deterministic stages produced: their shards' hashes (and the drafter's files)."""
    return {
        "synthesize": shard_hashes(_stage_manifest(root, "synthesize")),
        "extract": shard_hashes(_stage_manifest(root, "extract")),
        "train": shard_hashes(_stage_manifest(root, "train"), list(DRAFTER_FILES)),
    }


def _baseline_server(target: Path) -> list[int]:
    """The baseline vLLM server of this test's target (the one started without a drafter)."""
    found = []
    for pid in processes_naming(str(target)):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"vllm.entrypoints.openai.api_server" in command and b"--speculative-config" not in command:
            found.append(pid)
    return found


def _port_of(pid: int) -> int:
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(command[command.index(b"--port") + 1])


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _checkpoint_written(state: Path) -> bool:
    return any(state.glob(f"work/{NAME}/train/*/step-*/{CHECKPOINT_DONE}"))


@pytest.mark.engine
def test_killed_runs_resume_to_the_same_result(
    ledger: FaultLedger, flow_env: FlowEnv, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    # The session's Prefect server saves each run an API start; the first killed run starts its own
    # (what `draftloop run` does in a fresh shell), which a later run must stop.
    shared_prefect = driver_env({**FAST_MLFLOW_CLIENT, "PREFECT_API_URL": flow_env.api_url})
    own_prefect = driver_env(
        {**FAST_MLFLOW_CLIENT, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
    )
    with restartable(mlflow_server(tmp_path)) as mlflow:
        chain = Chain(workdir, _config(workdir, mlflow.health_url.removesuffix("/health")), shared_prefect)

        # The reference: the same cycle up to train, uninterrupted.
        chain.complete("train")
        reference = _results(chain.root)
        reference_steps = _stage_manifest(chain.root, "train").summary["steps"]
        for stage in ("synthesize", "extract", "train"):
            shutil.rmtree(chain.root / NAME / stage)
        shutil.rmtree(chain.state / "work" / NAME / "train")

        # SIGKILL the driver while each stage runs; every next run starts where the last one died.
        for stage, ready, env in (
            ("synthesize", lambda: True, own_prefect),
            ("extract", lambda: True, None),
            ("train", lambda: _checkpoint_written(chain.state), None),
        ):
            ledger.tried(f"driver SIGKILL in {stage}")
            chain.kill_in(stage, ready, env)

        # Up to register: train resumes; the baseline engine server dies during evaluation (the stage
        # fails and Prefect retries it); MLflow is stopped once registration starts.
        ledger.tried("engine server killed during evaluation")
        driver, known = chain.start("register", {**shared_prefect, "PREFECT_LOGGING_LEVEL": "INFO"})
        target = workdir / ".draftloop" / "models" / "tiny-llama"
        (server,) = wait_for(lambda: _baseline_server(target), driver, 420, "the baseline server")
        wait_for(lambda: _healthy(_port_of(server)), driver, 300, "the baseline server ready", poll_s=0.2)
        os.killpg(server, 9)
        wait_for(lambda: new_markers(chain.cycles, known, "evaluate.done"), driver, 420, "evaluate retried")
        ledger.completed_after("engine server killed during evaluation")
        wait_for(lambda: new_markers(chain.cycles, known, "register.started"), driver, 120, "register")
        ledger.tried("MLflow server stopped at registration")
        mlflow.kill()
        code = driver.wait(300)
        output = driver.output()
        assert code == 1, output[-4000:]
        assert new_markers(chain.cycles, known, "register.failed"), output[-4000:]
        # Prefect's retry lines: evaluate's names the dead server and quotes its log; register's once.
        evaluate_retry = next(line for line in output.splitlines() if "Retry 1/2" in line)
        for quoted in ("baseline", "exited with code -9", "--- server log"):
            assert quoted in evaluate_retry, evaluate_retry
        assert "Retry 1/1" in output, output[-4000:]

        mlflow.start()  # the server is back: the same command resumes at registration
        _, summary = chain.complete("register")

        assert summary["status"] == "completed"
        assert summary["cache_hits"] == ["evaluate", "extract", "synthesize", "train"], summary
        version = summary["registered_model"]["version"]
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=mlflow.health_url.removesuffix("/health"))
        versions = client.search_model_versions(f"name='drafter-{NAME}'")
        assert [v.version for v in versions] == [str(version)], "registered once, by the resumed run"
        ledger.completed_after("MLflow server stopped at registration")

        # The same result as the uninterrupted run, every row accounted for, nothing partial read.
        assert _results(chain.root) == reference
        committed = manifests(chain.root)
        assert {where.split("/")[0] for where in committed} == {
            "synthesize",
            "extract",
            "train",
            "evaluate",
            "register",
        }
        train_summary = _stage_manifest(chain.root, "train").summary
        assert train_summary["resumed_from_epoch"] == 0, "training resumed from the killed run's checkpoint"
        assert train_summary["steps"] == reference_steps
        ledger.rows_lost += lost_rows(committed)
        ledger.notes += rows_unaccounted(committed)
        partial = partial_artifacts_used(chain.root, chain.left_by_kills)
        ledger.partial_artifacts_read += len(partial)
        ledger.notes += partial

        # No process of a killed run is left (its Prefect server, Ray, workers): reaped by later runs.
        left = {stage: still_running(processes) for stage, processes in chain.killed_processes.items()}
        assert not any(left.values()), left
        for stage in ("synthesize", "extract", "train"):
            ledger.completed_after(f"driver SIGKILL in {stage}")
    assert not rows_unaccounted(committed) and not partial, ledger.notes


# ---------------------------------------------------------------------------------------------
# Online training: the driver, a producer and a trainer killed while hidden states stream


def _online_config(workdir: Path) -> Path:
    """The smallest config, online: 12 conversations in shards of 2, 2 epochs of one-sample steps."""
    path = _config(workdir, f"sqlite:///{workdir}/mlflow.db")
    config = yaml.safe_load(path.read_text())
    config["data"]["num_samples"] = 12
    config["extraction"]["mode"] = "online"
    config["training"]["epochs"] = 2
    path.write_text(yaml.safe_dump(config))
    return path


def _recorded(state: Path, kind: str) -> list[int]:
    """PIDs of `kind` in the PID records under `state` (producers: recorded by the train stage)."""
    found = []
    for path in state.glob("pids/*.json"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(entry["pid"]) for entry in json.loads(path.read_text())["processes"].get(kind, [])]
    return found


def _checkpoints(state: Path) -> int:
    """The latest completed checkpoint's step (the worker keeps only the last two folders)."""
    steps = [
        int(path.parent.name.removeprefix("step-"))
        for path in state.glob(f"work/{NAME}/train/*/step-*/{CHECKPOINT_DONE}")
    ]
    return max(steps, default=0)


def test_online_training_loses_nothing_when_killed(
    ledger: FaultLedger, flow_env: FlowEnv, tmp_path: Path
) -> None:
    """The driver SIGKILLed mid-train, then in the run that resumes a producer and a trainer: the run
    completes inside the stage, every sample trained exactly once per epoch, nothing stored."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    chain = Chain(workdir, _online_config(workdir), driver_env({"PREFECT_API_URL": flow_env.api_url}))
    ledger.tried("online: driver SIGKILL in train")
    chain.kill_in("train", lambda: _checkpoint_written(chain.state))
    driver, known = chain.start("train")
    faults = ("online: producer SIGKILL", "online: trainer SIGKILL")
    for fault, victims in zip(
        faults,
        (lambda: _recorded(chain.state, "producers"), lambda: ray_train_workers(driver.process.pid)),
        strict=True,
    ):
        ledger.tried(fault)
        written = _checkpoints(chain.state)
        wait_for(
            lambda written=written: _checkpoints(chain.state) > written,  # type: ignore[misc]
            driver,
            300,
            f"a checkpoint before the {fault}",
        )
        for pid in wait_for(victims, driver, 120, f"the {fault} victims"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert driver.wait(600) == 0, driver.output()[-4000:]
    train = _stage_manifest(chain.root, "train").summary
    assert not new_markers(chain.cycles, known, "train.failed"), "recovered inside the stage"
    training = train["stream"]["samples"] - train["held_out_samples"]
    assert train["trained_per_sample"] == [{"1": training}] * 2
    assert train["resumed_from_epoch"] is not None
    # (tests/test_online_training.py: a killed producer changes no weight; a resume is exact)
    assert train["stream"]["hidden_state_bytes_stored"] == 0
    ledger.count_epochs(train["trained_per_sample"])
    for fault in ("online: driver SIGKILL in train", *faults):
        ledger.completed_after(fault)


def _simulated_acceptance_length(flow_env: FlowEnv, cycle: dict[str, Any]) -> float:
    """A cycle's drafter simulated free-running (float32) on its eval prompts (local storage: the
    train stage's folder is the drafter's)."""
    from draftloop.infra.evaluation.simulator import NumericMode, run_simulator
    from draftloop.infra.runtime.config import ExperimentConfig
    from draftloop.infra.synthesis.conversations import read_eval_prompts

    config = ExperimentConfig.load(flow_env.config_path)
    conversations = read_manifest(cycle["stages"]["synthesize"]["uri"])
    prompts = [row["prompt"] for row in read_eval_prompts(conversations, storage_options(config))]
    figures = run_simulator(
        Path(config.target.path), Path(cycle["stages"]["train"]["uri"]), prompts,
        config.engine.num_speculative_tokens, config.evaluation.max_tokens,
        mode=NumericMode(dtype="float32", attention="transformers"),
    )  # fmt: skip
    assert figures.mean_acceptance_length is not None
    return figures.mean_acceptance_length


@pytest.mark.engine
def test_engine_server_killed_mid_stream_is_restarted_and_nothing_is_lost(
    ledger: FaultLedger, flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float], tmp_path: Path
) -> None:
    """`extraction.backend: engine`, online: the engine server in its extraction mode is SIGKILLed once
    the first step is trained; the producers have it started again and ask again, the stage completes
    (no retry of it), every sample trained once per epoch, and the drafter accepts like the offline one
    (simulated on the same prompts, within the seed spread). How an online drafter is served and judged
    is tests/test_flow.py's online cycle: the hidden states' source does not change the served folder."""
    first, _ = first_cycle
    config = yaml.safe_load(flow_env.config_path.read_text())
    config["extraction"].update({"mode": "online", "backend": "engine", "samples_per_shard": 2})
    config["training"]["checkpoint_every_steps"] = 1
    path = tmp_path / "flow-test-engine.yaml"
    path.write_text(yaml.safe_dump(config))
    state = flow_env.workdir / "state"
    cycles = Path(config["storage"]["root"]) / "flow-test" / "cycles"
    known = {run.name for run in cycles.glob("*")}
    env = driver_env(flow_env.env)
    checkpoints = f"work/flow-test/train/*/step-*/{CHECKPOINT_DONE}"
    earlier = set(state.glob(checkpoints))  # the offline cycle's
    run_dir = state / "work" / "flow-test" / "stream-engine"
    driver = start_driver(tmp_path, path, "train", "engine-online", env)
    try:
        ledger.tried("online: engine server killed mid-stream")
        wait_for(
            lambda: set(state.glob(checkpoints)) - earlier, driver, 600, "the first online step's checkpoint"
        )
        # The server's process group, from the cycle's PID record (recorded as it is spawned).
        (server,) = wait_for(lambda: _recorded(state, "engine-extraction"), driver, 10, "the engine server")
        os.killpg(server, signal.SIGKILL)
        assert driver.wait(900) == 0, driver.output()[-4000:]
    finally:  # a failed wait leaves the driver running: stop it (its cleanup stops what it started)
        if driver.process.poll() is None:
            os.killpg(driver.process.pid, signal.SIGTERM)
            driver.process.wait(timeout=120)
    assert not new_markers(cycles, known, "train.failed"), "recovered inside the stage"
    (summary_path,) = [p for p in cycles.glob("*/summary.json") if p.parent.name not in known]
    summary = json.loads(summary_path.read_text())
    train = read_manifest(summary["stages"]["train"]["uri"]).summary
    stream = train["stream"]
    assert stream["backend"] == "engine" and stream["engine_restarts"] == 1, stream
    assert stream["hidden_state_bytes_stored"] == 0 and not (run_dir / "hidden-states").exists()
    assert (run_dir / "server-extraction.log.exited").is_file(), "the killed server's log is kept"
    training = stream["samples"] - train["held_out_samples"]
    assert train["trained_per_sample"] == [{"1": training}] * train["epochs"]
    assert summary["status"] == "completed", summary
    # Hidden states from the engine (bfloat16 there, another shard size): within the offline seed spread.
    online, offline = (_simulated_acceptance_length(flow_env, cycle) for cycle in (summary, first))
    print(f"\n[engine online] simulated mean acceptance length {online:.3f}, offline {offline:.3f}")
    assert abs(online - offline) <= 0.1
    ledger.count_epochs(train["trained_per_sample"])
    ledger.completed_after("online: engine server killed mid-stream")


# ---------------------------------------------------------------------------------------------
# Storage: the S3 endpoint stopped mid-upload, the disk full during extraction

BUCKET = "faults"


def _hidden_samples(count: int, tokens: int, hidden: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 100, (tokens,), generator=generator),
            "loss_mask": torch.ones(tokens, dtype=torch.uint8),
            "aux_hidden": torch.randn(tokens, 3 * hidden, generator=generator),
            "last_hidden": torch.randn(tokens, hidden, generator=generator),
        }
        for _ in range(count)
    ]


def _write_extraction(writer: DatasetWriter, shards: int, samples_per_shard: int, tokens: int) -> int:
    """Write hidden-state shards the way an extraction actor does (streamed chunks); rows written."""
    metadata = shard_metadata(LayerIds((1, 3, 5)), "tiny-llama")
    rows = 0
    for index in range(shards):
        tensors = pack_hidden_shard(_hidden_samples(samples_per_shard, tokens, 64))
        writer.write_shard_chunks(
            f"hidden-a00-{index:05d}.safetensors", shard_chunks(tensors, metadata), rows=samples_per_shard
        )
        rows += samples_per_shard
    return rows


def test_s3_endpoint_stopped_mid_upload_is_retried(
    ledger: FaultLedger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    for key, value in DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    moto = moto_server(tmp_path)
    with restartable(moto):
        moto_url = moto.health_url.removesuffix("/moto-api/")
        direct = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto_url}, skip_instance_cache=True)
        direct.mkdir(BUCKET)
        relay = ByteCountingRelay(int(moto_url.rsplit(":", 1)[1]))
        uri = f"s3://{BUCKET}/{NAME}/extract/key"
        writer = DatasetWriter(uri, storage_options=storage_options(f"http://127.0.0.1:{relay.port}"))
        payload = os.urandom(48 * 2**20)
        name = "hidden-a00-00000.safetensors"
        seen_sizes: list[int] = []
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def upload() -> None:
            try:
                outcome["info"] = writer.write_shard(name, payload, rows=16)
            except Exception as error:
                outcome["error"] = error
            done.set()

        def read_while_uploading() -> None:
            """A reader polling the object the whole time: it must see nothing or all of it."""
            reader = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto_url}, skip_instance_cache=True)
            while not done.is_set():
                with contextlib.suppress(FileNotFoundError, OSError):
                    seen_sizes.append(int(reader.info(f"{BUCKET}/{NAME}/extract/key/{name}")["size"]))
                reader.invalidate_cache()
                time.sleep(0.02)

        started = time.monotonic()
        threads = [threading.Thread(target=upload), threading.Thread(target=read_while_uploading)]
        for thread in threads:
            thread.start()
        wait_for(lambda: relay.sent > 4 * 2**20 or done.is_set(), None, 60, "the upload under way", 0.005)
        assert not done.is_set(), "the upload finished before the endpoint could be stopped"
        ledger.tried("S3 endpoint stopped mid-upload")
        relay.up = False
        moto.kill()
        down_at = time.monotonic()
        moto.start()  # a fresh moto holds nothing: the bucket comes back before the endpoint does
        direct.mkdir(BUCKET)
        relay.up = True
        downtime = time.monotonic() - down_at
        for thread in threads:
            thread.join(timeout=180)

        assert "error" not in outcome, f"the write was not retried: {outcome.get('error')!r}"
        assert relay.connections >= 2  # the upload went again after the endpoint came back
        assert time.monotonic() - started > downtime
        manifest = writer.commit("extract", summary={"samples": 16, "skipped": 0})
        assert read_shard(read_manifest(uri, writer.options), name, writer.options) == payload
        relay.close()
        partial = [size for size in seen_sizes if size != len(payload)]
        ledger.partial_artifacts_read += len(partial)
        ledger.rows_lost += 16 - manifest.rows
        assert not partial, f"a reader saw a partial object: sizes {sorted(set(partial))}"
        ledger.completed_after("S3 endpoint stopped mid-upload")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (as root): a disk that fills up for real."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def test_disk_full_during_extraction_commits_nothing(ledger: FaultLedger, small_disk: Path) -> None:
    folder = small_disk / NAME / "extract" / "key"
    ledger.tried("disk full during extraction")
    writer = DatasetWriter(str(folder))
    with pytest.raises(OSError) as raised:
        _write_extraction(writer, shards=8, samples_per_shard=4, tokens=64)  # ~4.6 MiB onto 2 MiB

    assert raised.value.errno == errno.ENOSPC
    message = str(raised.value)
    assert "No space left on device" in message and str(folder) in message, message
    try:
        visible = read_manifest(str(folder))
    except ManifestNotFoundError:
        visible = None  # a reader finds no dataset: nothing it could read
    if visible is not None:  # whatever a reader would now read of the failed write
        ledger.partial_artifacts_read += len(visible.shards) or 1
    assert visible is None
    names = sorted(path.name for path in folder.iterdir())
    assert all(not name.startswith(".") for name in names), f"temporary files left: {names}"
    written = {shard.name: shard.size for shard in writer.shards}
    torn = [name for name in names if written.get(name) != (folder / name).stat().st_size]
    assert not torn, f"shards under their final name that were never completed: {torn}"

    # Room again (the disk grows): the same extraction write commits, every row listed.
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    writer = DatasetWriter(str(folder))
    rows = _write_extraction(writer, shards=8, samples_per_shard=4, tokens=64)
    manifest = writer.commit("extract", summary={"samples": rows, "skipped": 0})
    for shard in manifest.shards:
        read_shard(read_manifest(str(folder)), shard.name)
    ledger.rows_lost += rows - manifest.rows
    assert manifest.rows == rows == 32
    ledger.completed_after("disk full during extraction")


# ---------------------------------------------------------------------------------------------


def test_fault_summary_line(ledger: FaultLedger, capsys: pytest.CaptureFixture[str]) -> None:
    """Last in the module: the one line, from what the tests above observed."""
    with capsys.disabled():
        print(f"\n{ledger.line()}")
        for note in ledger.notes:
            print(f"  {note}")
    assert ledger.faults, "no fault was tried"
    assert sorted(ledger.recovered) == sorted(ledger.faults), ledger.line()
    assert ledger.rows_lost == 0 and ledger.partial_artifacts_read == 0, ledger.line()
    assert ledger.trained_twice == 0, ledger.line()
