"""Engine servers hosted in Ray actors: what the evaluate and synthesize stages start and talk to.

Each server runs in an `EngineServerActor` (on the node and GPUs Ray gives it, `engine.num_gpus`);
the driver talks to it over HTTP through a `ServerProxy`. A server's process group is recorded in the
cycle's PID record, so a cancelled or crashed flow run stops it even if this process dies.
`server_starter` is the evaluation's `StartServer` with each server in an actor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from draftloop.infra.engines.base import Engine, EngineSettings, Speculation
from draftloop.infra.engines.leftovers import clean_stale_servers
from draftloop.infra.engines.server import EngineServer, EngineStartError, SmokeResult, StartServer
from draftloop.infra.runtime.processes import PidRecord
from draftloop.infra.runtime.ray_cluster import kill_actors

# How long a server may take to shut down from inside its actor before the actor is killed.
_STOP_TIMEOUT_S = 60


class EngineServerActor:
    """Hosts one EngineServer inside a Ray actor (on the node and GPUs Ray gives it).

    Create with `EngineServerActor.options_for(settings).remote(EngineServer(...))`: num_gpus comes from
    the engine config (0 on CPU); the server, not started yet, travels pickled and starts on the actor's
    node. The benchmark client talks to the url `start()` returns over HTTP.
    """

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def start(self) -> dict[str, Any]:
        """Start and wait until ready; returns url, startup_s, log path (EngineStartError propagates)."""
        self.server.start()
        startup = self.server.wait_ready()
        return {"url": self.server.base_url, "startup_s": startup, "log_path": str(self.server.log_path)}

    def smoke_test(self) -> SmokeResult:
        return self.server.smoke_test()

    def metrics_text(self) -> str:
        return self.server.metrics_text()

    def check_alive(self) -> None:
        """EngineStartError (with the log excerpt) when the server has exited or logged a fatal error."""
        self.server.check_alive()

    def ensure_running(self) -> int:
        """The server's start count, after starting it again if its process had died (the actor's
        calls run one at a time: callers that find it dead together cause one restart)."""
        return self.server.ensure_running()

    def start_count(self) -> int:
        return self.server.starts

    def stop(self) -> None:
        self.server.stop()

    @staticmethod
    def options_for(settings: EngineSettings, **options: Any) -> Any:
        """The ray.remote actor class with the resources the engine config asks for."""
        return ray.remote(num_gpus=settings.num_gpus, num_cpus=0, max_restarts=0, **options)(
            EngineServerActor
        )


@dataclass
class ServerProxy:
    """A running server in a Ray actor, as evaluation's `ServerHandle` and synthesis see it."""

    actor: Any  # the EngineServerActor handle
    base_url: str
    startup_s: float | None
    log_path: Path
    model_name: str = "target"

    def metrics_text(self) -> str:
        return str(ray.get(self.actor.metrics_text.remote()))

    def smoke_test(self) -> SmokeResult:
        result: SmokeResult = ray.get(self.actor.smoke_test.remote())
        return result

    def raise_if_died(self, error: Exception) -> None:
        """When the server has died, raise its own failure (exit code, log excerpt) from `error`: a
        request that failed because the server died says why it died, and stays retryable unless
        the server logged a fatal error."""
        try:
            ray.get(self.actor.check_alive.remote(), timeout=_STOP_TIMEOUT_S)
        except ray.exceptions.RayTaskError as wrapped:
            if isinstance(wrapped.cause, EngineStartError):
                raise wrapped.cause from error
        except ray.exceptions.RayError:
            pass  # the actor itself is gone: nothing more to tell than `error`

    def stop(self) -> None:
        # Stop the server from inside the actor first: killing the actor alone would orphan it.
        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=_STOP_TIMEOUT_S)
        kill_actors([self.actor])


def start_server_actor(
    engine: Engine,
    target_path: str | Path,
    run_dir: Path,
    name: str,
    speculation: Speculation | None = None,
    pids: PidRecord | None = None,
    **actor_options: Any,
) -> ServerProxy:
    """Start one engine server in a Ray actor and wait until it is ready (Ray must be initialised).

    `actor_options` go to `ray.remote` (e.g. a `runtime_env`). The server adds its PID to `pids` under
    `engine-<name>` as soon as it is spawned, and removes it once stopped.
    """
    clean_stale_servers(run_dir)  # a previous attempt killed mid-way may have left one behind
    server = EngineServer(
        engine,
        Path(target_path),
        run_dir,
        name=name,
        speculation=speculation,
        pid_record=pids,
    )
    actor = EngineServerActor.options_for(engine.settings, **actor_options).remote(server)
    try:
        info = ray.get(actor.start.remote())
    except BaseException as error:
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=_STOP_TIMEOUT_S)
        kill_actors([actor])
        cause = getattr(error, "cause", None)  # RayTaskError wraps the actor's own exception
        if isinstance(cause, Exception) and cause is not error:
            raise cause from error
        raise
    return ServerProxy(
        actor=actor, base_url=info["url"], startup_s=info["startup_s"], log_path=Path(info["log_path"])
    )


def server_starter(
    engine: Engine,
    target_path: str | Path,
    run_dir: Path,
    pids: PidRecord | None = None,
    **actor_options: Any,
) -> StartServer:
    """evaluation's `start_server(name, speculation)`: each server in its own actor, stopped on exit."""

    @contextlib.contextmanager
    def start(name: str, speculation: Speculation | None) -> Iterator[ServerProxy]:
        server = start_server_actor(engine, target_path, run_dir, name, speculation, pids, **actor_options)
        try:
            yield server
        except Exception as error:
            server.raise_if_died(error)
            raise
        finally:
            server.stop()

    return start
