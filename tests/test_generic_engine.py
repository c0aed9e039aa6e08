"""Targets no family module covers, served by the real vLLM (CPU) with EAGLE-3: the generic decoder-only
path's captured layers are the ones vLLM feeds the drafter, so its acceptance equals the simulator's, and
speculation stays lossless.

tiny-qwen3 is served by vLLM's native Qwen3 class, tiny-olmo2 by its Transformers backend (which takes
layer k's input from layer k-1's output: the check that the ids line up there too). One speculative
server per target (about a minute each here), no baseline server: losslessness is checked against the
simulator's own greedy text, which is the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures_engine import evaluation_plan, export_for_vllm, require_vllm_env, vllm_settings

from draftloop.infra.engines.base import Speculation, get_engine
from draftloop.infra.engines.doctor import run_doctor
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.evaluation.benchmark import benchmark_server
from draftloop.infra.evaluation.simulator import encode_prompts
from draftloop.kernels.families.base import GENERIC, family_for_config
from draftloop.kernels.simulate import simulate_acceptance

pytestmark = [pytest.mark.slow, pytest.mark.engine]

K = 3
MAX_TOKENS = 32
TOLERANCE = 0.05


@pytest.mark.parametrize(
    ("recipe", "engine_class"),
    [("tiny-qwen3", "Qwen3ForCausalLM"), ("tiny-olmo2", "TransformersForCausalLM")],
)
def test_a_generic_target_served_with_eagle3_matches_the_simulator(
    recipe: str, engine_class: str, trained_pair: Callable[[str], Any], tmp_path: Path
) -> None:
    require_vllm_env()
    pair = trained_pair(recipe)
    assert family_for_config(pair.target.config) is GENERIC
    engine = get_engine("vllm", vllm_settings())
    drafter_dir = export_for_vllm(pair.drafter, tmp_path / "drafter")
    doctor = run_doctor(engine, pair.target_dir, drafter_dir)
    assert doctor["eagle3"]["support"] == "native" and doctor["eagle3"]["class"] == engine_class
    assert doctor["family"]["name"] == "generic" and doctor["layer_ids"]["consistent"] is True

    prompts = pair.held_out_prompts
    simulation = simulate_acceptance(
        pair.target, pair.tokenizer, pair.drafter, prompts, k=K, max_new_tokens=MAX_TOKENS
    )
    server = EngineServer(
        engine, pair.target_dir, tmp_path / "run", name="speculative", speculation=Speculation(drafter_dir, K)
    )
    with server:
        run = benchmark_server(
            server, engine, encode_prompts(pair.target_dir, prompts), [1],
            evaluation_plan(max_tokens=MAX_TOKENS).benchmark, name="speculative", num_speculative_tokens=K,
        )  # fmt: skip
    counters = run.prompt_pass_counters  # each prompt once: the simulator's prompt mix
    assert counters is not None and counters["num_draft_tokens"] > 0
    engine_rate = counters["num_accepted_tokens"] / counters["num_draft_tokens"]
    print(f"\n[{recipe}] engine {engine_rate:.3f} simulator {simulation.acceptance_rate}")
    assert simulation.acceptance_rate is not None and simulation.acceptance_rate > 0.2
    assert abs(engine_rate - simulation.acceptance_rate) <= TOLERANCE
    assert run.outputs == [result.text for result in simulation.results]  # lossless: the target's greedy
