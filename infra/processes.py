"""Processes draftloop starts: where their records live, whether they run, how they are stopped.

Engine servers, the local Prefect/MLflow services and a cycle's Ray head each lead their own process
group (their workers are in it). Stopping one is SIGTERM to the group, a grace period, then SIGKILL to
the group, because children may outlive their leader. PIDs are written to record files under the state
folder so that another process (a Prefect cancellation hook, `draftloop down`) can stop them later.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

_POLL_S = 0.1


def state_dir(root: Path | None = None) -> Path:
    """`<root or cwd>/.draftloop`: PID records, services, work folders; DRAFTLOOP_STATE_DIR overrides.

    Tests point DRAFTLOOP_STATE_DIR elsewhere to keep their state out of the checkout.
    """
    override = os.environ.get("DRAFTLOOP_STATE_DIR")
    return Path(override).resolve() if override else (root or Path.cwd()).resolve() / ".draftloop"


def is_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (a dead child not reaped yet) counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        # /proc/<pid>/stat: "pid (comm) state ..."; comm may contain spaces and parentheses.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return True  # no readable /proc entry: kill(0) said it exists
    return state != "Z"


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pid: int, group: bool, signum: int) -> bool:
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_processes(pids: Iterable[int], grace_s: float = 10.0, *, term_attempts: int = 1) -> list[int]:
    """Stop `pids`: SIGTERM (to the process group of each PID that leads one), wait, then SIGKILL.

    All are signalled first and share one `grace_s` deadline. `term_attempts` > 1 repeats SIGTERM after
    each grace period (a Prefect worker shuts down only on the second one). Groups get SIGKILL even when
    their leader already exited. Children of this process are reaped. Returns the PIDs signalled.
    """
    groups = {pid: _leads_group(pid) for pid in pids if pid > 0}
    signalled: list[int] = []
    for attempt in range(max(1, term_attempts)):
        waiting = [
            pid for pid, group in groups.items() if is_alive(pid) and _signal(pid, group, signal.SIGTERM)
        ]
        if attempt == 0:
            signalled = list(waiting)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(is_alive(pid) for pid in waiting):
            _reap(waiting)
            time.sleep(_POLL_S)
        if not any(is_alive(pid) for pid in waiting):
            break
    for pid, group in groups.items():
        if group or is_alive(pid):
            _signal(pid, group, signal.SIGKILL)
    _reap(list(groups))
    return signalled


def _reap(pids: list[int]) -> None:
    for pid in pids:
        with suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


class PidRecord:
    """A JSON file `{kind: [pid, ...]}` naming the processes one owner (a cycle) started."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, list[int]]:
        if not self.path.exists():
            return {}
        record: dict[str, list[int]] = json.loads(self.path.read_text())
        return record

    def add(self, kind: str, pids: Iterable[int]) -> None:
        record = self.read()
        record[kind] = sorted({*record.get(kind, []), *pids})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record))

    def forget(self, kind: str) -> None:
        record = self.read()
        if record.pop(kind, None) is not None:
            self.path.write_text(json.dumps(record))

    def stop_all(self, grace_s: float = 10.0) -> list[int]:
        """Stop every recorded process and delete the record; returns the PIDs signalled."""
        pids = [pid for kind_pids in self.read().values() for pid in kind_pids]
        signalled = stop_processes(pids, grace_s) if pids else []
        self.path.unlink(missing_ok=True)
        return signalled
