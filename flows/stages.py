"""Per-stage flows: the cycle up to one stage. Upstream stages come from the manifest cache when done.

Each is its own Prefect deployment (prefect.yaml), so a person can (re)run "just training" and see the
stages before it hit the cache. `flow_until(stage)` picks the flow that ends at `stage`.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, flow

from draftloop.flows.cycle import CYCLE_FLOW_HOOKS, TrainAndEvalParams, run_cycle
from draftloop.flows.train_and_eval import train_and_eval


@flow(name="synthesize", log_prints=True, **CYCLE_FLOW_HOOKS)
def synthesize_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Synthesize conversations with the target."""
    return run_cycle(params or TrainAndEvalParams(), until="synthesize")


@flow(name="extract", log_prints=True, **CYCLE_FLOW_HOOKS)
def extract_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Synthesize, then extract hidden states."""
    return run_cycle(params or TrainAndEvalParams(), until="extract")


@flow(name="train", log_prints=True, **CYCLE_FLOW_HOOKS)
def train_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Everything up to a trained drafter."""
    return run_cycle(params or TrainAndEvalParams(), until="train")


@flow(name="evaluate", log_prints=True, **CYCLE_FLOW_HOOKS)
def evaluate_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Everything up to the evaluation report (no registration)."""
    return run_cycle(params or TrainAndEvalParams(), until="evaluate")


CycleFlow = Flow[[TrainAndEvalParams | None], dict[str, Any]]
_FLOWS_UNTIL: dict[str, CycleFlow] = {
    "synthesize": synthesize_flow,
    "extract": extract_flow,
    "train": train_flow,
    "evaluate": evaluate_flow,
    "register": train_and_eval,
}


def flow_until(stage: str) -> CycleFlow:
    """The flow that runs the cycle up to and including `stage` (the whole cycle for `register`)."""
    return _FLOWS_UNTIL[stage]
