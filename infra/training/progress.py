"""Training progress while Ray Train runs: one line per epoch in the stage's log, and the epoch's metrics
in its MLflow run as they come, not all at once at the end.

Rank 0 appends one JSON line per epoch to `<work dir>/progress.jsonl` (`append_epoch`: the worker knows no
MLflow or Prefect); the driver tails that file while `trainer.fit()` blocks (`watch_epochs`, a thread
run in the caller's context, so its log lines reach the caller's Prefect run) and reports each epoch
(`epoch_reporter`). The work dir is where rank 0's checkpoints and `final/` already go, read by the
driver the same way.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftloop.infra.runtime.stage_log import STAGE_LOG

if TYPE_CHECKING:  # the driver's MLflow run; a training worker imports this module without MLflow
    from draftloop.infra.registry.runs import StageRun

PROGRESS_FILE = "progress.jsonl"
POLL_SECONDS = 1.0


def step_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """One optimizer step's record as MLflow metrics: loss, lr and the accuracy of each TTT step."""
    return {
        "step": record["step"],
        "loss": record["loss"],
        "lr": record["lr"],
        **{f"acc_{i}": a for i, a in enumerate(record["acc"])},
    }


@dataclass(frozen=True)
class EpochProgress:
    """One finished epoch as rank 0 saw it."""

    epoch: int  # 0-based, as the training history counts
    epochs: int
    loss: float
    held_out_acceptance_length: float | None
    steps: list[dict[str, float]] = field(default_factory=list)  # step_metrics of the epoch's steps

    def line(self) -> str:
        """`train: epoch 3/8: loss 10.0, held-out AL 2.49`."""
        text = f"train: epoch {self.epoch + 1}/{self.epochs}: loss {self.loss:.3g}"
        if self.held_out_acceptance_length is not None:
            text += f", held-out AL {self.held_out_acceptance_length:.2f}"
        return text


def append_epoch(work_dir: Path, progress: EpochProgress) -> None:
    """Rank 0, after each epoch: one complete line (the reader takes only lines ending in a newline)."""
    Path(work_dir).mkdir(parents=True, exist_ok=True)  # the first epoch may end before any checkpoint
    with (Path(work_dir) / PROGRESS_FILE).open("a") as out:
        out.write(json.dumps(asdict(progress)) + "\n")


def epoch_reporter(run: StageRun | None) -> Callable[[EpochProgress], None]:
    """Each epoch: its line into STAGE_LOG, its steps' curves and held-out AL into `run` (None: log only)."""

    def report(progress: EpochProgress) -> None:
        STAGE_LOG.info("%s", progress.line())
        if run is None:
            return
        run.log_metric_history(progress.steps)
        if progress.held_out_acceptance_length is not None:
            run.log_metrics(
                {"held_out_acceptance_length": progress.held_out_acceptance_length}, step=progress.epoch
            )

    return report


class _Tail:
    """The lines appended to a file since it was opened here (an earlier attempt's lines are skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as source:
            source.seek(self.offset)
            chunk = source.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        return [line for line in complete.decode().splitlines() if line.strip()]


@contextmanager
def watch_epochs(work_dir: Path, report: Callable[[EpochProgress], None]) -> Iterator[None]:
    """While the block runs (trainer.fit), report every epoch rank 0 appends under `work_dir`."""
    tail = _Tail(Path(work_dir) / PROGRESS_FILE)
    stop = threading.Event()

    def drain() -> None:
        for line in tail.new_lines():
            try:
                report(EpochProgress(**json.loads(line)))
            except Exception as error:  # progress must never fail the training it reports on
                STAGE_LOG.warning("train: could not report an epoch: %s", error)

    def loop() -> None:
        while not stop.wait(POLL_SECONDS):
            drain()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(loop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        drain()  # what the last epoch wrote after the last poll
