"""The evaluation's plan: what is served and measured, and how it is judged, built once from the config.

`EvaluationPlan.from_config(config)` reads the `evaluation` section, the engine's k
(`engine.num_speculative_tokens`) and the target's `trust_remote_code`; every default lives in those
config sections (infra/runtime/config.py), none here. `BenchmarkPlan` is the part that says how each
server is measured (benchmark.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from draftloop.infra.runtime.config import EvaluationConfig, ExperimentConfig

# Not config fields: the open-loop arrival schedule is the same in every run (so two runs compare), and a
# request that takes longer than this is a dead server, whatever is being measured.
OPEN_LOOP_SEED = 0
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class BenchmarkPlan:
    """How a server is measured (the same plan for baseline and speculative servers).

    Before anything is measured, `warmup_rounds` rounds of discarded requests at every concurrency level
    (so every batch shape the sweep uses has been run once: first-request compilation, caches, allocator).
    Each level then repeats `repeats` times; a repeat issues requests (prompts cycled) until it has at
    least `min_output_tokens` output tokens, lasted `min_seconds`, and sent at least `concurrency` requests
    (the reference level's first repeat sends every prompt once: the per-prompt records).
    `request_rates`: open-loop rates (requests/s) measured after the levels, `open_loop_requests` each.
    """

    max_tokens: int
    repeats: int
    min_output_tokens: int
    min_seconds: float
    warmup_rounds: int
    request_rates: tuple[float, ...]
    open_loop_requests: int
    tpot_target_s: float | None
    seed: int
    timeout_s: float
    interleave: bool  # baseline and speculative servers up together, measured in turns

    @classmethod
    def from_section(cls, evaluation: EvaluationConfig, *, engine_num_gpus: float = 0.0) -> BenchmarkPlan:
        interleave = evaluation.interleave
        return cls(
            max_tokens=int(evaluation.max_tokens),
            repeats=int(evaluation.repeats),
            min_output_tokens=int(evaluation.min_output_tokens),
            min_seconds=float(evaluation.min_seconds),
            warmup_rounds=int(evaluation.warmup_rounds),
            request_rates=tuple(float(rate) for rate in evaluation.request_rates),
            open_loop_requests=int(evaluation.open_loop_requests),
            tpot_target_s=evaluation.tpot_target_s,
            seed=OPEN_LOOP_SEED,
            timeout_s=REQUEST_TIMEOUT_S,
            interleave=engine_num_gpus == 0 if interleave == "auto" else bool(interleave),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"request_rates": list(self.request_rates)}


@dataclass(frozen=True)
class EvaluationPlan:
    """One evaluation: the servers (a baseline, then one speculative server per k), how each is measured
    (`benchmark`, at every `concurrency`), and the tolerances the verdict and the speedups are judged by.

    `num_speculative_tokens` is the engine's k, the one that carries the verdict (lossless, consistency);
    `speculative_tokens_sweep` adds more k to serve and measure (empty: none).
    """

    benchmark: BenchmarkPlan
    concurrency: tuple[int, ...]
    num_speculative_tokens: int
    speculative_tokens_sweep: tuple[int, ...]
    acceptance_tolerance: float  # |engine - simulator| acceptance rate allowed on the same text
    min_acceptance_length: float | None  # under it, a consistent drafter is weak (the gate's minimum)
    speedup_bound_tolerance: float
    throughput_consistency_factor: float
    trust_remote_code: bool  # the simulator and the prompts' tokenizer run the target folder's code

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> EvaluationPlan:
        """The plan of an experiment config: its evaluation section, engine k and target trust."""
        return cls.from_sections(
            config.evaluation,
            num_speculative_tokens=int(config.engine.num_speculative_tokens),
            trust_remote_code=bool(config.target.trust_remote_code),
            engine_num_gpus=float(config.engine.num_gpus),
        )

    @classmethod
    def from_sections(
        cls,
        evaluation: EvaluationConfig,
        *,
        num_speculative_tokens: int,
        trust_remote_code: bool,
        engine_num_gpus: float = 0.0,
    ) -> EvaluationPlan:
        return cls(
            benchmark=BenchmarkPlan.from_section(evaluation, engine_num_gpus=engine_num_gpus),
            concurrency=tuple(int(level) for level in evaluation.concurrency),
            num_speculative_tokens=int(num_speculative_tokens),
            speculative_tokens_sweep=tuple(int(k) for k in evaluation.speculative_tokens_sweep or ()),
            acceptance_tolerance=float(evaluation.acceptance_tolerance),
            min_acceptance_length=evaluation.gate.min_acceptance_length,
            speedup_bound_tolerance=float(evaluation.speedup_bound_tolerance),
            throughput_consistency_factor=float(evaluation.throughput_consistency_factor),
            trust_remote_code=trust_remote_code,
        )

    @property
    def max_tokens(self) -> int:
        return self.benchmark.max_tokens

    @property
    def ks(self) -> list[int]:
        """Every k served, ascending: the engine's k and the sweep's."""
        return sorted({self.num_speculative_tokens, *self.speculative_tokens_sweep})

    def server_name(self, k: int) -> str:
        """The server speculating at k: "speculative" at the engine's k, "speculative-k<k>" otherwise."""
        return "speculative" if k == self.num_speculative_tokens else f"speculative-k{k}"
