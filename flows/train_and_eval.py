"""The `train-and-eval` flow: one full EAGLE-3 drafter cycle as one retryable Prefect run."""

from __future__ import annotations

from typing import Any

from prefect import flow

from draftloop.flows.cycle import CYCLE_FLOW_HOOKS, TrainAndEvalParams, run_cycle


@flow(name="train-and-eval", log_prints=True, **CYCLE_FLOW_HOOKS)
def train_and_eval(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Synthesize -> extract -> train -> deploy+evaluate -> register, each stage cached on its inputs."""
    return run_cycle(params or TrainAndEvalParams())
