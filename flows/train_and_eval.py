"""The `train-and-eval` flow: one full EAGLE-3 drafter cycle as one retryable Prefect run.

`until` stops the cycle after one stage; prefect.yaml's per-stage deployments are this flow with `until` set
(upstream stages come from the manifest cache when done).
"""

from __future__ import annotations

from typing import Any

from draftloop.flows.cycle import (
    DEFAULT_CONFIG,
    DEFAULT_ENGINE_KIND,
    DEFAULT_EPOCHS,
    DEFAULT_NUM_SAMPLES,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_TARGET_PATH,
    TrainAndEvalParams,
    cycle_flow,
    run_cycle,
)
from draftloop.flows.form import (
    ConfigPath,
    DrafterInit,
    EngineKind,
    Epochs,
    LastStage,
    NumSamples,
    NumSpeculativeTokens,
    Overrides,
    ShippedConfig,
    TargetPath,
)


@cycle_flow("train-and-eval")
def train_and_eval(
    config: ShippedConfig = DEFAULT_CONFIG,
    config_path: ConfigPath = "",
    target_path: TargetPath = DEFAULT_TARGET_PATH,
    num_samples: NumSamples = DEFAULT_NUM_SAMPLES,
    epochs: Epochs = DEFAULT_EPOCHS,
    engine_kind: EngineKind = DEFAULT_ENGINE_KIND,
    num_speculative_tokens: NumSpeculativeTokens = DEFAULT_NUM_SPECULATIVE_TOKENS,
    drafter_init: DrafterInit = "",
    overrides: Overrides = {},  # noqa: B006 - a literal so the form shows it; never mutated
    until: LastStage = "register",
) -> dict[str, Any]:
    """Train an EAGLE-3 drafter for the target and measure it in a real serving engine.

    Synthesizes training conversations with the target, extracts its hidden states, trains the drafter,
    serves it for speculative decoding, benchmarks acceptance and speedup, and registers it in MLflow
    (it becomes the champion only if it passes the gate). Stages already done with the same inputs are
    reused. Fields left at their defaults keep the config file's own values.

    Args:
        config: A shipped experiment config (configs/).
        config_path: Another config file (YAML, absolute or from the repository); replaces config when set.
        target_path: Target model, a Hugging Face model folder.
        num_samples: Training conversations to synthesize.
        epochs: Training epochs of the drafter.
        engine_kind: Serving engine for the evaluation.
        num_speculative_tokens: k, the tokens the drafter proposes per step when served.
        drafter_init: Drafter folder to fine-tune from; empty trains a new drafter.
        overrides: Any other config value by dotted key, e.g. {"training.lr": 0.001}.
        until: Last stage to run (register: the whole cycle).
    """
    form = TrainAndEvalParams(
        config=config_path or config,
        target_path=target_path,
        num_samples=num_samples,
        epochs=epochs,
        engine_kind=engine_kind,
        num_speculative_tokens=num_speculative_tokens,
        drafter_init=drafter_init,
        overrides=overrides,
    )
    return run_cycle(form, until=until)
