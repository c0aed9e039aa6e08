"""Stage 3, train: hidden-state shards -> an EAGLE-3 drafter in the engine's native folder format.

The offline train stage: the extract stage's committed shards are read by every worker
(infra/training/sources.py). Ray Train around the worker body, checkpoints and the stored drafter are
infra/training/fit.py, shared with the online train stage (tasks/train_online.py).
"""

from __future__ import annotations

from typing import Any

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import Manifest, read_shard, storage_options
from draftloop.infra.training.fit import drafter_key_fields, fit, store_drafter, trainer_gpus, work_dir
from draftloop.infra.training.job import TrainingJob
from draftloop.kernels.contract import contract_record
from draftloop.kernels.shards import LAST_HIDDEN_STATE_KEY, TARGET_DTYPE_KEY, shard_metadata_from_bytes
from draftloop.tasks.cache import StageOutcome
from draftloop.tasks.stage import Stage, StageRequest
from draftloop.tasks.summaries import TRAINING_FIGURES, TrainingSummary


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


def loop_config(config: ExperimentConfig, hidden: StageOutcome, folder: Any) -> TrainingJob:
    """What every training worker needs (one frozen value: it travels to the Ray workers)."""
    return TrainingJob.from_config(config, hidden.manifest, folder, drafter_record(config, hidden))


def produce(request: StageRequest) -> Manifest:
    """Train the drafter on the extracted hidden states and store it in the engine's native format."""
    config, work, hidden = request.config, request.work, request.inputs["hidden"]
    folder = work_dir(config, work.key)
    folder.mkdir(parents=True, exist_ok=True)
    final = fit(config, loop_config(config, hidden, folder), work.key, request.pids, request.run)
    stored = store_drafter(config, final, work.uri, request.run)
    summary = {**stored.summary, "extraction_mode": "offline"}
    return stored.writer.commit("train", inputs=work.inputs, summary=summary)


STAGE = Stage(
    name="train",
    produce=produce,
    summary=TrainingSummary,
    sections=("target", "training"),
    inputs={"hidden": "extract"},
    key_fields=drafter_key_fields,
    gpus=trainer_gpus,
    retries=1,  # training is long and resumes from its checkpoints
    figures=TRAINING_FIGURES,
    description=(
        "Everything up to a trained drafter (synthesize, extract, train), no serving or registration."
    ),
)
