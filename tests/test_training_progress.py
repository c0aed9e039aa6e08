"""Train's progress while Ray Train runs: rank 0's epoch lines, tailed by the driver, become one log line
per epoch in the stage's run log and the epoch's metrics in its MLflow run, before training ends."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from draftloop.infra.runtime.stage_log import forwarded_to
from draftloop.infra.training import progress
from draftloop.infra.training.progress import (
    PROGRESS_FILE,
    EpochProgress,
    append_epoch,
    epoch_reporter,
    watch_epochs,
)


class _FakeRun:
    """Records what a StageRun would send to MLflow."""

    def __init__(self) -> None:
        self.histories: list[list[dict[str, float]]] = []
        self.metrics: list[tuple[dict[str, float], int | None]] = []

    def log_metric_history(self, rows: list[dict[str, float]], step_key: str = "step") -> None:
        self.histories.append(rows)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((dict(metrics), step))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _epoch(epoch: int, loss: float, length: float | None) -> EpochProgress:
    steps = [{"step": 2 * epoch + i + 1, "loss": loss, "lr": 1e-3, "acc_0": 0.5} for i in range(2)]
    return EpochProgress(epoch, 8, loss, length, steps)


def test_the_epoch_line_names_epoch_loss_and_held_out_acceptance() -> None:
    assert _epoch(2, 10.0, 2.4913).line() == "train: epoch 3/8: loss 10, held-out AL 2.49"
    assert _epoch(0, 5.4321, None).line() == "train: epoch 1/8: loss 5.43"


def test_epochs_are_reported_while_the_block_runs_not_after(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(progress, "POLL_SECONDS", 0.05)
    append_epoch(tmp_path, _epoch(0, 9.0, 1.1))  # an earlier attempt's line: not reported again
    seen: list[tuple[EpochProgress, float]] = []
    first_reported = threading.Event()

    def report(epoch: EpochProgress) -> None:
        seen.append((epoch, time.monotonic()))
        first_reported.set()

    with watch_epochs(tmp_path, report):
        append_epoch(tmp_path, _epoch(1, 8.0, 1.5))
        assert first_reported.wait(5), "the epoch was not reported while training ran"
        with (tmp_path / PROGRESS_FILE).open("a") as out:
            out.write('{"epoch": 2, "epo')  # a line being written: waits until it is complete
        time.sleep(0.2)
        assert [epoch.epoch for epoch, _ in seen] == [1]
        with (tmp_path / PROGRESS_FILE).open("a") as out:
            out.write('chs": 8, "loss": 7.0, "held_out_acceptance_length": 2.0, "steps": []}\n')
        ended = time.monotonic()
    assert [epoch.epoch for epoch, _ in seen] == [1, 2]  # the last one drained when the block ends
    assert seen[0][1] < ended


def test_each_epoch_reaches_the_run_log_and_mlflow(tmp_path: Path) -> None:
    run = _FakeRun()
    lines = _Lines()
    run_log = logging.getLogger("test.train.run_log")  # stands in for the Prefect run logger
    run_log.addHandler(lines)
    run_log.setLevel(logging.INFO)
    try:
        with forwarded_to(run_log):
            report = epoch_reporter(run)  # type: ignore[arg-type]
            report(_epoch(0, 9.5, 1.24))
            report(_epoch(1, 8.25, None))
    finally:
        run_log.removeHandler(lines)
    assert lines.messages == ["train: epoch 1/8: loss 9.5, held-out AL 1.24", "train: epoch 2/8: loss 8.25"]
    assert [row["step"] for rows in run.histories for row in rows] == [1, 2, 3, 4]
    assert run.metrics == [({"held_out_acceptance_length": 1.24}, 0)]
