"""The body of one Ray Train worker of the train stage (no Prefect, no MLflow here).

Data parallelism: each worker reads its own shards (round-robin by rank), gradients are averaged
across workers after every backward pass and weights start identical (broadcast from rank 0), so every
worker takes the same optimizer step, which is what DDP does. Rank 0 writes a checkpoint (drafter
weights + optimizer/scheduler state) after every epoch; a re-run resumes from the last complete one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from draftloop.infra.engines.base import get_engine
from draftloop.infra.storage import Manifest, read_shard
from draftloop.kernels.checkpoint import load_drafter, load_target_head
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes
from draftloop.kernels.train import TrainConfig, train_drafter
from draftloop.kernels.vocab import build_draft_vocab, count_tokens

CHECKPOINT_DONE = "COMPLETE"


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest epoch checkpoint whose write completed (the marker is written last)."""
    done = sorted(path.parent for path in folder.glob(f"epoch-*/{CHECKPOINT_DONE}"))
    return done[-1] if done else None


def _read_samples(
    manifest_json: dict[str, Any], options: dict[str, Any], rank: int, world: int
) -> list[dict[str, torch.Tensor]]:
    manifest = Manifest.model_validate(manifest_json)
    samples: list[dict[str, torch.Tensor]] = []
    for index, info in enumerate(manifest.shards):
        if index % world != rank or not info.name.endswith(".safetensors"):
            continue
        tensors, _ = shard_from_bytes(read_shard(manifest, info.name, options))
        samples.extend({k: v.clone() for k, v in sample.items()} for sample in iter_hidden_samples(tensors))
    return samples


def _build_drafter(
    loop: dict[str, Any], samples: list[dict[str, torch.Tensor]], distributed: bool
) -> tuple[Eagle3Drafter, torch.Tensor]:
    """(drafter with embeddings attached, target lm_head) — fresh from the target, or `drafter_init`."""
    embed, lm_head, final_norm = load_target_head(loop["target_path"])
    if loop["drafter_init"]:
        drafter = load_drafter(loop["drafter_init"])
    else:
        target_config = json.loads((Path(loop["target_path"]) / "config.json").read_text())
        layer_ids = LayerIds(tuple(loop["aux_layer_ids"]), "layer_input")
        config = DrafterConfig.for_target(target_config, layer_ids, loop["draft_vocab_size"])
        torch.manual_seed(int(loop["seed"]))
        drafter = Eagle3Drafter(config)
        vocab_size = int(config.vocab_size)
        # The draft vocabulary counts assistant tokens over ALL workers' data, so every rank agrees.
        counts = count_tokens(
            (s["input_ids"] for s in samples), vocab_size, (s["loss_mask"].long() for s in samples)
        )
        if distributed:
            dist.all_reduce(counts)
        d2t, t2d = build_draft_vocab(counts, vocab_size, loop["draft_vocab_size"])
        drafter.set_vocab_mapping(d2t, t2d)
        if lm_head.shape[1] == config.hidden_size:
            drafter.init_from_target_head(lm_head, final_norm)
    drafter.attach_embeddings(embed)
    return drafter, lm_head


def _average_gradients_across_workers(drafter: Eagle3Drafter, world: int) -> None:
    """After each backward pass, every trainable parameter's gradient becomes the mean over workers."""

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:  # always set: the hook runs after the gradient was accumulated
            dist.all_reduce(param.grad)
            param.grad.div_(world)

    for param in drafter.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


def train_loop_per_worker(loop: dict[str, Any]) -> None:
    """Ray Train worker body: this worker's rank and device, then `train_worker`."""
    context = ray.train.get_context()
    train_worker(
        loop,
        rank=context.get_world_rank(),
        world=context.get_world_size(),
        device=ray.train.torch.get_device(),
        report=ray.train.report,
    )


def train_worker(
    loop: dict[str, Any],
    rank: int,
    world: int,
    device: torch.device | str,
    report: Callable[[dict[str, Any]], None],
) -> None:
    """Load this rank's shards, (resume and) train, checkpoint every epoch; rank 0 writes `final/`.

    Ray-free apart from `report` (a metrics callback) and torch.distributed when `world` > 1.
    """
    distributed = world > 1
    samples = _read_samples(loop["manifest"], loop["storage_options"], rank, world)
    if distributed:
        # Equal step counts on every worker, or the gradient all-reduces would deadlock.
        count = torch.tensor([len(samples)])
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        samples = samples[: int(count)]
    if not samples:
        raise RuntimeError(f"worker {rank} has no training samples")
    drafter, lm_head = _build_drafter(loop, samples, distributed)
    work = Path(loop["work_dir"])
    resume_state = None
    resumed_from = None
    checkpoint = latest_checkpoint(work)
    if checkpoint is not None:
        drafter.load_state_dict(torch.load(checkpoint / "drafter.pt", weights_only=True), strict=False)
        resume_state = torch.load(checkpoint / "resume.pt", weights_only=False)
        resumed_from = int(resume_state["epoch"])
    drafter.to(device)
    if distributed:
        for tensor in drafter.state_dict().values():
            dist.broadcast(tensor, src=0)
        _average_gradients_across_workers(drafter, world)
    settings = TrainConfig(**loop["train_config"])

    def on_epoch(epoch: int, metrics: dict[str, Any]) -> None:
        state = metrics.pop("resume_state")
        epoch_report = {"epoch": epoch, "loss": float(metrics["loss"]), "steps": int(metrics["steps"])}
        if rank == 0:
            folder = work / f"epoch-{epoch + 1:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.cpu() for k, v in drafter.state_dict().items()}, folder / "drafter.pt")
            torch.save(state, folder / "resume.pt")
            (folder / CHECKPOINT_DONE).write_text(json.dumps(epoch_report))
            for older in sorted(work.glob("epoch-*"))[:-2]:  # keep the last two
                shutil.rmtree(older, ignore_errors=True)
        report(epoch_report)

    started = time.perf_counter()
    result = train_drafter(
        drafter,
        samples,
        lm_head,
        settings,
        device=device,
        on_epoch=on_epoch,
        resume_state=resume_state,
    )
    seconds = time.perf_counter() - started
    if rank == 0:
        final = work / "final"
        shutil.rmtree(final, ignore_errors=True)
        get_engine(loop["engine"]).export_drafter(
            drafter.cpu(),
            final / "drafter",
            metadata={"epochs": settings.epochs, "final": result.final_metrics},
        )
        new_steps = result.history[len(resume_state["history"]) if resume_state else 0 :]
        trained_tokens = sum(record["tokens"][0] for record in new_steps)  # step-0 positions = tokens seen
        (final / "result.json").write_text(
            json.dumps(
                {
                    "history": result.history,
                    "epochs": result.epochs,
                    "final": result.final_metrics,
                    "resumed_from_epoch": resumed_from,
                    "seconds": seconds,
                    "samples_per_worker": len(samples),
                    "workers": world,
                    "trained_tokens": trained_tokens * world,
                }
            )
        )
    report({"done": 1})
