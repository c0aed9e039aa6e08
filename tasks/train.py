"""Stage 3, train: hidden-state shards -> an EAGLE-3 drafter in the engine's native folder format.

Ray Train's `TorchTrainer` runs `training.num_workers` workers (GPUs when `num_gpus_per_worker` > 0,
gloo on CPU) around kernels/train.py's `train_drafter`; infra/training/worker.py is the worker body (data
parallelism, per-epoch checkpoints). Checkpoints go to a local work folder keyed by the stage's cache
key, so a re-run after a crash resumes from the last complete epoch.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from draftloop.infra.evaluation.plots import plot_training_curves
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, read_shard, storage_options
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.worker import JOB_KEY, train_loop_per_worker
from draftloop.kernels.contract import contract_record
from draftloop.kernels.shards import LAST_HIDDEN_STATE_KEY, TARGET_DTYPE_KEY, shard_metadata_from_bytes
from draftloop.tasks.cache import StageError, StageOutcome
from draftloop.tasks.stage import Figure, Stage, StageRequest
from draftloop.tasks.summaries import TrainingSummary

DRAFTER_FILES = ("config.json", "model.safetensors")


def work_dir(config: ExperimentConfig, key: str) -> Path:
    """Local folder for this training's checkpoints (survives a crash; keyed like the stage output)."""
    return state_dir() / "work" / str(config.name) / "train" / key


def drafter_record(config: ExperimentConfig, hidden: StageOutcome) -> dict[str, Any]:
    """What the drafter is trained against, for its draftloop block (the pairing check compares it with
    what is served): the target's chat template, and what extraction recorded in its shards (the dtype the
    target ran in, the last hidden state's semantics)."""
    first = next(info.name for info in hidden.manifest.shards if info.name.endswith(".safetensors"))
    extracted = shard_metadata_from_bytes(read_shard(hidden.manifest, first, storage_options(config)))
    return contract_record(
        config.target.path,
        target_dtype=extracted.get(TARGET_DTYPE_KEY),
        last_hidden_state=extracted.get(LAST_HIDDEN_STATE_KEY),
    )


def loop_config(config: ExperimentConfig, hidden: StageOutcome, folder: Path) -> TrainingJob:
    """What every training worker needs (one frozen value: it travels to the Ray workers)."""
    return TrainingJob.from_config(config, hidden.manifest, folder, drafter_record(config, hidden))


def _fit(config: ExperimentConfig, hidden: StageOutcome, key: str, folder: Path, pids: PidRecord) -> Path:
    ensure_ray(config.ray.address, pids)
    section = config.training
    gpus = float(section.num_gpus_per_worker)
    job = loop_config(config, hidden, folder)
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
            storage_path=str(folder / "ray_train"),
        ),
    )
    trainer.fit()
    final = folder / "final"
    if not (final / "result.json").exists():
        raise StageError("train", f"training finished without a drafter in {final}")
    return final


def produce(request: StageRequest) -> Manifest:
    """Train the drafter on the extracted hidden states and store it in the engine's native format."""
    config, work, hidden = request.config, request.work, request.inputs["hidden"]
    folder = work_dir(config, work.key)
    folder.mkdir(parents=True, exist_ok=True)
    final = _fit(config, hidden, work.key, folder, request.pids)
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
    held_out = [
        {"epoch": e["epoch"], "held_out_acceptance_length": e["held_out_acceptance_length"]}
        for e in result["epochs"]
        if e.get("held_out_acceptance_length") is not None
    ]
    with tempfile.TemporaryDirectory(prefix="draftloop-train-") as scratch:
        curves = plot_training_curves(history, Path(scratch) / "training_curves.png")
        request.run.log_metric_history(history)
        request.run.log_metric_history(held_out, step_key="epoch")
        request.run.log_artifact(curves, "plots")  # the drafter: logged once, as register's model
        writer = DatasetWriter(work.uri, storage_options=storage_options(config))
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
        "workers": result["workers"],
        "seconds": round(seconds, 3),
        "tokens_per_s": round(result["trained_tokens"] / seconds, 3) if seconds > 0 else None,
        "packing_efficiency": round(real_tokens / computed_tokens, 4) if computed_tokens else None,
        # The exported drafter: the epoch with the best held-out acceptance length (else the last).
        "held_out_samples": result["held_out_samples"],
        "held_out_acceptance_length": [round(e["held_out_acceptance_length"], 4) for e in held_out],
        "exported_epoch": result["exported_epoch"],  # infra/training/best_epoch.py decided it
        "exported_held_out_acceptance_length": result["best_held_out_acceptance_length"],
    }
    return writer.commit("train", inputs=work.inputs, summary=summary)


def key_fields(config: ExperimentConfig) -> dict[str, str]:
    # Not the whole engine section: the drafter is saved in that engine's native format; samples are
    # truncated at data.max_length.
    return {"engine.kind": str(config.engine.kind), "data.max_length": str(config.data.max_length)}


def gpus(config: ExperimentConfig) -> float:
    return float(config.training.num_workers * config.training.num_gpus_per_worker)


STAGE = Stage(
    name="train",
    produce=produce,
    summary=TrainingSummary,
    sections=("target", "training"),
    inputs={"hidden": "extract"},
    key_fields=key_fields,
    gpus=gpus,
    retries=1,  # training is long and resumes from its checkpoints
    figures=(
        Figure("epochs", "epochs"),
        Figure("final_loss", "final loss"),
        Figure("loss_per_epoch", "loss per epoch"),
        Figure("final_accuracy", "final accuracy"),
        Figure("held_out_acceptance_length", "held-out AL per epoch"),
        Figure("exported_epoch", "exported epoch"),
        Figure("tokens_per_s", "tokens/s"),
    ),
    description=(
        "Everything up to a trained drafter (synthesize, extract, train), no serving or registration."
    ),
)
