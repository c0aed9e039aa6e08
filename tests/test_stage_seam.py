"""A stage is one declared object: a stage added by one module (tests/fake_stage.py) gets its cache key,
its GPU slots, its nested MLflow run and its summary figures from the declaration alone."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fake_stage
import pytest
from fixtures_flow import FlowEnv
from pydantic import BaseModel

from draftloop.flows.pipeline import CYCLE
from draftloop.tasks.stage import Pipeline, Stage


class _Empty(BaseModel):
    pass


def _stage(name: str, inputs: dict[str, str] | None = None) -> Stage:
    def produce(request: Any) -> Any:
        raise AssertionError("never run: only the pipeline's order is checked")

    return Stage(name=name, produce=produce, summary=_Empty, sections=(), inputs=inputs or {})


def test_a_pipeline_refuses_a_stage_whose_input_no_earlier_stage_produces() -> None:
    with pytest.raises(ValueError, match="'late' reads early, which no earlier stage produces"):
        Pipeline((_stage("late", {"x": "early"}), _stage("early")))
    with pytest.raises(ValueError, match="appears twice"):
        Pipeline((_stage("a"), _stage("a")))
    # Leaving a stage out is allowed when no later stage reads it; `until` cuts after a stage.
    assert Pipeline((_stage("a"), _stage("b"))).without("a").names == ("b",)
    assert CYCLE.until("train").names == ("synthesize", "extract", "train")
    assert fake_stage.PIPELINE.names == (
        "synthesize",
        "extract",
        "train",
        "drafter-size",
        "evaluate",
        "register",
    )
    with pytest.raises(ValueError, match="reads extract"):
        CYCLE.without("extract")  # train reads the hidden states


@pytest.mark.slow
def test_a_stage_added_by_one_module_runs_in_the_flow_with_what_it_declares(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    from draftloop.flows.cycle import TrainAndEvalParams, cycle_flow, run_cycle
    from draftloop.infra.runtime.config import ExperimentConfig
    from draftloop.infra.runtime.storage import read_manifest

    held: list[int] = []

    @contextmanager
    def recording_hold(count: int) -> Iterator[None]:
        held.append(count)
        yield

    monkeypatch.setattr("draftloop.tasks.stage.hold_gpus", recording_hold)

    @cycle_flow("fake-stage-cycle")
    def with_fake_stage(config: str) -> dict[str, Any]:
        return run_cycle(TrainAndEvalParams(config=config), pipeline=fake_stage.PIPELINE)

    first = with_fake_stage(str(flow_env.config_path))
    assert first["status"] == "completed"
    # Every stage of the shared cycle is reused; only the new one runs, holding its declared GPUs.
    assert sorted(first["cache_hits"]) == sorted(first_cycle[0]["stages"])
    timing = first["stages"]["drafter-size"]
    assert timing["cache_hit"] is False
    assert held == [2]  # a cache hit takes no slot
    # Its cache key hashes its declared section and its input's manifest.
    manifest = read_manifest(timing["uri"])
    train_uri = first["stages"]["train"]["uri"]
    assert manifest.inputs["upstream.drafter"] == read_manifest(train_uri).content_hash()
    assert "config.training" in manifest.inputs
    # Its figures reach summary.json, as declared.
    drafter_bytes = sum(info.size for info in read_manifest(train_uri).shards)
    assert timing["figures"] == {
        "drafter bytes": drafter_bytes,
        "files": len(read_manifest(train_uri).shards),
    }
    # Its nested MLflow run carries its metrics.
    config = ExperimentConfig.load(flow_env.config_path)
    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    assert experiment is not None
    children = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{first['mlflow_run_id']}'"
    )
    runs = {run.data.tags["draftloop.stage"]: run for run in children}
    assert set(runs) == {*first_cycle[0]["stages"], "drafter-size"}
    assert runs["drafter-size"].data.metrics["drafter_bytes"] == drafter_bytes
    assert runs["drafter-size"].data.tags["draftloop.cache_hit"] == "false"

    second = with_fake_stage(str(flow_env.config_path))
    assert second["stages"]["drafter-size"]["cache_hit"] is True
    assert second["stages"]["drafter-size"]["uri"] == timing["uri"]
