"""What tests/test_faults.py observes: the fault ledger, a driver it can SIGKILL, processes, manifests.

The ledger is filled from what the tests saw (faults injected, runs that completed after them, rows a
committed manifest does not account for, shards read that no manifest committed) and printed as one line
at the end of the module, so a lost row or a partial artifact shows up as a nonzero count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftloop.infra.runtime.ports import free_port
from draftloop.infra.runtime.processes import stop_processes
from draftloop.infra.runtime.services import mlflow_server_command
from draftloop.infra.runtime.storage import Manifest, ShardIntegrityError, read_manifest, read_shard

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class FaultLedger:
    """Counts the module's tests add to; `line()` is what the module prints last."""

    faults: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    rows_lost: int = 0
    partial_artifacts_read: int = 0
    trained_twice: int = 0  # samples trained more than once in one epoch (online runs' counts)
    notes: list[str] = field(default_factory=list)

    def tried(self, fault: str) -> None:
        self.faults.append(fault)

    def completed_after(self, fault: str) -> None:
        """A run (or the storage operation) completed after `fault`, with its checks passed."""
        self.recovered.append(fault)

    def line(self) -> str:
        return (
            f"faults tried: {len(self.faults)}, runs completed after them: {len(self.recovered)}, "
            f"rows lost: {self.rows_lost}, partial artifacts read: {self.partial_artifacts_read}, "
            f"samples trained twice in one epoch: {self.trained_twice}"
        )

    def count_epochs(self, trained_per_sample: list[dict[str, int]]) -> None:
        """An online run's per-epoch histograms (times trained -> samples): 0 is lost, 2+ twice."""
        for epoch in trained_per_sample:
            for times, count in epoch.items():
                if int(times) == 0:
                    self.rows_lost += count
                elif int(times) > 1:
                    self.trained_twice += count


# ---------------------------------------------------------------------------------------------
# Processes


def start_time(pid: int) -> int | None:
    """Start time of `pid` (clock ticks since boot), None when it is gone: (pid, start) names one process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def descendants(root: int) -> dict[int, int | None]:
    """`root` and every process below it, each with its start time."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, int | None] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found[pid] = start_time(pid)
        todo.extend(children.get(pid, []))
    return {pid: started for pid, started in found.items() if started is not None}


def ray_train_workers(root: int) -> list[int]:
    """PIDs of the Ray Train worker processes below `root` (their process title names the actor)."""
    found = []
    for pid in descendants(root):
        with suppress(OSError):
            if b"RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def recorded_pids(state: Path) -> dict[int, int | None]:
    """Every PID a run recorded under `state` (cycle and driver PID records), with its start time now."""
    found: dict[int, int | None] = {}
    for path in [*state.glob("pids/*.json"), *state.glob("cycles/*/pids.json")]:
        with suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            entries = record.get("processes", record)
            for values in entries.values() if isinstance(entries, dict) else []:
                for entry in values if isinstance(values, list) else []:
                    pid = int(entry["pid"]) if isinstance(entry, dict) else int(entry)
                    if (started := start_time(pid)) is not None:
                        found[pid] = started
    return found


def still_running(processes: dict[int, int | None]) -> list[str]:
    """Those of `processes` (pid -> start time) that still run, with their command lines."""
    alive = []
    for pid, started in sorted(processes.items()):
        if started is not None and start_time(pid) == started:
            with suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:160]
                alive.append(f"{pid} {command.decode(errors='replace')}")
    return alive


def processes_naming(text: str) -> list[int]:
    """PIDs whose command line contains `text` (e.g. a test's own folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            with suppress(OSError):
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


# ---------------------------------------------------------------------------------------------
# The driver: `draftloop run CONFIG --until STAGE` in its own session


@dataclass
class Driver:
    process: subprocess.Popen[bytes]
    log: Path
    started: float

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"driver still running after {timeout_s} s:\n{self.output()[-3000:]}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the driver alone (not its group): what the OOM killer or `kill -9` does."""
        with suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def driver_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any Prefect/draftloop/MLflow setting of the test session: a user's shell."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PREFECT_", "DRAFTLOOP_", "MLFLOW_"))
    }
    env.update({"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled", **(extra or {})})
    return env


def start_driver(workdir: Path, config: Path, until: str, log_name: str, env: dict[str, str]) -> Driver:
    log = workdir / f"{log_name}.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "draftloop", "run", str(config), "--until", until],
            cwd=workdir,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Driver(process, log, time.monotonic())


def wait_for(
    condition: Callable[[], Any], driver: Driver | None, timeout_s: float, what: str, poll_s: float = 0.05
) -> Any:
    """Poll `condition` until it returns something truthy; fail early when `driver` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if driver is not None and driver.process.poll() is not None:
            raise AssertionError(
                f"driver exited ({driver.process.returncode}) before {what}:\n{driver.output()[-3000:]}"
            )
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def new_markers(cycles: Path, known_runs: set[str], name: str) -> list[Path]:
    """`<cycles>/<run>/stages/<name>` of runs not in `known_runs` (the run started now)."""
    return [path for path in cycles.glob(f"*/stages/{name}") if path.parent.parent.name not in known_runs]


# ---------------------------------------------------------------------------------------------
# Datasets: rows accounted for, shards left by a killed writer


def manifests(root: Path) -> dict[str, Manifest]:
    """Every committed dataset under a run root (`<root>/<name>/<stage>/<key>`), by stage/key."""
    return {
        f"{path.parent.parent.name}/{path.parent.name}": read_manifest(str(path.parent))
        for path in sorted(root.glob("*/*/*/manifest.json"))
    }


def shard_hashes(manifest: Manifest, names: list[str] | None = None) -> dict[str, str]:
    return {shard.name: shard.sha256 for shard in manifest.shards if names is None or shard.name in names}


def _shard_rows(manifest: Manifest, prefix: str) -> int:
    return sum(shard.rows for shard in manifest.shards if shard.name.startswith(prefix))


def rows_unaccounted(committed: dict[str, Manifest]) -> list[str]:
    """Rows each manifest's summary promises that its shards or its upstream do not account for.

    synthesize: requested prompts = conversations + prompts the target could not answer, and every
    count equals its shard's rows; extract: its shards hold `samples`, and samples + skipped = the
    upstream conversations; train: one history row per step; evaluate: one report row per eval prompt.
    """
    by_hash = {manifest.content_hash(): manifest for manifest in committed.values()}
    problems = []

    def upstream(manifest: Manifest, stage: str) -> Manifest | None:
        found = [by_hash[h] for h in manifest.inputs.values() if h in by_hash and by_hash[h].stage == stage]
        return found[0] if found else None

    for where, manifest in committed.items():
        summary = manifest.summary
        if manifest.stage == "synthesize":
            answered_rejected = summary["rejected"] - summary["input_rejected"]
            checks = {
                "requested = rows + unanswered": (summary["requested"], summary["rows"] + answered_rejected),
                "rows = conversation shard rows": (summary["rows"], _shard_rows(manifest, "conversations-")),
                "eval prompts = shard rows": (summary["eval_prompts"], _shard_rows(manifest, "eval_prompts")),
                "rejected = shard rows": (summary["rejected"], _shard_rows(manifest, "rejected")),
                "input rows = accepted + rejected": (
                    summary["input_rows"],
                    summary["input_accepted"] + summary["input_rejected"],
                ),
            }
        elif manifest.stage == "extract":
            conversations = upstream(manifest, "synthesize")
            checks = {"samples = shard rows": (summary["samples"], manifest.rows)}
            if conversations is not None:
                checks["conversations = samples + skipped"] = (
                    conversations.summary["rows"],
                    summary["samples"] + summary["skipped"],
                )
        elif manifest.stage == "train":
            checks = {"steps = history rows": (summary["steps"], _shard_rows(manifest, "training_history"))}
        elif manifest.stage == "evaluate":
            checks = {"prompts = report rows": (summary["num_prompts"], _shard_rows(manifest, "eval_report"))}
        else:
            checks = {"one registration row": (1, manifest.rows)}
        problems += [
            f"{where}: {name}: {expected} != {found}"
            for name, (expected, found) in checks.items()
            if expected != found
        ]
    return problems


def lost_rows(committed: dict[str, Manifest]) -> int:
    """How many rows the accounting of `rows_unaccounted` misses, summed (0 when every row is there)."""
    total = 0
    for problem in rows_unaccounted(committed):
        expected, found = problem.rsplit(": ", 1)[1].split(" != ")
        total += abs(int(expected) - int(found))
    return total


FileIdentity = tuple[int, int, int]  # inode, size, mtime_ns: the same file, never rewritten


def uncommitted_files(root: Path) -> dict[str, FileIdentity]:
    """Files in dataset folders that have no manifest (what a killed writer left), by relative path."""
    found = {}
    for folder in root.glob("*/*/*"):
        if folder.is_dir() and folder.parent.name != "cycles" and not (folder / "manifest.json").exists():
            for path in folder.iterdir():
                stat = path.stat()
                found[str(path.relative_to(root))] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return found


def partial_artifacts_used(root: Path, left_by_kill: dict[str, FileIdentity]) -> list[str]:
    """Shards a committed manifest lists that are a killed writer's files never rewritten since, or
    whose bytes do not match the manifest (a reader would get what nobody committed)."""
    used = []
    for where, manifest in manifests(root).items():
        for shard in manifest.shards:
            relative = f"{Path(manifest.uri).relative_to(root)}/{shard.name}"
            stat = (root / relative).stat()
            if left_by_kill.get(relative) == (stat.st_ino, stat.st_size, stat.st_mtime_ns):
                used.append(f"{relative}: the killed run's file, listed without being rewritten")
            try:
                read_shard(manifest, shard.name)
            except ShardIntegrityError as error:
                used.append(f"{where}: {error}")
    return used


# ---------------------------------------------------------------------------------------------
# Servers the tests stop and restart


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        with suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s:\n{log.read_text()[-3000:]}")


class RestartableServer:
    """A server process on a fixed 127.0.0.1 port that a test stops (SIGKILL, no goodbye) and restarts."""

    def __init__(self, name: str, command: list[str], health_url: str, log_dir: Path) -> None:
        self.name = name
        self.command = command
        self.health_url = health_url
        self.log = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300) -> None:
        with open(self.log, "ab") as sink:
            self.process = subprocess.Popen(
                self.command,
                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: its workers stop with it
            )
        _wait_http(self.health_url, self.process, self.log, timeout_s)

    def kill(self) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process.pid], grace_s=10)
            self.process = None


@contextmanager
def restartable(server: RestartableServer) -> Iterator[RestartableServer]:
    try:
        server.start()
        yield server
    finally:
        server.stop()


def mlflow_server(folder: Path) -> RestartableServer:
    """`mlflow server` on a free port, SQLite backend and artifacts under `folder`."""
    port = free_port()
    command = mlflow_server_command(
        port, f"sqlite:///{folder}/mlflow.db", "--default-artifact-root", str(folder / "mlartifacts")
    )
    return RestartableServer("mlflow", command, f"http://127.0.0.1:{port}/health", folder)


def moto_server(folder: Path) -> RestartableServer:
    """moto's S3 server as its own process (its state lives in that process: a restart empties it)."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    return RestartableServer("moto", command, f"http://127.0.0.1:{port}/moto-api/", folder)


class ByteCountingRelay:
    """A TCP relay 127.0.0.1:port -> 127.0.0.1:upstream_port counting the bytes clients send.

    Clients talk to the relay; the test watches `sent` to stop the server behind it mid-request. While
    `up` is False (the server is stopped, or restarted but not yet holding its bucket again), a client
    connection is closed on arrival: what a client sees of an endpoint that is down; open ones break
    when the server's sockets do.
    """

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading

        self.upstream_port = upstream_port
        self.sent = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self.up = True  # False: the endpoint is down, connections are closed on arrival
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            if not self.up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: Any, sink: Any, counted: bool) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
                if counted:
                    with self._lock:
                        self.sent += len(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with suppress(OSError):
                    sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
