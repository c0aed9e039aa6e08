"""EAGLE-3 training with training-time test (TTT), unrolled the way vLLM drafts.

For a sample x_0..x_{L-1} with target aux states h_t and final (normed) states g_t:

- step 0 at position t: hidden fc(h_t), token x_{t+1}, position id t; predicts x_{t+2} against the target's
  distribution softmax(lm_head(g_{t+1})) restricted to the draft vocabulary;
- step j: hidden = the drafter's own prenorm output of step j-1 at t, token x_{t+1+j}, position id t+j;
  predicts x_{t+2+j} against softmax(lm_head(g_{t+1+j})).

Attention at step j: the step-0 keys at positions <= t (causal) plus the chain keys of steps 1..j at the
same t (the diagonal, computed elementwise in :func:`drafter._attend`). Loss weight ``decay**j``; only
positions whose predicted token is an assistant token (loss_mask) and inside the sample count.
Samples are right-padded in a batch, so causal attention never crosses samples.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .drafter import Eagle3Drafter, KVPair

__all__ = [
    "TrainConfig",
    "TrainResult",
    "collate_samples",
    "draft_target_head",
    "make_optimizer",
    "make_scheduler",
    "train_drafter",
    "ttt_loss",
]


@dataclass
class TrainConfig:
    ttt_length: int = 7
    epochs: int = 1
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

    def __post_init__(self) -> None:
        checks = {
            "ttt_length": self.ttt_length >= 1,
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 1,
            "grad_accum": self.grad_accum >= 1,
            "lr": self.lr > 0,
            "warmup_ratio": 0 <= self.warmup_ratio < 1,
            "step_decay": 0 < self.step_decay <= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid training settings: {', '.join(bad)} ({asdict(self)})")


@dataclass
class TrainResult:
    history: list[dict[str, Any]]  # one entry per optimizer step
    epochs: list[dict[str, Any]]  # one entry per epoch (token-weighted means)
    final_metrics: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)  # optimizer/scheduler/epoch/step, for resume


# --------------------------------------------------------------------------------------------- batches


def collate_samples(
    samples: Sequence[Mapping[str, Tensor]],
    device: torch.device | str = "cpu",
    max_length: int | None = None,
    batch_size: int | None = None,
    pad_multiple: int | None = None,
) -> dict[str, Tensor]:
    """Right-pad samples into a batch: input_ids/loss_mask [B, L], aux/last [B, L, *], lengths [B].

    ``batch_size`` adds empty rows (length 0, nothing counted) up to that many; ``pad_multiple`` rounds
    L up to a multiple — both keep the shapes a compiled loss sees few.
    """
    if not samples:
        raise ValueError("empty batch")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    if max_length is not None:
        lengths = [min(n, max_length) for n in lengths]
    length = max(lengths)
    if pad_multiple:
        length = -(-length // pad_multiple) * pad_multiple
    batch = max(len(samples), batch_size or 0)
    lengths += [0] * (batch - len(samples))
    aux_dim = int(samples[0]["aux_hidden"].shape[-1])
    last_dim = int(samples[0]["last_hidden"].shape[-1])
    hidden_dtype = samples[0]["aux_hidden"].dtype
    input_ids = torch.zeros(batch, length, dtype=torch.int64)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    aux = torch.zeros(batch, length, aux_dim, dtype=hidden_dtype)
    last = torch.zeros(batch, length, last_dim, dtype=samples[0]["last_hidden"].dtype)
    for row, (sample, n) in enumerate(zip(samples, lengths[: len(samples)], strict=True)):
        input_ids[row, :n] = sample["input_ids"][:n]
        loss_mask[row, :n] = sample["loss_mask"][:n].bool()
        aux[row, :n] = sample["aux_hidden"][:n]
        last[row, :n] = sample["last_hidden"][:n]
    return {
        "input_ids": input_ids.to(device, non_blocking=True),
        "loss_mask": loss_mask.to(device, non_blocking=True),
        "aux_hidden": aux.to(device, non_blocking=True),
        "last_hidden": last.to(device, non_blocking=True),
        "lengths": torch.tensor(lengths, dtype=torch.int64).to(device),
    }


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


def ttt_loss(
    drafter: Eagle3Drafter,
    batch: Mapping[str, Tensor],
    target_head_draft: Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
) -> tuple[Tensor, dict[str, Any]]:
    """Weighted TTT loss of one collated batch, and per-step metrics.

    Returns (loss, {"loss": [per step], "acc": [per step], "tokens": [per step]}) where acc is the
    share of counted positions whose drafter argmax equals the target's argmax over the draft vocab.
    """
    input_ids = batch["input_ids"]
    loss_mask = batch["loss_mask"].bool()
    lengths = batch["lengths"]
    bsz, length = input_ids.shape
    device = input_ids.device
    positions = torch.arange(length, device=device)
    in_sample = positions[None, :] < lengths[:, None]
    counted = loss_mask & in_sample

    with torch.no_grad():
        last = batch["last_hidden"].to(target_head_draft.dtype)
        target_logits = torch.matmul(last, target_head_draft.t()).float()  # [B, L, Vd]
        # Padded once at the end so that every step reads a shifted view instead of a copy.
        pad = ttt_length + 1
        target_probs = F.pad(torch.softmax(target_logits, dim=-1), (0, 0, 0, pad))
        target_argmax = F.pad(target_logits.argmax(-1), (0, pad), value=-1)
        del target_logits
        ids_padded = F.pad(input_ids, (0, pad))
        counted_padded = F.pad(counted, (0, pad + 1))

    hidden = drafter.fuse(batch["aux_hidden"])
    position_ids = positions[None, :].expand(bsz, length)
    step0: KVPair | None = None
    chain: list[KVPair] = []
    total = hidden.new_zeros((), dtype=torch.float32)
    step_losses: list[Tensor] = []
    step_accs: list[Tensor] = []
    step_tokens: list[Tensor] = []
    for step in range(ttt_length):
        step_ids = ids_padded[:, 1 + step : 1 + step + length]
        if step0 is None:
            hidden, kv = drafter(hidden, step_ids, position_ids)
            step0 = kv
        else:
            hidden, kv = drafter(
                hidden,
                step_ids,
                position_ids + step,
                past=[step0],
                attn_bias=None,  # causal over the step-0 keys (FlexAttention on CUDA)
                diagonal=chain,
            )
            chain = [*chain, kv]
        # Counted where the predicted token x_{t+2+step} exists and is an assistant token.
        weight = counted_padded[:, 2 + step : 2 + step + length].float()
        probs = target_probs[:, 1 + step : 1 + step + length]
        logits = drafter.logits(hidden).float()
        # Soft cross-entropy with a normalised target: logsumexp(z) - sum(p * z), no log_softmax tensor.
        per_token = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
        tokens = weight.sum()
        step_loss = (per_token * weight).sum() / tokens.clamp_min(1.0)
        total = total + (decay**step) * step_loss
        with torch.no_grad():
            hits = (logits.argmax(-1) == target_argmax[:, 1 + step : 1 + step + length]).float() * weight
            step_accs.append(hits.sum() / tokens.clamp_min(1.0))
        step_losses.append(step_loss.detach())
        step_tokens.append(tokens.detach())
    stacked = torch.stack(
        [torch.stack(step_losses), torch.stack(step_accs), torch.stack(step_tokens)]
    ).tolist()
    metrics = {"loss": stacked[0], "acc": stacked[1], "tokens": [int(t) for t in stacked[2]]}
    return total, metrics


# --------------------------------------------------------------------------------------------- optimisation


def make_optimizer(drafter: Eagle3Drafter, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float) -> Any:
    """Linear warm-up to the base lr, then cosine decay to zero over ``total_steps`` optimizer steps."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _autocast(device: torch.device) -> AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm  # shipped with transformers
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _state(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    epochs_done: int,
    global_step: int,
    history: list[dict[str, Any]],
    epoch_history: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epochs_done,
        "global_step": global_step,
        "history": list(history),
        "epochs": list(epoch_history),
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
    samples: Iterable[Mapping[str, Tensor]],
    target_head: Tensor,
    cfg: TrainConfig,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    on_epoch: Callable[[int, dict[str, Any]], None] | None = None,
    resume_state: Mapping[str, Any] | None = None,
) -> TrainResult:
    """Train ``drafter`` in place with TTT on per-sample dicts from hidden-state shards.

    ``target_head``: the target's lm_head weight [V, Ht] (or already the draft rows [Vd, Ht]).
    The drafter must have the target's embeddings attached. ``on_step(step, metrics)`` runs after every
    optimizer step, ``on_epoch(epoch, metrics)`` after every epoch. ``resume_state`` is a previous
    result's ``state`` (continues after its last finished epoch).
    """
    device = torch.device(device)
    data = list(samples)
    if not data:
        raise ValueError("no training samples")
    drafter.to(device)
    drafter.train()
    if drafter.embed_weight is None:
        raise RuntimeError("attach the target's embeddings (drafter.attach_embeddings) before training")
    head = target_head.to(device)
    if head.shape[0] != drafter.config.draft_vocab_size:
        head = draft_target_head(drafter, head)
    head = head.to(torch.bfloat16) if device.type == "cuda" else head.float()
    compiled = cfg.compile and device.type == "cuda"
    loss_fn: Callable[..., tuple[Tensor, dict[str, Any]]] = (
        cast(Any, torch.compile(ttt_loss, dynamic=False)) if compiled else ttt_loss
    )

    batches_per_epoch = math.ceil(len(data) / cfg.batch_size)
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = steps_per_epoch * cfg.epochs
    optimizer = make_optimizer(drafter, cfg)
    scheduler = make_scheduler(optimizer, total_steps, cfg.warmup_ratio)
    start_epoch = 0
    global_step = 0
    history: list[dict[str, Any]] = []
    epoch_history: list[dict[str, Any]] = []
    if resume_state:
        optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        start_epoch = int(resume_state["epoch"])
        global_step = int(resume_state["global_step"])
        history = list(resume_state.get("history", []))
        epoch_history = list(resume_state.get("epochs", []))

    progress = _progress(total_steps - global_step, cfg.show_progress, "train drafter")
    try:
        for epoch in range(start_epoch, cfg.epochs):
            # Same order for the same seed and epoch, independent of the global RNG.
            order = list(range(len(data)))
            random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
            torch.manual_seed(cfg.seed + epoch)
            epoch_loss = 0.0
            epoch_batches = 0
            token_acc = [0.0] * cfg.ttt_length
            token_count = [0] * cfg.ttt_length
            batch_starts = list(range(0, len(order), cfg.batch_size))
            for group_start in range(0, len(batch_starts), cfg.grad_accum):
                group = batch_starts[group_start : group_start + cfg.grad_accum]
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                step_acc = [0.0] * cfg.ttt_length
                step_count = [0] * cfg.ttt_length
                for start in group:
                    chosen = [data[i] for i in order[start : start + cfg.batch_size]]
                    if compiled:
                        batch = collate_samples(
                            chosen, device, cfg.max_length, cfg.batch_size, cfg.pad_multiple
                        )
                    else:
                        batch = collate_samples(chosen, device, cfg.max_length)
                    with _autocast(device):
                        loss, metrics = loss_fn(drafter, batch, head, cfg.ttt_length, cfg.step_decay)
                    (loss / len(group)).backward()
                    step_loss += float(loss.detach()) / len(group)
                    for j in range(cfg.ttt_length):
                        step_acc[j] += metrics["acc"][j] * metrics["tokens"][j]
                        step_count[j] += metrics["tokens"][j]
                grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                global_step += 1
                record = {
                    "step": global_step,
                    "epoch": epoch,
                    "loss": step_loss,
                    "lr": optimizer.param_groups[0]["lr"],
                    "grad_norm": float(grad_norm),
                    "acc": [a / c if c else 0.0 for a, c in zip(step_acc, step_count, strict=True)],
                    "tokens": step_count,
                }
                history.append(record)
                epoch_loss += step_loss
                epoch_batches += 1
                for j in range(cfg.ttt_length):
                    token_acc[j] += step_acc[j]
                    token_count[j] += step_count[j]
                if on_step is not None:
                    on_step(global_step, record)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{step_loss:.3f}", acc0=f"{record['acc'][0]:.2f}")
            summary = {
                "epoch": epoch,
                "loss": epoch_loss / max(1, epoch_batches),
                "acc": [a / c if c else 0.0 for a, c in zip(token_acc, token_count, strict=True)],
                "tokens": token_count,
                "steps": global_step,
            }
            epoch_history.append(summary)
            if on_epoch is not None:
                # A CPU copy: the optimizer keeps updating its live state tensors in place.
                resume = _cpu_copy(
                    _state(optimizer, scheduler, epoch + 1, global_step, history, epoch_history)
                )
                on_epoch(epoch, {**summary, "resume_state": resume})
    finally:
        if progress is not None:
            progress.close()
    drafter.eval()
    state = _state(optimizer, scheduler, cfg.epochs, global_step, history, epoch_history)
    final = dict(epoch_history[-1]) if epoch_history else {}
    return TrainResult(history=history, epochs=epoch_history, final_metrics=final, state=state)
