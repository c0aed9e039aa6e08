"""The EAGLE 3.1 drafter variant (kernels/variants/eagle31.py): a published vLLM-style folder loads as it
and computes vLLM's math; exports round-trip; its norms train; plain EAGLE-3 is untouched; the MLA
drafter and the simulator run with it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fixtures_kernels import builtin_prompts, default_layer_ids, load_target, plain_greedy, reference_drafts
from safetensors.torch import save_file
from synthetic_training import LAYERS, TARGET, synthetic_samples, target_tensors
from transformers import DeepseekV3Config

from draftloop.kernels.attention import Chain, Decode
from draftloop.kernels.checkpoint import load_drafter, save_drafter
from draftloop.kernels.data import InMemorySamples
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.files import DrafterFormatError
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.simulate import StepRecord, encode_prompt, simulate_acceptance, speculative_generate
from draftloop.kernels.speculators import export_speculators
from draftloop.kernels.train import TrainConfig, train_drafter
from draftloop.kernels.variants.base import UnsupportedVariantError, get_variant

NAME = "eagle3.1"
OPTIONS = ("fc_norm", "norm_before_fc", "norm_output")

# The published drafter's shape: target hidden 24 != drafter hidden 16, so fc_norm chunks are [24] each.
HIDDEN, TARGET_HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 16, 24, 4, 2, 4, 32
VOCAB, DRAFT_VOCAB, EPS, THETA = 48, 20, 1e-5, 5000.0
AUX_IDS = [1, 3, 5]


def randomise_norms(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """Norm weights away from ones, so that a norm skipped, doubled or swapped changes the outputs."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return drafter


def eagle31_drafter(target: Any = TARGET, layers: LayerIds = LAYERS, **options: bool) -> Eagle3Drafter:
    torch.manual_seed(3)
    config = DrafterConfig.for_target(target, layers, variant=NAME, variant_options=options)
    drafter = randomise_norms(Eagle3Drafter(config))
    return drafter.attach_embeddings(torch.randn(config.vocab_size, config.hidden_size))


def passes(
    drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(handed-on state, logits) of a first pass over [1, T] and of one chain step from it."""
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        hidden, kv = drafter(drafter.fuse(aux), ids, positions)
        chained, _ = drafter(hidden, ids, positions + 1, Chain(past=[kv]))
    return hidden, drafter.logits(hidden), chained, drafter.logits(chained)


def random_inputs(
    aux_width: int, vocab: int, length: int = 7, seed: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, length, aux_width, generator=gen) * 4, torch.randint(
        0, vocab, (1, length), generator=gen
    )


# ---------------------------------------------------------------------------------------------------------
# (a) A published vLLM-style folder, written by hand, against a from-scratch reference of vLLM's math


def published_weights(options: dict[str, bool]) -> dict[str, torch.Tensor]:
    """Random weights under the names a vLLM EAGLE 3.1 checkpoint has on disk."""
    gen = torch.Generator().manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    def norm(size: int) -> torch.Tensor:
        return torch.rand(size, generator=gen) + 0.5

    n = len(AUX_IDS)
    layer = "midlayer."  # published EAGLE-3 name of vLLM's layers.0
    weights = {
        "fc.weight": rand(HIDDEN, n * TARGET_HIDDEN),
        layer + "input_layernorm.weight": norm(HIDDEN),
        layer + "hidden_norm.weight": norm(HIDDEN),
        layer + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        layer + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        layer + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        layer + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        layer + "post_attention_layernorm.weight": norm(HIDDEN),
        layer + "mlp.gate_proj.weight": rand(INTER, HIDDEN),
        layer + "mlp.up_proj.weight": rand(INTER, HIDDEN),
        layer + "mlp.down_proj.weight": rand(HIDDEN, INTER),
        "norm.weight": norm(HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
        "embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
    }
    target_ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    weights["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)
    weights["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    weights["t2d"][target_ids] = True
    if options["norm_before_fc"]:
        weights["input_norm.weight"] = norm(n * TARGET_HIDDEN)
    if options["fc_norm"]:
        for i in range(n):
            weights[f"fc_norm.{i}.weight"] = norm(TARGET_HIDDEN)
    return weights


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on x [T, heads, d] (halves rotated)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].float() / THETA ** (torch.arange(0, 2 * half, 2).float() / (2 * half))
    cos, sin = (torch.cat((f, f), -1)[:, None] for f in (angles.cos(), angles.sin()))
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference_fuse(w: dict[str, torch.Tensor], aux: torch.Tensor, options: dict[str, bool]) -> torch.Tensor:
    """vLLM's combine_hidden_states: input_norm over the concat, then fc_norm per chunk, then fc."""
    if options["norm_before_fc"]:
        aux = rms(aux, w["input_norm.weight"])
    if options["fc_norm"]:
        chunks = aux.chunk(len(AUX_IDS), -1)
        aux = torch.cat([rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], -1)
    return aux @ w["fc.weight"].T


def reference_step(
    w: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    norm_output: bool,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One vLLM drafter pass over T positions ([T, H] in): (handed-on state, logits, (k, v, positions)).
    Keys at positions <= the query's are seen (the past's and its own)."""
    p, length = "midlayer.", hidden.shape[0]
    x = torch.cat((rms(w["embed_tokens.weight"][ids], w[p + "input_layernorm.weight"]),
                   rms(hidden, w[p + "hidden_norm.weight"])), -1)  # fmt: skip
    q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(length, HEADS, HEAD_DIM), positions)
    k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(length, KV_HEADS, HEAD_DIM), positions)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(length, KV_HEADS, HEAD_DIM)
    own = (k, v, positions)
    if past is not None:
        k, v, key_pos = (torch.cat(pair) for pair in zip(past, own, strict=True))
    else:
        key_pos = positions
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(key_pos[None, None, :] > positions[None, :, None], float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(length, -1)
    mid = hidden + attn @ w[p + "self_attn.o_proj.weight"].T  # residual: the raw incoming hidden
    n = rms(mid, w[p + "post_attention_layernorm.weight"])
    prenorm = (
        mid
        + (F.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T))
        @ w[p + "mlp.down_proj.weight"].T
    )
    post = rms(prenorm, w["norm.weight"])  # vLLM's final norm(hidden, residual)
    return (post if norm_output else prenorm), post @ w["lm_head.weight"].T, own


def write_published(
    folder: Path, options: dict[str, bool], *, in_eagle_config: bool = False
) -> dict[str, Any]:
    """A vLLM-style drafter folder (no draftloop block); norm_before_fc in ``eagle_config`` if asked
    (where vLLM's Llama drafter looks first), with the opposite value at the top level."""
    folder.mkdir(parents=True)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": TARGET_HIDDEN,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "fc_norm": options["fc_norm"],
        "norm_output": options["norm_output"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True},
    }
    if in_eagle_config:
        config["eagle_config"]["norm_before_fc"] = options["norm_before_fc"]
        config["norm_before_fc"] = not options["norm_before_fc"]
    elif options["norm_before_fc"]:
        config["norm_before_fc"] = True
    weights = published_weights(options)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return weights


@pytest.mark.parametrize(
    ("options", "in_eagle_config"),
    [
        ({"fc_norm": True, "norm_before_fc": False, "norm_output": True}, False),  # published EAGLE 3.1
        ({"fc_norm": False, "norm_before_fc": True, "norm_output": False}, False),
        ({"fc_norm": True, "norm_before_fc": True, "norm_output": False}, True),
    ],
    ids=["fc_norm+norm_output", "norm_before_fc", "both-norms-eagle_config"],
)
def test_published_folder_loads_as_eagle31_and_computes_vllms_math(
    tmp_path: Path, options: dict[str, bool], in_eagle_config: bool
) -> None:
    weights = write_published(tmp_path / "published", options, in_eagle_config=in_eagle_config)
    drafter = load_drafter(tmp_path / "published", convention="layer_input")
    assert drafter.config.variant == NAME and drafter.config.variant_options == options
    assert drafter.config.rms_norm_eps == EPS and drafter.config.aux_layer_ids == LayerIds(tuple(AUX_IDS))
    new = {"input_norm.weight"} if options["norm_before_fc"] else set()
    new |= {f"fc_norm.{i}.weight" for i in range(3)} if options["fc_norm"] else set()
    assert new <= set(drafter.weights_state_dict())
    assert {name for name in drafter.weights_state_dict() if "fc_norm" in name or "input_norm" in name} == new

    aux, ids = random_inputs(3 * TARGET_HIDDEN, VOCAB, length=6)
    aux = aux * 1e-3  # mean square ~ eps: a norm with another eps than the config's shows
    positions = torch.arange(6)
    with torch.no_grad():
        hidden, kv = drafter(drafter.fuse(aux), ids, positions[None])
        logits = drafter.logits(hidden)
        # the next draft step at position 6, fed the last position's handed-on state and a drafted token
        step, _ = drafter(hidden[:, -1:], ids[:, :1], positions[None, -1:] + 1, Decode(past=[kv]))
        step_logits = drafter.logits(step)
    ref_hidden, ref_logits, ref_kv = reference_step(
        weights, reference_fuse(weights, aux[0], options), ids[0], positions, None, options["norm_output"]
    )
    ref_step, ref_step_logits, _ = reference_step(
        weights, ref_hidden[-1:], ids[0, :1], positions[-1:] + 1, ref_kv, options["norm_output"]
    )
    for got, want in ((hidden[0], ref_hidden), (logits[0], ref_logits), (step[0], ref_step)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_logits[0], ref_step_logits, rtol=1e-5, atol=1e-5)


def test_published_fields_no_variant_computes_are_refused_by_name(tmp_path: Path) -> None:
    options = {"fc_norm": True, "norm_before_fc": False, "norm_output": True}
    folder = tmp_path / "p"
    write_published(folder, options)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    with pytest.raises(DrafterFormatError, match=r"'norm_before_residual': True.*no drafter variant"):
        load_drafter(folder, convention="layer_input")
    # The fields without their tensors (or the tensors without the fields) are refused, naming them.
    (folder / "config.json").write_text(json.dumps({**config, "fc_norm": False}))
    with pytest.raises(DrafterFormatError, match=r"unexpected tensors \['fc_norm\.0\.weight"):
        load_drafter(folder, convention="layer_input")


# ---------------------------------------------------------------------------------------------------------
# (b) Export -> load round trips


@pytest.mark.parametrize(
    "options",
    [{}, {"fc_norm": False, "norm_before_fc": True}, {"norm_before_fc": True, "norm_output": False}],
    ids=["defaults", "input_norm+norm_output", "both-norms"],
)
def test_native_export_round_trips_the_variant_and_weights(tmp_path: Path, options: dict[str, bool]) -> None:
    drafter = eagle31_drafter(**options)
    resolved = get_variant(NAME).resolve_options(options)
    assert drafter.config.variant_options == resolved
    out = save_drafter(drafter, tmp_path / "native")
    written = json.loads((out / "config.json").read_text())
    assert {name: written[name] for name in OPTIONS} == resolved  # top level, as vLLM reads them
    aux, ids = random_inputs(3 * TARGET.hidden_size, TARGET.vocab_size)
    # Ours (draftloop block) and as a published folder (the block removed): same variant, same numbers.
    written.pop("draftloop")
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "config.json").write_text(json.dumps(written))
    (tmp_path / "published" / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    for loaded in (load_drafter(out), load_drafter(tmp_path / "published", convention="layer_input")):
        assert (loaded.config.variant, loaded.config.variant_options) == (NAME, resolved)
        want = drafter.weights_state_dict()
        got = loaded.weights_state_dict()
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
        loaded.attach_embeddings(drafter.embed_weight)
        for a, b in zip(passes(drafter, aux, ids), passes(loaded, aux, ids), strict=True):
            assert torch.equal(a, b)


def test_speculators_export_round_trips_and_refuses_both_norms(tmp_path: Path) -> None:
    drafter = eagle31_drafter()
    spec = export_speculators(drafter, tmp_path / "spec", str(tmp_path / "target"))
    exported = json.loads((spec / "config.json").read_text())
    assert [exported[n] for n in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")] == [
        True,
        False,
        True,
        False,
    ]
    exported.pop("draftloop")
    (spec / "config.json").write_text(json.dumps(exported))
    loaded = load_drafter(spec, convention="layer_input").attach_embeddings(drafter.embed_weight)
    assert (loaded.config.variant, loaded.config.variant_options) == (NAME, drafter.config.variant_options)
    aux, ids = random_inputs(3 * TARGET.hidden_size, TARGET.vocab_size)
    for a, b in zip(passes(drafter, aux, ids), passes(loaded, aux, ids), strict=True):
        assert torch.equal(a, b)
    # vLLM reads an absent norm_before_residual of this format as true: no variant computes that.
    (spec / "config.json").write_text(
        json.dumps({k: v for k, v in exported.items() if k != "norm_before_residual"})
    )
    with pytest.raises(DrafterFormatError, match=r"'norm_before_residual': True"):
        load_drafter(spec, convention="layer_input")
    with pytest.raises(UnsupportedVariantError, match="both fc_norm and norm_before_fc"):
        export_speculators(eagle31_drafter(norm_before_fc=True), tmp_path / "both", str(tmp_path / "target"))


# ---------------------------------------------------------------------------------------------------------
# (c) Training reaches the new norms


def test_training_changes_the_variant_norms() -> None:
    embed, lm_head = target_tensors()
    drafter = eagle31_drafter(norm_before_fc=True).attach_embeddings(embed)
    new = ["input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    # each gets a gradient from the logits of a chain step (through the handed-on, normed state)
    aux, ids = random_inputs(3 * TARGET.hidden_size, TARGET.vocab_size)
    positions = torch.arange(ids.shape[1])[None]
    hidden, kv = drafter(drafter.fuse(aux), ids, positions)
    drafter.logits(drafter(hidden, ids, positions + 1, Chain(past=[kv]))[0]).logsumexp(-1).sum().backward()
    grads = dict(drafter.named_parameters())
    for name in new:
        assert grads[name].grad is not None and grads[name].grad.abs().sum() > 0, name
    drafter.zero_grad(set_to_none=True)

    before = {name: tensor.clone() for name, tensor in drafter.weights_state_dict().items()}
    cfg = TrainConfig(ttt_length=2, epochs=1, batch_size=2, lr=3e-3, show_progress=False)
    result = train_drafter(drafter, InMemorySamples(synthetic_samples(4, seed=4)), lm_head, cfg)
    assert len(result.history) == 2 and all(math.isfinite(step["loss"]) for step in result.history)
    after = drafter.weights_state_dict()
    for name in [*new, "fc.weight", "norm.weight"]:
        assert not torch.equal(after[name], before[name]), name


# ---------------------------------------------------------------------------------------------------------
# (d) Plain EAGLE-3 is untouched by the seam


def prenorm_by_modules(
    drafter: Eagle3Drafter, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """EAGLE-3's layer spelled out with the drafter's modules (what forward computed before the seam)."""
    layer = drafter.midlayer
    x = torch.cat((layer.input_layernorm(drafter.embed(ids)), layer.hidden_norm(hidden)), -1)
    mid = hidden + layer.self_attn(x, positions, Decode())[0]
    return mid + layer.mlp(layer.post_attention_layernorm(mid))


@pytest.mark.parametrize("target", ["llama", "mla"])
def test_plain_eagle3_outputs_are_bit_identical(target: str) -> None:
    torch.manual_seed(3)
    config = DrafterConfig.for_target(TARGET if target == "llama" else mla_target(), LAYERS)
    drafter = randomise_norms(Eagle3Drafter(config)).attach_embeddings(
        torch.randn(config.vocab_size, config.hidden_size)
    )
    aux, ids = random_inputs(3 * config.target_hidden_size, config.vocab_size)
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        fused = drafter.fuse(aux)
        hidden, _ = drafter(fused, ids, positions)
        assert torch.equal(fused, F.linear(aux, drafter.fc.weight))
        assert torch.equal(
            hidden, prenorm_by_modules(drafter, fused, ids, positions)
        )  # the prenorm, handed on
        assert torch.equal(drafter.logits(hidden), F.linear(drafter.norm(hidden), drafter.lm_head.weight))


# ---------------------------------------------------------------------------------------------------------
# (e) The MLA drafter


def mla_target() -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=16,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=32,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        vocab_size=48,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
    )


def test_mla_drafter_with_eagle31_builds_runs_and_round_trips(tmp_path: Path) -> None:
    drafter = eagle31_drafter(mla_target())
    assert drafter.config.attention == "mla" and drafter.config.variant_options["norm_output"]
    # Against plain EAGLE-3's MLA layer with the same weights, fed vLLM's fused state by hand: the handed-on
    # state is norm(prenorm) and the logits lm_head(norm(prenorm)), in the first pass and a chain step.
    plain = Eagle3Drafter(DrafterConfig.for_target(mla_target(), LAYERS)).attach_embeddings(
        drafter.embed_weight
    )
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k in plain.state_dict()})
    aux, ids = random_inputs(3 * 16, 48)
    weights = {k: v for k, v in drafter.weights_state_dict().items() if k.startswith(("fc", "input_norm"))}
    fused = reference_fuse(weights, aux, {"fc_norm": True, "norm_before_fc": False})
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        first, kv = plain(fused, ids, positions)
        chain, _ = plain(plain.norm(first), ids, positions + 1, Chain(past=[kv]))
    hidden, logits, chained, chained_logits = passes(drafter, aux, ids)
    for got, want in ((hidden, plain.norm(first)), (chained, plain.norm(chain))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, plain.logits(first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chained_logits, plain.logits(chain), rtol=1e-5, atol=1e-5)

    out = save_drafter(drafter, tmp_path / "mla")
    written = json.loads((out / "config.json").read_text())
    assert (
        written["model_type"] == "deepseek_v2"
        and {n: written[n] for n in OPTIONS} == drafter.config.variant_options
    )
    loaded = load_drafter(out).attach_embeddings(drafter.embed_weight)
    assert loaded.config == drafter.config
    for a, b in zip(passes(drafter, aux, ids), passes(loaded, aux, ids), strict=True):
        assert torch.equal(a, b)
    # vLLM's MLA drafter reads no norm_before_fc: refused up front, and in a published MLA folder.
    with pytest.raises(ValueError, match="norm_before_fc is not read by vLLM's MLA drafter"):
        DrafterConfig.for_target(mla_target(), LAYERS, variant=NAME, variant_options={"norm_before_fc": True})
    written.pop("draftloop")
    (out / "config.json").write_text(json.dumps({**written, "norm_before_fc": True}))
    with pytest.raises(DrafterFormatError, match="norm_before_fc is not read by vLLM's MLA drafter"):
        load_drafter(out, convention="layer_input")


def test_every_option_off_is_refused_as_plain_eagle3() -> None:
    with pytest.raises(ValueError, match="all off is plain EAGLE-3"):
        DrafterConfig.for_target(TARGET, LAYERS, variant=NAME, variant_options=dict.fromkeys(OPTIONS, False))


# ---------------------------------------------------------------------------------------------------------
# (f) The simulator


def test_simulator_runs_an_eagle31_drafter(zoo_target_dir: Callable[[str], Path]) -> None:
    target, tokenizer = load_target(zoo_target_dir("tiny-llama"))
    layers = default_layer_ids(target)
    drafter = (
        eagle31_drafter(target.config, layers).attach_embeddings(target.get_input_embeddings().weight).eval()
    )
    prompts, k = builtin_prompts()[:2], 3
    report = simulate_acceptance(target, tokenizer, drafter, prompts, k=k, max_new_tokens=12)
    for prompt, result in zip(prompts, report.results, strict=True):
        assert result.output_token_ids == plain_greedy(target, tokenizer, prompt, 12)  # still lossless
    assert report.num_draft_tokens == k * report.num_drafts > 0
    # Its cached drafting (handed-on normed states) equals the proposal recomputed from scratch.
    prompt_ids = encode_prompt(tokenizer, prompts[0])
    steps: list[StepRecord] = []
    output, _, _ = speculative_generate(
        target,
        drafter,
        torch.tensor([prompt_ids]),
        k=k,
        max_new_tokens=8,
        capture_layer_ids=layers,
        on_step=steps.append,
    )
    assert steps
    for step in steps:
        committed = prompt_ids + output[: step.position - len(prompt_ids) + 1]
        assert step.draft_token_ids == reference_drafts(target, drafter, committed, k, layers)
