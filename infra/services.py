"""`draftloop up` / `draftloop down`: a local Prefect server + process worker + MLflow UI, by PID.

Everything binds 127.0.0.1 and lives under `.draftloop/` (PREFECT_HOME, logs, PID files). `up` is
idempotent: services whose recorded PID is alive are left alone. `down` stops exactly the processes
`up` recorded (their process groups: a Prefect server or worker has children), SIGTERM then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from draftloop.infra.processes import is_alive, state_dir, stop_processes

WORK_POOL = "draftloop"
SERVICE_NAMES = ("prefect-server", "mlflow", "prefect-worker")


@dataclass
class Service:
    name: str
    pid: int
    url: str | None
    log: str


def services_dir(root: Path | None = None) -> Path:
    return state_dir(root) / "services"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_or_free(preferred: int | None) -> int:
    """`preferred` when nothing listens on it (127.0.0.1), otherwise any free port."""
    if preferred:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", preferred))
            except OSError:
                return free_port()
            return preferred
    return free_port()


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


def _bin(name: str) -> str:
    """An executable of this interpreter's environment (prefect, mlflow)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


# A small cycle (a few minutes on a laptop CPU) for the command `draftloop up` prints.
QUICK_RUN_PARAMS: dict[str, int] = {"num_samples": 32, "epochs": 2}


def deployment_run_command(api_url: str, params: dict[str, int] | None = None) -> str:
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
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DRAFTLOOP_ROOT": str((root or Path.cwd()).resolve()),
            "DO_NOT_TRACK": "1",
        }
    )
    return env


def _spawn(name: str, argv: list[str], env: dict[str, str], root: Path | None, url: str | None) -> Service:
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
    service = Service(name=name, pid=process.pid, url=url, log=str(log_path))
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


def mlflow_server_command(port: int, backend_store_uri: str, artifact_flag: str, artifacts: str) -> list[str]:
    """`mlflow server` on 127.0.0.1:`port`, one worker; `artifact_flag` is `--default-artifact-root`
    (clients write artifacts there directly) or `--artifacts-destination` (the server proxies them)."""
    return [
        _bin("mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        backend_store_uri,
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


def up(
    root: Path | None = None,
    prefect_port: int | None = None,
    mlflow_port: int | None = None,
    mlflow_uri: str = "sqlite:///.draftloop/mlflow.db",
    artifact_root: str = ".draftloop/mlartifacts",
    start_worker: bool = True,
    deploy: bool = True,
) -> dict[str, Service]:
    """Start the Prefect server, create the pool, deploy prefect.yaml, start a worker and MLflow's UI."""
    running = {name: svc for name, svc in read_services(root).items() if is_alive(svc.pid)}
    env = base_env(root)
    services: dict[str, Service] = dict(running)
    try:
        if "prefect-server" not in running:
            port = port_or_free(prefect_port)
            server = _spawn(
                "prefect-server",
                [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                env,
                root,
                url=f"http://127.0.0.1:{port}",
            )
            services["prefect-server"] = server
            _wait_http(f"{server.url}/api/health", server, timeout_s=120)
        api_url = f"{services['prefect-server'].url}/api"
        env["PREFECT_API_URL"] = api_url
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
            port = port_or_free(mlflow_port)
            backend = mlflow_uri
            if backend.startswith("sqlite:///") and not backend.startswith("sqlite:////"):
                local = (Path(root or Path.cwd()) / backend.removeprefix("sqlite:///")).resolve()
                local.parent.mkdir(parents=True, exist_ok=True)
                backend = f"sqlite:///{local}"
            artifacts = (
                artifact_root
                if "://" in artifact_root
                else str((Path(root or Path.cwd()) / artifact_root).resolve())
            )
            mlflow = _spawn(
                "mlflow",
                mlflow_server_command(port, backend, "--default-artifact-root", artifacts),
                env,
                root,
                url=f"http://127.0.0.1:{port}",
            )
            services["mlflow"] = mlflow
            _wait_http(f"{mlflow.url}/health", mlflow, timeout_s=120)
    except BaseException:
        down(root)  # never leave half a stack behind
        raise
    return services


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
