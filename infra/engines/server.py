"""Start, watch, probe and stop one engine server process.

`EngineServer` runs the engine's OpenAI-compatible server from the engine's own Python, in its own
process group, with its output in a log file kept for the run's artifacts. Start-up fails fast: while
waiting for readiness the log is scanned as it grows for the engine's fatal patterns, and the process is
polled for exit; either raises `EngineStartError` carrying the log excerpt within a second or two.

Servers are stopped (SIGTERM, then SIGKILL, to the process group, by PID) on `stop()`, on leaving the
context manager, at interpreter exit and on SIGTERM/SIGINT to the orchestrator. A pidfile under the run
folder records each server, so the next start in that folder kills a stale one left by a crashed run
(leftovers.py); the cycle's PID record (`pid_record`) names it too, for the next run's reaper when the
driver itself was killed. In a Ray actor: infra/engines/actors.py.

A server binds `engine.host` (127.0.0.1 by default); bound beyond loopback it refuses to start without
`engine.api_key`, which every client of it sends as a bearer token (`Engine.request_headers`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from draftloop.infra.engines.base import (
    Engine,
    EngineConfigError,
    EngineError,
    ServerSpec,
    Speculation,
    is_loopback,
)
from draftloop.infra.engines.leftovers import (
    ServerPidfile,
    clean_stale_servers,
    group_pids,
    pid_tagged_shm,
    pidfile_path,
    remove_unused_shm,
    shm_held_by,
)
from draftloop.infra.runtime.ports import free_port
from draftloop.infra.runtime.processes import PidRecord, stop_processes
from draftloop.infra.runtime.redaction import redact_text

_POLL_S = 0.25


class EngineStartError(EngineError):
    """The server died or logged a fatal error before it became ready; carries the log excerpt."""

    def __init__(
        self,
        message: str,
        *,
        log_excerpt: str = "",
        log_path: Path | None = None,
        elapsed_s: float = 0.0,
        pattern: str | None = None,
    ) -> None:
        text = message
        if log_excerpt:
            text += f"\n--- server log ({log_path}) ---\n{log_excerpt}"
        super().__init__(text)
        self.summary = message
        self.log_excerpt = log_excerpt
        self.log_path = log_path
        self.elapsed_s = elapsed_s
        self.pattern = pattern


class EngineSmokeError(EngineError):
    """The server is up but a chat completion came back empty or failed."""


@dataclass(frozen=True)
class SmokeResult:
    """A chat completion's answer, with the reasoning a thinking model returns apart (None otherwise)."""

    content: str
    reasoning: str | None


# Servers started by this process, stopped at exit or on a terminating signal.
_LIVE: set[EngineServer] = set()
_LIVE_LOCK = threading.Lock()
_AT_EXIT_REGISTERED = False
_SIGNALS_HANDLED = False


def _stop_all_live() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _stop_all_live()
    previous = _PREVIOUS_HANDLERS.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_PREVIOUS_HANDLERS: dict[int, Any] = {}


def _install_exit_handlers() -> None:
    """Stop this process's servers at exit and on a terminating signal. Signal handlers can only be set
    from the main thread: a call from another (servers entered together start in threads) registers
    atexit only, and the next main-thread call sets them (a server object is made there first)."""
    global _AT_EXIT_REGISTERED, _SIGNALS_HANDLED
    if not _AT_EXIT_REGISTERED:
        _AT_EXIT_REGISTERED = True
        atexit.register(_stop_all_live)
    if _SIGNALS_HANDLED or threading.current_thread() is not threading.main_thread():
        return
    _SIGNALS_HANDLED = True
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            _PREVIOUS_HANDLERS[signum] = signal.getsignal(signum)
            signal.signal(signum, _on_signal)


class EngineServer:
    """One engine server: baseline (no `speculation`) or speculative (its drafter at its own k)."""

    def __init__(
        self,
        engine: Engine,
        target_dir: Path,
        run_dir: Path,
        *,
        name: str = "baseline",
        speculation: Speculation | None = None,
        port: int | None = None,
        served_model_name: str = "target",
        startup_timeout_s: float | None = None,
        pid_record: PidRecord | None = None,
    ) -> None:
        self.engine = engine
        self.target_dir = Path(target_dir).resolve()
        self.run_dir = Path(run_dir).resolve()
        self.name = name
        self.speculation = (
            Speculation(Path(speculation.drafter_dir).resolve(), speculation.num_speculative_tokens)
            if speculation is not None
            else None
        )
        self.port = port
        self.served_model_name = served_model_name
        self.startup_timeout_s = float(startup_timeout_s or engine.settings.startup_timeout_s)
        self.log_path = self.run_dir / f"server-{name}.log"
        self.pidfile = pidfile_path(self.run_dir, name)
        # The cycle's PID record: the server is in it from the moment it is spawned, so a driver killed
        # while the server starts still leaves it to the next run's reaper.
        self.pid_record = pid_record
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._started_at = 0.0
        self._own_shm: set[str] = set()
        self._own_pids: set[int] = set()
        self._argv: list[str] = []
        self.starts = 0  # how often the process was launched
        _install_exit_handlers()  # here, in the caller's thread: the start may run in another

    # ---- properties --------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise EngineError("server not started")
        host = self.engine.settings.host
        # A wildcard bind is reached through loopback here; a named address through itself.
        reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return f"http://{f'[{reach}]' if ':' in reach else reach}:{self.port}"

    @property
    def record_kind(self) -> str:
        return f"engine-{self.name}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EngineServer:
        """Clean stale state, then launch the server process (returns at once; see wait_ready)."""
        if self.process is not None:
            raise EngineError(f"server {self.name} already started")
        settings = self.engine.settings
        if not is_loopback(settings.host) and not settings.api_key:
            raise EngineConfigError(
                "engine.api_key",
                f"required: engine.host {settings.host!r} exposes the {self.engine.kind} server beyond "
                "this machine",
            )
        self.engine.check_python()
        if not (self.target_dir / "config.json").is_file():
            raise EngineError(f"target folder {self.target_dir} has no config.json")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        clean_stale_servers(self.run_dir, self.name)
        if self.port is None:
            self.port = free_port()
        argv = (
            self.engine.server_command(
                ServerSpec(
                    self.target_dir,
                    self.port,
                    served_model_name=self.served_model_name,
                    speculation=self.speculation,
                )
            )
            + self.engine.reasoning_args()
        )
        # Recorded as passed: it must equal /proc/<pid>/cmdline for the stale-server check.
        self._argv = argv
        log = self.log_path.open("wb")
        log.write(f"# draftloop: {redact_text(' '.join(argv))}\n".encode())
        log.flush()
        _install_exit_handlers()
        self._started_at = time.monotonic()
        try:
            self.process = subprocess.Popen(
                argv,
                env=self.engine.process_env(self.run_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(self.run_dir),
                start_new_session=True,  # its own process group: stop() signals the whole tree
            )
        finally:
            log.close()
        self.starts += 1
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._write_pidfile()
        if self.pid_record is not None:
            self.pid_record.add(self.record_kind, [self.process.pid])
        return self

    def _record_own_shm(self) -> None:
        """Tag the /dev/shm files this server's processes hold now as its own (pidfile included)."""
        if self.process is None:
            return
        pids = group_pids(self.process.pid)
        self._own_pids.update(pids)
        self._own_shm |= shm_held_by(pids) | pid_tagged_shm(self._own_pids)
        self._write_pidfile(self._own_shm)

    def _write_pidfile(self, shm_files: set[str] | None = None) -> None:
        if self.process is None:
            return
        record = ServerPidfile(
            pid=self.process.pid,
            argv=self._argv,
            name=self.name,
            port=self.port,
            log=str(self.log_path),
            shm_files=sorted(shm_files or []),
            owner=os.getpid(),
        )
        record.write(self.pidfile)

    def read_log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_excerpt(self, max_chars: int = 4000) -> str:
        """The end of the log, starting at the last traceback when there is one."""
        text = self.read_log()
        start = text.rfind("Traceback (most recent call last)")
        excerpt = text[start:] if start >= 0 else text
        if len(excerpt) > max_chars:
            excerpt = "...\n" + excerpt[-max_chars:]
        return excerpt.strip()

    def _fatal_in_log(self, text: str) -> tuple[str, str] | None:
        found = self.engine.find_fatal(text)
        if found is None:
            return None
        pattern, line = found
        return pattern.name, line

    def check_alive(self) -> None:
        """Raise EngineStartError when the process has exited or logged a fatal error."""
        if self.process is None:
            raise EngineError(f"server {self.name} not started")
        elapsed = time.monotonic() - self._started_at
        code = self.process.poll()
        fatal = self._fatal_in_log(self.read_log())
        if fatal is not None:
            name, line = fatal
            pattern = next(p for p in self.engine.fatal_patterns if p.name == name)
            hint = f" ({pattern.hint})" if pattern.hint else ""
            raise self._start_failure(f"failed after {elapsed:.1f}s: {line.strip()}{hint}", elapsed, name)
        if code is not None:
            raise self._start_failure(f"exited with code {code} after {elapsed:.1f}s", elapsed)

    def _start_failure(self, what: str, elapsed: float, pattern: str | None = None) -> EngineStartError:
        """Stop the server and describe why it never became ready (the caller raises it)."""
        excerpt = self.log_excerpt()
        self.stop()
        return EngineStartError(
            f"{self.engine.kind} server {self.name!r} {what}",
            log_excerpt=excerpt,
            log_path=self.log_path,
            elapsed_s=elapsed,
            pattern=pattern,
        )

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until /health and /v1/models answer; returns the start-up time in seconds."""
        if self.process is None:
            raise EngineError(f"server {self.name} not started")
        deadline = self._started_at + float(timeout_s or self.startup_timeout_s)
        health_ok = False
        with httpx.Client(timeout=2.0, headers=self.engine.request_headers()) as client:
            while True:
                self.check_alive()
                try:
                    if not health_ok:
                        health_ok = client.get(self.base_url + self.engine.health_path).status_code == 200
                    if health_ok:
                        response = client.get(self.base_url + self.engine.models_path)
                        if response.status_code == 200 and self.served_model_name in response.text:
                            break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    elapsed = time.monotonic() - self._started_at
                    raise self._start_failure(
                        f"not ready after {elapsed:.0f}s (engine.startup_timeout_s)", elapsed
                    )
                time.sleep(_POLL_S)
        self.startup_s = time.monotonic() - self._started_at
        self._record_own_shm()
        return self.startup_s

    def ensure_running(self) -> int:
        """Start the server again (and wait until ready) if its process has exited; its start count.

        For a server that others keep asking (the extraction server of an online stream): one killed
        mid-stream comes back on the same port, and a caller whose request failed asks again when the
        count has grown since its request. A server that logged a fatal error is not restarted:
        `check_alive` raises it with the log excerpt."""
        if self.process is not None and self.process.poll() is not None:
            if self._fatal_in_log(self.read_log()) is not None:
                self.check_alive()
            self.stop()
            self.log_path.replace(self.log_path.with_name(f"{self.log_path.name}.exited"))
            self.process = None
            self.start()
            self.wait_ready()
        return self.starts

    def smoke_test(self) -> SmokeResult:
        """One greedy chat completion; its content must be non-empty. A thinking target's (the settings
        name a reasoning parser): the seeds' "What is 2+2?", whose reasoning must come back apart from the
        content: a parser that leaves it in the content (or drops it) fails here, by name."""
        parser = self.engine.settings.reasoning_parser
        # Room to think before answering (a cut-off thought leaves the content empty: named below too).
        prompt, max_tokens = ("What is 2+2?", 512) if parser else ("Say hello.", 16)
        body = {
            "model": self.served_model_name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        try:
            response = httpx.post(
                self.base_url + "/v1/chat/completions",
                json=body,
                headers=self.engine.request_headers(),
                timeout=120.0,
            )
        except httpx.HTTPError as exc:
            self.check_alive()
            raise EngineSmokeError(f"server {self.name!r}: chat completion failed: {exc}") from exc
        if response.status_code != 200:
            raise EngineSmokeError(
                f"server {self.name!r}: chat completion returned {response.status_code}: "
                f"{response.text[:500]}"
            )
        message = response.json()["choices"][0]["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if not content.strip():
            raise EngineSmokeError(
                f"server {self.name!r}: chat completion content is empty"
                + (f" (reasoning: {str(reasoning)[:200]!r})" if reasoning else "")
            )
        if parser and not str(reasoning or "").strip():
            raise EngineSmokeError(
                f"server {self.name!r}: the reasoning parser {parser!r} returned no reasoning for {prompt!r} "
                f"(content: {content[:200]!r}): the target's thinking is dropped or left in the content"
            )
        return SmokeResult(content=content, reasoning=reasoning)

    def metrics_text(self) -> str:
        response = httpx.get(
            self.base_url + self.engine.metrics_path, headers=self.engine.request_headers(), timeout=30.0
        )
        response.raise_for_status()
        return response.text

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM then SIGKILL the server's process group; idempotent."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            self._record_own_shm()
            stop_processes([process.pid], grace_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5.0)
        else:
            # The leader exited; its children (engine core, workers) may not have.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        # The server's own /dev/shm files (held by its process group while it ran) that no live
        # process holds any more: its leftovers. Files of other processes are never touched.
        remove_unused_shm(self._own_shm | pid_tagged_shm(self._own_pids))
        self.pidfile.unlink(missing_ok=True)
        if self.pid_record is not None:
            self.pid_record.forget(self.record_kind)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def __enter__(self) -> EngineServer:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __hash__(self) -> int:
        return id(self)


# start_server(name, speculation): a context manager yielding a running server (speculation None: a
# baseline). The evaluation starts every server through one; infra/engines/actors.py has the Ray one.
StartServer = Callable[[str, Speculation | None], AbstractContextManager[Any]]


def local_server_starter(engine: Engine, target_dir: Path, run_dir: Path) -> StartServer:
    """`StartServer` without Ray: each server an EngineServer in this process."""

    @contextlib.contextmanager
    def start(name: str, speculation: Speculation | None) -> Iterator[EngineServer]:
        with EngineServer(engine, target_dir, run_dir, name=name, speculation=speculation) as server:
            yield server

    return start
