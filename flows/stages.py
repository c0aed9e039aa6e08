"""Per-stage flows: the cycle up to one stage. Upstream stages come from the manifest cache when done.

Each is its own Prefect deployment (prefect.yaml), so a person can (re)run "just training" and see the
stages before it hit the cache.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from draftloop.flows.train_and_eval import TrainAndEvalParams, run_cycle, stop_started_resources

_HOOKS: dict[str, Any] = {"on_cancellation": [stop_started_resources], "on_crashed": [stop_started_resources]}


@flow(name="synthesize", log_prints=True, **_HOOKS)
def synthesize_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Synthesize conversations with the target."""
    return run_cycle(params or TrainAndEvalParams(), until="synthesize")


@flow(name="extract", log_prints=True, **_HOOKS)
def extract_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Synthesize, then extract hidden states."""
    return run_cycle(params or TrainAndEvalParams(), until="extract")


@flow(name="train", log_prints=True, **_HOOKS)
def train_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Everything up to a trained drafter."""
    return run_cycle(params or TrainAndEvalParams(), until="train")


@flow(name="evaluate", log_prints=True, **_HOOKS)
def evaluate_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """Everything up to the evaluation report (no registration)."""
    return run_cycle(params or TrainAndEvalParams(), until="evaluate")


@flow(name="register", log_prints=True, **_HOOKS)
def register_flow(params: TrainAndEvalParams | None = None) -> dict[str, Any]:
    """The whole cycle, ending in the registry."""
    return run_cycle(params or TrainAndEvalParams(), until="register")
