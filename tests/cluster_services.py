"""Throwaway servers for tests/test_flow_cluster.py: PostgreSQL (and databases in it), a Ray head.

Each is a context manager that starts one real server on 127.0.0.1 and a free port, waits until it
answers, yields how to reach it, and stops it by PID (or its own stop command) on the way out.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from draftloop.infra.runtime.ports import free_port
from draftloop.infra.runtime.processes import stop_processes

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = REPO_ROOT / ".venv" / "bin"


def postgres_bin_dir() -> Path | None:
    """Folder of Debian's initdb/pg_ctl, or None when PostgreSQL is not installed."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(candidates[-1]).parent if candidates else None


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the `postgres` user then."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL cluster in a temporary folder; yields a SQLAlchemy URI of its `postgres` db."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed (.ci/run installs Debian's postgresql package)")
    # Not under pytest's tmp_path: that is root-only (0700), and the server runs as `postgres`.
    root = Path(tempfile.mkdtemp(prefix="draftloop-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = free_port()
    log = root / "server.log"
    subprocess.run(
        _as_postgres(
            [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8"]
        ),
        check=True,
        capture_output=True,
        timeout=120,
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    try:
        subprocess.run(
            _as_postgres(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "start"]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        stopped = subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
            capture_output=True,
            timeout=60,
        )
        pid_file = data / "postmaster.pid"
        if stopped.returncode != 0 and pid_file.exists():  # pg_ctl could not stop it: by PID
            with suppress(ValueError, ProcessLookupError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def create_database(server_uri: str, name: str) -> str:
    """CREATE DATABASE `name` on the server of `server_uri` (a `postgres_server` URI); its URI."""
    import psycopg

    with psycopg.connect(server_uri, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return f"{server_uri.rsplit('/', 1)[0]}/{name}"


@contextmanager
def ray_head(log_dir: Path, num_cpus: int = 2) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head started with `ray start`; yields (address, env a driver needs to join it).

    Token auth stays on (Ray's default for a cluster): the token lives in a file both sides name
    through RAY_AUTH_TOKEN_PATH, as infra/runtime/ray_cluster.py expects for a cluster address. AWS
    credentials are kept out of the head's environment, so its workers only see what the driver passes them.
    """
    # Short: Ray's Unix socket paths must stay under 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="dlray-", dir="/tmp"))
    driver_env = {"RAY_TMPDIR": str(tmp), "RAY_AUTH_TOKEN_PATH": str(tmp / "auth_token")}
    (tmp / "auth_token").write_text(os.urandom(16).hex())
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env.pop("RAY_AUTH_MODE", None)
    env.update(driver_env)
    port = free_port()
    ports = {
        "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--metrics-export-port": free_port(),
        "--runtime-env-agent-port": free_port(),
    }
    ray = str(VENV_BIN / "ray")
    command = [ray, "start", "--head", "--port", str(port), "--num-cpus", str(num_cpus)]
    command += ["--include-dashboard=false", "--node-ip-address", "127.0.0.1", "--temp-dir", str(tmp)]
    for flag, value in ports.items():
        command += [flag, str(value)]
    log = log_dir / "ray-start.log"
    try:
        with open(log, "wb") as sink:
            subprocess.run(command, env=env, stdout=sink, stderr=subprocess.STDOUT, check=True, timeout=180)
        yield f"127.0.0.1:{port}", driver_env
    finally:
        # Not `ray stop`: it stops every Ray on the machine. This head's processes name its temp dir.
        stop_processes(_pids_naming(str(tmp)), grace_s=20)
        shutil.rmtree(tmp, ignore_errors=True)


def _pids_naming(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains `marker`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with suppress(OSError):
            if marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
    return pids
