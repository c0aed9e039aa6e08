"""tiny-deepseek served by vLLM (CPU, bfloat16) gives transformers' bfloat16 greedy tokens.

The zoo's code rule (infra/targets/zoo.py) gives every step a wide top-1 margin, so the two bf16
implementations (different MLA and MoE kernels, different summation orders) must agree token for token
on the cycle's own eval prompts; a near-tie model parts ways within a few dozen tokens.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from fixtures_engine import require_vllm_env, vllm_settings
from test_zoo import NEW_TOKENS, cycle_eval_prompts, greedy_one_by_one

from draftloop.infra.engines.base import get_engine
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.targets.zoo import create_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_vllm_bf16_greedy_equals_transformers_bf16(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_vllm_env()
    target = create_tiny_model("tiny-deepseek", tmp_path / "tiny-deepseek", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    prompts = cycle_eval_prompts()
    expected, prompt_ids = greedy_one_by_one(tokenizer, model, prompts, NEW_TOKENS)

    engine = get_engine("vllm", vllm_settings(dtype="bfloat16", enforce_eager=True, max_model_len=512))
    served: list[list[int]] = []
    with EngineServer(engine, target, tmp_path / "run") as server, httpx.Client(timeout=300.0) as client:
        for ids in prompt_ids:
            response = client.post(
                server.base_url + "/v1/completions",
                json={
                    "model": "target",
                    "prompt": ids,
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0.0,
                    "return_token_ids": True,
                },
            )
            response.raise_for_status()
            served.append([int(t) for t in response.json()["choices"][0]["token_ids"]])
    mismatched = [i for i, (a, b) in enumerate(zip(served, expected, strict=True)) if a != b]
    equal = len(prompts) - len(mismatched)
    print(f"\n[tiny-deepseek] vLLM bf16 vs transformers bf16: {equal}/{len(prompts)} prompts equal")
    assert all(len(out) == NEW_TOKENS for out in served)
    assert not mismatched, f"prompts {mismatched} differ"
