"""The typed summary of each stage's manifest: what a stage commits and what later readers see.

A stage declares its model (`Stage.summary`); the flow's summary.json and the register stage read the
others' summaries through these models, never through string keys.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from draftloop.infra.registry.gate import CycleResults


class SynthesisSummary(BaseModel):
    """The synthesize manifest's summary (plus the input-data counts of `InputData.summary()`)."""

    model_config = ConfigDict(extra="allow")

    backend: str
    target: str
    requested: int
    rows: int
    rejected: int
    rejected_reasons: dict[str, int]
    eval_prompts: int
    with_reasoning: int
    generated_tokens: int
    shortened_at_max_length: int
    seconds: float
    startup_seconds: float
    generation_seconds: float
    rows_per_s: float | None
    tokens_per_s: float | None


class ExtractionSummary(BaseModel):
    """The extract manifest's summary."""

    target: str
    samples: int
    tokens: int
    skipped: int
    backend: str
    actors: int
    aux_layer_ids: list[int]  # layer_input convention
    layer_id_convention: str
    seconds: float
    tokens_per_s: float | None


class TrainingSummary(BaseModel):
    """The train manifest's summary."""

    drafter_files: list[str]
    engine_format: str
    aux_layer_ids: list[int] | None
    convention_exported: str | None
    epochs: int
    steps: int
    final_loss: float | None
    loss_per_epoch: list[float]
    final_accuracy: list[float] | float | None
    resumed_from_epoch: int | None
    workers: int
    seconds: float
    tokens_per_s: float | None
    packing_efficiency: float | None
    held_out_samples: int
    held_out_acceptance_length: list[float]
    exported_epoch: int
    exported_held_out_acceptance_length: float | None


class EvaluationSummary(BaseModel):
    """The evaluate manifest's summary: the gate's results and the report's headline figures."""

    results: dict[str, Any]  # CycleResults.to_dict()
    verdict: str
    reasons: list[str]
    lossless: bool
    engine: str
    engine_version: str
    num_prompts: int
    num_speculative_tokens: int
    engine_layer_ids: dict[str, Any] | None
    startup_s: dict[str, float | None]
    speedup_levels: list[dict[str, Any]]
    k_sweep: list[dict[str, Any]]
    recommended_k: dict[str, int | None]
    serving_k: int  # the k to serve: the best at the lowest concurrency, else the engine's k
    category_acceptance: dict[str, dict[str, Any]]

    def cycle_results(self) -> CycleResults:
        return CycleResults.from_dict(self.results)


class RegistrationSummary(BaseModel):
    """The register manifest's summary: `Registration.to_dict()`."""

    name: str
    version: str
    champion: bool
    alias_status: str
    previous_champion: str | None
    gate: dict[str, Any]  # GateDecision.to_dict()
    verdict: str
    model_id: str
