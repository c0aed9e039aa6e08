"""The drafter's training loop, torchtitan-style: `TrainingRun.forward_backward` (one micro-batch),
`TrainingRun.train_step` (one optimizer step: its micro-batches, the sum over ranks, clipping, the step)
and `train_drafter` (the epoch loop, resumable at any optimizer step).

The objective is kernels/objective.py; the sums over ranks kernels/distributed.py; the loop's position
and resume state kernels/train_state.py; the samples come from any `TrainingData` (kernels/data.py).
An optimizer step's loss is the token-weighted mean over all its counted positions, whatever the
micro-batches, the packing or the number of workers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from .compile_cache import cache_file, load_compiled, save_compiled
from .data import StepShare, TrainingData
from .distributed import sum_across_ranks, sum_gradients_across_ranks
from .drafter import Eagle3Drafter
from .objective import compiled_regions, draft_target_head, sample_ttt_tokens, ttt_loss
from .packing import collate_rows, pack_first_fit_decreasing, sample_length
from .train_state import EpochTally, StepSums, TrainedCounts, TrainState, cpu_copy

__all__ = [
    "LrSchedule",
    "StepFeed",
    "TrainConfig",
    "TrainResult",
    "TrainingRun",
    "make_optimizer",
    "make_scheduler",
    "train_drafter",
]


LrSchedule = Literal["cosine", "linear"]  # the decay after the warm-up
LR_SCHEDULES = get_args(LrSchedule)


@dataclass(frozen=True)
class TrainConfig:
    """The training loop's settings and the one place their defaults live: the config's training section
    takes its defaults from here (tests/test_defaults.py fails on a second, different default)."""

    ttt_length: int = 7
    epochs: int = 8
    # batch_size * grad_accum samples per optimizer step, over all workers (so a run's steps do not
    # depend on the number of workers); unpacked micro-batches hold batch_size samples.
    batch_size: int = 8
    lr: float = 3e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 1
    seed: int = 0
    step_decay: float = 0.8
    max_length: int | None = None  # truncate samples longer than this many tokens
    show_progress: bool = True
    # CUDA only: torch.compile the TTT loss (FlexAttention for the chain); None: when training on CUDA
    # (~2x faster after ~2 min of compilation, bench/RESULTS.md). Batches are then padded to the full
    # batch size and to a multiple of pad_multiple tokens, so only a few shapes compile.
    compile: bool | None = None
    # Compiled: a folder where the compiled loss is kept between processes (kernels/compile_cache.py),
    # loaded before the first step and written after it. None: torch's per-machine caches only.
    compile_cache_dir: str | None = None
    pad_multiple: int = 512
    # Pack samples into rows of at most this many tokens (first-fit decreasing); each micro-batch holds
    # rows_per_micro_batch packed rows (the step's last one may hold fewer; compiled, it is padded with
    # empty rows to the same shape). None: one sample per row.
    pack_tokens: int | None = None
    rows_per_micro_batch: int = 1
    # Hand a resume state to on_checkpoint every this many optimizer steps (and after every epoch).
    checkpoint_every_steps: int | None = None
    # The next three defaults (and a fresh drafter's final norm starting at ones) are speculators' way:
    # on the tiny-llama quality bench together they lifted draftloop's mean acceptance length from
    # 0.962x the peer's to 1.036x, and leaving any one out lost part of it (bench/RESULTS.md).
    # False: the drafter's lm_head keeps its initial weights (the target's rows when started from the
    # target) and gets no gradient; its weight gradient, [Vd, H] per position and TTT step, is then not
    # computed (11% of the FLOPs per token of a Llama-3.1-8B-shaped drafter at TTT 7).
    train_lm_head: bool = False
    adam_betas: tuple[float, float] = (0.9, 0.999)
    # After the linear warm-up, the learning rate decays to zero: "cosine" or "linear".
    lr_schedule: LrSchedule = "linear"

    def __post_init__(self) -> None:
        # A JSON list too.
        object.__setattr__(self, "adam_betas", (float(self.adam_betas[0]), float(self.adam_betas[1])))
        checks = {
            "ttt_length": self.ttt_length >= 1,
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "grad_accum": self.grad_accum >= 1,
            "lr": self.lr > 0,
            "warmup_ratio": 0 <= self.warmup_ratio < 1,
            "step_decay": 0 < self.step_decay <= 1,
            "pack_tokens": self.pack_tokens is None or self.pack_tokens >= 1,
            "rows_per_micro_batch": self.rows_per_micro_batch >= 1,
            "checkpoint_every_steps": self.checkpoint_every_steps is None or self.checkpoint_every_steps >= 1,
            "adam_betas": all(0 <= beta < 1 for beta in self.adam_betas),
            "lr_schedule": self.lr_schedule in LR_SCHEDULES,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid training settings: {', '.join(bad)} ({asdict(self)})")

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.grad_accum


@dataclass
class TrainResult:
    history: list[dict[str, Any]]  # one entry per optimizer step
    epochs: list[dict[str, Any]]  # one entry per epoch (token-weighted means)
    final_metrics: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)  # the resume state after the last step


# --------------------------------------------------------------------------------------------- optimisation


def make_optimizer(drafter: Eagle3Drafter, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the drafter's trainable parameters (the lm_head only with ``cfg.train_lm_head``)."""
    drafter.lm_head.weight.requires_grad_(cfg.train_lm_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.adam_betas)


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, schedule: LrSchedule
) -> Any:
    """Linear warm-up to the base lr, then ``schedule`` ("cosine" or "linear") decay to zero over
    ``total_steps`` optimizer steps."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}: one of {LR_SCHEDULES}")
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _autocast(device: torch.device) -> AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from transformers.utils.logging import tqdm  # transformers' bar: kernels depend on no tqdm of their own

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _micro_batch_rows(
    samples: Sequence[Mapping[str, Tensor]], cfg: TrainConfig
) -> list[list[list[Mapping[str, Tensor]]]]:
    """This rank's samples of one step as micro-batches of rows: batch_size one-sample rows, or one
    rows_per_micro_batch packed rows of at most pack_tokens tokens each."""
    if cfg.pack_tokens is None:
        rows, per = [[s] for s in samples], cfg.batch_size
    else:
        lengths = [sample_length(s, cfg.max_length) for s in samples]
        rows = [[samples[i] for i in row] for row in pack_first_fit_decreasing(lengths, cfg.pack_tokens)]
        per = cfg.rows_per_micro_batch
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def _copied_ahead(
    micro_batches: Sequence[list[list[Mapping[str, Tensor]]]],
    collate: Callable[[list[list[Mapping[str, Tensor]]]], dict[str, Tensor]],
    device: torch.device,
) -> Iterator[dict[str, Tensor]]:
    """The collated micro-batches in order. On CUDA each one is collated, and copied to the GPU on a side
    stream, once the one before it has been handed out (its kernels queued): on the compute stream its
    copies would wait for the kernels queued before them and hold every kernel queued after (~2% of an
    H100 step). (Collated before the one before it was handed out, a step's first kernel waited for two
    collates.)"""
    if device.type != "cuda":
        yield from (collate(rows) for rows in micro_batches)
        return
    compute, copies = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    for rows in micro_batches:
        with torch.cuda.stream(copies):
            batch, copied = collate(rows), torch.cuda.Event()
            copied.record(copies)
        compute.wait_event(copied)
        for tensor in batch.values():
            tensor.record_stream(compute)  # (its memory is not reused while the step reads it)
        yield batch


@dataclass(frozen=True)
class StepFeed:
    """One optimizer step's share and its micro-batches, the first already collated and on its way to
    the device (`TrainingRun.feed`)."""

    share: StepShare
    batches: Iterator[dict[str, Tensor]]


def _step_ttt_tokens(samples: Sequence[Mapping[str, Tensor]], cfg: TrainConfig, world: int) -> Tensor:
    """Counted positions of each TTT step over one optimizer step's samples on every rank [ttt_length]."""
    counts = [sample_ttt_tokens(s, cfg.ttt_length, cfg.max_length) for s in samples]
    tokens = torch.tensor(counts or [[0] * cfg.ttt_length], dtype=torch.float64).sum(0)
    sum_across_ranks([tokens], world)
    return tokens


def _batch_shape(cfg: TrainConfig, compiled: bool) -> tuple[int | None, int | None]:
    """(rows, tokens) every micro-batch is padded to, None where it is not. Compiled, few shapes: unpacked
    batches get batch_size rows of a multiple of pad_multiple tokens; packed ones rows_per_micro_batch rows
    (a step's last micro-batch gets empty rows) of pack_tokens rounded up to pad_multiple (first-fit
    decreasing fills them nearly). Eagerly, each batch as it is."""
    if not compiled:
        return None, None
    if cfg.pack_tokens is None:
        return cfg.batch_size, cfg.pad_multiple
    return cfg.rows_per_micro_batch, -(-cfg.pack_tokens // cfg.pad_multiple) * cfg.pad_multiple


LossFn = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True, eq=False)  # (holds tensors and modules: identity is what equality means)
class TrainingRun:
    """What every optimizer step of one run uses: the drafter, the target head's draft rows, the
    settings, the optimizer and schedule, the (compiled) loss."""

    drafter: Eagle3Drafter
    head: Tensor  # the target lm_head's draft-vocabulary rows [Vd, Ht], on the device
    cfg: TrainConfig
    device: torch.device
    world: int
    optimizer: torch.optim.AdamW
    scheduler: Any
    params: list[nn.Parameter]  # the trainable ones
    loss_fn: LossFn
    # Compiled: few shapes. (rows, tokens) every batch is padded to, None where it is not.
    fixed_shape: tuple[int | None, int | None]
    compile_cache: Path | None = None  # where the compiled loss is kept (compiled, with a cache folder)

    @classmethod
    def start(
        cls,
        drafter: Eagle3Drafter,
        target_head: Tensor,
        cfg: TrainConfig,
        device: torch.device,
        world: int,
        total_steps: int,
    ) -> TrainingRun:
        """Put ``drafter`` in training mode on ``device``, with its optimizer and a schedule over
        ``total_steps`` optimizer steps."""
        drafter.to(device)
        drafter.train()
        if drafter.embed_weight is None:
            raise RuntimeError("attach the target's embeddings (drafter.attach_embeddings) before training")
        head = target_head.to(device)
        if head.shape[0] != drafter.config.draft_vocab_size:
            head = draft_target_head(drafter, head)
        head = head.to(torch.bfloat16) if device.type == "cuda" else head.float()
        compiled = cfg.compile is not False and device.type == "cuda"
        if compiled and cfg.compile_cache_dir is not None:
            load_compiled(cache_file(cfg.compile_cache_dir, device))
        # Compiled by region (kernels/objective.py): four graphs reused across TTT steps and chunks.
        loss_fn: LossFn = partial(ttt_loss, regions=compiled_regions()) if compiled else ttt_loss
        fixed_shape = _batch_shape(cfg, compiled)
        optimizer = make_optimizer(drafter, cfg)  # (freezes the lm_head unless cfg.train_lm_head)
        params = [p for p in drafter.parameters() if p.requires_grad]
        scheduler = make_scheduler(optimizer, total_steps, cfg.warmup_ratio, cfg.lr_schedule)
        cache = cache_file(cfg.compile_cache_dir, device) if compiled and cfg.compile_cache_dir else None
        return cls(
            drafter, head, cfg, device, world, optimizer, scheduler, params, loss_fn, fixed_shape, cache
        )

    def forward_backward(self, batch: Mapping[str, Tensor], step_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """One micro-batch: its loss and TTT terms; its backward pass adds its part of dL/dθ."""
        cfg = self.cfg
        with _autocast(self.device):
            loss, terms = self.loss_fn(
                self.drafter, batch, self.head, cfg.ttt_length, cfg.step_decay, step_tokens
            )
        loss.backward()
        return loss, terms

    def feed(self, share: StepShare) -> StepFeed:
        """``share``'s micro-batches, the first collated and its copy queued now: called while the step
        before runs, the GPU does not wait for it when that step ends."""
        cfg = self.cfg
        collate = partial(
            collate_rows,
            device=self.device,
            max_length=cfg.max_length,
            batch_size=self.fixed_shape[0],
            pad_multiple=self.fixed_shape[1],
            packed=cfg.pack_tokens is not None,
            ttt_length=cfg.ttt_length,
        )
        batches = _copied_ahead(_micro_batch_rows(share.samples, cfg), collate, self.device)
        first = next(batches, None)
        return StepFeed(share, batches if first is None else itertools.chain([first], batches))

    def train_step(
        self, feed: StepFeed, step: int, epoch: int, upcoming: Iterator[StepShare]
    ) -> tuple[dict[str, Any], StepFeed | None]:
        """One optimizer step on this rank's share (every rank calls it for every step); returns the
        step's record, summed over ranks, and the feed of ``upcoming``'s next share (None when it has
        none), taken once this step's kernels are queued and before the step's figures are read."""
        cfg, world, share = self.cfg, self.world, feed.share
        # N_j = counted positions of TTT step j in the whole optimizer step (every rank); the step's
        # loss is L = sum_j decay^j * (sum of CE_j over those positions) / N_j.
        step_tokens = _step_ttt_tokens(share.samples, cfg, world)
        step_tokens_on_device = step_tokens.to(self.device)  # once: a host copy waits for the GPU
        self.optimizer.zero_grad(set_to_none=True)
        sums = StepSums(cfg.ttt_length, self.device)
        # This rank's micro-batches: their backward passes add up to its part of dL/dθ.
        for batch in feed.batches:
            loss, terms = self.forward_backward(batch, step_tokens_on_device)
            sums.add(loss, terms, batch)
        # dL/dθ = the sum of every rank's part (an idle rank adds zeros); clip, then one AdamW step.
        sum_gradients_across_ranks(self.params, world)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        # The next step's data read and its first micro-batch collated while this step's kernels run
        # (reading the record below waits for them: the GPU would idle through both).
        following = next(upcoming, None)
        next_feed = self.feed(following) if following is not None else None
        record = sums.across_ranks(world).record(step_tokens)
        record.update(
            step=step,
            epoch=epoch,
            samples=share.step_samples,
            lr=self.optimizer.param_groups[0]["lr"],
            grad_norm=float(grad_norm),
        )
        return record, next_feed


def train_drafter(
    drafter: Eagle3Drafter,
    data: TrainingData,
    target_head: Tensor,
    cfg: TrainConfig,
    device: torch.device | str = "cpu",
    *,
    rank: int = 0,
    world: int = 1,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
    on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
    resume_state: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Train ``drafter`` in place with TTT on ``data`` (`InMemorySamples`, `ShardedSamples`, ...).

    ``target_head``: the target's lm_head weight [V, Ht] (or already the draft rows [Vd, Ht]).
    The drafter must have the target's embeddings attached. With ``world`` > 1, torch.distributed is
    initialised, every rank calls this with the same data and weights, and each trains its share of
    every optimizer step (kernels/data.py); the step's gradient is summed over ranks once, so a rank
    with nothing in a step still takes part. ``on_step(step, record)`` runs after every optimizer step,
    ``on_epoch(epoch, summary)`` after every epoch, ``on_checkpoint(resume_state)`` every
    ``cfg.checkpoint_every_steps`` steps and after every epoch; pass that state back as
    ``resume_state`` (any number of workers) to continue from the same sample.
    """
    total_steps = math.ceil(data.num_samples / cfg.samples_per_step) * cfg.epochs
    run = TrainingRun.start(drafter, target_head, cfg, torch.device(device), world, total_steps)
    state = (
        TrainState.resumed(resume_state, run.optimizer, run.scheduler, rank) if resume_state else TrainState()
    )

    def checkpoint() -> None:
        if on_checkpoint is None:
            return
        trained = state.trained.summed(world) if state.trained is not None else None  # (all ranks)
        # A CPU copy: the optimizer updates its state tensors in place.
        on_checkpoint(cpu_copy(state.resume_state(run.optimizer, run.scheduler, trained)))

    progress = _progress(total_steps - state.global_step, cfg.show_progress, "train drafter")
    saved_compiled = False
    try:
        while state.epoch < cfg.epochs:
            if state.consumed == 0:
                torch.manual_seed(cfg.seed + state.epoch)
                state.tally = EpochTally.empty(cfg.ttt_length)
            if state.trained is None:  # (a resume state from before the counts: they start here)
                state.trained = TrainedCounts(data.num_samples)
            shares = data.rank_steps(state.epoch, cfg.seed, cfg.samples_per_step, state.consumed, rank, world)
            first = next(shares, None)
            feed = run.feed(first) if first is not None else None
            while feed is not None:
                share = feed.share
                record, feed = run.train_step(feed, state.global_step + 1, state.epoch, shares)
                if run.compile_cache is not None and rank == 0 and not saved_compiled:
                    save_compiled(run.compile_cache)  # the first step compiled what later steps reuse
                    saved_compiled = True
                state.step_done(record, share.step_samples, share.sample_ids)
                if on_step is not None:
                    on_step(state.global_step, record)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.2f}")
                every = cfg.checkpoint_every_steps
                if every and state.global_step % every == 0 and state.consumed < data.num_samples:
                    checkpoint()  # (the epoch's last step checkpoints just below)
            summary = state.epoch_done(world)
            if on_epoch is not None:
                on_epoch(summary["epoch"], summary)
            checkpoint()
    finally:
        if progress is not None:
            progress.close()
    drafter.eval()
    final = dict(state.epochs[-1]) if state.epochs else {}
    return TrainResult(
        history=state.history,
        epochs=state.epochs,
        final_metrics=final,
        state=state.resume_state(run.optimizer, run.scheduler),
    )
