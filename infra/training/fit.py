"""One training run of the train stage, whatever feeds it: Ray Train around the worker body, then the
drafter, its curves and its figures stored as the stage's dataset.

Ray Train's `TorchTrainer` runs `training.num_workers` workers (GPUs when `num_gpus_per_worker` > 0,
gloo on CPU) around infra/training/worker.py; a worker that dies restarts the group (its failure
config), which resumes from the last checkpoint. Checkpoints go to a local work folder keyed by the
stage's cache key, so a re-run after a crash resumes from there too, on any number of workers.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from draftloop.infra.evaluation.plots import plot_training_curves
from draftloop.infra.registry.runs import StageRun
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray
from draftloop.infra.runtime.storage import DatasetWriter, storage_options
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.progress import epoch_reporter, step_metrics, watch_epochs
from draftloop.infra.training.worker import JOB_KEY, train_loop_per_worker

DRAFTER_FILES = ("config.json", "model.safetensors")
WORKER_RESTARTS = 2  # a training worker that dies: the group restarts from the last checkpoint


class TrainingFailed(RuntimeError):
    pass


def drafter_key_fields(config: ExperimentConfig) -> dict[str, str]:
    """Single fields outside the training section a trained drafter depends on: it is saved in the
    engine's native format; samples are truncated at data.max_length."""
    return {"engine.kind": str(config.engine.kind), "data.max_length": str(config.data.max_length)}


def trainer_gpus(config: ExperimentConfig) -> float:
    return float(config.training.num_workers * config.training.num_gpus_per_worker)


def work_dir(config: ExperimentConfig, key: str) -> Path:
    """Local folder for this training's checkpoints (survives a crash; keyed like the stage output)."""
    return state_dir() / "work" / str(config.name) / "train" / key


def fit(
    config: ExperimentConfig, job: TrainingJob, key: str, pids: PidRecord, run: StageRun | None = None
) -> Path:
    """Train with Ray Train; the folder holding the drafter and result.json (rank 0's). Each epoch is
    reported while training runs: a line in the stage's log, its metrics into `run`."""
    ensure_ray(config.ray.address, pids)
    section = config.training
    gpus = float(section.num_gpus_per_worker)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={JOB_KEY: job},
        torch_config=TorchConfig(backend="nccl" if gpus > 0 else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=int(section.num_workers),
            use_gpu=gpus > 0,
            resources_per_worker={"CPU": 1, **({"GPU": gpus} if gpus > 0 else {})},
        ),
        run_config=RunConfig(
            name=f"train-{key}-{int(time.time())}",
            storage_path=str(job.work_dir / "ray_train"),
            failure_config=FailureConfig(max_failures=WORKER_RESTARTS),
        ),
    )
    with watch_epochs(job.work_dir, epoch_reporter(run)):
        trainer.fit()
    final = job.work_dir / "final"
    if not (final / "result.json").exists():
        raise TrainingFailed(f"training finished without a drafter in {final}")
    return final


@dataclass(frozen=True)
class StoredDrafter:
    """The train stage's dataset as written (its summary before the stage adds its own fields)."""

    writer: DatasetWriter
    summary: dict[str, Any]
    result: dict[str, Any]  # result.json


def store_drafter(config: ExperimentConfig, final: Path, uri: str, run: StageRun) -> StoredDrafter:
    """The drafter, its history and curves into the stage's dataset at `uri` (not committed), the
    curves and per-step and per-epoch figures into the stage's MLflow run; the summary's figures."""
    result = json.loads((final / "result.json").read_text())
    history = [step_metrics(r) for r in result["history"]]
    held_out = [
        {"epoch": e["epoch"], "held_out_acceptance_length": e["held_out_acceptance_length"]}
        for e in result["epochs"]
        if e.get("held_out_acceptance_length") is not None
    ]
    writer = DatasetWriter(uri, storage_options=storage_options(config))
    with tempfile.TemporaryDirectory(prefix="draftloop-train-") as scratch:
        curves = plot_training_curves(history, Path(scratch) / "training_curves.png")
        # What `fit` did not stream already (an earlier attempt's epochs, before a resume).
        streamed = {m.step for m in run.client.get_metric_history(run.run_id, "loss")}
        run.log_metric_history([row for row in history if row["step"] not in streamed])
        streamed = {m.step for m in run.client.get_metric_history(run.run_id, "held_out_acceptance_length")}
        run.log_metric_history([row for row in held_out if row["epoch"] not in streamed], step_key="epoch")
        run.log_artifact(curves, "plots")  # the drafter: logged once, as register's model
        for name in DRAFTER_FILES:
            writer.write_shard(name, (final / "drafter" / name).read_bytes(), rows=0)
        writer.write_shard("training_history.json", json.dumps(result).encode(), rows=len(history))
        writer.write_shard("training_curves.png", curves.read_bytes(), rows=0)
    drafter_config = json.loads((final / "drafter" / "config.json").read_text())
    block = drafter_config.get("draftloop", {})
    final_metrics = result["final"]
    seconds = float(result["seconds"])
    # Real sample tokens over computed row slots (padding included), over every epoch and worker.
    real_tokens = sum(int(epoch["real_tokens"]) for epoch in result["epochs"])
    computed_tokens = sum(int(epoch["computed_tokens"]) for epoch in result["epochs"])
    trained = [epoch.get("trained_per_sample") for epoch in result["epochs"]]
    summary = {
        "drafter_files": list(DRAFTER_FILES),
        "engine_format": str(config.engine.kind),
        "aux_layer_ids": block.get("aux_layer_ids"),
        "convention_exported": block.get("convention_exported"),
        "epochs": int(config.training.epochs),
        "steps": len(history),
        "final_loss": final_metrics.get("loss"),
        "loss_per_epoch": [round(float(epoch["loss"]), 4) for epoch in result["epochs"]],
        "final_accuracy": final_metrics.get("acc"),
        "resumed_from_epoch": result["resumed_from_epoch"],
        "resumed_at_sample": result.get("resumed_at_sample"),
        "workers": result["workers"],
        "seconds": round(seconds, 3),
        "tokens_per_s": round(result["trained_tokens"] / seconds, 3) if seconds > 0 else None,
        "packing_efficiency": round(real_tokens / computed_tokens, 4) if computed_tokens else None,
        # The exported drafter: the epoch with the best held-out acceptance length (else the last).
        "held_out_samples": result["held_out_samples"],
        "held_out_acceptance_length": [round(e["held_out_acceptance_length"], 4) for e in held_out],
        "exported_epoch": result["exported_epoch"],  # infra/training/best_epoch.py decided it
        "exported_held_out_acceptance_length": result["best_held_out_acceptance_length"],
        # {times trained: samples} per epoch, over every worker and resume: {"1": N} is exactly once.
        "trained_per_sample": trained if all(t is not None for t in trained) else None,
    }
    return StoredDrafter(writer, summary, result)
