"""Processes draftloop starts: where their records live, whether they run, how they are stopped.

Engine servers, the local Prefect/MLflow services and a cycle's Ray head each lead their own process
group (their workers are in it). Stopping one is SIGTERM to the group, a grace period, then SIGKILL to
the group, because children may outlive their leader. PIDs are written to record files under the state
folder so that another process (a Prefect cancellation hook, `draftloop down`, the next run after a
SIGKILL: `reap_dead_records`) can stop them later.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

_POLL_S = 0.1
_LOCK_POLL_S = 0.5


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


def process_start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None if it is gone.

    A PID and its start time name one process for good: a PID reused by a new process has another
    start time, so a stale record never makes us signal a stranger.
    """
    try:
        # After "pid (comm)": state is field 3 of the line, starttime field 22, i.e. index 19 here.
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _runs(pid: int, started: int | None) -> bool:
    """True while the process recorded as (`pid`, `started`) still runs (not a reuse of its PID).

    A process recorded without a start time was already gone when it was recorded.
    """
    return started is not None and is_alive(pid) and process_start_time(pid) == started


def pid_records_dir() -> Path:
    """`<state>/pids/`: every PID record (one per cycle run, one per driver), scanned by the reaper."""
    return state_dir() / "pids"


class PidRecord:
    """A JSON file naming the processes one owner (a cycle, a driver) started, and the driver it runs in.

    `{"driver": {"pid", "started"}, "processes": {kind: [{"pid", "started"}, ...]}}`. The driver is the
    process that claimed the record first (the cycle's driver; engine servers started from Ray actors add
    to it, keeping that driver). While the driver runs, the record is its business; once it is gone (a
    SIGKILL leaves no one to clean up), `reap_dead_records` stops what the record names.
    Updates are read-modify-write under a lock file and replace the file atomically.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> dict[str, Any]:
        try:
            loaded: dict[str, Any] = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return loaded

    @contextmanager
    def _update(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            record = self._load()
            record.setdefault("driver", _identity(os.getpid()))
            record.setdefault("processes", {})
            yield record
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(self.path)

    def claim(self) -> None:
        """Name this process as the record's driver (the cycle's driver, before it starts anything)."""
        with self._update() as record:
            record["driver"] = _identity(os.getpid())

    def driver(self) -> tuple[int, int | None] | None:
        """(pid, start time) of the record's driver, None when nothing was recorded."""
        found = self._load().get("driver")
        return (int(found["pid"]), found.get("started")) if found else None

    def driver_alive(self) -> bool:
        found = self.driver()
        return found is not None and _runs(*found)

    def read(self) -> dict[str, list[int]]:
        """The recorded PIDs by kind."""
        processes = self._load().get("processes", {})
        return {kind: [int(entry["pid"]) for entry in entries] for kind, entries in processes.items()}

    def add(self, kind: str, pids: Iterable[int]) -> None:
        with self._update() as record:
            entries = {int(entry["pid"]): entry for entry in record["processes"].get(kind, [])}
            for pid in pids:
                entries[int(pid)] = _identity(int(pid))
            record["processes"][kind] = [entries[pid] for pid in sorted(entries)]

    def forget(self, kind: str) -> None:
        if not self.path.exists():
            return
        with self._update() as record:
            record["processes"].pop(kind, None)

    def stop_all(self, grace_s: float = 10.0) -> list[int]:
        """Stop every recorded process still running and delete the record; returns the PIDs signalled."""
        processes = self._load().get("processes", {})
        running = [
            int(entry["pid"])
            for entries in processes.values()
            for entry in entries
            if _runs(int(entry["pid"]), entry.get("started"))
        ]
        signalled = stop_processes(running, grace_s) if running else []
        self.path.unlink(missing_ok=True)
        self.path.with_name(self.path.name + ".lock").unlink(missing_ok=True)
        return signalled


def _identity(pid: int) -> dict[str, Any]:
    return {"pid": pid, "started": process_start_time(pid)}


def reap_dead_records(folder: Path | None = None, grace_s: float = 10.0) -> list[int]:
    """Stop the processes named by records whose driver is gone, and delete those records.

    Called when a run starts: a driver killed by SIGKILL (or the OOM killer) never ran its cleanup, so
    its Prefect server, Ray head and engine servers may still run. Records of live drivers are left
    alone. Returns the PIDs signalled.
    """
    signalled: list[int] = []
    for path in sorted((folder or pid_records_dir()).glob("*.json")):
        record = PidRecord(path)
        try:
            if record.driver_alive():
                continue
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: nothing it names can be trusted
            path.unlink(missing_ok=True)
            continue
        signalled += record.stop_all(grace_s)
    return signalled


@contextmanager
def held_exclusively(name: str, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock `name` (a file under the state folder's `locks/`) while the block runs.

    Another live holder makes this wait; `on_wait(holder)` is told who holds it first. The kernel drops
    the lock when its holder exits (SIGKILL included); a lock whose recorded holder is dead (a forked
    child kept it) is not waited for.
    """
    path = state_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                pid = int(holder.split()[1]) if holder.startswith("pid ") else 0
                if pid and not is_alive(pid):
                    break
                if on_wait is not None and not told:
                    on_wait(holder or "another process")
                    told = True
                time.sleep(_LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
