"""Eagle3Drafter: both attention variants, incremental/chain attention, save/load/export, vocab."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from draftloop.kernels.attention import Chain, Decode, Masked, Packed
from draftloop.kernels.checkpoint import LayerIdExportError, load_drafter, save_drafter
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.files import DrafterFormatError, load_target_head
from draftloop.kernels.layer_ids import Convention, LayerIds
from draftloop.kernels.speculators import export_speculators
from draftloop.kernels.vocab import build_draft_vocab, count_tokens

HIDDEN = 32
VOCAB = 50
ROPE = {"rope_type": "default", "rope_theta": 5000.0}


def llama_target_config(**overrides: object) -> LlamaConfig:
    values: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        rope_parameters=dict(ROPE),
    )
    values.update(overrides)
    return LlamaConfig(**values)


def deepseek_target_config(**overrides: object) -> DeepseekV3Config:
    values: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        vocab_size=VOCAB,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        rope_parameters=dict(ROPE),
    )
    values.update(overrides)
    return DeepseekV3Config(**values)


TARGETS = {"llama": llama_target_config, "mla": deepseek_target_config}


def make_drafter(kind: str, draft_vocab: int | None = None, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig.for_target(TARGETS[kind](), LayerIds((1, 3, 5)), draft_vocab_size=draft_vocab)
    drafter = Eagle3Drafter(config)
    # Random norms so that a mix-up of norm weights would change the outputs.
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.uniform_(0.5, 1.5)
    drafter.attach_embeddings(torch.randn(VOCAB, HIDDEN))
    return drafter.eval()


def assert_same_logits(drafter: Eagle3Drafter, loaded: Eagle3Drafter) -> None:
    """`loaded` (given the drafter's embeddings) computes exactly the drafter's logits."""
    loaded.attach_embeddings(drafter.embed_weight)
    aux, ids, positions = inputs()
    with torch.no_grad():
        want = drafter.logits(drafter(drafter.fuse(aux), ids, positions)[0])
        got = loaded.logits(loaded(loaded.fuse(aux), ids, positions)[0])
    assert torch.equal(want, got)


def inputs(batch: int = 2, length: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(batch, length, 3 * HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    positions = torch.arange(length).expand(batch, length)
    return aux, ids, positions


def test_for_target_picks_attention_from_model_type() -> None:
    assert DrafterConfig.for_target(llama_target_config(), LayerIds((1, 3, 5))).attention == "llama"
    mla = DrafterConfig.for_target(deepseek_target_config(), LayerIds((1, 3, 5)))
    assert mla.attention == "mla"
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank) == (16, 4, 16)
    assert mla.rope_theta == 5000.0
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.5"):
        DrafterConfig.for_target(llama_target_config(), LayerIds((1, 3, 6)))
    # Layer-output ids are stored as layer_input.
    cfg = DrafterConfig.for_target(llama_target_config(), LayerIds((0, 2, 4), "layer_output"))
    assert cfg.aux_layer_ids == LayerIds((1, 3, 5), "layer_input")


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_incremental_decoding_matches_full_pass(kind: str) -> None:
    drafter = make_drafter(kind)
    aux, ids, positions = inputs()
    hidden = drafter.fuse(aux)
    with torch.no_grad():
        full, (k, v) = drafter(hidden, ids, positions)
        _prefix, kv = drafter(hidden[:, :6], ids[:, :6], positions[:, :6])
        step, _ = drafter(hidden[:, 6:], ids[:, 6:], positions[:, 6:], Decode(past=[kv]))
    heads = 2 if kind == "llama" else 4
    assert k.shape[:3] == (2, heads, 9) and v.shape[:3] == (2, heads, 9)
    assert full.shape == (2, 9, HIDDEN)
    torch.testing.assert_close(step, full[:, 6:], atol=1e-5, rtol=1e-5)
    # The future must not leak into earlier positions.
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    with torch.no_grad():
        other, _ = drafter(hidden, changed, positions)
    torch.testing.assert_close(other[:, :-1], full[:, :-1])
    assert not torch.allclose(other[:, -1], full[:, -1])


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_chain_attention_equals_explicit_mask(kind: str) -> None:
    drafter = make_drafter(kind)
    aux, ids, positions = inputs()
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    eye = torch.eye(length, dtype=torch.bool)
    with torch.no_grad():
        h0, kv0 = drafter(drafter.fuse(aux), ids, positions)
        h1, kv1 = drafter(h0, ids, positions + 1, Chain(past=[kv0]))
        h1_ref, _ = drafter(h0, ids, positions + 1, Masked(past=[kv0], visible=torch.cat([causal, eye], 1)))
        h2, _ = drafter(h1, ids, positions + 2, Chain(past=[kv0], earlier=[kv1]))
        additive = torch.zeros(length, 3 * length).masked_fill(
            ~torch.cat([causal, eye, eye], 1), float("-inf")
        )
        h2_ref, _ = drafter(h1, ids, positions + 2, Masked(past=[kv0, kv1], visible=additive))
    torch.testing.assert_close(h1, h1_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2, h2_ref, atol=1e-5, rtol=1e-5)
    # A packed row holding one sample: the same as one sample per row, for the first pass and the chain.
    one_sample = torch.zeros_like(ids)
    with torch.no_grad():
        p0, pkv0 = drafter(drafter.fuse(aux), ids, positions, Packed(one_sample))
        p1, _ = drafter(p0, ids, positions + 1, Chain(past=[pkv0], segments=one_sample))
    torch.testing.assert_close(p0, h0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p1, h1, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="query length"):
        drafter(h1[:, :4], ids[:, :4], positions[:, :4] + 2, Chain(past=[kv0]))


def test_llama_attention_matches_transformers_reference() -> None:
    """RoPE (neox), GQA and scale agree with HF's LlamaAttention on the 2H input."""
    drafter = make_drafter("llama")
    ours = drafter.midlayer.self_attn
    ref_cfg = llama_target_config(hidden_size=2 * HIDDEN)
    ref_cfg._attn_implementation = "eager"
    ref = LlamaAttention(ref_cfg, 0)
    _compare_attention(ours, ref, LlamaRotaryEmbedding(ref_cfg))


def test_mla_attention_matches_transformers_reference() -> None:
    """MLA with interleaved RoPE agrees with HF's DeepseekV3Attention (rope_interleave) on the 2H input."""
    drafter = make_drafter("mla")
    ours = drafter.midlayer.self_attn
    ref_cfg = deepseek_target_config(hidden_size=2 * HIDDEN)
    ref_cfg._attn_implementation = "eager"
    assert ref_cfg.rope_interleave
    ref = DeepseekV3Attention(ref_cfg, 0)
    _compare_attention(ours, ref, DeepseekV3RotaryEmbedding(ref_cfg))


def _compare_attention(ours: Any, ref: Any, rotary: Any) -> None:
    weights = {k: v for k, v in ours.state_dict().items() if not k.startswith("o_proj")}
    result = ref.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["o_proj.weight"] and not result.unexpected_keys
    captured: dict[str, torch.Tensor] = {}
    ref.o_proj.register_forward_pre_hook(lambda _m, a: captured.__setitem__("ref", a[0]))
    ours.o_proj.register_forward_pre_hook(lambda _m, a: captured.__setitem__("ours", a[0]))
    x = torch.randn(2, 7, 2 * HIDDEN)
    positions = torch.arange(3, 10).expand(2, 7)
    cos, sin = rotary(x, positions)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref(x, (cos, sin), mask)
        ours(x, positions, Decode())
    torch.testing.assert_close(captured["ours"], captured["ref"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("convention", ["layer_input", "layer_output"])
def test_save_load_identical_logits(kind: str, convention: Convention, tmp_path: Path) -> None:
    drafter = make_drafter(kind, draft_vocab=20)
    drafter.set_vocab_mapping(*build_draft_vocab(torch.arange(VOCAB), VOCAB, 20))
    out = save_drafter(
        drafter,
        tmp_path / "d",
        convention=convention,
        engine="some-engine",
        extra_config={"engine_block": {"ids": [7]}},
        metadata={"run": "abc"},
    )
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["vocab_size"] == VOCAB and config["draft_vocab_size"] == 20
    expected_ids = [1, 3, 5] if convention == "layer_input" else [0, 2, 4]
    assert config["eagle_aux_hidden_state_layer_ids"] == expected_ids
    assert config["engine_block"] == {"ids": [7]}  # an engine's extra keys, written as given
    block = config["draftloop"]
    assert block["aux_layer_ids"] == [1, 3, 5] and block["aux_layer_ids_convention"] == "layer_input"
    assert block["convention_exported"] == convention
    assert block["engine"] == "some-engine"
    assert block["metadata"] == {"run": "abc"}
    if kind == "llama":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    else:
        assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert config["model_type"] == "deepseek_v2"
        for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace"):
            assert isinstance(config[key], int)
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert not any("embed" in name for name in names)
    assert {"fc.weight", "lm_head.weight", "d2t", "t2d", "norm.weight"} <= names
    attn_names = (
        {"q_proj", "k_proj", "v_proj"} if kind == "llama" else {"q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    )
    assert {f"midlayer.self_attn.{n}.weight" for n in attn_names} <= names

    loaded = load_drafter(out).eval()
    assert loaded.config.aux_layer_ids == LayerIds((1, 3, 5))
    assert loaded.embed_weight is None
    assert_same_logits(drafter, loaded)
    assert torch.equal(loaded.to_target_ids(torch.arange(20)), torch.arange(VOCAB - 20, VOCAB))


def test_load_bf16_and_dtype_override(tmp_path: Path) -> None:
    drafter = make_drafter("llama").to(torch.bfloat16)
    out = save_drafter(drafter, tmp_path / "d")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_drafter(out).fc.weight.dtype == torch.bfloat16
    assert load_drafter(out, dtype=torch.float32).fc.weight.dtype == torch.float32


def test_published_folder_needs_a_convention(tmp_path: Path) -> None:
    drafter = make_drafter("llama")
    out = save_drafter(drafter, tmp_path / "d", convention="layer_output")
    config = json.loads((out / "config.json").read_text())
    del config["draftloop"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match=r"config\.json.*convention"):
        load_drafter(out)
    loaded = load_drafter(out, convention="layer_output")
    assert loaded.config.aux_layer_ids == LayerIds((1, 3, 5), "layer_input")
    loaded = load_drafter(out, convention="layer_input")
    assert loaded.config.aux_layer_ids == LayerIds((0, 2, 4), "layer_input")


def test_published_folder_with_layers_prefix_and_embedding(tmp_path: Path) -> None:
    """Checkpoints that name the layer layers.0.* and carry their own embed_tokens load too."""
    from safetensors.torch import save_file

    drafter = make_drafter("llama")
    out = save_drafter(drafter, tmp_path / "d")
    tensors = {
        (("layers.0." + k[len("midlayer.") :]) if k.startswith("midlayer.") else k): v
        for k, v in drafter.weights_state_dict().items()
        if k not in ("d2t", "t2d")
    }
    assert drafter.embed_weight is not None
    tensors["embed_tokens.weight"] = drafter.embed_weight.clone()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["draftloop"]
    (out / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(out, convention="layer_input")
    assert loaded.embed_weight is not None
    aux, ids, positions = inputs()
    with torch.no_grad():
        want = drafter(drafter.fuse(aux), ids, positions)[0]
        got = loaded(loaded.fuse(aux), ids, positions)[0]
    assert torch.equal(want, got)


def test_load_rejects_shape_mismatch(tmp_path: Path) -> None:
    out = save_drafter(make_drafter("llama"), tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    config["draftloop"]["drafter_config"]["intermediate_size"] = 48
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match=r"midlayer\.mlp"):
        load_drafter(out)


@pytest.mark.parametrize("tied", [False, True])
def test_load_target_head(tied: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_target_config(tie_word_embeddings=tied))
    model.save_pretrained(tmp_path / "t")
    embed, lm_head, norm = load_target_head(tmp_path / "t")
    assert torch.equal(embed, model.model.embed_tokens.weight.detach())
    assert torch.equal(lm_head, model.lm_head.weight.detach())
    assert norm is not None and torch.equal(norm, model.model.norm.weight.detach())
    assert torch.equal(lm_head, embed) == tied


def test_build_draft_vocab() -> None:
    d2t, t2d = build_draft_vocab(torch.zeros(10), 10, 10)
    assert torch.equal(d2t, torch.zeros(10, dtype=torch.int64)) and bool(t2d.all())
    counts = count_tokens([torch.tensor([7, 7, 7, 2, 2, 9]), torch.tensor([[9, 9, 9, 9]])], 10)
    assert counts.tolist() == [0, 0, 2, 0, 0, 0, 0, 3, 0, 5]
    d2t, t2d = build_draft_vocab([torch.tensor([7, 7, 7, 2, 2, 9]), torch.tensor([[9, 9, 9, 9]])], 10, 3)
    draft_ids = torch.arange(3) + d2t
    assert draft_ids.tolist() == [2, 7, 9]
    assert t2d.nonzero().flatten().tolist() == [2, 7, 9]
    # Fewer seen tokens than Vd: unseen low ids fill the rest, deterministically.
    d2t, t2d = build_draft_vocab(counts, 10, 5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 7, 9]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 10, 11)


def _speculators_available() -> bool:
    return importlib.util.find_spec("speculators") is not None


def test_export_speculators_format(tmp_path: Path) -> None:
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(llama_target_config())
    target.save_pretrained(tmp_path / "target")
    drafter = make_drafter("llama", draft_vocab=20)
    drafter.set_vocab_mapping(*build_draft_vocab(torch.arange(VOCAB), VOCAB, 20))
    out = export_speculators(drafter, tmp_path / "spec", str(tmp_path / "target"), speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["norm_before_residual"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert config["transformer_layer_config"]["model_type"] == "llama"
    with pytest.raises(ValueError, match="MLA"):
        export_speculators(make_drafter("mla"), tmp_path / "x", str(tmp_path / "target"))

    # Read back by draftloop itself (simulate or evaluate a speculators-format drafter): same logits.
    loaded = load_drafter(out).eval()
    assert loaded.config.aux_layer_ids == LayerIds((1, 3, 5)) and loaded.config.draft_vocab_size == 20
    assert_same_logits(drafter, loaded)
    # a variant our layer does not compute is refused, naming it
    variant = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**variant, "norm_before_residual": True, "draftloop": {}}))
    with pytest.raises(DrafterFormatError, match="norm_before_residual"):
        load_drafter(out)
    (out / "config.json").write_text(json.dumps(variant))
    if not _speculators_available():
        pytest.skip(
            "speculators is not importable here (DESIGN.md, kernels API: PYTHONPATH to a --no-deps install)"
        )
    from speculators.models.eagle3 import Eagle3DraftModel

    loaded = Eagle3DraftModel.from_pretrained(str(out))
    assert loaded.config.eagle_aux_hidden_state_layer_ids == [1, 3, 5]
    state = loaded.state_dict()
    for name, tensor in drafter.weights_state_dict().items():
        native = "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name
        assert torch.equal(state[native].to(tensor.dtype), tensor), native


def test_export_with_other_layer_ids_is_refused_naming_both_sets(tmp_path: Path) -> None:
    drafter = make_drafter("llama")
    trained = list(drafter.config.aux_layer_ids.ids)
    shifted = LayerIds(tuple(i - 1 for i in trained), "layer_input")
    with pytest.raises(LayerIdExportError) as refused:
        save_drafter(drafter, tmp_path / "bad", layer_ids=shifted)
    assert str(trained) in str(refused.value) and str(list(shifted.ids)) in str(refused.value)
    assert not (tmp_path / "bad" / "config.json").exists()  # nothing half-written
    # The same tensors named in the layer_output convention are the trained ids: accepted.
    same = LayerIds(tuple(i - 1 for i in trained), "layer_output")
    save_drafter(drafter, tmp_path / "ok", convention="layer_output", layer_ids=same)
    # Forced (to measure what a wrong export costs): the engine gets the shifted ids, the record stays true.
    save_drafter(drafter, tmp_path / "forced", layer_ids=shifted, allow_layer_mismatch=True)
    config = json.loads((tmp_path / "forced" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == list(shifted.ids)
    assert config["draftloop"]["aux_layer_ids"] == trained


def test_packed_flex_mask_equals_dense_segment_mask() -> None:
    """The document-aware FlexAttention path (compiled CUDA training) computes what the dense segment
    mask computes: each query sees only earlier keys of its own sample, plus its own chain entries."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from draftloop.kernels.attention import _flex_chain

    gen = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 160, 16
    # Row 0: samples of 70, 50 and 30 tokens then padding; row 1: one sample of 150 then padding.
    segments = torch.full((batch, length), -1)
    segments[0, :70], segments[0, 70:120], segments[0, 120:150] = 0, 1, 2
    segments[1, :150] = 0

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = rand(batch, heads, length, dim)
    past = (rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim))
    chain = [(rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim)) for _ in range(3)]
    scale = dim**-0.5
    # Step 0 (no chain) and a step with a chain of two earlier steps plus its own key.
    dense0 = Packed(segments).attend(q, *past, scale)
    flex0 = _flex_chain(q, *past, length, 0, scale, segments)
    dense2 = Chain(past=[past], earlier=chain[:2], segments=segments).attend(q, *chain[2], scale)
    keys = torch.cat([past[0], *(k for k, _ in chain)], dim=2)
    values = torch.cat([past[1], *(v for _, v in chain)], dim=2)
    flex2 = _flex_chain(q, keys, values, length, 3, scale, segments)
    torch.testing.assert_close(flex0, dense0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex2, dense2, atol=1e-5, rtol=1e-5)
    # The mask keeps samples apart: changing sample 0's keys leaves sample 1's outputs alone.
    changed = past[0].clone()
    changed[0, :, :70] += 1.0
    moved = Packed(segments).attend(q, changed, past[1], scale)
    torch.testing.assert_close(moved[0, :, 70:], dense0[0, :, 70:])
    assert not torch.allclose(moved[0, :, :70], dense0[0, :, :70])
