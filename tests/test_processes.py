"""infra/processes.py: liveness that sees through zombies, and TERM-then-KILL of process groups."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from draftloop.infra.processes import PidRecord, is_alive, stop_processes


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_dead_child_not_yet_reaped_is_not_alive() -> None:
    child = subprocess.Popen(["sleep", "30"])
    assert is_alive(child.pid)
    child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(child.pid) == "Z"  # kill(pid, 0) would still succeed
    assert not is_alive(child.pid)
    child.wait()
    assert not is_alive(child.pid)


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    ignores_term = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    ignores_term += "subprocess.Popen(['sleep', '60']); print('ready', flush=True); time.sleep(60)"
    leader = subprocess.Popen(
        [sys.executable, "-c", ignores_term], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout is not None and leader.stdout.readline().strip() == "ready"
    record = PidRecord(tmp_path / "pids.json")
    record.add("server", [leader.pid])
    started = time.monotonic()
    assert record.stop_all(grace_s=0.5) == [leader.pid]
    assert 0.5 <= time.monotonic() - started < 10  # TERM ignored for the whole grace period, then KILL
    # stop_processes reaps its own children, so the exit status may be consumed already (Popen then
    # reports 0): what counts is that the leader is gone.
    assert leader.wait(timeout=10) in (-signal.SIGKILL, 0)
    assert not is_alive(leader.pid)
    group = subprocess.run(["pgrep", "-g", str(leader.pid)], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in group if is_alive(int(pid))]  # the child went too (a zombie at most)
    assert not record.path.exists()
    assert stop_processes([leader.pid]) == []  # nothing left to signal
