"""The long-context evaluation set (infra/synthesis/long_context.py) and its config checks: prompts of the
lengths asked for in the target's own tokens, the same every time, refused where they cannot be served."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
from draftloop.infra.synthesis.long_context import (
    LongContextError,
    Section,
    category_for,
    long_context_key_fields,
    long_context_prompts,
    long_context_rows,
    source_sections,
)
from draftloop.kernels.simulate import encode_prompt

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = REPO / "configs" / "tiny-llama.yaml"
LENGTHS = (2048, 4096, 8192)
LONG_CONTEXT = "evaluation.long_context_tokens"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """tiny-llama's tokenizer (the zoo's, seed 0), without building its weights."""
    from draftloop.infra.targets.zoo import build_tokenizer

    return build_tokenizer(0)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[Any]:
    return long_context_prompts(tokenizer, LENGTHS, 2)


def test_prompts_fill_their_lengths_in_the_targets_tokens(tokenizer: Any, prompts: list[Any]) -> None:
    assert [p.category for p in prompts] == ["long_2k"] * 2 + ["long_4k"] * 2 + ["long_8k"] * 2
    for prompt, length in zip(prompts, [n for n in LENGTHS for _ in range(2)], strict=True):
        sent = len(encode_prompt(tokenizer, prompt.prompt))  # as the engine's chat endpoint sends it
        assert sent == prompt.tokens
        assert 0.98 * length <= sent <= length, (prompt.id, sent)
        assert prompt.prompt.rstrip().endswith(("?", "."))  # the task comes after the document
    assert {p.task for p in prompts} == {"summarize", "question", "continue"}
    assert len({p.prompt for p in prompts}) == len(prompts)
    assert len({p.sections[0] for p in prompts}) == len(prompts)  # each document starts elsewhere


def test_the_set_is_deterministic_and_never_repeats_text(tokenizer: Any, prompts: list[Any]) -> None:
    again = long_context_prompts(tokenizer, LENGTHS, 2)
    assert again == prompts
    for prompt in prompts:  # a module quoted once: no wrap-around, no repeated text
        assert len(prompt.sections) == len(set(prompt.sections))
        for name in prompt.sections:
            assert prompt.prompt.count(f"## {name}\n") == 1
    names = [section.name for section in source_sections()]
    assert names == sorted(names) and "draftloop.kernels.train" in names and "draftloop.cli" in names


def test_a_length_the_text_cannot_fill_is_refused(tokenizer: Any) -> None:
    short = [Section("a.b", "one line of text\nanother line"), Section("a.c", "a third line")]
    with pytest.raises(LongContextError, match="more than draftloop's module documentation fills"):
        long_context_prompts(tokenizer, [2048], 1, sections=short)
    assert category_for(3000) == "long_3000" and category_for(16384) == "long_16k"


def _runnable(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {"engine.python": sys.executable, "storage.root": str(tmp_path / "runs"), **overrides}


def _error(tmp_path: Path, **overrides: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        ExperimentConfig.load(TINY_LLAMA, _runnable(tmp_path, **overrides), base_dir=tmp_path)
    return caught.value


def test_a_set_longer_than_the_served_length_is_refused(tmp_path: Path) -> None:
    error = _error(tmp_path, **{LONG_CONTEXT: [2048, 4096], "engine.max_model_len": 4096})
    assert error.field == LONG_CONTEXT
    assert "4096 tokens + evaluation.max_tokens 64 + k 3 need 4163 positions" in error.reason
    assert "engine.max_model_len 4096" in error.reason
    fits = ExperimentConfig.load(
        TINY_LLAMA, _runnable(tmp_path, **{LONG_CONTEXT: [2048, 4096], "engine.max_model_len": 4163}),
        base_dir=tmp_path,
    )  # fmt: skip
    assert fits.evaluation.long_context_tokens == [2048, 4096]
    assert _error(tmp_path, **{LONG_CONTEXT: [100]}).field.startswith(LONG_CONTEXT)  # below 256


def test_a_set_beyond_the_targets_or_drafters_rope_length_is_refused(tmp_path: Path) -> None:
    from draftloop.infra.targets.recipes import get_recipe

    recipe = get_recipe("tiny-llama")
    target = tmp_path / "short-target"
    target.mkdir()
    fields = {**recipe.config_fields, "model_type": recipe.model_type, "max_position_embeddings": 2048}
    (target / "config.json").write_text(json.dumps(fields))
    served = {LONG_CONTEXT: [4096], "engine.max_model_len": 8192}
    error = _error(tmp_path, **served, **{"target.path": str(target), "target.create": None})
    assert error.field == LONG_CONTEXT and "the target's max_position_embeddings 2048" in error.reason
    drafter = tmp_path / "short-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"hidden_size": 256, "max_position_embeddings": 4096}))
    error = _error(tmp_path, **served, **{"training.drafter_init": str(drafter)})
    assert error.field == LONG_CONTEXT
    assert f"max_position_embeddings in {drafter / 'config.json'} 4096" in error.reason


def test_cli_refuses_it_with_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY_LLAMA, tmp_path / "cfg.yaml")
    args = ["config", "validate", "cfg.yaml", "--set", f"engine.python={sys.executable}"]
    result = CliRunner().invoke(app, [*args, "--set", f"{LONG_CONTEXT}=[8192]"])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"config error: {LONG_CONTEXT}: ") and "1024" in result.stderr


def test_off_by_default_leaves_the_evaluation_key_as_it_was(tmp_path: Path) -> None:
    config = ExperimentConfig.load(TINY_LLAMA, _runnable(tmp_path), base_dir=tmp_path)
    before = config.evaluation.model_dump(mode="json")
    for added in ("long_context_tokens", "long_context_prompts"):
        before.pop(added)
    canonical = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert config.section_hash("evaluation") == hashlib.sha256(canonical.encode()).hexdigest()
    assert long_context_key_fields(config) == {}
    on = ExperimentConfig.load(
        TINY_LLAMA,
        _runnable(tmp_path, **{LONG_CONTEXT: [2048], "engine.max_model_len": 4096}),
        base_dir=tmp_path,
    )
    assert on.section_hash("evaluation") != config.section_hash("evaluation")
    assert set(long_context_key_fields(on)) == {"long_context_text"}


def test_the_evaluation_rows_carry_their_categories(tmp_path: Path, tokenizer: Any) -> None:
    tokenizer.save_pretrained(tmp_path / "target")
    config = ExperimentConfig.load(
        TINY_LLAMA,
        _runnable(tmp_path, **{LONG_CONTEXT: [512, 1536], "evaluation.long_context_prompts": 1,
                               "engine.max_model_len": 4096}),
        base_dir=tmp_path,
    )  # fmt: skip
    rows = long_context_rows(config, tmp_path / "target")
    assert [row["category"] for row in rows] == ["long_512", "long_1536"]
    assert [row["id"] for row in rows] == ["long_512-00", "long_1536-00"]
    assert (
        long_context_rows(ExperimentConfig.load(TINY_LLAMA, _runnable(tmp_path), base_dir=tmp_path), "x")
        == []
    )
