"""The cycle's stages in order: the one place a stage is placed (each is declared in tasks/<stage>.py)."""

from __future__ import annotations

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.tasks import evaluate, extract, register, synthesize, train, train_online
from draftloop.tasks.stage import Pipeline

CYCLE = Pipeline((synthesize.STAGE, extract.STAGE, train.STAGE, evaluate.STAGE, register.STAGE))
# extraction.mode online | hybrid: no extract stage, the train stage streams the hidden states.
ONLINE_CYCLE = Pipeline((synthesize.STAGE, train_online.STAGE, evaluate.STAGE, register.STAGE))


def pipeline_for(config: ExperimentConfig) -> Pipeline:
    """The product's pipeline for `config`'s extraction mode."""
    return CYCLE if config.extraction.mode == "offline" else ONLINE_CYCLE
