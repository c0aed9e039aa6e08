"""EAGLE-3 training with training-time test (TTT), unrolled the way vLLM drafts.

For a sample x_0..x_{L-1} with target aux states h_t and final (normed) states g_t:

- step 0 at position t: hidden fc(h_t), token x_{t+1}, position id t; predicts x_{t+2} against the target's
  distribution softmax(lm_head(g_{t+1})) restricted to the draft vocabulary;
- step j: hidden = the drafter's own prenorm output of step j-1 at t, token x_{t+1+j}, position id t+j;
  predicts x_{t+2+j} against softmax(lm_head(g_{t+1+j})).

Attention at step j: the step-0 keys at positions <= t (causal) plus the chain keys of steps 1..j at the
same t (the diagonal, computed elementwise in :func:`drafter._attend`). Loss weight ``decay**j``; only
positions whose predicted token is an assistant token (loss_mask) of the same sample count.

Batches are either one sample per row (right-padded: causal attention never reaches the padding) or
packed rows (kernels/packing.py): then a block-diagonal causal mask keeps every TTT step inside its
sample, and positions restart per sample. An optimizer step's loss is the token-weighted mean over all
its counted positions, whatever the micro-batches, the packing or the number of workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .data import ShardedSamples
from .drafter import Eagle3Drafter, KVPair
from .packing import collate_rows, pack_first_fit_decreasing, sample_length

__all__ = [
    "LrSchedule",
    "TrainConfig",
    "TrainResult",
    "collate_samples",
    "draft_target_head",
    "make_optimizer",
    "make_scheduler",
    "train_drafter",
    "ttt_loss",
    "ttt_metrics",
    "ttt_weights",
]


LrSchedule = Literal["cosine", "linear"]  # the decay after the warm-up
LR_SCHEDULES = get_args(LrSchedule)


@dataclass
class TrainConfig:
    ttt_length: int = 7
    epochs: int = 1
    # batch_size * grad_accum samples per optimizer step, over all workers (so a run's steps do not
    # depend on the number of workers); unpacked micro-batches hold batch_size samples.
    batch_size: int = 8
    lr: float = 1e-4
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 1
    seed: int = 0
    step_decay: float = 0.8
    max_length: int | None = None  # truncate samples longer than this many tokens
    show_progress: bool = True
    # CUDA only: torch.compile the TTT loss (FlexAttention for the chain). Batches are then padded to
    # the full batch size and to a multiple of pad_multiple tokens, so only a few shapes compile.
    compile: bool = False
    pad_multiple: int = 512
    # Pack samples into rows of at most this many tokens (first-fit decreasing); each micro-batch is one
    # packed row. None: one sample per row.
    pack_tokens: int | None = None
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
        self.adam_betas = (float(self.adam_betas[0]), float(self.adam_betas[1]))  # a JSON list too
        checks = {
            "ttt_length": self.ttt_length >= 1,
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "grad_accum": self.grad_accum >= 1,
            "lr": self.lr > 0,
            "warmup_ratio": 0 <= self.warmup_ratio < 1,
            "step_decay": 0 < self.step_decay <= 1,
            "pack_tokens": self.pack_tokens is None or self.pack_tokens >= 1,
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


# --------------------------------------------------------------------------------------------- batches


def collate_samples(
    samples: Sequence[Mapping[str, Tensor]],
    device: torch.device | str = "cpu",
    max_length: int | None = None,
    batch_size: int | None = None,
    pad_multiple: int | None = None,
) -> dict[str, Tensor]:
    """One sample per row, right-padded: input_ids/loss_mask [B, L], aux/last [B, L, *], lengths [B]
    (see :func:`packing.collate_rows` for ``batch_size`` and ``pad_multiple``)."""
    if not samples:
        raise ValueError("empty batch")
    return collate_rows([[s] for s in samples], device, max_length, batch_size, pad_multiple, packed=False)


def draft_target_head(drafter: Eagle3Drafter, lm_head_weight: Tensor) -> Tensor:
    """The target lm_head rows of the draft vocabulary, in draft-id order [Vd, Ht]."""
    if lm_head_weight.shape[0] != drafter.config.vocab_size:
        raise ValueError(
            f"target lm_head has {lm_head_weight.shape[0]} rows, the drafter's vocabulary is "
            f"{drafter.config.vocab_size}"
        )
    ids = drafter.draft_token_ids().to(lm_head_weight.device)
    return lm_head_weight[ids].detach()


# --------------------------------------------------------------------------------------------- loss


def _segments(batch: Mapping[str, Tensor]) -> Tensor:
    """Which sample of its row each token belongs to [B, L] (-1 = padding)."""
    if "segment_ids" in batch:
        return batch["segment_ids"]
    positions = torch.arange(batch["input_ids"].shape[1], device=batch["input_ids"].device)
    return torch.where(positions[None, :] < batch["lengths"][:, None], 0, -1)


def _positions_and_segments(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(position_ids [B, L], segment ids [B, L] of packed rows or None for one sample per row)."""
    input_ids = batch["input_ids"]
    bsz, length = input_ids.shape
    if "segment_ids" not in batch:  # one sample per row: causal attention never reaches the padding
        positions = torch.arange(length, device=input_ids.device)
        return positions[None, :].expand(bsz, length), None
    # Packed: the drafter keeps every query inside its sample (query t sees key s <= t of the same
    # segment; padding sees padding, so no row is fully masked), with a document-aware block mask
    # when compiled on CUDA, so the attention between samples is never computed.
    return batch["position_ids"], batch["segment_ids"]


def ttt_weights(batch: Mapping[str, Tensor], ttt_length: int) -> Tensor:
    """Counted positions [ttt_length, B, L]: at step j, anchor t counts when x_{t+2+j} is an assistant
    token of the same sample (so no target, token or loss crosses a sample boundary)."""
    segments = _segments(batch)
    length = segments.shape[1]
    pad = ttt_length + 2
    segments_ahead = F.pad(segments, (0, pad), value=-1)
    mask_ahead = F.pad(batch["loss_mask"].bool(), (0, pad))
    steps = [
        mask_ahead[:, 2 + j : 2 + j + length] & (segments_ahead[:, 2 + j : 2 + j + length] == segments)
        for j in range(ttt_length)
    ]
    return torch.stack(steps) & (segments >= 0)


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: Mapping[str, Tensor],
    target_head_draft: Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    step_tokens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Weighted TTT loss of one collated batch, and per-step metrics ``terms`` [3, ttt_length] (loss, acc,
    tokens), left on the batch's device: reading them waits for the GPU, so the training loop reads one
    step's sums once (:func:`ttt_metrics` turns them into lists).

    ``step_tokens`` [ttt_length]: counted positions per TTT step over the whole optimizer step (every
    micro-batch, every rank); step j's loss sums over this batch and divides by them, so the losses of
    a step's micro-batches add up to its token-weighted mean. None: this batch's own counts.
    Per step, the terms' loss and acc are this batch's means, acc being the share of counted positions
    whose drafter argmax equals the target's argmax over the draft vocab; tokens are those positions.
    """
    input_ids = batch["input_ids"]
    length = input_ids.shape[1]
    position_ids, segments = _positions_and_segments(batch)
    weights = ttt_weights(batch, ttt_length).float()

    with torch.no_grad():
        last = batch["last_hidden"].to(target_head_draft.dtype)
        target_logits = torch.matmul(last, target_head_draft.t()).float()  # [B, L, Vd]
        # Padded once at the end so that every step reads a shifted view instead of a copy. Where the
        # shift reaches past a sample's end the position is not counted, and its outputs reach no
        # counted position (own chain only; its step-0 key is visible only to itself).
        pad = ttt_length + 1
        target_probs = F.pad(torch.softmax(target_logits, dim=-1), (0, 0, 0, pad))
        target_argmax = F.pad(target_logits.argmax(-1), (0, pad), value=-1)
        del target_logits
        ids_padded = F.pad(input_ids, (0, pad))

    hidden = drafter.fuse(batch["aux_hidden"])
    step0: KVPair | None = None
    chain: list[KVPair] = []
    total = hidden.new_zeros((), dtype=torch.float32)
    step_losses: list[Tensor] = []
    step_accs: list[Tensor] = []
    step_counts: list[Tensor] = []
    for step in range(ttt_length):
        step_ids = ids_padded[:, 1 + step : 1 + step + length]
        if step0 is None:
            hidden, kv = drafter(hidden, step_ids, position_ids, segments=segments)
            step0 = kv
        else:
            hidden, kv = drafter(
                hidden,
                step_ids,
                position_ids + step,
                past=[step0],
                diagonal=chain,  # causal over the step-0 keys (FlexAttention when compiled on CUDA)
                segments=segments,
            )
            chain = [*chain, kv]
        weight = weights[step]
        probs = target_probs[:, 1 + step : 1 + step + length]
        logits = drafter.logits(hidden).float()
        # Soft cross-entropy with a normalised target: logsumexp(z) - sum(p * z), no log_softmax tensor.
        per_token = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
        tokens = weight.sum()
        loss_sum = (per_token * weight).sum()
        norm = tokens if step_tokens is None else step_tokens[step].to(tokens)
        total = total + (decay**step) * loss_sum / norm.clamp_min(1.0)
        with torch.no_grad():
            hits = (logits.argmax(-1) == target_argmax[:, 1 + step : 1 + step + length]).float() * weight
            step_accs.append(hits.sum() / tokens.clamp_min(1.0))
        step_losses.append(loss_sum.detach() / tokens.clamp_min(1.0))
        step_counts.append(tokens.detach())
    return total, torch.stack([torch.stack(step_losses), torch.stack(step_accs), torch.stack(step_counts)])


def ttt_metrics(terms: Tensor) -> dict[str, list[Any]]:
    """:func:`ttt_loss`'s per-step terms as lists: {"loss": [...], "acc": [...], "tokens": [int, ...]}."""
    losses, accs, counts = terms.tolist()
    return {"loss": losses, "acc": accs, "tokens": [int(t) for t in counts]}


def _sample_ttt_tokens(sample: Mapping[str, Tensor], ttt_length: int, max_length: int | None) -> list[int]:
    """Counted positions of each TTT step in one sample (what :func:`ttt_weights` counts for it)."""
    mask = sample["loss_mask"][: sample_length(sample, max_length)].bool()
    return [int(mask[2 + j :].sum()) for j in range(ttt_length)]


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
    packed row of at most pack_tokens tokens each."""
    if cfg.pack_tokens is None:
        return [
            [[s] for s in samples[i : i + cfg.batch_size]] for i in range(0, len(samples), cfg.batch_size)
        ]
    lengths = [sample_length(s, cfg.max_length) for s in samples]
    return [[[samples[i] for i in row]] for row in pack_first_fit_decreasing(lengths, cfg.pack_tokens)]


def _sum_across_ranks(tensors: Sequence[Tensor], world: int) -> None:
    """In place: every tensor becomes its sum over the ranks (one collective per dtype)."""
    if world == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    # NCCL reduces only CUDA tensors; gloo CPU ones.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group]).to(on or group[0].device)
        dist.all_reduce(flat)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def _sum_gradients_across_ranks(params: Sequence[Tensor], world: int) -> None:
    for param in params:
        if param.grad is None:  # this rank had nothing to train in the step
            param.grad = torch.zeros_like(param)
    _sum_across_ranks([cast(Tensor, p.grad) for p in params], world)


def _step_ttt_tokens(samples: Sequence[Mapping[str, Tensor]], cfg: TrainConfig, world: int) -> Tensor:
    """Counted positions of each TTT step over one optimizer step's samples on every rank [ttt_length]."""
    counts = [_sample_ttt_tokens(s, cfg.ttt_length, cfg.max_length) for s in samples]
    tokens = torch.tensor(counts or [[0] * cfg.ttt_length], dtype=torch.float64).sum(0)
    _sum_across_ranks([tokens], world)
    return tokens


class _StepSums:
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

    def across_ranks(self, world: int) -> _StepSums:
        _sum_across_ranks([self.values], world)
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
class _EpochTally:
    """Sums over an epoch's steps (all ranks), saved in the resume state so a resumed epoch sums on."""

    loss: float = 0.0
    steps: int = 0
    hits: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    real_tokens: int = 0  # sample tokens trained
    computed_tokens: int = 0  # row slots computed, padding included

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


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu_copy(v) for v in value)
    return value


def train_drafter(
    drafter: Eagle3Drafter,
    samples: Sequence[Mapping[str, Tensor]] | ShardedSamples,
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
    """Train ``drafter`` in place with TTT on hidden-state samples (a list, or shards streamed lazily).

    ``target_head``: the target's lm_head weight [V, Ht] (or already the draft rows [Vd, Ht]).
    The drafter must have the target's embeddings attached. With ``world`` > 1, torch.distributed is
    initialised, every rank calls this with the same data and weights, and each trains its share of
    every optimizer step (kernels/data.py); the step's gradient is summed over ranks once, so a rank
    with nothing in a step still takes part. ``on_step(step, record)`` runs after every optimizer step,
    ``on_epoch(epoch, summary)`` after every epoch, ``on_checkpoint(resume_state)`` every
    ``cfg.checkpoint_every_steps`` steps and after every epoch; pass that state back as
    ``resume_state`` (any number of workers) to continue from the same sample.
    """
    device = torch.device(device)
    data = samples if isinstance(samples, ShardedSamples) else ShardedSamples.in_memory(samples)
    drafter.to(device)
    drafter.train()
    if drafter.embed_weight is None:
        raise RuntimeError("attach the target's embeddings (drafter.attach_embeddings) before training")
    head = target_head.to(device)
    if head.shape[0] != drafter.config.draft_vocab_size:
        head = draft_target_head(drafter, head)
    head = head.to(torch.bfloat16) if device.type == "cuda" else head.float()
    compiled = cfg.compile and device.type == "cuda"
    loss_fn: Callable[..., tuple[Tensor, Tensor]] = (
        cast(Any, torch.compile(ttt_loss, dynamic=False)) if compiled else ttt_loss
    )
    # Compiled: few shapes. Unpacked batches padded to batch_size rows of a multiple of pad_multiple tokens;
    # packed rows all to pack_tokens (rounded up to pad_multiple): first-fit decreasing fills them nearly.
    fixed_shape: tuple[int | None, int | None] = (None, None)
    if compiled and cfg.pack_tokens is None:
        fixed_shape = (cfg.batch_size, cfg.pad_multiple)
    elif compiled and cfg.pack_tokens is not None:
        fixed_shape = (None, -(-cfg.pack_tokens // cfg.pad_multiple) * cfg.pad_multiple)
    ttt = cfg.ttt_length

    steps_per_epoch = math.ceil(data.num_samples / cfg.samples_per_step)
    total_steps = steps_per_epoch * cfg.epochs
    optimizer = make_optimizer(drafter, cfg)  # (freezes the lm_head unless cfg.train_lm_head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    scheduler = make_scheduler(optimizer, total_steps, cfg.warmup_ratio, cfg.lr_schedule)
    # Data position: the next sample of epoch `epoch`'s global order (independent of the worker count).
    epoch, consumed, global_step = 0, 0, 0
    history: list[dict[str, Any]] = []
    epoch_history: list[dict[str, Any]] = []
    tally = _EpochTally()
    if resume_state:
        # A copy: the optimizer updates its state tensors in place, and the caller may share them.
        optimizer.load_state_dict(_cpu_copy(resume_state["optimizer"]))
        scheduler.load_state_dict(resume_state["scheduler"])
        epoch, consumed = int(resume_state["epoch"]), int(resume_state["consumed"])
        global_step = int(resume_state["global_step"])
        history = list(resume_state["history"])
        epoch_history = list(resume_state["epochs"])
        tally = _EpochTally(**resume_state["epoch_tally"])
        torch.set_rng_state(resume_state["rng"])

    def current_state() -> dict[str, Any]:
        return {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "consumed": consumed,
            "global_step": global_step,
            "rng": torch.get_rng_state(),
            "history": history,
            "epochs": epoch_history,
            "epoch_tally": asdict(tally),
        }

    def checkpoint() -> None:
        if on_checkpoint is not None:  # a CPU copy: the optimizer updates its state tensors in place
            on_checkpoint(_cpu_copy(current_state()))

    progress = _progress(total_steps - global_step, cfg.show_progress, "train drafter")
    try:
        while epoch < cfg.epochs:
            if consumed == 0:
                torch.manual_seed(cfg.seed + epoch)
                tally = _EpochTally(hits=[0.0] * ttt, tokens=[0] * ttt)
            for share in data.rank_steps(epoch, cfg.seed, cfg.samples_per_step, consumed, rank, world):
                # N_j = counted positions of TTT step j in the whole optimizer step (every rank); the step's
                # loss is L = sum_j decay^j * (sum of CE_j over those positions) / N_j.
                step_tokens = _step_ttt_tokens(share.samples, cfg, world)
                # This rank's micro-batches: their backward passes add up to its part of dL/dθ.
                step_tokens_on_device = step_tokens.to(device)  # once: a host copy waits for the GPU
                optimizer.zero_grad(set_to_none=True)
                sums = _StepSums(ttt, device)
                for rows in _micro_batch_rows(share.samples, cfg):
                    batch = collate_rows(
                        rows, device, cfg.max_length, *fixed_shape, packed=cfg.pack_tokens is not None
                    )
                    with _autocast(device):
                        loss, terms = loss_fn(
                            drafter, batch, head, ttt, cfg.step_decay, step_tokens_on_device
                        )
                    loss.backward()
                    sums.add(loss, terms, batch)
                # dL/dθ = the sum of every rank's part (an idle rank adds zeros); clip, then one AdamW step.
                _sum_gradients_across_ranks(params, world)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                global_step += 1
                consumed += share.step_samples

                record = sums.across_ranks(world).record(step_tokens)
                record.update(
                    step=global_step,
                    epoch=epoch,
                    samples=share.step_samples,
                    lr=optimizer.param_groups[0]["lr"],
                    grad_norm=float(grad_norm),
                )
                history.append(record)
                tally.add(record)
                if on_step is not None:
                    on_step(global_step, record)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.2f}")
                every = cfg.checkpoint_every_steps
                if every and global_step % every == 0 and consumed < data.num_samples:
                    checkpoint()  # (the epoch's last step checkpoints just below)
            summary = tally.summary(epoch, global_step)
            epoch_history.append(summary)
            epoch, consumed = epoch + 1, 0
            if on_epoch is not None:
                on_epoch(summary["epoch"], summary)
            checkpoint()
    finally:
        if progress is not None:
            progress.close()
    drafter.eval()
    final = dict(epoch_history[-1]) if epoch_history else {}
    return TrainResult(history=history, epochs=epoch_history, final_metrics=final, state=current_state())
