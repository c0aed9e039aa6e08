"""What an engine server leaves behind, and its cleanup: the pidfile and the /dev/shm files.

Each server records itself in a pidfile under its run folder (`<run>/engine-servers/<name>.json`): its
PID, process group, argv and the /dev/shm files its processes held. The next start in that folder
(`clean_stale_servers`) kills a server a crashed run left behind, when the live process still runs the
recorded command line (PIDs get reused), and removes its recorded /dev/shm files that no live process
holds. Files of other processes are never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from draftloop.infra.runtime.processes import is_alive, stop_processes

SHM_DIR = Path("/dev/shm")
PIDFILE_DIR_NAME = "engine-servers"


@dataclass(frozen=True)
class ServerPidfile:
    """One server's record in its run folder (pgid = pid: each server leads its own process group)."""

    pid: int
    argv: list[str]  # as passed: it must equal /proc/<pid>/cmdline for the stale-server check
    name: str
    port: int | None
    log: str
    shm_files: list[str]  # sorted
    # The process that started the server: while it lives, the server is its (two may share a folder:
    # a baseline and a speculative server measured in turns), not a leftover.
    owner: int = 0

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {**asdict(self), "pgid": self.pid, "started": time.time()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)


def pidfile_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / PIDFILE_DIR_NAME / f"{name}.json"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                # /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may contain spaces.
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    pids.append(int(proc.name))
    return pids


def shm_held_by(pids: Iterable[int]) -> set[str]:
    """/dev/shm files the processes `pids` have open or mapped."""
    held: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix):
                        held.add(target[len(prefix) :].split(" ")[0])
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text(errors="replace").splitlines():
                index = line.find(prefix)
                if index >= 0:
                    held.add(line[index + len(prefix) :].split(" ")[0])
    return held


def _shm_in_use() -> set[str]:
    """Names of /dev/shm files some live process has open or mapped."""
    return shm_held_by(int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit())


_KMP_FILE = re.compile(r"^__KMP_REGISTERED_LIB_(\d+)_")


def pid_tagged_shm(pids: set[int]) -> set[str]:
    """Files Intel OpenMP (libiomp5, preloaded for vLLM CPU) registers under its process id."""
    names: set[str] = set()
    with contextlib.suppress(OSError):
        for path in SHM_DIR.iterdir():
            match = _KMP_FILE.match(path.name)
            if match and int(match.group(1)) in pids:
                names.add(path.name)
    return names


def remove_unused_shm(names: set[str]) -> list[str]:
    """Remove the /dev/shm files `names` that no live process holds; returns those removed."""
    if not names:
        return []
    in_use = _shm_in_use()
    removed = []
    for name in sorted(names - in_use):
        match = _KMP_FILE.match(name)
        if match and is_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            (SHM_DIR / name).unlink()
            removed.append(name)
    return removed


def clean_stale_servers(run_dir: Path, name: str | None = None) -> list[int]:
    """Kill servers recorded in run_dir's pidfiles whose command line still matches — those whose
    starter has exited, and the one recorded as `name` (about to start again); remove their recorded
    /dev/shm files. A live process's other servers are left running. Returns the PIDs killed."""
    killed: list[int] = []
    folder = Path(run_dir) / PIDFILE_DIR_NAME
    if not folder.is_dir():
        return killed
    for pidfile in folder.glob("*.json"):
        try:
            record = json.loads(pidfile.read_text())
        except (OSError, json.JSONDecodeError):
            pidfile.unlink(missing_ok=True)
            continue
        pid = int(record.get("pid", 0))
        owner = int(record.get("owner", 0))
        if owner > 0 and is_alive(owner) and record.get("name") != name:
            continue  # a sibling server of a live run
        # Only ours: the live process must still run the command line we recorded (PIDs get reused).
        if pid > 0 and is_alive(pid) and _cmdline(pid) == list(record.get("argv", [])):
            stop_processes([int(record.get("pgid", pid))], grace_s=5.0)
            killed.append(pid)
        remove_unused_shm({str(name) for name in record.get("shm_files", []) if "/" not in str(name)})
        pidfile.unlink(missing_ok=True)
    return killed
