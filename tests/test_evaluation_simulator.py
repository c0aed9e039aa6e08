"""The evaluation's simulator: numeric modes, and replaying an engine's output token by token."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fixtures_engine import engine_settings
from fixtures_kernels import builtin_prompts, load_target, make_lookup_drafter, untrained_drafter

from draftloop.infra.evaluation.simulator import (
    NumericMode,
    engine_numeric_mode,
    first_divergence,
    mode_mismatch,
    run_simulator,
    simulator_numeric_mode,
)
from draftloop.kernels.checkpoint import save_drafter
from draftloop.kernels.simulate import (
    StepRecord,
    encode_prompt,
    simulate_acceptance,
    speculative_generate,
    stop_token_ids,
)

PROMPTS = builtin_prompts()[:3]
K = 3
MAX_TOKENS = 24


def test_numeric_modes_follow_the_engine_settings(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    auto = engine_numeric_mode(engine_settings(dtype="auto"), tmp_path, "mla")
    assert auto.dtype == "bfloat16" and "mla" in auto.attention
    simulator = simulator_numeric_mode(auto, "mla")
    assert simulator.dtype == "bfloat16" and mode_mismatch(auto, simulator) is None

    fp8_cache = engine_numeric_mode(
        engine_settings(dtype="float16", extra_args=("--kv-cache-dtype", "fp8")), tmp_path, "llama"
    )
    assert fp8_cache.kv_cache_dtype == "fp8"
    reason = mode_mismatch(fp8_cache, simulator_numeric_mode(fp8_cache, "llama"))
    assert reason is not None and "fp8" in reason

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float8_e4m3fn"}))
    fp8 = engine_numeric_mode(
        engine_settings(dtype="auto", extra_args=("--quantization=fp8",)), tmp_path, "llama"
    )
    fallback = simulator_numeric_mode(fp8, "llama")
    assert fallback == NumericMode("float32", "transformers (llama)")
    reason = mode_mismatch(fp8, fallback)
    assert reason is not None and "float8_e4m3fn (engine) vs float32 (simulator)" in reason
    assert "quantization fp8" in reason


def _greedy_after(target: torch.nn.Module, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=count)  # type: ignore[operator]
    return list(out[0, len(ids) :].tolist())


def _diverged_output(target: torch.nn.Module, prompt_ids: list[int], own: list[int], at: int) -> list[int]:
    """An "engine" trajectory: the target's greedy output up to `at`, its runner-up token there, then
    greedy again (what a near-tie flipped by other numerics produces)."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt_ids + own[:at]])).logits[0, -1]  # type: ignore[operator]
    runner_up = int(logits.topk(2).indices[1])
    prefix = [*own[:at], runner_up]
    return prefix + _greedy_after(target, prompt_ids + prefix, MAX_TOKENS - len(prefix))


def test_replay_counts_acceptance_along_the_engines_text(zoo_target_dir: Callable[[str], Path]) -> None:
    target, tokenizer = load_target(zoo_target_dir("tiny-llama"))
    drafter = make_lookup_drafter(target)
    layer_ids = drafter.config.aux_layer_ids
    stops = stop_token_ids(target, tokenizer)
    free = simulate_acceptance(target, tokenizer, drafter, PROMPTS, k=K, max_new_tokens=MAX_TOKENS)
    assert free.num_accepted_tokens > 0

    # Replaying its own output is exactly the free-running simulation.
    own = [result.output_token_ids for result in free.results]
    replay = simulate_acceptance(
        target, tokenizer, drafter, PROMPTS, k=K, max_new_tokens=MAX_TOKENS, follow_token_ids=own
    )
    assert replay.counters == free.counters
    assert [r.output_token_ids for r in replay.results] == own

    # Replaying a text that left the target's greedy path: the output is that text, and each step's
    # drafts are accepted exactly as far as they match it (the engine's rule, with its tokens).
    prompt_ids = encode_prompt(tokenizer, PROMPTS[0])
    engine_text = _diverged_output(target, prompt_ids, own[0], at=5)
    steps: list[StepRecord] = []
    output, _reason, counters = speculative_generate(
        target, drafter, torch.tensor([prompt_ids]), k=K, max_new_tokens=MAX_TOKENS,
        capture_layer_ids=layer_ids, eos_token_ids=stops, on_step=steps.append, follow=engine_text,
    )  # fmt: skip
    assert output == engine_text
    for step in steps:
        start = step.position - len(prompt_ids) + 1  # output index of the first draft
        expected = engine_text[start : start + K]
        matched = 0
        while matched < min(K, len(expected)) and step.draft_token_ids[matched] == expected[matched]:
            matched += 1
        if start + K <= len(engine_text):  # (past the text's end the target's own choices stand)
            assert step.num_accepted == matched, step
    assert counters.num_drafts == len(steps)

    divergence = first_divergence(target, prompt_ids, engine_text)
    assert divergence is not None and divergence["position"] == 5 and divergence["gap_nats"] >= 0
    assert divergence["engine_token"] == engine_text[5] and divergence["simulator_token"] == own[0][5]
    assert first_divergence(target, prompt_ids, own[0]) is None


def test_run_simulator_loads_the_pair_in_the_engines_dtype(
    zoo_target_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    target_dir = zoo_target_dir("tiny-llama")
    target, tokenizer = load_target(target_dir)
    drafter_dir = save_drafter(untrained_drafter(target), tmp_path / "drafter")
    mode = simulator_numeric_mode(NumericMode("bfloat16", "vllm kernels (llama)"), "llama")
    free = run_simulator(target_dir, drafter_dir, PROMPTS, K, 12, mode=mode)
    assert free.method == "free_running" and free.numeric_mode is not None
    assert free.numeric_mode["dtype"] == "bfloat16"
    # The "engine" returned the simulator's own bf16 text: a replay over it diverges nowhere.
    bf16_target = target.to(torch.bfloat16)
    follow = []
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        follow.append(_greedy_after(bf16_target, ids, 12))
    replay = run_simulator(target_dir, drafter_dir, PROMPTS, K, 12, mode=mode, follow_token_ids=follow)
    assert replay.method == "replay" and len(replay.prompts) == len(PROMPTS)
    assert sum(p.num_drafts for p in replay.prompts) == replay.num_drafts
    assert not [p for p in replay.prompts if p.divergent and p.divergence and p.divergence["gap_nats"] > 0.15]
    with pytest.raises(ValueError):
        run_simulator(target_dir, drafter_dir, PROMPTS, K, 12, mode=mode, follow_token_ids=follow[:1])
