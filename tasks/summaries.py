"""The typed summary of each stage's manifest: what a stage commits and what later readers see.

A stage declares its model (`Stage.summary`); the flow's summary.json and the register stage read the
others' summaries through these models, never through string keys.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from draftloop.infra.registry.gate import CycleResults
from draftloop.tasks.stage import Figure


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


class StreamSummary(BaseModel):
    """What the online train stage streamed: producers, bytes in flight and in the object store, what
    was stored (hybrid) and what was recomputed."""

    mode: str
    backend: str
    producers: int
    shards: int
    samples: int
    skipped: int  # conversations with no assistant token within data.max_length
    asked_ahead_per_worker: int
    max_bytes_in_flight: int
    peak_object_store_bytes: int
    object_store_bytes: int
    spilled_bytes: int  # 0 expected: the cap keeps the stream inside the store
    target_forward_passes: int  # samples the producers computed (every epoch, held-out, retries)
    produced_shards: int
    hidden_state_bytes_stored: int  # 0 online; hybrid: the cached shards, at most the budget
    storage_budget: int | None
    budget_for_zero_recompute: int  # a budget this large would store every shard once
    cache_uri: str | None
    bytes_received: int | None = None  # by the trainers, from the producers
    bytes_from_other_nodes: int | None = None  # crossed between Ray nodes' object stores
    bytes_read_from_cache: int | None = None
    engine_restarts: int | None = None  # backend engine: its server died and was started again


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
    resumed_at_sample: int | None = None  # the position in that epoch's sample order
    workers: int
    seconds: float
    tokens_per_s: float | None
    packing_efficiency: float | None
    held_out_samples: int
    held_out_acceptance_length: list[float]
    exported_epoch: int
    exported_held_out_acceptance_length: float | None
    # {times trained: samples} per epoch over every worker and resume ({"1": N}: exactly once)
    trained_per_sample: list[dict[str, int]] | None = None
    extraction_mode: str = "offline"
    stream: StreamSummary | None = None  # online / hybrid


# What people see of either train stage (offline, online).
TRAINING_FIGURES = (
    Figure("epochs", "epochs"),
    Figure("final_loss", "final loss"),
    Figure("loss_per_epoch", "loss per epoch"),
    Figure("final_accuracy", "final accuracy per TTT step"),
    Figure("held_out_acceptance_length", "held-out AL per epoch"),
    Figure("exported_epoch", "exported epoch"),
    Figure("tokens_per_s", "tokens/s"),
)


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
