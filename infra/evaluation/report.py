"""The evaluation's record: eval_report.json (what the evaluate stage stores, logs and gates on)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftloop.infra.evaluation.benchmark import ServerRun


@dataclass
class EvalReport:
    engine: str
    engine_version: str | None
    target: str
    drafter: str
    num_speculative_tokens: int
    max_tokens: int
    num_prompts: int
    concurrency: list[int]
    baseline: ServerRun
    speculative: ServerRun
    speedup: dict[int, float | None]
    lossless: bool
    mismatched_prompts: list[int]  # greedy outputs differ beyond a numerical tie
    engine_acceptance: dict[str, Any] | None
    simulator: dict[str, Any] | None
    acceptance_gap: float | None  # |engine - simulator| acceptance rate on the same text (consistency)
    acceptance_tolerance: float
    verdict: str
    reasons: list[str]
    engine_layer_ids: dict[str, Any] | None = None
    plots: list[str] = field(default_factory=list)
    # Prompts whose greedy outputs differ only from a numerical tie at the first divergence (see
    # verdict.numeric_tie_at_divergence): prompt index -> {position, baseline, speculative, gap_nats}.
    numeric_ties: dict[int, dict[str, Any]] = field(default_factory=dict)
    # {"engine": NumericMode, "simulator": NumericMode, "mismatch": what the simulator does not reproduce}
    numeric_modes: dict[str, Any] = field(default_factory=dict)
    # verdict.AcceptanceComparison.to_json(): how acceptance was paired, divergent / excluded prompts.
    consistency: dict[str, Any] = field(default_factory=dict)
    # verdict.LevelSpeedup per concurrency at the engine's k: speedup, interval, status, reasons.
    speedup_levels: list[dict[str, Any]] = field(default_factory=list)
    benchmark_plan: dict[str, Any] = field(default_factory=dict)
    # Per k served: predicted (simulator) and measured AL, and its LevelSpeedup list.
    k_sweep: list[dict[str, Any]] = field(default_factory=list)
    sweep_runs: dict[int, ServerRun] = field(default_factory=dict)  # the other k's servers
    recommended_k: dict[int, int | None] = field(default_factory=dict)  # per concurrency
    serving_k: int | None = None  # the k to serve (best at the lowest concurrency)
    # category -> {prompts, simulator: {acceptance_rate, mean_acceptance_length}, engine: same or None}
    category_acceptance: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["speedup"] = {str(k): v for k, v in self.speedup.items()}
        data["sweep_runs"] = {str(k): v for k, v in data["sweep_runs"].items()}
        data["recommended_k"] = {str(c): k for c, k in self.recommended_k.items()}
        return data

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path
