"""Ray's lifetime in this process: one `ray.init`, its environment, shutdown, actor options.

Actors never call Prefect or MLflow: in ephemeral Prefect mode every Ray worker would start its own
temporary Prefect server. They load models, compute, write shards through runtime.storage and return
small results; the driver (the Prefect task) logs and commits.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import ray

from draftloop.infra.runtime.internals import ray_head_pids
from draftloop.infra.runtime.processes import PidRecord

# Ray 2.60 turns token auth on and writes ~/.ray/auth_token; a local, in-process cluster needs neither.
_LOCAL_RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
# Unix socket paths are limited to 107 bytes: keep Ray's session folder short (not under a deep tmp_path).
_DEFAULT_RAY_TMPDIR = str(Path(tempfile.gettempdir()) / "draftloop-ray")

_started_here = False


def ray_environment(address: str | None) -> dict[str, str]:
    """Environment Ray needs before `ray.init` (set in os.environ by `ensure_ray`)."""
    env = {"RAY_TMPDIR": os.environ.get("RAY_TMPDIR", _DEFAULT_RAY_TMPDIR)}
    has_token = "RAY_AUTH_TOKEN_PATH" in os.environ or "RAY_AUTH_TOKEN" in os.environ
    if address is None and not has_token:
        env.update(_LOCAL_RAY_ENV)
    elif address is not None and has_token:
        # A driver joining a token-auth cluster sends its token only in explicit token mode.
        env["RAY_AUTH_MODE"] = "token"
    return env


def ensure_ray(
    address: str | None = None, pids: PidRecord | None = None, num_cpus: int | None = None
) -> bool:
    """Connect to (or start) Ray once in this process. Returns True when this call started it; then
    the head processes it started are recorded in `pids` (a cycle's record: stopped should it die)."""
    global _started_here

    if ray.is_initialized():
        return False
    for key, value in ray_environment(address).items():
        os.environ.setdefault(key, value)
    _reload_ray_auth_settings()
    Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    ray.init(
        address=address,
        num_cpus=num_cpus if address is None else None,
        include_dashboard=False,
        # Actor/worker output on the driver's console; the demo turns it off to keep its progress bars
        # readable (failures still arrive as exceptions carrying the remote traceback).
        log_to_driver=os.environ.get("DRAFTLOOP_RAY_LOG_TO_DRIVER", "1") != "0",
        configure_logging=False,
        # Tokenizers must not start a thread pool per worker on a 2-core machine.
        runtime_env={
            "env_vars": {"TOKENIZERS_PARALLELISM": "false", **_forwarded_credentials()},
            "worker_process_setup_hook": "draftloop.infra.runtime.ray_logging.quiet_ray_train_cleaner",
        },
    )
    _started_here = True
    if pids is not None:
        pids.add("ray", ray_head_pids())
    return True


# Storage credentials workers need to read/write S3 (training reads shards there); config holds none.
_FORWARDED_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)


def _forwarded_credentials() -> dict[str, str]:
    """The driver's S3 credentials, for this job's Ray workers (a cluster's nodes may have none)."""
    return {key: os.environ[key] for key in _FORWARDED_ENV if os.environ.get(key)}


def _reload_ray_auth_settings() -> None:
    """Make Ray re-read RAY_AUTH_* now: it reads them once, when `ray` is first imported.

    Without this a process that imported Ray (or ran a local, auth-less Ray) before cannot join a
    token-auth cluster named later by a config. Ray's own tests reset the same two caches.
    """
    with suppress(Exception):
        raylet: Any = importlib.import_module("ray._raylet")  # compiled module: no type stubs
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


def started_here() -> bool:
    """True while a Ray this process started (not one it only connected to) is running."""
    return _started_here


def shutdown_ray() -> None:
    """Stop Ray if this process started it (a cluster we only connected to is left running)."""
    global _started_here

    if ray.is_initialized():
        ray.shutdown()
    _started_here = False


def kill_actors(handles: Sequence[Any]) -> None:
    """Best-effort: stop actors we started (on success, failure and cancellation alike)."""
    for handle in handles:
        with suppress(Exception):
            ray.kill(handle, no_restart=True)


def remote_options(num_gpus: float, num_cpus: float = 1) -> dict[str, Any]:
    """Ray resource request from a config's per-stage GPU count (0 on CPU machines)."""
    return {"num_cpus": num_cpus, "num_gpus": num_gpus}


# ---------------------------------------------------------------------------------------------------------
# Synthesis: greedy answers from the Hugging Face target, in bounded batches.
