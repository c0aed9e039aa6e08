"""Where a training run stands: one step's sums, the epoch's tally, and the resume state.

A run's position is (epoch, samples consumed of that epoch's global order, optimizer steps); with the
history, the epoch's running sums, and the optimizer, scheduler and RNG states it is the resume state
handed to ``on_checkpoint`` and taken back as ``resume_state`` (a plain dict of tensors and numbers:
it is saved with torch.save and restored by any number of workers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from .distributed import sum_across_ranks

__all__ = ["EpochTally", "StepSums", "TrainState", "TrainedCounts", "cpu_copy"]


class StepSums:
    """One optimizer step's loss, hits per TTT step, real and computed tokens, summed over micro-batches
    (and then ranks)."""

    def __init__(self, ttt_length: int, device: torch.device) -> None:
        self.ttt_length = ttt_length
        # loss, hits..., real, computed; on the device: adding never waits for the GPU (the host can
        # collate the next micro-batch meanwhile), the step's record reads them once.
        self.values = torch.zeros(ttt_length + 3, dtype=torch.float64, device=device)

    def add(self, loss: Tensor, terms: Tensor, batch: Mapping[str, Tensor]) -> None:
        hits = terms[1].double() * terms[2].double()  # acc x counted positions, per TTT step
        self.values[0] += loss.detach().double()
        self.values[1 : self.ttt_length + 1] += hits
        self.values[self.ttt_length + 1] += batch["lengths"].sum().double()
        self.values[self.ttt_length + 2] += batch["input_ids"].numel()

    def across_ranks(self, world: int) -> StepSums:
        sum_across_ranks([self.values], world)
        return self

    def record(self, step_tokens: Tensor) -> dict[str, Any]:
        ttt = self.ttt_length
        values = self.values.tolist()
        hits = values[1 : ttt + 1]
        tokens = [int(n) for n in step_tokens.tolist()]
        return {
            "loss": values[0],
            "acc": [h / n if n else 0.0 for h, n in zip(hits, tokens, strict=True)],
            "hits": hits,
            "tokens": tokens,
            "real_tokens": int(values[ttt + 1]),
            "computed_tokens": int(values[ttt + 2]),
        }


@dataclass
class EpochTally:
    """Sums over an epoch's steps (all ranks), saved in the resume state so a resumed epoch sums on."""

    loss: float = 0.0
    steps: int = 0
    hits: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    real_tokens: int = 0  # sample tokens trained
    computed_tokens: int = 0  # row slots computed, padding included

    @classmethod
    def empty(cls, ttt_length: int) -> EpochTally:
        return cls(hits=[0.0] * ttt_length, tokens=[0] * ttt_length)

    def add(self, record: Mapping[str, Any]) -> None:
        self.loss += record["loss"]
        self.steps += 1
        self.hits = [a + h for a, h in zip(self.hits, record["hits"], strict=True)]
        self.tokens = [a + n for a, n in zip(self.tokens, record["tokens"], strict=True)]
        self.real_tokens += record["real_tokens"]
        self.computed_tokens += record["computed_tokens"]

    def summary(self, epoch: int, global_step: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "loss": self.loss / max(1, self.steps),
            "acc": [h / n if n else 0.0 for h, n in zip(self.hits, self.tokens, strict=True)],
            "tokens": list(self.tokens),
            "steps": global_step,
            "real_tokens": self.real_tokens,
            "computed_tokens": self.computed_tokens,
            "packing_efficiency": self.real_tokens / max(1, self.computed_tokens),
        }


class TrainedCounts:
    """How many times each sample (by `StepShare.sample_ids`) was trained in the current epoch: what
    proves exactly-once training across faults and resumes. Each rank counts its own samples; the sum
    over ranks is the epoch's count (a resume state carries that sum, restored on one rank only)."""

    def __init__(self, num_samples: int, counts: Tensor | None = None) -> None:
        self.counts = counts.clone() if counts is not None else torch.zeros(num_samples, dtype=torch.int64)
        if self.counts.numel() != num_samples:
            raise ValueError(f"trained counts of {self.counts.numel()} samples for data of {num_samples}")

    def add(self, sample_ids: list[int]) -> None:
        if sample_ids:
            ids = torch.tensor(sample_ids, dtype=torch.int64)
            self.counts += torch.bincount(ids, minlength=self.counts.numel())

    def summed(self, world: int) -> Tensor:
        """The counts over every rank (a collective when ``world`` > 1: every rank calls it)."""
        total = self.counts.clone()
        sum_across_ranks([total], world)
        return total

    @staticmethod
    def histogram(total: Tensor) -> dict[str, int]:
        """{times trained: samples}, e.g. {"1": 240} when every sample was trained exactly once."""
        times, samples = torch.unique(total, return_counts=True)
        return {str(int(t)): int(n) for t, n in zip(times.tolist(), samples.tolist(), strict=True)}


@dataclass
class TrainState:
    """The loop's position and records. ``epoch`` and ``consumed``: the next sample of that epoch's global
    order (independent of the worker count); ``global_step``: optimizer steps taken."""

    epoch: int = 0
    consumed: int = 0
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per optimizer step
    epochs: list[dict[str, Any]] = field(default_factory=list)  # one summary per epoch
    tally: EpochTally = field(default_factory=EpochTally)
    trained: TrainedCounts | None = None  # this epoch's, from its first step (or the resume) on

    @classmethod
    def resumed(
        cls, resume: Mapping[str, Any], optimizer: torch.optim.Optimizer, scheduler: Any, rank: int = 0
    ) -> TrainState:
        """Restore ``resume`` (a `resume_state`): the optimizer, scheduler and RNG states are loaded; the
        epoch's trained counts (a sum over ranks) on rank 0 only, so that the next sum stays one."""
        # A copy: the optimizer updates its state tensors in place, and the caller may share them.
        optimizer.load_state_dict(cpu_copy(resume["optimizer"]))
        scheduler.load_state_dict(resume["scheduler"])
        state = cls(
            epoch=int(resume["epoch"]),
            consumed=int(resume["consumed"]),
            global_step=int(resume["global_step"]),
            history=list(resume["history"]),
            epochs=list(resume["epochs"]),
            tally=EpochTally(**resume["epoch_tally"]),
        )
        counts = resume.get("trained_counts")
        if counts is not None:
            state.trained = TrainedCounts(counts.numel(), counts if rank == 0 else torch.zeros_like(counts))
        torch.set_rng_state(resume["rng"])
        return state

    def step_done(self, record: dict[str, Any], step_samples: int, sample_ids: list[int]) -> None:
        if self.trained is not None:
            self.trained.add(sample_ids)
        self.global_step += 1
        self.consumed += step_samples
        self.history.append(record)
        self.tally.add(record)

    def epoch_done(self, world: int) -> dict[str, Any]:
        """Close the epoch: its summary (recorded), and the position moves to the next epoch's start."""
        summary = self.tally.summary(self.epoch, self.global_step)
        if self.trained is not None:
            summary["trained_per_sample"] = TrainedCounts.histogram(self.trained.summed(world))
            self.trained = None
        self.epochs.append(summary)
        self.epoch, self.consumed = self.epoch + 1, 0
        return summary

    def resume_state(
        self, optimizer: torch.optim.Optimizer, scheduler: Any, trained_counts: Tensor | None = None
    ) -> dict[str, Any]:
        """Everything a run needs to continue from here (live tensors: `cpu_copy` it to keep it);
        ``trained_counts``: the epoch's counts summed over ranks (`TrainedCounts.summed`)."""
        return {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": self.epoch,
            "consumed": self.consumed,
            "global_step": self.global_step,
            "rng": torch.get_rng_state(),
            "history": self.history,
            "epochs": self.epochs,
            "epoch_tally": asdict(self.tally),
            "trained_counts": trained_counts,
        }


def cpu_copy(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (dicts, lists and tuples copied through)."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cpu_copy(v) for v in value)
    return value
