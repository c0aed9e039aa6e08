"""`draftloop up` / `draftloop down`: a Prefect server + process worker + MLflow server, by PID.

Two profiles. `local` (default): Prefect on its own SQLite, MLflow on SQLite with artifacts in a local
folder, everything under `.draftloop/`. `team`: the Prefect server on PostgreSQL, MLflow on PostgreSQL
with its artifacts proxied to S3 (`TeamBackends`), so several people share one history. Both bind
127.0.0.1 unless a host is given, and both create the Prefect global concurrency limit `gpus` (one slot
per GPU of the machine) that each GPU-using stage holds while it runs (`hold_gpus`), so two cycles never
take the same GPUs.

`up` is idempotent: services whose recorded PID is alive are left alone. `down` stops exactly the
processes `up` recorded (their process groups: a Prefect server or worker has children), SIGTERM then
SIGKILL. PREFECT_HOME, logs and PID files live under `.draftloop/services/`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from draftloop.infra.runtime.mlflow_landing import LANDING_EXPERIMENT_ENV
from draftloop.infra.runtime.ports import free_port
from draftloop.infra.runtime.processes import is_alive, state_dir, stop_processes

WORK_POOL = "draftloop"
SERVICE_NAMES = ("prefect-server", "mlflow", "prefect-worker")
PROFILES = ("local", "team")
# The Prefect global concurrency limit `up` creates and GPU stages hold: one slot per GPU.
GPU_LIMIT = "gpus"


@dataclass
class Service:
    name: str
    pid: int
    url: str | None
    log: str
    # MLflow (local profile): the SQLite store it serves, so clients of that store log through it instead
    # (`served_tracking_uri`). None elsewhere: a team database URL may hold a password.
    store: str | None = None


@dataclass(frozen=True)
class TeamBackends:
    """Where the team profile keeps its state: two PostgreSQL databases and an artifact store.

    Two databases, not one: Prefect and MLflow each keep an `alembic_version` table.
    """

    prefect_database_url: str  # postgresql://user:password@host:5432/prefect
    mlflow_database_url: str  # postgresql://user:password@host:5432/mlflow
    mlflow_artifacts: str  # s3://bucket/prefix: the MLflow server proxies every artifact there
    s3_endpoint_url: str | None = None  # a non-AWS S3 (MinIO, moto, Ceph)


def with_driver(database_url: str, driver: str) -> str:
    """`postgresql+<driver>://...` for any PostgreSQL URL (`postgres://`, `postgresql+psycopg://`, ...)."""
    match = re.match(r"^(postgres|postgresql)(\+\w+)?://", database_url)
    if match is None:
        raise ValueError("not a PostgreSQL URL (postgresql://user:password@host:port/database)")
    return f"postgresql+{driver}://{database_url[match.end() :]}"


def services_dir(root: Path | None = None) -> Path:
    return state_dir(root) / "services"


def port_or_free(preferred: int | None, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """`preferred` when nothing listens on it, otherwise any free port; never one of `avoid` (ports
    picked for servers that have not bound them yet)."""
    if preferred and preferred not in avoid:
        with socket.socket() as sock:
            try:
                sock.bind((host, preferred))
            except OSError:
                pass
            else:
                return preferred
    while (port := free_port()) in avoid:
        pass
    return port


def read_services(root: Path | None = None) -> dict[str, Service]:
    found: dict[str, Service] = {}
    folder = services_dir(root)
    for name in SERVICE_NAMES:
        record = folder / f"{name}.json"
        if record.exists():
            found[name] = Service(**json.loads(record.read_text()))
    return found


def _record(service: Service, root: Path | None) -> None:
    folder = services_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{service.name}.json").write_text(json.dumps(asdict(service)))
    (folder / f"{service.name}.pid").write_text(str(service.pid))


def running_service(name: str, health_path: str, root: Path | None = None) -> Service | None:
    """The service `up` recorded as `name`, when its process lives and `<url><health_path>` answers."""
    service = read_services(root).get(name)
    if service is None or service.url is None or not is_alive(service.pid):
        return None
    try:
        answered = httpx.get(f"{service.url}{health_path}", timeout=3).status_code == 200
    except httpx.HTTPError:
        answered = False
    return service if answered else None


def served_tracking_uri(store_uri: str, root: Path | None = None) -> str | None:
    """The URL of `up`'s MLflow server when it serves the tracking store `store_uri` (the same SQLite
    file), else None. Runs logged through it get links people can open (a file store has no UI URL)."""
    if not store_uri.startswith("sqlite:///"):
        return None
    service = running_service("mlflow", "/health", root)
    if service is None or service.store is None:
        return None
    return service.url if _sqlite_path(service.store) == _sqlite_path(store_uri) else None


def _sqlite_path(uri: str) -> Path:
    return Path(uri.removeprefix("sqlite:///")).resolve()


def served_prefect_api(root: Path | None = None) -> str | None:
    """The API URL of `up`'s Prefect server while it answers, else None."""
    service = running_service("prefect-server", "/api/health", root)
    return f"{service.url}/api" if service is not None else None


def _bin(name: str) -> str:
    """An executable of this interpreter's environment (prefect, mlflow)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


# A small cycle (a few minutes on a laptop CPU) for the command `draftloop up` prints.
QUICK_RUN_PARAMS: dict[str, Any] = {"num_samples": 32, "epochs": 2}


def deployment_run_command(api_url: str, params: dict[str, Any] | None = None) -> str:
    """A copy-paste shell command that runs one `train-and-eval` cycle on the server at `api_url`."""
    return shlex.join(
        [
            "env",
            f"PREFECT_API_URL={api_url}",
            _bin("prefect"),
            "deployment",
            "run",
            "train-and-eval/train-and-eval",
            "--params",
            json.dumps(QUICK_RUN_PARAMS if params is None else params),
            "--watch",
        ]
    )


def base_env(root: Path | None = None) -> dict[str, str]:
    """Environment shared by the services and the CLI calls made against them."""
    env = dict(os.environ)
    env.update(
        {
            "PREFECT_HOME": str(state_dir(root) / "prefect-server"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
            # `prefect deployment run --watch` interleaves the run's logs with its events only when the
            # server publishes and streams logs (both off by default): the cycle's last line, with the
            # MLflow links, then reaches the terminal that started the run.
            "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
            "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
            "DRAFTLOOP_ROOT": str((root or Path.cwd()).resolve()),
            "DO_NOT_TRACK": "1",
        }
    )
    # MLflow's telemetry (its server, its UI and clients) is off unless the user turns it on with
    # MLFLOW_DISABLE_TELEMETRY=false; MLflow reads DO_NOT_TRACK only as "true", not the "1" above.
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return env


def _spawn(
    name: str,
    argv: list[str],
    env: dict[str, str],
    root: Path | None,
    url: str | None,
    store: str | None = None,
) -> Service:
    folder = services_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str((root or Path.cwd()).resolve()),
            start_new_session=True,  # its own process group: `down` stops its children too
        )
    service = Service(name=name, pid=process.pid, url=url, log=str(log_path), store=store)
    _record(service, root)
    return service


def _wait_http(url: str, service: Service, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive(service.pid):
            tail = Path(service.log).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{service.name} exited during start-up; log tail:\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{service.name} did not answer {url} within {timeout_s:.0f} s (log: {service.log})")


# The MLflow app `up` serves (`mlflow server --app-name`, the `mlflow.app` entry point in pyproject.toml):
# MLflow's own, its root opening on the cycles' experiment in model-training mode (mlflow_landing.py).
MLFLOW_APP = "draftloop"


def mlflow_server_command(
    port: int,
    backend_store_uri: str,
    artifact_flag: str,
    artifacts: str,
    host: str = "127.0.0.1",
    experiment: str = "draftloop",
) -> list[str]:
    """A light `mlflow server` on `host`:`port` for one machine or a small team, its UI opening on
    `experiment` (the draftloop app, infra/runtime/mlflow_landing.py).

    One worker process, and MLflow 3's job execution off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION: its job
    runner and seven Huey consumers serve GenAI scorers draftloop does not use; with them the server
    tree holds ~2 GB instead of ~0.5 GB). The settings go through `env`, which execs mlflow in place
    (same PID), so every launcher gets the same server; the backend URI, which may hold a password,
    travels in MLFLOW_BACKEND_STORE_URI rather than on the server's command line. `artifact_flag` is
    `--default-artifact-root` (clients write artifacts there directly) or `--artifacts-destination`
    (the server proxies them).
    """
    return [
        shutil.which("env") or "/usr/bin/env",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false",
        f"MLFLOW_BACKEND_STORE_URI={backend_store_uri}",
        f"{LANDING_EXPERIMENT_ENV}={experiment}",
        _bin("mlflow"),
        "server",
        "--app-name",
        MLFLOW_APP,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
        artifact_flag,
        artifacts,
    ]


def _run(argv: list[str], env: dict[str, str], root: Path | None, timeout_s: float = 300) -> str:
    done = subprocess.run(
        argv,
        env=env,
        cwd=str((root or Path.cwd()).resolve()),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return done.stdout


def detected_gpus() -> int:
    """GPUs `nvidia-smi -L` lists on this machine (0 without an NVIDIA driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def ensure_gpu_limit(api_url: str, slots: int) -> dict[str, Any]:
    """Create (or resize) the `gpus` global concurrency limit on the Prefect server at `api_url`."""
    endpoint = f"{api_url}/v2/concurrency_limits"
    existing = httpx.get(f"{endpoint}/{GPU_LIMIT}", timeout=30)
    if existing.status_code == 404:
        httpx.post(f"{endpoint}/", json={"name": GPU_LIMIT, "limit": slots}, timeout=30).raise_for_status()
    else:
        existing.raise_for_status()
        httpx.patch(f"{endpoint}/{GPU_LIMIT}", json={"limit": slots}, timeout=30).raise_for_status()
    current = httpx.get(f"{endpoint}/{GPU_LIMIT}", timeout=30)
    current.raise_for_status()
    limit: dict[str, Any] = current.json()
    return limit


@contextmanager
def hold_gpus(count: int) -> Iterator[None]:
    """Hold `count` slots of the `gpus` limit (waiting for them) when a Prefect server is configured.

    Without PREFECT_API_URL (`draftloop run`'s ephemeral API, private to one process) nothing is shared,
    so there is nothing to hold. The slots are leased: a killed holder frees them when the lease lapses.
    """
    from prefect import get_run_logger
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import MissingContextError
    from prefect.settings import PREFECT_API_URL

    if count <= 0 or not PREFECT_API_URL.value():
        yield
        return
    with suppress(MissingContextError):  # called outside a Prefect run: nothing to log into
        get_run_logger().info(
            f"taking {count} slot(s) of the `{GPU_LIMIT}` limit (waits while other cycles hold them)"
        )
    with concurrency(GPU_LIMIT, occupy=count):
        yield


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def up(
    root: Path | None = None,
    prefect_port: int | None = None,
    mlflow_port: int | None = None,
    mlflow_uri: str = "sqlite:///.draftloop/mlflow.db",
    artifact_root: str = ".draftloop/mlartifacts",
    start_worker: bool = True,
    deploy: bool = True,
    team: TeamBackends | None = None,
    gpus: int | None = None,
    host: str = "127.0.0.1",
    experiment: str = "draftloop",
) -> dict[str, Service]:
    """Start the Prefect server, create the pool, the `gpus` limit (`gpus` slots, default: this
    machine's GPUs; none when 0), deploy prefect.yaml, start a worker and the MLflow server.

    With `team`, Prefect and MLflow keep their state in its PostgreSQL databases and MLflow proxies
    artifacts to its store; otherwise `mlflow_uri` and `artifact_root` (local SQLite and folder): cycles
    tracking into that SQLite file then log through the server (`served_tracking_uri`). MLflow's UI
    opens on `experiment`.
    """
    running = {name: svc for name, svc in read_services(root).items() if is_alive(svc.pid)}
    env = base_env(root)
    services: dict[str, Service] = dict(running)
    shown = _display_host(host)
    try:
        if "prefect-server" not in running:
            port = port_or_free(prefect_port, host)
            server_env = dict(env)
            # The UI's API address; Prefect would derive it from PREFECT_API_URL (another server's, when
            # set) or from port 4200, never from --port: on any other port the UI could not connect.
            server_env["PREFECT_UI_API_URL"] = f"http://{shown}:{port}/api"
            if team is not None:
                # Only the server sees the database URL (it may hold a password): not the worker, not argv.
                server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = with_driver(
                    team.prefect_database_url, "asyncpg"
                )
            server = _spawn(
                "prefect-server",
                [_bin("prefect"), "server", "start", "--host", host, "--port", str(port)],
                server_env,
                root,
                url=f"http://{shown}:{port}",
            )
            services["prefect-server"] = server
        # MLflow starts while Prefect does (tens of seconds each on a laptop); Prefect is awaited first.
        if "mlflow" not in running:
            picked = [urlsplit(svc.url).port or 0 for svc in services.values() if svc.url]
            port = port_or_free(mlflow_port, host, avoid=picked)
            mlflow_env = dict(env)
            store: str | None = None
            if team is not None:
                command = mlflow_server_command(
                    port,
                    with_driver(team.mlflow_database_url, "psycopg"),
                    "--artifacts-destination",
                    team.mlflow_artifacts,
                    host,
                    experiment,
                )
                if team.s3_endpoint_url:
                    mlflow_env["MLFLOW_S3_ENDPOINT_URL"] = team.s3_endpoint_url
            else:
                store = _local_sqlite(mlflow_uri, root)
                command = mlflow_server_command(
                    port, store, "--default-artifact-root", _local(artifact_root, root), host, experiment
                )
            services["mlflow"] = _spawn(
                "mlflow", command, mlflow_env, root, url=f"http://{shown}:{port}", store=store
            )
        if "prefect-server" not in running:
            _wait_http(
                f"{services['prefect-server'].url}/api/health", services["prefect-server"], timeout_s=180
            )
        api_url = f"{services['prefect-server'].url}/api"
        env["PREFECT_API_URL"] = api_url
        slots = detected_gpus() if gpus is None else gpus
        if slots > 0:
            ensure_gpu_limit(api_url, slots)
        if deploy:
            listed = _run([_bin("prefect"), "work-pool", "ls"], env, root)
            if WORK_POOL not in listed:
                _run([_bin("prefect"), "work-pool", "create", WORK_POOL, "--type", "process"], env, root)
            _run([_bin("prefect"), "--no-prompt", "deploy", "--all"], env, root)
        if start_worker and "prefect-worker" not in running:
            services["prefect-worker"] = _spawn(
                "prefect-worker",
                [_bin("prefect"), "worker", "start", "--pool", WORK_POOL],
                env,
                root,
                url=None,
            )
        if "mlflow" not in running:
            _wait_http(f"{services['mlflow'].url}/health", services["mlflow"], timeout_s=180)
    except BaseException:
        down(root)  # never leave half a stack behind
        raise
    return services


def _local(path_or_uri: str, root: Path | None) -> str:
    """A URI as given; a relative path resolved against `root`."""
    return path_or_uri if "://" in path_or_uri else str((Path(root or Path.cwd()) / path_or_uri).resolve())


def _local_sqlite(uri: str, root: Path | None) -> str:
    """`sqlite:///relative.db` made absolute against `root` (the server runs there, clients may not)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        local = (Path(root or Path.cwd()) / uri.removeprefix("sqlite:///")).resolve()
        local.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{local}"
    return uri


def down(root: Path | None = None, grace_s: float = 10) -> list[str]:
    """Stop every recorded service (worker first, so it takes no new run) and forget it."""
    stopped: list[str] = []
    folder = services_dir(root)
    for name in ("prefect-worker", "mlflow", "prefect-server"):
        record = folder / f"{name}.json"
        if not record.exists():
            continue
        service = Service(**json.loads(record.read_text()))
        if is_alive(service.pid):
            # A Prefect worker may ignore the first SIGTERM.
            stop_processes([service.pid], grace_s, term_attempts=2)
            stopped.append(name)
        record.unlink(missing_ok=True)
        (folder / f"{name}.pid").unlink(missing_ok=True)
    return stopped
