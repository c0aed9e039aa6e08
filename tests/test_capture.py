"""Hook-based capture of aux hidden states, and the hidden-state shard format."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, PretrainedConfig, Qwen2Config

from draftloop.kernels.capture import capture_aux_hidden_states
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import (
    iter_hidden_samples,
    pack_hidden_shard,
    shard_from_bytes,
    shard_layer_ids,
    shard_metadata,
    shard_to_bytes,
)

COMMON: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=6, num_attention_heads=4, intermediate_size=64, vocab_size=64
)


def tiny_config(kind: str) -> PretrainedConfig:
    if kind == "llama":
        return LlamaConfig(**COMMON, num_key_value_heads=2)
    if kind == "qwen2":
        return Qwen2Config(**COMMON, num_key_value_heads=2)
    return DeepseekV3Config(
        **COMMON,
        num_key_value_heads=4,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )


@pytest.fixture(scope="module", params=["llama", "qwen2", "deepseek_v3"])
def tiny_model(request: pytest.FixtureRequest) -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(request.param)).eval()


def test_capture_equals_output_hidden_states(tiny_model: Any) -> None:
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    layer_ids = LayerIds((0, 2, 5))
    result = capture_aux_hidden_states(tiny_model, ids, layer_ids, want_logits=True)
    with torch.no_grad():
        reference = tiny_model(input_ids=ids, output_hidden_states=True)
    hidden_states = reference.hidden_states
    assert result.aux.shape == (2, 11, 3 * 32)
    for slot, layer in enumerate(layer_ids.ids):
        assert torch.equal(result.aux[..., slot * 32 : (slot + 1) * 32], hidden_states[layer])
    # HF's last entry is after the final norm; so is ours, and lm_head(last) gives the logits.
    assert result.last is not None and torch.equal(result.last, hidden_states[-1])
    assert result.logits is not None
    torch.testing.assert_close(result.logits, reference.logits)
    torch.testing.assert_close(tiny_model.lm_head(result.last), reference.logits)
    # No hooks left behind.
    assert all(not layer._forward_pre_hooks for layer in tiny_model.model.layers)


def test_capture_converts_layer_output_ids(tiny_model: Any) -> None:
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    as_input = capture_aux_hidden_states(tiny_model, ids, LayerIds((1, 3, 5)), want_last=False)
    as_output = capture_aux_hidden_states(
        tiny_model, ids, LayerIds((0, 2, 4), "layer_output"), want_last=False
    )
    assert as_input.last is None and as_input.logits is None
    assert torch.equal(as_input.aux, as_output.aux)


def test_capture_with_attention_mask_matches_unpadded() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    ids = torch.randint(1, 64, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.int64)], 1)
    mask = torch.cat([torch.ones(1, 6), torch.zeros(1, 3)], 1).long()
    alone = capture_aux_hidden_states(model, ids, LayerIds((1, 3, 5)))
    batched = capture_aux_hidden_states(model, padded, LayerIds((1, 3, 5)), attention_mask=mask)
    torch.testing.assert_close(batched.aux[:, :6], alone.aux, atol=1e-5, rtol=1e-5)
    assert alone.last is not None and batched.last is not None
    torch.testing.assert_close(batched.last[:, :6], alone.last, atol=1e-5, rtol=1e-5)


def test_capture_rejects_ids_beyond_depth() -> None:
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.5"):
        capture_aux_hidden_states(model, torch.zeros(1, 3, dtype=torch.int64), LayerIds((1, 3, 6)))


def _sample(length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 64, (length,), generator=gen),
        "loss_mask": (torch.rand(length, generator=gen) > 0.5).to(torch.uint8),
        "aux_hidden": torch.randn(length, 96, generator=gen).to(torch.bfloat16),
        "last_hidden": torch.randn(length, 32, generator=gen).to(torch.bfloat16),
    }


def test_shard_pack_iterate_and_bytes_round_trip() -> None:
    samples = [_sample(n, i) for i, n in enumerate([5, 1, 9])]
    packed = pack_hidden_shard(samples)
    assert packed["seq_offsets"].tolist() == [0, 5, 6, 15]
    assert packed["input_ids"].dtype == torch.int64 and packed["loss_mask"].dtype == torch.uint8
    assert packed["aux_hidden"].shape == (15, 96) and packed["last_hidden"].shape == (15, 32)
    meta = shard_metadata(LayerIds((0, 2, 4), "layer_output"), "tiny-llama", rows=3)
    data = shard_to_bytes(packed, meta)
    tensors, metadata = shard_from_bytes(data)
    assert json.loads(metadata["aux_layer_ids"]) == [1, 3, 5]
    assert shard_layer_ids(metadata) == LayerIds((1, 3, 5))
    assert metadata["target"] == "tiny-llama" and metadata["rows"] == "3"
    back = list(iter_hidden_samples(tensors))
    assert len(back) == 3
    for original, restored in zip(samples, back, strict=True):
        for key, value in original.items():
            assert torch.equal(restored[key], value.long() if key == "input_ids" else value), key


def test_shard_pack_rejects_inconsistent_lengths() -> None:
    bad = _sample(5, 0)
    bad["last_hidden"] = bad["last_hidden"][:4]
    with pytest.raises(ValueError, match="sample 0: last_hidden"):
        pack_hidden_shard([bad])
    with pytest.raises(ValueError, match="empty"):
        pack_hidden_shard([])
