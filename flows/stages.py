"""Per-stage flows: the cycle up to one stage. Upstream stages come from the manifest cache when done.

Each is its own Prefect deployment (prefect.yaml), so a person can (re)run "just training" and see the
stages before it hit the cache. `flow_until(stage)` picks the flow that ends at `stage`. They take the
same parameters as `train-and-eval`.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, flow

from draftloop.flows.cycle import (
    CYCLE_FLOW_HOOKS,
    DEFAULT_CONFIG,
    DEFAULT_ENGINE_KIND,
    DEFAULT_EPOCHS,
    DEFAULT_NUM_SAMPLES,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_TARGET_PATH,
    TrainAndEvalParams,
    run_cycle,
)
from draftloop.flows.train_and_eval import train_and_eval


@flow(name="synthesize", log_prints=True, **CYCLE_FLOW_HOOKS)
def synthesize_flow(
    config: str = DEFAULT_CONFIG,
    target_path: str = DEFAULT_TARGET_PATH,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    epochs: int = DEFAULT_EPOCHS,
    engine_kind: str = DEFAULT_ENGINE_KIND,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    drafter_init: str = "",
    overrides: dict[str, Any] = {},  # noqa: B006 - a literal so the form shows it; never mutated
) -> dict[str, Any]:
    """Synthesize the training conversations with the target.

    Reused when already done with the same inputs.
    Fields left at their defaults keep the config file's own values.

    Args:
        config: Experiment config file (YAML), relative to the repository.
        target_path: Target model, a Hugging Face model folder.
        num_samples: Training conversations to synthesize.
        epochs: Training epochs of the drafter.
        engine_kind: Serving engine for the evaluation, vllm or sglang.
        num_speculative_tokens: k, the tokens the drafter proposes per step when served.
        drafter_init: Drafter folder to fine-tune from; empty trains a new drafter.
        overrides: Any other config value by dotted key, e.g. {"training.lr": 0.001}.
    """
    return run_cycle(TrainAndEvalParams(**locals()), until="synthesize")


@flow(name="extract", log_prints=True, **CYCLE_FLOW_HOOKS)
def extract_flow(
    config: str = DEFAULT_CONFIG,
    target_path: str = DEFAULT_TARGET_PATH,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    epochs: int = DEFAULT_EPOCHS,
    engine_kind: str = DEFAULT_ENGINE_KIND,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    drafter_init: str = "",
    overrides: dict[str, Any] = {},  # noqa: B006 - a literal so the form shows it; never mutated
) -> dict[str, Any]:
    """Synthesize the training conversations, then extract the target's hidden states.

    Finished stages with the same inputs are reused.
    Fields left at their defaults keep the config file's own values.

    Args:
        config: Experiment config file (YAML), relative to the repository.
        target_path: Target model, a Hugging Face model folder.
        num_samples: Training conversations to synthesize.
        epochs: Training epochs of the drafter.
        engine_kind: Serving engine for the evaluation, vllm or sglang.
        num_speculative_tokens: k, the tokens the drafter proposes per step when served.
        drafter_init: Drafter folder to fine-tune from; empty trains a new drafter.
        overrides: Any other config value by dotted key, e.g. {"training.lr": 0.001}.
    """
    return run_cycle(TrainAndEvalParams(**locals()), until="extract")


@flow(name="train", log_prints=True, **CYCLE_FLOW_HOOKS)
def train_flow(
    config: str = DEFAULT_CONFIG,
    target_path: str = DEFAULT_TARGET_PATH,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    epochs: int = DEFAULT_EPOCHS,
    engine_kind: str = DEFAULT_ENGINE_KIND,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    drafter_init: str = "",
    overrides: dict[str, Any] = {},  # noqa: B006 - a literal so the form shows it; never mutated
) -> dict[str, Any]:
    """Train an EAGLE-3 drafter: synthesize, extract hidden states, train.

    No serving, no registration. Finished stages with the same inputs are reused.
    Fields left at their defaults keep the config file's own values.

    Args:
        config: Experiment config file (YAML), relative to the repository.
        target_path: Target model, a Hugging Face model folder.
        num_samples: Training conversations to synthesize.
        epochs: Training epochs of the drafter.
        engine_kind: Serving engine for the evaluation, vllm or sglang.
        num_speculative_tokens: k, the tokens the drafter proposes per step when served.
        drafter_init: Drafter folder to fine-tune from; empty trains a new drafter.
        overrides: Any other config value by dotted key, e.g. {"training.lr": 0.001}.
    """
    return run_cycle(TrainAndEvalParams(**locals()), until="train")


@flow(name="evaluate", log_prints=True, **CYCLE_FLOW_HOOKS)
def evaluate_flow(
    config: str = DEFAULT_CONFIG,
    target_path: str = DEFAULT_TARGET_PATH,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    epochs: int = DEFAULT_EPOCHS,
    engine_kind: str = DEFAULT_ENGINE_KIND,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    drafter_init: str = "",
    overrides: dict[str, Any] = {},  # noqa: B006 - a literal so the form shows it; never mutated
) -> dict[str, Any]:
    """Train an EAGLE-3 drafter, serve it and benchmark it, without registering it.

    Finished stages with the same inputs are reused.
    Fields left at their defaults keep the config file's own values.

    Args:
        config: Experiment config file (YAML), relative to the repository.
        target_path: Target model, a Hugging Face model folder.
        num_samples: Training conversations to synthesize.
        epochs: Training epochs of the drafter.
        engine_kind: Serving engine for the evaluation, vllm or sglang.
        num_speculative_tokens: k, the tokens the drafter proposes per step when served.
        drafter_init: Drafter folder to fine-tune from; empty trains a new drafter.
        overrides: Any other config value by dotted key, e.g. {"training.lr": 0.001}.
    """
    return run_cycle(TrainAndEvalParams(**locals()), until="evaluate")


CycleFlow = Flow[..., dict[str, Any]]
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
