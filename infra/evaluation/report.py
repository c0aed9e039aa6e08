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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["speedup"] = {str(k): v for k, v in self.speedup.items()}
        return data

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path
