"""One run of the cycle as its stages see it: its config, tracker, run folder, timings and outcomes.

The flow builds a `CycleContext` and hands it to every stage (tasks/stage.py runs them); progress
markers go to the run folder, where anyone can watch them, and to the `draftloop.progress` logger, where
in-process observers (the CLI's progress bars) attach a handler.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from draftloop.infra.registry.challenge import Challenge
from draftloop.infra.registry.runs import Tracker
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, pid_records_dir
from draftloop.infra.runtime.storage import join, storage_options, write_text_atomic
from draftloop.tasks.cache import StageOutcome

# Stage events ("started", "running", "done", "failed"), each record carrying `stage` and `event`.
PROGRESS_LOG = logging.getLogger("draftloop.progress")
PROGRESS_LOG.setLevel(logging.INFO)
PROGRESS_LOG.propagate = False  # for observers that attach a handler, not for the console


def run_folder_uri(config: ExperimentConfig, run_id: str) -> str:
    """`<storage.root>/<name>/cycles/<run id>`: the run's config, progress markers and summary."""
    return join(str(config.storage.root), config.name, "cycles", run_id)


def cycle_pids(run_id: str) -> PidRecord:
    """The processes run `run_id` started (engine servers, its Ray head), for cancellation hooks and
    for the reaper of the next run (`reap_dead_records`) should its driver die."""
    return PidRecord(pid_records_dir() / f"cycle-{run_id}.json")


@dataclass
class StageTiming:
    seconds: float
    cache_hit: bool
    figures: dict[str, Any] = field(default_factory=dict)  # the stage's declared figures, by label
    shown: dict[str, str] = field(default_factory=dict)  # the same as people read them ("41.2 %")


@dataclass
class CycleContext:
    """One flow run: its config, tracker, run folder, stage timings and what it started."""

    config: ExperimentConfig
    run_id: str
    tracker: Tracker
    run_uri: str
    timings: dict[str, StageTiming] = field(default_factory=dict)
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)
    origin: str | None = None  # what runs this cycle when not a person: a sweep (the registry says so)
    challenge: Challenge | None = None  # a refresh's champion against this drafter (the gate reads it)

    @property
    def pids(self) -> PidRecord:
        return cycle_pids(self.run_id)

    def write_text(self, name: str, text: str) -> None:
        """Write `<run folder>/<name>` (atomically, on any storage)."""
        write_text_atomic(join(self.run_uri, name), text, storage_options(self.config))

    def mark(self, stage: str, event: str) -> None:
        """`<run folder>/stages/<stage>.<event>`: progress anyone can watch (tests, people, the CLI)."""
        self.write_text(f"stages/{stage}.{event}", time.strftime("%Y-%m-%dT%H:%M:%S"))
        # logging isolates handlers: a broken progress bar cannot fail a stage
        PROGRESS_LOG.info("%s %s", stage, event, extra={"stage": stage, "event": event})
