"""A stage added by one module, as a newcomer would add one: declared, then placed in a pipeline.

It reads the trained drafter (the train stage's output) and counts its bytes; nothing else in the code
base knows it exists. tests/test_stage_seam.py runs it through the real flow.
"""

from __future__ import annotations

from pydantic import BaseModel

from draftloop.flows.pipeline import CYCLE
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, read_shard, storage_options
from draftloop.tasks.stage import Figure, Stage, StageRequest


class DrafterSizeSummary(BaseModel):
    drafter_bytes: int
    files: int


def produce(request: StageRequest) -> Manifest:
    drafter = request.inputs["drafter"].manifest
    options = storage_options(request.config)
    sizes = [len(read_shard(drafter, info.name, options)) for info in drafter.shards]
    summary = DrafterSizeSummary(drafter_bytes=sum(sizes), files=len(sizes))
    writer = DatasetWriter(request.work.uri, storage_options=options)
    return writer.commit("drafter-size", inputs=request.work.inputs, summary=summary.model_dump())


def gpus(config: ExperimentConfig) -> float:
    return 1.5  # rounded up to two slots of the `gpus` limit


STAGE = Stage(
    name="drafter-size",
    produce=produce,
    summary=DrafterSizeSummary,
    sections=("training",),
    inputs={"drafter": "train"},
    gpus=gpus,
    figures=(Figure("drafter_bytes", "drafter bytes"), Figure("files", "files")),
    description="Count the trained drafter's bytes.",
)

PIPELINE = CYCLE.inserted(STAGE, after="train")
