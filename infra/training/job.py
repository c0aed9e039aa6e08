"""One training job: everything a train-stage worker needs, one frozen value built once from the config.

The train stage builds it (`TrainingJob.from_config`) and hands it to every Ray Train worker inside
`train_loop_config` (pickled: plain dataclasses, a pydantic manifest, `LayerIds`, a `TrainConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import state_dir
from draftloop.infra.runtime.storage import Manifest, storage_options
from draftloop.infra.training.sources import HiddenStates, StoredHiddenStates
from draftloop.kernels.data import RankSplit
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.train import TrainConfig

__all__ = ["TrainingJob"]

# The TrainConfig fields the training section does not hold: set below.
_NOT_FROM_SECTION = ("max_length", "show_progress", "compile_cache_dir")


@dataclass(frozen=True)
class TrainingJob:
    """What every training worker of one train stage needs."""

    hidden: HiddenStates  # the extracted shards, or the producers that compute them on request
    target_path: str
    aux_layer_ids: LayerIds  # the extracted ones (layer_input), the drafter's fused layers
    draft_vocab_size: int | None  # None: the target's vocabulary
    drafter_init: str | None  # a drafter folder to start from; None: a fresh drafter
    init_norm_from_target: bool  # a fresh drafter's final norm starts from the target's (else ones)
    engine: str  # the exported drafter's format
    drafter_metadata: Mapping[str, Any]  # what it is trained against (kernels/contract.py)
    work_dir: Path  # checkpoints, the best epoch's weights, final/
    shuffle_window_shards: int
    prefetch_shards: int
    rank_split: RankSplit  # how workers share each step (training.rank_split)
    held_out_samples: int  # asked for; at most a tenth of the data is held out
    acceptance_k: int  # draft length of the held-out acceptance estimate
    train: TrainConfig
    # The convention of a published drafter_init's aux ids (training.drafter_init_convention); None: the
    # folder records them. Last, with a default: jobs built without a drafter_init need not name it.
    drafter_init_convention: str | None = None
    # A fresh drafter's variant and options (training.drafter, training.drafter_options).
    drafter_variant: str = "eagle3"
    drafter_variant_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls,
        config: ExperimentConfig,
        hidden: Manifest | HiddenStates,
        work_dir: Path,
        drafter_metadata: Mapping[str, Any],
    ) -> TrainingJob:
        """The job of ``config``'s train stage over ``hidden``: the extract stage's manifest (the aux
        layer ids are the ones it recorded), or the stream (the config's), checkpointing under
        ``work_dir``."""
        section = config.training
        shared = {
            f.name: getattr(section, f.name)
            for f in fields(TrainConfig)
            if f.name in type(section).model_fields and f.name not in _NOT_FROM_SECTION
        }
        train = TrainConfig(
            **shared,
            max_length=int(config.data.max_length),
            show_progress=False,
            # Shared by every run on this machine: a resume, a rerun or another config of the same
            # shapes finds the loss compiled (kernels/compile_cache.py).
            compile_cache_dir=str(state_dir() / "compile-cache"),
        )
        if isinstance(hidden, Manifest):
            extracted = LayerIds(tuple(int(i) for i in hidden.summary["aux_layer_ids"]), "layer_input")
            hidden = StoredHiddenStates(hidden, storage_options(config))
        else:
            extracted = config.aux_layer_ids_internal()
        return cls(
            hidden=hidden,
            target_path=str(config.target.path),
            aux_layer_ids=extracted,
            draft_vocab_size=section.draft_vocab_size,
            drafter_init=section.drafter_init,
            init_norm_from_target=bool(section.init_norm_from_target),
            engine=str(config.engine.kind),
            drafter_metadata=dict(drafter_metadata),
            work_dir=Path(work_dir),
            shuffle_window_shards=int(section.shuffle_window_shards),
            prefetch_shards=int(section.prefetch_shards),
            rank_split=section.rank_split,
            held_out_samples=int(section.held_out_samples),
            acceptance_k=int(config.engine.num_speculative_tokens),
            train=train,
            drafter_init_convention=section.drafter_init_convention,
            drafter_variant=section.drafter,
            drafter_variant_options=dict(section.drafter_options),
        )
