"""The cycle's stages in order: the one place a stage is placed (each is declared in tasks/<stage>.py)."""

from __future__ import annotations

from draftloop.tasks import evaluate, extract, register, synthesize, train
from draftloop.tasks.stage import Pipeline

CYCLE = Pipeline((synthesize.STAGE, extract.STAGE, train.STAGE, evaluate.STAGE, register.STAGE))
