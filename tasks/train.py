"""Stage 3, train: hidden-state shards -> an EAGLE-3 drafter in the engine's native folder format.

Ray Train's `TorchTrainer` runs `training.num_workers` workers (GPUs when `num_gpus_per_worker` > 0,
gloo on CPU) around kernels/train.py's `train_drafter` (the TTT step lives there). Data parallelism:
each worker reads its own shards (round-robin by rank), gradients are averaged across workers after
every backward pass and weights start identical (broadcast from rank 0), so every worker takes the
same optimizer step, which is what DDP does.

A checkpoint (drafter weights + optimizer/scheduler state) is written after every epoch to a local
work folder keyed by the stage's cache key; a re-run after a crash resumes from the last complete one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from draftloop.tasks._stage import (
    StageError,
    StageOutcome,
    StageWork,
    local_state_dir,
    run_cached,
    storage_options,
)

# Plus engine.kind (not the whole engine section): the drafter is saved in that engine's native format.
SECTIONS = ("target", "training")
CHECKPOINT_DONE = "COMPLETE"
DRAFTER_FILES = ("config.json", "model.safetensors")


def work_dir(config: Any, key: str) -> Path:
    """Local folder for this training's checkpoints (survives a crash; keyed like the stage output)."""
    return local_state_dir() / "work" / str(config.name) / "train" / key


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest epoch checkpoint whose write completed (the marker is written last)."""
    done = sorted(path.parent for path in folder.glob(f"epoch-*/{CHECKPOINT_DONE}"))
    return done[-1] if done else None


# ---------------------------------------------------------------------------------------------------------
# Inside a Ray Train worker (no Prefect, no MLflow here)


def _read_samples(manifest_json: dict[str, Any], options: dict[str, Any], rank: int, world: int) -> list[Any]:
    from draftloop.infra.storage import Manifest, read_shard
    from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes

    manifest = Manifest.model_validate(manifest_json)
    samples: list[Any] = []
    for index, info in enumerate(manifest.shards):
        if index % world != rank or not info.name.endswith(".safetensors"):
            continue
        tensors, _ = shard_from_bytes(read_shard(manifest, info.name, options))
        samples.extend({k: v.clone() for k, v in sample.items()} for sample in iter_hidden_samples(tensors))
    return samples


def _build_drafter(loop: dict[str, Any], samples: list[Any], distributed: bool) -> tuple[Any, Any]:
    """(drafter with embeddings attached, target lm_head) — fresh from the target, or `drafter_init`."""
    import torch

    from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter, load_drafter, load_target_head
    from draftloop.kernels.layer_ids import LayerIds
    from draftloop.kernels.vocab import build_draft_vocab, count_tokens

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
            import torch.distributed as dist

            dist.all_reduce(counts)
        d2t, t2d = build_draft_vocab(counts, vocab_size, loop["draft_vocab_size"])
        drafter.set_vocab_mapping(d2t, t2d)
        if lm_head.shape[1] == config.hidden_size:
            drafter.init_from_target_head(lm_head, final_norm)
    drafter.attach_embeddings(embed)
    return drafter, lm_head


def _average_gradients_across_workers(drafter: Any, world: int) -> None:
    """After each backward pass, every trainable parameter's gradient becomes the mean over workers."""
    import torch.distributed as dist

    def hook(param: Any) -> None:
        dist.all_reduce(param.grad)
        param.grad.div_(world)

    for param in drafter.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


def train_loop_per_worker(loop: dict[str, Any]) -> None:
    """Ray Train worker body: this worker's rank and device, then `train_worker`."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    train_worker(
        loop,
        rank=context.get_world_rank(),
        world=context.get_world_size(),
        device=ray.train.torch.get_device(),
        report=ray.train.report,
    )


def train_worker(loop: dict[str, Any], rank: int, world: int, device: Any, report: Any) -> None:
    """Load this rank's shards, (resume and) train, checkpoint every epoch; rank 0 writes `final/`.

    Ray-free apart from `report` (a metrics callback) and torch.distributed when `world` > 1.
    """
    import torch

    from draftloop.kernels.drafter import save_drafter
    from draftloop.kernels.train import TrainConfig, train_drafter

    distributed = world > 1
    samples = _read_samples(loop["manifest"], loop["storage_options"], rank, world)
    if distributed:
        import torch.distributed as dist

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
        import torch.distributed as dist

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
        save_drafter(
            drafter.cpu(),
            final / "drafter",
            engine=loop["engine"],
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


# ---------------------------------------------------------------------------------------------------------
# In the flow (driver)


def loop_config(config: Any, hidden: StageOutcome, folder: Path) -> dict[str, Any]:
    """What every training worker needs (plain data: it travels to Ray workers)."""
    section = config.training
    return {
        "manifest": hidden.manifest.model_dump(mode="json"),
        "storage_options": storage_options(config),
        "target_path": str(config.target.path),
        "aux_layer_ids": list(hidden.manifest.summary["aux_layer_ids"]),
        "draft_vocab_size": section.draft_vocab_size,
        "drafter_init": section.drafter_init,
        "seed": int(section.seed),
        "engine": str(config.engine.kind),
        "work_dir": str(folder),
        "train_config": {
            "ttt_length": int(section.ttt_length),
            "epochs": int(section.epochs),
            "batch_size": int(section.batch_size),
            "lr": float(section.lr),
            "warmup_ratio": float(section.warmup_ratio),
            "weight_decay": float(section.weight_decay),
            "grad_clip": float(section.grad_clip),
            "grad_accum": int(section.grad_accum),
            "seed": int(section.seed),
            "max_length": int(config.data.max_length),
            "show_progress": False,
            # training.compile: null = compile the TTT loss when training on GPUs (CUDA only in kernels).
            "compile": bool(
                getattr(section, "compile", None)
                if getattr(section, "compile", None) is not None
                else float(section.num_gpus_per_worker) > 0
            ),
        },
    }


def _fit(config: Any, hidden: StageOutcome, key: str, folder: Path) -> Path:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from draftloop.infra.actors import ensure_ray

    ensure_ray(config.ray.address)
    section = config.training
    gpus = float(section.num_gpus_per_worker)
    loop = loop_config(config, hidden, folder)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop,
        torch_config=TorchConfig(backend="nccl" if gpus > 0 else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=int(section.num_workers),
            use_gpu=gpus > 0,
            resources_per_worker={"CPU": 1, **({"GPU": gpus} if gpus > 0 else {})},
        ),
        run_config=RunConfig(
            name=f"train-{key}-{int(time.time())}",
            storage_path=str(folder / "ray_train"),
        ),
    )
    trainer.fit()
    final = folder / "final"
    if not (final / "result.json").exists():
        raise StageError("train", f"training finished without a drafter in {final}")
    return final


def run(config: Any, hidden: StageOutcome, stage_run: Any = None, on_start: Any = None) -> StageOutcome:
    """Train the drafter on `hidden` (cached on target + training sections + the hidden manifest)."""

    def body(work: StageWork) -> Any:
        from draftloop.infra.storage import DatasetWriter
        from draftloop.infra.tracking import plot_training_curves

        folder = work_dir(config, work.key)
        folder.mkdir(parents=True, exist_ok=True)
        final = _fit(config, hidden, work.key, folder)
        result = json.loads((final / "result.json").read_text())
        history = [
            {
                "step": r["step"],
                "loss": r["loss"],
                "lr": r["lr"],
                **{f"acc_{i}": a for i, a in enumerate(r["acc"])},
            }
            for r in result["history"]
        ]
        with tempfile.TemporaryDirectory(prefix="draftloop-train-") as scratch:
            curves = plot_training_curves(history, Path(scratch) / "training_curves.png")
            if stage_run is not None:
                stage_run.log_metric_history(history)
                stage_run.log_artifact(curves, "plots")
                stage_run.log_artifact(final / "drafter", "drafter")
            writer = DatasetWriter(work.uri, storage_options=storage_options(config))
            for name in DRAFTER_FILES:
                writer.write_shard(name, (final / "drafter" / name).read_bytes(), rows=0)
            writer.write_shard("training_history.json", json.dumps(result).encode(), rows=len(history))
            writer.write_shard("training_curves.png", curves.read_bytes(), rows=0)
        drafter_config = json.loads((final / "drafter" / "config.json").read_text())
        block = drafter_config.get("draftloop", {})
        final_metrics = result["final"]
        seconds = float(result["seconds"])
        summary = {
            "drafter_files": list(DRAFTER_FILES),
            "engine_format": str(config.engine.kind),
            "aux_layer_ids": block.get("aux_layer_ids"),
            "convention_exported": block.get("convention_exported"),
            "epochs": int(config.training.epochs),
            "steps": len(history),
            "final_loss": final_metrics.get("loss"),
            "final_accuracy": final_metrics.get("acc"),
            "resumed_from_epoch": result["resumed_from_epoch"],
            "workers": result["workers"],
            "seconds": round(seconds, 3),
            "tokens_per_s": round(result["trained_tokens"] / seconds, 3) if seconds > 0 else None,
        }
        return writer.commit("train", inputs=work.inputs, summary=summary)

    return run_cached(
        "train",
        config,
        SECTIONS,
        {"hidden": hidden.manifest},
        body,
        on_start=on_start,
        extra_inputs={"engine.kind": str(config.engine.kind), "data.max_length": str(config.data.max_length)},
    )


def download_drafter(manifest: Any, into: Path, options: dict[str, Any] | None = None) -> Path:
    """Materialise a train manifest's drafter folder locally."""
    from draftloop.infra.storage import read_shard

    into.mkdir(parents=True, exist_ok=True)
    for name in manifest.summary.get("drafter_files", DRAFTER_FILES):
        (into / name).write_bytes(read_shard(manifest, name, options))
    return into


def _task(ctx: Any, hidden: StageOutcome) -> StageOutcome:
    from draftloop.tasks._stage import execute_stage

    return execute_stage(
        ctx,
        "train",
        lambda stage_run, on_start: run(ctx.config, hidden, stage_run=stage_run, on_start=on_start),
    )


def train_task() -> Any:
    from prefect import task

    from draftloop.tasks._stage import task_options

    return task(name="train", **task_options(retries=1))(_task)
