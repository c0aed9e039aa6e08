"""infra/zoo.py and `draftloop models create`: tiny targets that load, generate and are reproducible."""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.storage import load_prompts
from draftloop.infra.zoo import EOS_TOKEN_ID, RECIPES, SPECIAL_TOKENS, create_tiny_model, ensure_model


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {name: create_tiny_model(name, root / name, seed=0) for name in RECIPES}


def _load(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)


def _greedy(tokenizer: object, model: object, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of all prompts in one left-padded batch (one thread: the CPU is shared)."""
    torch.set_num_threads(1)
    texts = [
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        for prompt in prompts
    ]
    tokenizer.padding_side = "left"  # type: ignore[attr-defined]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # type: ignore[operator]
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)  # type: ignore[attr-defined]
    return out[:, batch["input_ids"].shape[1] :].tolist()  # type: ignore[no-any-return]


def test_same_seed_gives_byte_identical_files(built: dict[str, Path], tmp_path: Path) -> None:
    for name, folder in built.items():
        again = create_tiny_model(name, tmp_path / f"{name}-again", seed=0)
        assert _hashes(again) == _hashes(folder), name
        expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
        assert expected <= set(_hashes(folder))
        assert (folder / "model.safetensors").stat().st_size < 40 * 2**20
    other = create_tiny_model("tiny-llama", tmp_path / "seed1", seed=1)
    assert _hashes(other)["model.safetensors"] != _hashes(built["tiny-llama"])["model.safetensors"]


def test_recipe_config_matches_built_folder(built: dict[str, Path]) -> None:
    for name, folder in built.items():
        saved = json.loads((folder / "config.json").read_text())
        recipe = RECIPES[name]
        assert (saved["num_hidden_layers"], saved["hidden_size"]) == (
            recipe.num_hidden_layers,
            recipe.hidden_size,
        )
        assert saved["eos_token_id"] == EOS_TOKEN_ID and saved["tie_word_embeddings"] is False
        assert recipe.hf_config().num_hidden_layers == recipe.num_hidden_layers


def test_deepseek_is_shaped_for_vllm_cpu_mla(built: dict[str, Path]) -> None:
    saved = json.loads((built["tiny-deepseek"] / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3"
    assert saved["kv_lora_rank"] + saved["qk_rope_head_dim"] == 576
    assert (saved["topk_method"], saved["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert saved["first_k_dense_replace"] == 1 and saved["n_routed_experts"] == 8
    with safe_open(str(built["tiny-deepseek"] / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    # Original per-expert layout (what vLLM's loader maps), a dense first layer, the router bias.
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in keys


def test_tokenizer_and_chat_template(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer, _ = _load(built["tiny-llama"], monkeypatch)
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
        tokenize=False,
    )
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
    prompt = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|assistant|>\n")
    assert tokenizer.eos_token_id == EOS_TOKEN_ID and len(tokenizer) == 2048  # type: ignore[attr-defined,arg-type]
    sample = "Write a Rust function that reverses a string: ünïcode 123!"
    assert tokenizer.decode(tokenizer(sample)["input_ids"]) == sample  # type: ignore[attr-defined,operator]
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token)["input_ids"]) == 1  # type: ignore[operator]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_greedy_outputs_are_context_dependent_and_not_degenerate(
    recipe: str, built: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, model = _load(built[recipe], monkeypatch)
    prompts = [p.prompt for p in load_prompts("builtin")[:8]]
    outputs = _greedy(tokenizer, model, prompts, new_tokens=24)
    assert len({tuple(o) for o in outputs}) >= 6, "different prompts should mostly give different text"
    for out in outputs:
        assert len(out) == 24  # special tokens (eos) are never the greedy choice
        assert not set(out) & set(range(len(SPECIAL_TOKENS)))
        assert len(set(out)) >= 6, "one token repeated is degenerate"


def test_greedy_continuations_are_learnable(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bigram/trigram table from some continuations predicts much of unseen ones: structure a drafter
    can learn (a target that is pure noise would score near 0 here)."""
    tokenizer, model = _load(built["tiny-llama"], monkeypatch)
    prompts = [p.prompt for p in load_prompts("builtin")[:40]]
    outputs = _greedy(tokenizer, model, prompts, new_tokens=32)
    train, held_out = outputs[:32], outputs[32:]
    tables: dict[int, dict[tuple[int, ...], collections.Counter[int]]] = {
        n: collections.defaultdict(collections.Counter) for n in (1, 2)
    }
    for out in train:
        for n in (1, 2):
            for i in range(n, len(out)):
                tables[n][tuple(out[i - n : i])][out[i]] += 1

    def predict(context: list[int]) -> int:
        for n in (2, 1):
            counts = tables[n].get(tuple(context[-n:]))
            if counts:
                return counts.most_common(1)[0][0]
        return -1

    hits = total = 0
    for out in held_out:
        for i in range(1, len(out)):
            total += 1
            hits += predict(out[:i]) == out[i]
    assert hits / total >= 0.4, f"held-out next-token lookup accuracy {hits / total:.2f}"
    assert hits / total < 1.0, "continuations should depend on more than the previous token"


@pytest.mark.parametrize("recipe", sorted(name for name, spec in RECIPES.items() if spec.layer_marker_scale))
def test_layers_carry_distinct_markers(
    recipe: str, built: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adjacent layers' hidden states differ (a drafter fed the wrong layer ids must notice), through
    reserved dimensions that the output head never reads."""
    tokenizer, model = _load(built[recipe], monkeypatch)
    torch.set_num_threads(1)
    spec = RECIPES[recipe]
    depth, scale = spec.num_hidden_layers, spec.layer_marker_scale
    assert scale > 0
    batch = tokenizer("Explain how a hash map works.", return_tensors="pt")  # type: ignore[operator]
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states  # type: ignore[operator]
    reserved = slice(spec.hidden_size - depth - 1, spec.hidden_size)
    for index in range(depth):  # the last entry is after the final norm
        marker = hidden[index][0, :, reserved]
        assert int(marker.abs().mean(0).argmax()) == index
        assert marker[:, index].min() > 0.5 * scale
    for index in range(1, depth):
        cosine = torch.nn.functional.cosine_similarity(hidden[index], hidden[index - 1], dim=-1).mean()
        assert cosine < 0.8, f"layers {index - 1} and {index}: cosine {cosine:.3f}"
    head = model.get_output_embeddings().weight  # type: ignore[attr-defined]
    assert torch.count_nonzero(head[:, reserved]) == 0


def test_ensure_model_builds_only_when_needed(tmp_path: Path) -> None:
    path = tmp_path / "m"
    with pytest.raises(FileNotFoundError):
        ensure_model(path, recipe=None)
    ensure_model(path, "tiny-llama", seed=0)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    ensure_model(path, "tiny-llama", seed=0)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_cli_models_create(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["models", "create", "tiny-llama", "--out", str(tmp_path / "m"), "--seed", "3"]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "model.safetensors").is_file()
    result = runner.invoke(app, ["models", "create", "tiny-gpt", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "tiny-gpt" in result.stderr
    assert not (tmp_path / "x").exists()
