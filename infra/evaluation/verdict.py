"""What the measurements mean: lossless, engine vs simulator consistency, and the verdict.

Verdicts, most serious first:
- `integration_fault`: the engine does not run the drafter as it was trained: the exported layer ids are
  not the trained ones, no drafts were made, speculative outputs differ from the baseline's beyond a
  numerical tie, or engine and simulator acceptance differ beyond the tolerance on the same text;
- `numeric_mode_mismatch`: acceptance differs beyond the tolerance, but the simulator could not run in the
  engine's numeric mode (the two modes are named), so the gap says nothing about the integration;
- `inconclusive`: acceptance differs beyond the tolerance, but was measured on different texts (the
  simulator's greedy text left the engine's, and the engine gives neither its token ids nor per-request
  counters to align them);
- `weak_drafter`: consistent, but the mean acceptance length is under the gate's minimum;
- `ok`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, read_json, stored_layer_ids
from draftloop.infra.evaluation.benchmark import ConcurrencyResult, ServerRun
from draftloop.infra.evaluation.simulator import SimulatorFigures
from draftloop.kernels.checkpoint import served_drafter_kind, trained_drafter_kind
from draftloop.kernels.variants.base import UnsupportedVariantError

VERDICT_OK = "ok"
VERDICT_WEAK = "weak_drafter"
VERDICT_FAULT = "integration_fault"
VERDICT_MODE_MISMATCH = "numeric_mode_mismatch"
VERDICT_INCONCLUSIVE = "inconclusive"

# A greedy flip between two tokens whose logprobs differ by less than this is a numerical tie (one bf16
# step of a logit is ~0.06-0.125 nats at these magnitudes; a multi-token verify step and a single-token
# decode round differently), not a loss.
NUMERIC_TIE_NATS = 0.15


# ------------------------------------------------------------------------------------------------
# Lossless


def numeric_tie_at_divergence(
    baseline: Sequence[tuple[str, Mapping[str, float]]],
    speculative: Sequence[tuple[str, Mapping[str, float]]],
    tolerance: float = NUMERIC_TIE_NATS,
) -> dict[str, Any] | None:
    """Where two greedy token streams first differ, the baseline's logprob gap between its token and the
    speculative server's; a dict when that gap is within ``tolerance`` (a tie), else None."""
    for position, ((base_token, top), (spec_token, _)) in enumerate(zip(baseline, speculative, strict=False)):
        if base_token == spec_token:
            continue
        if base_token not in top or spec_token not in top:
            return None
        gap = top[base_token] - top[spec_token]
        if gap > tolerance:
            return None
        return {"position": position, "baseline": base_token, "speculative": spec_token, "gap_nats": gap}
    return None


def compare_outputs(
    baseline: ServerRun, speculative: ServerRun
) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """(prompts whose greedy outputs differ beyond a numerical tie, {prompt: tie} for the excused ones).

    Lossless within one numeric mode: a differing prompt is excused only when its first divergence is a
    near-tie in the baseline's own logprobs.
    """
    differing = [
        i for i, (a, b) in enumerate(zip(baseline.outputs, speculative.outputs, strict=True)) if a != b
    ]
    ties: dict[int, dict[str, Any]] = {}
    for i in differing:
        if i < len(baseline.output_logprobs) and i < len(speculative.output_logprobs):
            tie = numeric_tie_at_divergence(baseline.output_logprobs[i], speculative.output_logprobs[i])
            if tie is not None:
                ties[i] = tie
    return [i for i in differing if i not in ties], ties


# ------------------------------------------------------------------------------------------------
# Engine vs simulator


def engine_acceptance(run: ServerRun) -> dict[str, Any] | None:
    """Counters of the prompt pass (each prompt exactly once at the lowest concurrency: the outputs the
    run records per prompt, the simulator's prompt mix); for a report without one, of the first level
    that had drafts."""
    if run.prompt_pass_counters is not None:
        return dict(run.prompt_pass_counters, concurrency=run.reference_concurrency, prompt_pass=True)
    for level in sorted(run.levels, key=lambda lv: lv.concurrency):
        if level.counters is not None:
            return dict(level.counters, concurrency=level.concurrency)
    return None


@dataclass
class AcceptanceComparison:
    """Engine and simulator acceptance rates measured on the same text, and how that was ensured.

    `method`: "replay" (the simulator replayed the engine's output tokens: every prompt compared),
    "agreeing_prompts" (free-running simulator; prompts whose texts differ excluded on both sides with
    the engine's per-request counters), "all_prompts" (free-running; no prompt diverged, or no way to
    exclude them: then `comparable` is False when some did), "given" (figures passed in).
    """

    method: str
    engine_rate: float | None
    simulator_rate: float | None
    comparable: bool = True
    divergent_prompts: list[int] = field(default_factory=list)
    excluded_prompts: list[int] = field(default_factory=list)
    # Replay: divergent prompts whose first divergence is a near-tie in the simulator's own numerics.
    near_tie_prompts: list[int] = field(default_factory=list)

    @property
    def gap(self) -> float | None:
        if self.engine_rate is None or self.simulator_rate is None:
            return None
        return abs(self.engine_rate - self.simulator_rate)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gap": self.gap}


def _rate(accepted: float, draft_tokens: float) -> float | None:
    return accepted / draft_tokens if draft_tokens > 0 else None


def _prompt_mix(
    engine: Mapping[str, Any] | None, speculative: ServerRun, num_prompts: int
) -> list[int] | None:
    """Requests per prompt behind the engine's counters (the level they were read from), if recorded;
    None for the prompt pass (each prompt once, the simulator's own mix)."""
    if engine is None or engine.get("prompt_pass"):
        return None
    for level in speculative.levels:
        if level.concurrency == engine.get("concurrency"):
            mix = level.prompt_requests
            return mix if mix is not None and len(mix) == num_prompts else None
    return None


def _weighted_rate(simulator: SimulatorFigures, mix: Sequence[int] | None) -> float | None:
    """The simulator's rate over the same prompt mix as the engine's counters: the level's repeats cycle
    the prompts, so a prompt sent twice weighs twice there (without this, a short prompt list whose
    first prompts are repeated shifts the engine's rate away from the simulator's on identical text)."""
    if mix is None or not simulator.prompts or all(count == 1 for count in mix):
        return simulator.acceptance_rate
    return _rate(
        sum(count * p.num_accepted_tokens for count, p in zip(mix, simulator.prompts, strict=True)),
        sum(count * p.num_draft_tokens for count, p in zip(mix, simulator.prompts, strict=True)),
    )


def compare_acceptance(
    engine: Mapping[str, Any] | None,
    speculative: ServerRun,
    simulator: SimulatorFigures | None,
) -> AcceptanceComparison:
    """Pair the engine's acceptance with the simulator's on the same text (see AcceptanceComparison)."""
    engine_rate = engine.get("acceptance_rate") if engine else None
    if simulator is None:
        return AcceptanceComparison("none", engine_rate, None)
    divergent = [i for i, prompt in enumerate(simulator.prompts) if prompt.divergent]
    near_ties = [
        i
        for i in divergent
        if (d := simulator.prompts[i].divergence) is not None and d["gap_nats"] <= NUMERIC_TIE_NATS
    ]
    if simulator.method != "free_running" or not divergent:
        method = "all_prompts" if simulator.method == "free_running" else simulator.method
        simulator_rate = _weighted_rate(simulator, _prompt_mix(engine, speculative, len(simulator.prompts)))
        return AcceptanceComparison(method, engine_rate, simulator_rate, True, divergent, [], near_ties)
    # Free running and some texts differ: the engine's aggregate counters cover those prompts too, so
    # compare only the prompts whose texts agree, which needs the engine's counters per request.
    per_request = speculative.prompt_counters()
    agreeing = [i for i in range(len(simulator.prompts)) if i not in divergent]
    if per_request is None or len(per_request) != len(simulator.prompts) or not agreeing:
        return AcceptanceComparison(
            "all_prompts", engine_rate, simulator.acceptance_rate, False, divergent, [], near_ties
        )
    engine_subset = _rate(
        sum(per_request[i].num_accepted_tokens for i in agreeing),
        sum(per_request[i].num_draft_tokens for i in agreeing),
    )
    simulator_subset = _rate(
        sum(simulator.prompts[i].num_accepted_tokens for i in agreeing),
        sum(simulator.prompts[i].num_draft_tokens for i in agreeing),
    )
    return AcceptanceComparison(
        "agreeing_prompts", engine_subset, simulator_subset, True, divergent, divergent, near_ties
    )


# ------------------------------------------------------------------------------------------------
# Export check and verdict


def exported_layer_id_mismatch(engine: Engine, drafter_dir: Path) -> str | None:
    """A reason when the ids the engine will read from the drafter's config are not, in draftloop's
    convention, the ids the drafter was trained on (its `draftloop` block); None when they agree or
    the folder carries no training record (a published drafter)."""
    config = read_json(Path(drafter_dir) / "config.json")
    trained = stored_layer_ids(config)
    served = engine.drafter_layer_ids(drafter_dir)
    if trained is None or served is None:
        return None
    if served.as_input() == trained.as_input():
        return None
    return (
        f"the drafter's config makes {engine.kind} capture layers {list(served.ids)} ({served.convention}) "
        f"= layer_input {list(served.as_input())}, but it was trained on layer_input "
        f"{list(trained.as_input())} (layer-id convention mix-up at export?)"
    )


def exported_variant_mismatch(drafter_dir: Path) -> str | None:
    """A reason when the layer the engine computes from the drafter's config fields (fc_norm,
    norm_before_fc, norm_output: kernels/variants/) is not the one the drafter was trained as (its
    `draftloop` block); None when they agree or the folder carries no training record."""
    path = Path(drafter_dir) / "config.json"
    config = read_json(path)
    trained = trained_drafter_kind(config)
    if trained is None:
        return None
    try:
        served = served_drafter_kind(config)
    except UnsupportedVariantError as error:
        return f"{path}: the drafter was trained as {trained}, but {error}"
    if served == trained:
        return None
    flipped = sorted(
        name
        for name in set(served.options) | set(trained.options)
        if bool(served.options.get(name)) != bool(trained.options.get(name))
    )
    return f"{path} makes the engine run the drafter as {served}, but it was trained as {trained}" + (
        f" ({', '.join(f'{name}: {str(bool(served.options.get(name))).lower()}' for name in flipped)} "
        "in config.json; variant fields lost or flipped at export?)"
        if flipped
        else ""
    )


def exported_drafter_mismatch(engine: Engine, drafter_dir: Path) -> str | None:
    """What the engine will read from an exported drafter that it was not trained on: layer ids or the
    layer's variant fields (None: it reads what was trained, or the folder has no training record)."""
    reasons = [
        reason
        for reason in (
            exported_layer_id_mismatch(engine, drafter_dir),
            exported_variant_mismatch(drafter_dir),
        )
        if reason
    ]
    return "; ".join(reasons) or None


def decide_verdict(
    *,
    engine_rate: float | None,
    simulator_rate: float | None,
    tolerance: float,
    lossless: bool,
    mean_acceptance_length: float | None,
    min_acceptance_length: float | None,
    export_mismatch: str | None = None,
    numeric_mode_mismatch: str | None = None,
    comparable: bool = True,
) -> tuple[str, list[str]]:
    """integration_fault before the excused gaps (numeric_mode_mismatch, inconclusive) before weak_drafter.

    `engine_rate` / `simulator_rate`: acceptance on the same text (compare_acceptance); `comparable`
    False when they were measured on different texts.
    """
    faults: list[str] = []
    if export_mismatch:
        faults.append(export_mismatch)
    if engine_rate is None:
        faults.append("the speculative server reported no drafts (speculation not running)")
    if not lossless:
        faults.append("greedy outputs of the speculative server differ from the baseline's")
    excused: tuple[str, str] | None = None
    if (
        engine_rate is not None
        and simulator_rate is not None
        and abs(engine_rate - simulator_rate) > tolerance
    ):
        gap = (
            f"engine acceptance rate {engine_rate:.3f} vs simulator {simulator_rate:.3f}: "
            f"|difference| {abs(engine_rate - simulator_rate):.3f} > tolerance {tolerance:.3f}"
        )
        if numeric_mode_mismatch:
            excused = (
                VERDICT_MODE_MISMATCH,
                f"{gap}, but the simulator could not run in the engine's numeric mode "
                f"({numeric_mode_mismatch}): the gap does not measure the integration",
            )
        elif not comparable:
            excused = (
                VERDICT_INCONCLUSIVE,
                f"{gap}, measured on different texts (the simulator's greedy output left the engine's, "
                "and the engine returns neither its output token ids nor per-request counters)",
            )
        else:
            faults.append(
                f"{gap} on the same text (wrong aux layer ids / layer-id convention, drafter format or "
                "attention type?)"
            )
    if faults:
        return VERDICT_FAULT, faults
    if excused is not None:
        return excused[0], [excused[1]]
    if (
        min_acceptance_length is not None
        and mean_acceptance_length is not None
        and mean_acceptance_length < min_acceptance_length
    ):
        return VERDICT_WEAK, [
            f"mean acceptance length {mean_acceptance_length:.2f} < required {min_acceptance_length:.2f} "
            "(engine and simulator agree: the drafter itself is weak)"
        ]
    return VERDICT_OK, []


# ------------------------------------------------------------------------------------------------
# Speedup: interval, inconclusive levels and physical bounds

SPEEDUP_OK = "ok"
SPEEDUP_INCONCLUSIVE = "inconclusive"
SPEEDUP_MEASUREMENT_ERROR = "measurement_error"
SPEEDUP_UNMEASURED = "unmeasured"


@dataclass
class LevelSpeedup:
    """Speedup at one concurrency and its interval, with its status. `method` "interleaved": both servers
    were up and took turns repeat by repeat; the speedup is the median of the adjacent pairs' ratios,
    the interval their min-max (load that changed during the measurement fell on both sides of each
    pair). "sequential": one server after the other; median speculative / median baseline throughput,
    in [min spec / max baseline, max spec / min baseline] over the repeats (blind to load that changed
    between the two servers)."""

    concurrency: int
    speedup: float | None
    low: float | None
    high: float | None
    status: str
    reasons: list[str] = field(default_factory=list)
    mean_acceptance_length: float | None = None  # the bound: the level's own, else the whole run's
    method: str = "sequential"  # interleaved | sequential


def throughput_contradiction(level: ConcurrencyResult, factor: float) -> str | None:
    """A reason when a level's duration disagrees with its own latencies by more than `factor`.

    A closed loop of `concurrency` streams each taking TTFT + (n - 1) TPOT for its n tokens (medians)
    should take requests x that / min(concurrency, requests) seconds per repeat (Little's law). Summed
    over the repeats (one scheduling hiccup in a short repeat is not a contradiction), a level much slower
    than that spent its time outside its requests' typical latency: a warm-up absorbed by one request.
    """
    ttft, tpot = level.ttft_s.get("p50"), level.tpot_s.get("p50")
    if ttft is None or tpot is None:
        return None
    measured = predicted = 0.0
    for repeat in level.repeats:
        ok_requests = repeat.num_requests - repeat.errors
        if ok_requests <= 0:
            continue
        latency = ttft + max(repeat.output_tokens / ok_requests - 1.0, 0.0) * tpot
        predicted += ok_requests * latency / min(level.concurrency, ok_requests)
        measured += repeat.duration_s
    if predicted <= 0 or measured <= 0:
        return None
    ratio = measured / predicted
    if 1.0 / factor <= ratio <= factor:
        return None
    return (
        f"concurrency {level.concurrency}: its repeats took {measured:.3f}s, {ratio:.2f}x the "
        f"{predicted:.3f}s its own TTFT p50 {ttft:.4f}s and TPOT p50 {tpot:.4f}s predict "
        f"(allowed 1/{factor:g}..{factor:g}x)"
    )


def level_speedups(
    baseline: ServerRun,
    speculative: ServerRun,
    *,
    acceptance_length: float | None,
    bound_tolerance: float,
    consistency_factor: float,
) -> list[LevelSpeedup]:
    """Speedup per concurrency level of `speculative`, each `ok`, `inconclusive` (its interval contains
    1.0), `measurement_error` (physically impossible: above the mean acceptance length x (1 + tolerance),
    or a level's throughput contradicting its own TTFT/TPOT) or `unmeasured`."""
    base_levels = {level.concurrency: level for level in baseline.levels}
    speedups = []
    for spec in speculative.levels:
        base = base_levels.get(spec.concurrency)
        length = (spec.counters or {}).get("mean_acceptance_length") or acceptance_length
        if base is None or not base.output_tokens_per_s:
            speedups.append(LevelSpeedup(spec.concurrency, None, None, None, SPEEDUP_UNMEASURED, [], length))
            continue
        pairs = _paired_ratios(baseline, base, speculative, spec)
        low: float | None
        high: float | None
        if pairs:
            method = "interleaved"
            speedup, low, high = statistics.median(pairs), min(pairs), max(pairs)
        else:
            method = "sequential"
            speedup = spec.output_tokens_per_s / base.output_tokens_per_s
            b_low, b_high = base.throughput.get("min"), base.throughput.get("max")
            s_low, s_high = spec.throughput.get("min"), spec.throughput.get("max")
            low = s_low / b_high if s_low is not None and b_high else None
            high = s_high / b_low if s_high is not None and b_low else None
        errors = [
            f"{run.name} {reason}"
            for run, level in ((baseline, base), (speculative, spec))
            if (reason := throughput_contradiction(level, consistency_factor)) is not None
        ]
        if length is not None and speedup > length * (1.0 + bound_tolerance):
            errors.insert(
                0,
                f"speedup {speedup:.3f}x at concurrency {spec.concurrency} exceeds the mean acceptance "
                f"length {length:.3f} (+{bound_tolerance:.0%} tolerance): one target forward yields at "
                "most AL tokens, so the baseline or the speculative timing is wrong",
            )
        if errors:
            status, reasons = SPEEDUP_MEASUREMENT_ERROR, errors
        elif low is not None and high is not None and low <= 1.0 <= high:
            status = SPEEDUP_INCONCLUSIVE
            reasons = [
                f"speedup interval [{low:.3f}, {high:.3f}] at concurrency {spec.concurrency} contains 1.0"
            ]
        else:
            status, reasons = SPEEDUP_OK, []
        speedups.append(LevelSpeedup(spec.concurrency, speedup, low, high, status, reasons, length, method))
    return speedups


def _paired_ratios(
    baseline: ServerRun, base: ConcurrencyResult, speculative: ServerRun, spec: ConcurrencyResult
) -> list[float]:
    """Speculative / baseline throughput of each adjacent pair of repeats, when the two servers were
    measured alternately (empty otherwise)."""
    if speculative.interleaved_with != baseline.name or len(base.repeats) != len(spec.repeats):
        return []
    return [
        s.output_tokens_per_s / b.output_tokens_per_s
        for b, s in zip(base.repeats, spec.repeats, strict=True)
        if b.output_tokens_per_s > 0
    ]
