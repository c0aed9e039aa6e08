"""The body of one Ray Train worker of the train stage (no Prefect, no MLflow here).

Data parallelism (kernels/data.py): every worker sees the whole hidden-state dataset as shards read
lazily from storage, trains the samples of each optimizer step that come from the shards it owns, and
the step's gradient is summed over workers inside `train_drafter`; weights start identical (broadcast
from rank 0), so every worker takes the same optimizer step and a run's steps do not depend on the
worker count. Rank 0 writes a checkpoint (drafter weights + the resume state) after every epoch; a
re-run resumes from the last complete one, with any number of workers.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from draftloop.infra.engines.base import get_engine
from draftloop.infra.training.best_epoch import BestEpoch, exported_epoch
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.progress import EpochProgress, append_epoch, step_metrics
from draftloop.infra.training.sources import (
    TRAFFIC_FIELDS,
    StreamTraffic,
    WorkerData,
    sample_count,
    worker_data,
)
from draftloop.kernels.checkpoint import load_drafter
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.files import load_target_head
from draftloop.kernels.simulate import teacher_forced_acceptance
from draftloop.kernels.train import train_drafter
from draftloop.kernels.vocab import build_draft_vocab, count_tokens

CHECKPOINT_DONE = "COMPLETE"
JOB_KEY = "job"  # the one entry of Ray Train's train_loop_config (a dict by its API): the TrainingJob
Sample = Mapping[str, torch.Tensor]


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint whose write completed (the marker is written last)."""
    done = sorted(path.parent for path in folder.glob(f"step-*/{CHECKPOINT_DONE}"))
    return done[-1] if done else None


def held_out_count(num_samples: int, requested: int) -> int:
    """Samples held out for the per-epoch acceptance estimate: as requested, at most a tenth of the data."""
    return min(requested, num_samples // 10)


def _draft_vocab_counts(data: WorkerData, vocab_size: int, rank: int, world: int) -> torch.Tensor:
    """Assistant-token counts over the training samples (each worker counts every world-th shard)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for index, shard in enumerate(data.samples.shards):
        if index % world == rank:
            samples = data.load_tokens(shard.name)
            counts += count_tokens(
                (s["input_ids"] for s in samples), vocab_size, (s["loss_mask"].long() for s in samples)
            )
    if world > 1:
        dist.all_reduce(counts)
    return counts


def _build_drafter(
    job: TrainingJob, data: WorkerData | None, rank: int, world: int
) -> tuple[Eagle3Drafter, torch.Tensor]:
    """(drafter with embeddings attached, target lm_head) — fresh from the target, or `drafter_init`."""
    embed, lm_head, final_norm = load_target_head(job.target_path)
    if job.drafter_init:
        drafter = load_drafter(job.drafter_init, convention=job.drafter_init_convention)
    else:
        target_config = json.loads((Path(job.target_path) / "config.json").read_text())
        config = DrafterConfig.for_target(
            target_config, job.aux_layer_ids, job.draft_vocab_size,
            variant=job.drafter_variant, variant_options=job.drafter_variant_options,
        )  # fmt: skip
        torch.manual_seed(job.train.seed)
        drafter = Eagle3Drafter(config)
        vocab_size = int(config.vocab_size)
        if config.draft_vocab_size < vocab_size:  # the draft vocabulary: the most frequent answer tokens
            if data is None:
                raise ValueError("a draft vocabulary smaller than the target's is counted from the data")
            counts = _draft_vocab_counts(data, vocab_size, rank, world)
            drafter.set_vocab_mapping(*build_draft_vocab(counts, vocab_size, config.draft_vocab_size))
        if lm_head.shape[1] == config.hidden_size:
            drafter.init_from_target_head(lm_head, final_norm if job.init_norm_from_target else None)
    drafter.attach_embeddings(embed)
    return drafter, lm_head


def train_loop_per_worker(loop_config: Mapping[str, TrainingJob]) -> None:
    """Ray Train worker body: this worker's rank and device, then `train_worker`."""
    context = ray.train.get_context()
    train_worker(
        loop_config[JOB_KEY],
        rank=context.get_world_rank(),
        world=context.get_world_size(),
        device=ray.train.torch.get_device(),
        report=ray.train.report,
    )


def train_worker(
    job: TrainingJob,
    rank: int,
    world: int,
    device: torch.device | str,
    report: Callable[[dict[str, Any]], None],
) -> None:
    """(Resume and) train this worker's share, checkpoint every epoch; rank 0 writes `final/`.

    Ray-free apart from `report` (a metrics callback) and torch.distributed when `world` > 1.
    """
    held_out_samples = held_out_count(sample_count(job.hidden), job.held_out_samples)
    source = worker_data(
        job.hidden, job.shuffle_window_shards, job.prefetch_shards, held_out_samples, rank, job.rank_split
    )
    data = source.samples
    drafter, lm_head = _build_drafter(job, source, rank, world)
    work = job.work_dir
    resume_state = None
    resumed_from = None
    resumed_at = None
    checkpoint = latest_checkpoint(work)
    if checkpoint is not None:
        drafter.load_state_dict(torch.load(checkpoint / "drafter.pt", weights_only=True), strict=False)
        resume_state = torch.load(checkpoint / "resume.pt", weights_only=False)
        resumed_from = int(resume_state["epoch"])
        resumed_at = int(resume_state["consumed"])  # the sample position in that epoch's order
    drafter.to(device)
    if world > 1:
        for tensor in drafter.state_dict().values():
            dist.broadcast(tensor, src=0)
    settings = job.train

    # Rank 0 estimates acceptance on the held-out samples after every epoch and keeps the best epoch's
    # weights: that epoch is exported (infra/training/best_epoch.py).
    held_out = source.load_held_out() if rank == 0 else []
    best = BestEpoch.load(work) if checkpoint is not None else BestEpoch()
    head_on_device = lm_head.to(device) if held_out else lm_head

    epoch_steps: list[dict[str, float]] = []  # rank 0: this epoch's step records, for the driver's log

    def on_step(step: int, record: dict[str, Any]) -> None:
        if rank == 0:
            epoch_steps.append(step_metrics(record))

    def on_epoch(epoch: int, summary: dict[str, Any]) -> None:
        figures = {"epoch": epoch, "loss": float(summary["loss"]), "steps": int(summary["steps"])}
        length = None
        if held_out:
            drafter.eval()
            estimate = teacher_forced_acceptance(drafter, held_out, head_on_device, k=job.acceptance_k)
            drafter.train()
            length = estimate.mean_acceptance_length
            summary["held_out_acceptance_length"] = length
            figures["held_out_acceptance_length"] = float(length or 0.0)
            best.offer(work, epoch, length, drafter)
        report(figures)
        if rank == 0:  # the driver tails this while training runs (infra/training/progress.py)
            append_epoch(
                work, EpochProgress(epoch, settings.epochs, figures["loss"], length, list(epoch_steps))
            )
            epoch_steps.clear()

    def on_checkpoint(state: dict[str, Any]) -> None:
        if rank != 0:
            return
        folder = work / f"step-{int(state['global_step']):08d}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in drafter.state_dict().items()}, folder / "drafter.pt")
        torch.save(state, folder / "resume.pt")
        (folder / CHECKPOINT_DONE).write_text(
            json.dumps({"epoch": state["epoch"], "consumed": state["consumed"]})
        )
        for older in sorted(work.glob("step-*"))[:-2]:  # keep the last two
            shutil.rmtree(older, ignore_errors=True)

    started = time.perf_counter()
    result = train_drafter(
        drafter,
        data,
        lm_head,
        settings,
        device=device,
        rank=rank,
        world=world,
        on_step=on_step,
        on_epoch=on_epoch,
        on_checkpoint=on_checkpoint,
        resume_state=resume_state,
    )
    seconds = time.perf_counter() - started
    traffic = _summed_traffic(source.traffic, world)
    if rank == 0:
        final = work / "final"
        shutil.rmtree(final, ignore_errors=True)
        exported = drafter.cpu()
        best.load_weights_into(work, exported)
        epoch = exported_epoch(best.epoch, settings.epochs)
        get_engine(job.engine).export_drafter(
            exported,
            final / "drafter",
            metadata={
                **job.drafter_metadata,
                "epochs": settings.epochs,
                "final": result.final_metrics,
                "exported_epoch": epoch,
            },
        )
        new_steps = result.history[len(resume_state["history"]) if resume_state else 0 :]
        # Sample tokens each step trained on, over every worker (padding not counted).
        trained_tokens = sum(record["real_tokens"] for record in new_steps)
        (final / "result.json").write_text(
            json.dumps(
                {
                    "history": result.history,
                    "epochs": result.epochs,
                    "final": result.final_metrics,
                    "resumed_from_epoch": resumed_from,
                    "resumed_at_sample": resumed_at,
                    "seconds": seconds,
                    "samples": data.num_samples,
                    "workers": world,
                    "trained_tokens": trained_tokens,
                    "held_out_samples": len(held_out),
                    "best_epoch": best.epoch,
                    "best_held_out_acceptance_length": best.length,
                    "exported_epoch": epoch,
                    "stream": traffic,
                }
            )
        )
    report({"done": 1})


def _summed_traffic(traffic: StreamTraffic | None, world: int) -> dict[str, int] | None:
    """What the workers received from the producers, summed over workers (None: stored shards)."""
    if traffic is None:
        return None
    totals = traffic.as_tensor()
    if world > 1:
        dist.all_reduce(totals)
    return dict(zip(TRAFFIC_FIELDS, (int(v) for v in totals.tolist()), strict=True))
