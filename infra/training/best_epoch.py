"""Which epoch's drafter a training exports: the best held-out one, else the last (`exported_epoch`).

After every epoch rank 0 estimates the drafter's acceptance length on held-out samples; the best epoch
so far keeps its weights in the work folder (`BestEpoch`), so a resumed run still exports it (later
epochs may overfit a small dataset). Without held-out samples the last epoch is exported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftloop.kernels.drafter import Eagle3Drafter

__all__ = ["BEST_RECORD", "BEST_WEIGHTS", "BestEpoch", "exported_epoch"]

BEST_WEIGHTS = "best-drafter.pt"
BEST_RECORD = "best.json"


def exported_epoch(best_epoch: int | None, epochs: int) -> int:
    """The epoch whose drafter is exported: the best held-out one, else the last of ``epochs``."""
    return best_epoch if best_epoch is not None else epochs - 1


@dataclass
class BestEpoch:
    """The epoch with the highest held-out acceptance length so far (its weights in the work folder)."""

    epoch: int | None = None
    length: float | None = None

    @classmethod
    def load(cls, work: Path) -> BestEpoch:
        record = work / BEST_RECORD
        if not record.exists():
            return cls()
        data = json.loads(record.read_text())
        return cls(int(data["epoch"]), float(data["length"]))

    def offer(self, work: Path, epoch: int, length: float | None, drafter: Eagle3Drafter) -> None:
        """Keep ``drafter`` as the best when its held-out acceptance ``length`` beats the best so far."""
        if length is not None and (self.length is None or length > self.length):
            self._update(work, epoch, length, drafter)

    def _update(self, work: Path, epoch: int, length: float, drafter: Eagle3Drafter) -> None:
        self.epoch, self.length = epoch, length
        work.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}
        torch.save(weights, work / f"{BEST_WEIGHTS}.tmp")
        (work / f"{BEST_WEIGHTS}.tmp").replace(work / BEST_WEIGHTS)  # the record follows the weights
        (work / BEST_RECORD).write_text(json.dumps({"epoch": epoch, "length": length}))

    def load_weights_into(self, work: Path, drafter: Eagle3Drafter) -> None:
        """Put the best epoch's weights into ``drafter`` (nothing to do when no epoch was estimated)."""
        if self.epoch is not None:
            drafter.load_state_dict(torch.load(work / BEST_WEIGHTS, weights_only=True), strict=False)
