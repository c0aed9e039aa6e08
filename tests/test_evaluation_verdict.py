"""The evaluation's judgement on synthetic measurements: lossless, like-with-like consistency, verdicts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from fixtures_engine import write_config

from draftloop.infra.engines.base import get_engine
from draftloop.infra.evaluation.benchmark import ConcurrencyResult, ServerRun
from draftloop.infra.evaluation.simulator import PromptFigures, SimulatorFigures
from draftloop.infra.evaluation.verdict import (
    NUMERIC_TIE_NATS,
    VERDICT_FAULT,
    VERDICT_INCONCLUSIVE,
    VERDICT_MODE_MISMATCH,
    VERDICT_OK,
    VERDICT_WEAK,
    compare_acceptance,
    decide_verdict,
    exported_drafter_mismatch,
    exported_layer_id_mismatch,
    exported_variant_mismatch,
    numeric_tie_at_divergence,
)
from draftloop.kernels.counters import SpecCounters

K = 3
# Free running: prompt 0's text left the engine's; its simulated acceptance was measured on another text.
DIVERGED_FIRST: list[tuple[int, int, dict[str, Any] | bool | None]] = [
    (10, 27, True), (10, 12, None), (10, 12, None), (10, 12, None)
]  # fmt: skip


def test_verdicts_separate_integration_faults_from_weak_drafters() -> None:
    common = {"tolerance": 0.05, "min_acceptance_length": 1.5}
    verdict, _ = decide_verdict(
        engine_rate=0.42, simulator_rate=0.44, lossless=True, mean_acceptance_length=2.3, **common
    )
    assert verdict == VERDICT_OK
    verdict, reasons = decide_verdict(
        engine_rate=0.10, simulator_rate=0.44, lossless=True, mean_acceptance_length=1.3, **common
    )
    assert verdict == VERDICT_FAULT and "0.100" in reasons[0] and "0.440" in reasons[0]
    verdict, _ = decide_verdict(
        engine_rate=0.10, simulator_rate=0.12, lossless=True, mean_acceptance_length=1.3, **common
    )
    assert verdict == VERDICT_WEAK
    verdict, reasons = decide_verdict(
        engine_rate=0.4, simulator_rate=0.4, lossless=False, mean_acceptance_length=2.2, **common
    )
    assert verdict == VERDICT_FAULT and "differ" in reasons[0]
    verdict, _ = decide_verdict(
        engine_rate=None, simulator_rate=0.4, lossless=True, mean_acceptance_length=None, **common
    )
    assert verdict == VERDICT_FAULT
    verdict, reasons = decide_verdict(
        engine_rate=0.4, simulator_rate=0.4, lossless=True, mean_acceptance_length=2.2,
        export_mismatch="trained on layer_input [1, 3, 5]", **common,
    )  # fmt: skip
    assert verdict == VERDICT_FAULT and "trained on" in reasons[0]


def test_a_gap_the_simulator_could_not_measure_in_the_engines_mode_is_named_not_a_fault() -> None:
    common = {"tolerance": 0.05, "min_acceptance_length": 1.5, "mean_acceptance_length": 2.2}
    verdict, reasons = decide_verdict(
        engine_rate=0.41, simulator_rate=0.50, lossless=True,
        numeric_mode_mismatch="dtype fp8 (engine) vs float32 (simulator)", **common,
    )  # fmt: skip
    assert verdict == VERDICT_MODE_MISMATCH and "fp8" in reasons[0] and "0.410" in reasons[0]
    # A real fault stays a fault whatever the modes.
    verdict, reasons = decide_verdict(
        engine_rate=0.41, simulator_rate=0.50, lossless=True, export_mismatch="trained on [1, 3, 5]",
        numeric_mode_mismatch="dtype fp8 (engine) vs float32 (simulator)", **common,
    )  # fmt: skip
    assert verdict == VERDICT_FAULT and reasons == ["trained on [1, 3, 5]"]
    # Within tolerance, a mode difference changes nothing.
    verdict, _ = decide_verdict(
        engine_rate=0.49, simulator_rate=0.50, lossless=True, numeric_mode_mismatch="dtype", **common
    )
    assert verdict == VERDICT_OK


# ------------------------------------------------------------------------------------------------
# Like with like: the engine's counters against the simulator's on the same text


def _speculative(per_prompt: list[tuple[int, int]] | None = None) -> ServerRun:
    """A speculative ServerRun; `per_prompt` (drafts, accepted) = per-request counters (SGLang-like)."""
    counters = [SpecCounters(d, d * K, a).to_json() for d, a in per_prompt] if per_prompt is not None else []
    return ServerRun("speculative", 1.0, None, None, [], ["x"] * 4, output_counters=counters)


def _figures(
    method: Any, rate: float, prompts: list[tuple[int, int, dict[str, Any] | bool | None]]
) -> SimulatorFigures:
    """Simulator figures; each prompt (drafts, accepted, divergence): a dict (replay), True (free-running
    text differs) or None (agrees)."""
    return SimulatorFigures(
        acceptance_rate=rate, mean_acceptance_length=1 + K * rate, per_position=[], num_drafts=40,
        capture_layer_ids=[1, 2, 3], method=method,
        prompts=[
            PromptFigures(d, d * K, a, divergent=bool(div), divergence=div if isinstance(div, dict) else None)
            for d, a, div in prompts
        ],
    )  # fmt: skip


def _verdict(engine_rate: float, speculative: ServerRun, simulator: SimulatorFigures) -> tuple[str, Any]:
    comparison = compare_acceptance({"acceptance_rate": engine_rate}, speculative, simulator)
    verdict, reasons = decide_verdict(
        engine_rate=comparison.engine_rate, simulator_rate=comparison.simulator_rate, tolerance=0.05,
        lossless=True, mean_acceptance_length=2.2, min_acceptance_length=1.5,
        comparable=comparison.comparable,
    )  # fmt: skip
    return verdict, (comparison, reasons)


def test_replay_compares_every_prompt_and_reports_near_tie_divergences_without_a_fault() -> None:
    """The issue's case: the engine's bf16 trajectory leaves the simulator's greedy one at near-ties.
    Replayed along the engine's text, the rates agree: ok, with the divergent prompts counted."""
    tie = {"position": 5, "engine_token": 11, "simulator_token": 12, "gap_nats": 0.0}
    small = {"position": 9, "engine_token": 3, "simulator_token": 4, "gap_nats": 0.125}
    real = {"position": 2, "engine_token": 7, "simulator_token": 8, "gap_nats": 2.5}
    simulator = _figures("replay", 0.42, [(10, 13, tie), (10, 12, None), (10, 13, small), (10, 12, real)])
    verdict, (comparison, reasons) = _verdict(0.414, _speculative(), simulator)
    assert verdict == VERDICT_OK, reasons
    assert comparison.method == "replay" and comparison.excluded_prompts == []
    assert comparison.divergent_prompts == [0, 2, 3] and comparison.near_tie_prompts == [0, 2]
    assert small["gap_nats"] <= NUMERIC_TIE_NATS < real["gap_nats"]


def test_replay_with_a_real_acceptance_gap_is_an_integration_fault() -> None:
    """Same text, different acceptance: the engine's drafter does not see what it was trained on."""
    simulator = _figures("replay", 0.50, [(10, 15, None)] * 4)
    verdict, (comparison, reasons) = _verdict(0.30, _speculative(), simulator)
    assert verdict == VERDICT_FAULT and comparison.gap == pytest.approx(0.20)
    assert "on the same text" in reasons[0]


def test_replay_weighs_each_prompt_as_often_as_the_engines_counters_saw_it() -> None:
    """The CI case on tiny-deepseek: the concurrency-1 level sent 8 prompts, then two short repeats each
    sent prompts 0 and 1 again, so the engine's counters count those two prompts three times. Weighted
    by that mix the simulator's rate is the engine's exactly; unweighted it looked like a 0.07 gap."""
    per_prompt = [(37, 26), (27, 37), (24, 41), (20, 43), (20, 43), (24, 39), (24, 39), (24, 40)]
    simulator = _figures("replay", 0.5133, [(d, a, None) for d, a in per_prompt])
    mix = [3, 3, 1, 1, 1, 1, 1, 1]
    level = ConcurrencyResult(1, 12, 768, 1.0, 1.0, 0, [], {}, {}, {}, {}, None, mix)
    run = dataclasses.replace(_speculative(), levels=[level])
    drafts = sum(m * d for m, (d, _) in zip(mix, per_prompt, strict=True))
    accepted = sum(m * a for m, (_, a) in zip(mix, per_prompt, strict=True))
    engine = SpecCounters(drafts, drafts * K, accepted)
    comparison = compare_acceptance(
        {"acceptance_rate": engine.acceptance_rate, "concurrency": 1}, run, simulator
    )
    assert engine.acceptance_rate == pytest.approx(434 / 984)
    assert comparison.gap == pytest.approx(0.0) and comparison.simulator_rate == pytest.approx(434 / 984)
    # Without the level's prompt mix the comparison falls back to the unweighted rate.
    unweighted = compare_acceptance(
        {"acceptance_rate": engine.acceptance_rate, "concurrency": 1}, _speculative(), simulator
    )
    assert unweighted.gap == pytest.approx(0.5133 - 434 / 984)


def test_free_running_divergent_prompts_are_excluded_with_per_request_counters() -> None:
    # Prompt 0 diverged: its simulated acceptance (on another text) is far from the engine's there.
    simulator = _figures("free_running", 0.55, DIVERGED_FIRST)
    engine_per_prompt = [(10, 3), (10, 12), (10, 12), (10, 13)]  # overall 40/120 = 0.333 vs 0.55
    verdict, (comparison, reasons) = _verdict(40 / 120, _speculative(engine_per_prompt), simulator)
    assert comparison.method == "agreeing_prompts" and comparison.excluded_prompts == [0]
    assert comparison.engine_rate == pytest.approx(37 / 90)
    assert comparison.simulator_rate == pytest.approx(36 / 90)
    assert verdict == VERDICT_OK, reasons
    # On the agreeing prompts, a real gap is still a fault.
    faulty = [(10, 3), (10, 2), (10, 3), (10, 2)]
    verdict, (comparison, _) = _verdict(10 / 120, _speculative(faulty), simulator)
    assert verdict == VERDICT_FAULT and comparison.excluded_prompts == [0]


def test_free_running_divergence_without_a_way_to_align_is_inconclusive_not_a_fault() -> None:
    simulator = _figures("free_running", 0.55, DIVERGED_FIRST)
    verdict, (comparison, reasons) = _verdict(0.40, _speculative(), simulator)
    assert verdict == VERDICT_INCONCLUSIVE and not comparison.comparable
    assert comparison.divergent_prompts == [0] and "different texts" in reasons[0]
    # No divergence: the free-running rates are like with like, and a gap is a fault.
    agreeing = _figures("free_running", 0.55, [(10, 17, None)] * 4)
    verdict, _ = _verdict(0.40, _speculative(), agreeing)
    assert verdict == VERDICT_FAULT


# ------------------------------------------------------------------------------------------------
# Export check and lossless


def test_exported_ids_that_differ_from_the_trained_ones_are_detected(tmp_path: Path) -> None:
    vllm, sglang = get_engine("vllm"), get_engine("sglang")
    record = {"draftloop": {"aux_layer_ids": [1, 3, 5], "aux_layer_ids_convention": "layer_input"}}
    good = write_config(tmp_path / "good", {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], **record})
    assert exported_layer_id_mismatch(vllm, good) is None
    # SGLang-convention ids written into a vLLM export: off by one.
    bad = write_config(tmp_path / "bad", {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], **record})
    reason = exported_layer_id_mismatch(vllm, bad)
    assert reason is not None and "[0, 2, 4]" in reason and "[1, 3, 5]" in reason
    assert exported_layer_id_mismatch(sglang, bad) is None  # the same ids are right for SGLang
    published = write_config(tmp_path / "pub", {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]})
    assert exported_layer_id_mismatch(vllm, published) is None  # no training record to compare with


def test_exported_variant_fields_that_differ_from_the_trained_layer_are_detected(tmp_path: Path) -> None:
    """An EAGLE 3.1 drafter whose exported config.json lost or flipped a variant field: the engine would
    compute another layer than was trained (the simulator reads the record): an integration fault."""
    trained = {"variant": "eagle3.1", "variant_options": {"fc_norm": True, "norm_output": True}}
    record = {
        "draftloop": {
            "aux_layer_ids": [1, 3, 5],
            "aux_layer_ids_convention": "layer_input",
            "drafter_config": trained,
        }
    }
    ids = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    fields = {"fc_norm": True, "norm_before_fc": False, "norm_output": True}
    good = write_config(tmp_path / "good", {**ids, **fields, **record})
    assert exported_variant_mismatch(good) is None
    flipped = write_config(tmp_path / "flipped", {**ids, **fields, "norm_output": False, **record})
    reason = exported_variant_mismatch(flipped)
    assert (
        reason is not None and "norm_output: false" in reason and "eagle3.1 (fc_norm, norm_output)" in reason
    )
    lost = write_config(tmp_path / "lost", {**ids, **record})  # no variant fields: plain EAGLE-3 served
    reason = exported_variant_mismatch(lost)
    assert reason is not None and "as eagle3," in reason and "fc_norm: false" in reason
    # Both export checks in one reason: ids off by one and the variant lost.
    both = write_config(tmp_path / "both", {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], **record})
    joined = exported_drafter_mismatch(get_engine("vllm"), both)
    assert joined is not None and "[0, 2, 4]" in joined and "fc_norm: false" in joined
    published = write_config(tmp_path / "pub", {**ids, "norm_output": True})
    assert exported_variant_mismatch(published) is None  # no training record to compare with


def test_numeric_tie_excuses_only_near_ties_at_the_first_divergence() -> None:
    base = [("a", {"a": -0.1, "b": -2.0}), ("c", {"c": -0.60, "d": -0.70}), ("e", {"e": -0.1})]
    flip_near_tie = [("a", {}), ("d", {}), ("x", {})]
    tie = numeric_tie_at_divergence(base, flip_near_tie)
    assert tie is not None and tie["position"] == 1 and tie["speculative"] == "d"
    assert abs(tie["gap_nats"] - 0.10) < 1e-9
    assert numeric_tie_at_divergence(base, [("b", {}), ("c", {}), ("e", {})]) is None  # gap 1.9 nats: a loss
    assert numeric_tie_at_divergence(base, [("a", {}), ("z", {}), ("e", {})]) is None  # not in the top-2
    assert numeric_tie_at_divergence(base, base) is None  # identical streams: nothing to excuse
