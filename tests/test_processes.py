"""infra/runtime/processes.py: liveness that sees through zombies, TERM-then-KILL of process groups, and the
reaping of what a killed run left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from draftloop.infra.runtime.processes import PidRecord, is_alive, reap_dead_records, stop_processes


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

    def group_alive() -> list[str]:
        group = subprocess.run(
            ["pgrep", "-g", str(leader.pid)], capture_output=True, text=True
        ).stdout.split()
        return [pid for pid in group if is_alive(int(pid))]

    deadline = time.monotonic() + 5  # SIGKILL is delivered when the child is next scheduled
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive()  # the child went too (a zombie at most)
    assert not record.path.exists()
    assert stop_processes([leader.pid]) == []  # nothing left to signal


def _dead_pid() -> int:
    """The PID of a process that has exited and been reaped (a driver killed by SIGKILL, say)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_records_of_a_dead_driver_are_reaped_and_a_live_drivers_are_kept(tmp_path: Path) -> None:
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)  # an engine server left behind
    kept = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a live run's server
    try:
        dead_run = PidRecord(tmp_path / "cycle-dead.json")
        dead_run.add("engine-baseline", [orphan.pid])
        # The record's driver: this test claimed it, now pretend it was a driver that died by SIGKILL.
        record = json.loads(dead_run.path.read_text())
        record["driver"] = {"pid": _dead_pid(), "started": 1}
        dead_run.path.write_text(json.dumps(record))
        live_run = PidRecord(tmp_path / "cycle-live.json")
        live_run.claim()  # this process: alive
        live_run.add("engine-baseline", [kept.pid])

        assert reap_dead_records(tmp_path, grace_s=2) == [orphan.pid]
        assert not is_alive(orphan.pid)  # (reaped by stop_processes: its exit status is not ours to see)
        assert not dead_run.path.exists()
        assert is_alive(kept.pid)
        assert live_run.read() == {"engine-baseline": [kept.pid]}
    finally:
        for process in (orphan, kept):
            stop_processes([process.pid], grace_s=1)


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    """A record names a process by PID and start time: a stranger now holding that PID is left alone."""
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        record = PidRecord(tmp_path / "cycle-old.json")
        record.add("engine-baseline", [stranger.pid])
        stored = json.loads(record.path.read_text())
        stored["driver"] = {"pid": _dead_pid(), "started": 1}
        stored["processes"]["engine-baseline"][0]["started"] -= 1  # the recorded process started earlier
        record.path.write_text(json.dumps(stored))
        assert reap_dead_records(tmp_path, grace_s=1) == []
        assert is_alive(stranger.pid)
        assert not record.path.exists()
    finally:
        stop_processes([stranger.pid], grace_s=1)


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, sys.argv[2].encode(), 0)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _hold(path: Path, holder: str, seconds: float) -> subprocess.Popen[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(path), holder, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_held_lock_is_waited_for_and_one_whose_holder_died_is_not(tmp_path: Path, monkeypatch) -> None:
    from draftloop.infra.runtime.processes import held_exclusively

    monkeypatch.setenv("DRAFTLOOP_STATE_DIR", str(tmp_path))
    lock = tmp_path / "locks" / "cycle-train-abc.lock"
    told: list[str] = []
    holder = _hold(lock, "", 2.0)
    try:
        started = time.monotonic()
        with held_exclusively("cycle-train-abc", on_wait=told.append):
            waited = time.monotonic() - started
        assert waited >= 1.0 and len(told) == 1  # waited for the live holder and said so once
    finally:
        holder.kill()
        holder.wait()

    # A forked child kept the lock of a run that died: its recorded holder is dead, so nobody waits.
    orphan = _hold(lock, f"pid {_dead_pid()} since earlier", 60.0)
    try:
        started = time.monotonic()
        with held_exclusively("cycle-train-abc"):
            assert time.monotonic() - started < 5.0
    finally:
        orphan.kill()
        orphan.wait()
