"""The types of the `train-and-eval` form: each field's choices, limits and title, declared once.

The flow's signature (flows/train_and_eval.py) and `TrainAndEvalParams` (flows/cycle.py) both use them, so
Prefect's parameter schema carries them: an enum is a dropdown, a number shows its minimum and maximum,
and the UI (and the server, for a deployment run) refuses a value outside them before any run starts.
Prefect titles a field with its parameter name; `json_schema_extra`'s title replaces that one.
Static lists, not computed: `prefect deploy` reads the signature from the source; tests/test_flow_form.py
checks each list against what it names (the shipped configs, the registered engines, the pipeline).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field


def _titled(title: str, **limits: Any) -> Any:
    return Field(json_schema_extra={"title": title}, **limits)


# configs/*.yaml; another file goes in `config_path`.
ShippedConfig = Annotated[
    Literal["configs/tiny-llama.yaml", "configs/tiny-deepseek.yaml"], _titled("Config (shipped)")
]
ConfigPath = Annotated[str, _titled("Config file (another)")]
TargetPath = Annotated[str, _titled("Target model folder")]
# The engines of infra/engines/ (vllm.py, sglang.py).
EngineKind = Annotated[Literal["vllm", "sglang"], _titled("Serving engine")]
# flows/pipeline.py CYCLE's stages, in order (the online pipeline has no extract: refused by name).
LastStage = Annotated[
    Literal["synthesize", "extract", "train", "evaluate", "register"], _titled("Run up to stage")
]
# Lower limits as the config's (DataConfig, TrainingConfig, EngineConfig); upper ones catch a typo.
NumSamples = Annotated[int, _titled("Training conversations", ge=1, le=1_000_000)]
Epochs = Annotated[int, _titled("Training epochs", ge=1, le=1000)]
NumSpeculativeTokens = Annotated[int, _titled("Draft tokens per step (k)", ge=1, le=16)]
DrafterInit = Annotated[str, _titled("Fine-tune from drafter")]
Overrides = Annotated[dict[str, Any], _titled("Other config values")]

# The `sweep` form (flows/sweep.py): each grid value list and variant a JSON value.
SweepGrid = Annotated[dict[str, list[Any]], _titled("Grid: values per config key")]
SweepList = Annotated[list[dict[str, Any]], _titled("More variants (config keys each)")]
Parallel = Annotated[int, _titled("Variants at once", ge=1, le=16)]

# The `refresh` form (flows/refresh.py).
TrafficLocation = Annotated[str, _titled("New traffic (folder or S3 prefix)")]
RetrainDrop = Annotated[float, _titled("Retrain past this drop of acceptance length", ge=0.0, le=1.0)]
