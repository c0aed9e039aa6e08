"""The lines a long stage writes while it runs: a server up, a concurrency level measured, an epoch trained.

infra/ knows no Prefect: it logs to `STAGE_LOG` (`draftloop.stage`); tasks/stage.py forwards that logger's
records into the Prefect run log of the stage's task run for as long as the stage runs (`forwarded_to`).
The logger does not propagate: the Prefect run logger prints the forwarded line once, on its own console.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STAGE_LOG = logging.getLogger("draftloop.stage")
STAGE_LOG.setLevel(logging.INFO)
STAGE_LOG.propagate = False


class _Forward(logging.Handler):
    """Hands each record's message to `target` (a Prefect run logger: its adapter carries the run's ids,
    so a line logged from another thread still lands in the run's log)."""

    def __init__(self, target: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        super().__init__(logging.INFO)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.log(record.levelno, "%s", record.getMessage())


@contextmanager
def forwarded_to(target: logging.Logger | logging.LoggerAdapter[Any]) -> Iterator[None]:
    """STAGE_LOG's records go to `target` inside the block."""
    handler = _Forward(target)
    STAGE_LOG.addHandler(handler)
    try:
        yield
    finally:
        STAGE_LOG.removeHandler(handler)
