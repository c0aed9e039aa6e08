"""infra/synthesis/selection.py: one length policy for every row (training and evaluation), evaluation
prompts no row can dominate, the shortfall against data.num_samples, measured in a real target's tokens
(the zoo's tiny-llama tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.synthesis.conversations import count_rejections, first_turns, templated_prompt
from draftloop.infra.synthesis.prompts import read_input
from draftloop.infra.synthesis.selection import (
    OVER_LENGTH,
    LengthPolicy,
    RowCounts,
    select_prompts,
    shortfall_error,
    shortfall_warning,
)

TINY_LLAMA = Path(__file__).resolve().parent.parent / "configs" / "tiny-llama.yaml"
HUGE = " ".join(["word"] * 200_000)  # a 200,000-word prompt: far beyond any context


@pytest.fixture(scope="module")
def tokenizer(zoo_target_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(zoo_target_dir("tiny-llama"))


def _rows(count: int, **long_rows: str) -> list[dict[str, Any]]:
    rows = [{"id": f"r{i}", "prompt": f"Question number {i}?"} for i in range(count)]
    for row_id, text in long_rows.items():
        next(row for row in rows if row["id"] == row_id)["prompt"] = text
    return rows


def _tokens(tokenizer: Any, row: dict[str, Any]) -> int:
    return templated_prompt(tokenizer, first_turns(row))[1]


def test_the_builtin_demo_selection_is_the_last_rows_and_the_first_of_the_rest(tokenizer: Any) -> None:
    """Change no number: on the demo's data the selection is what it was before the policy (eval = the
    last 16 rows, training = the first 256 of the others), every row measured once at most."""
    rows = read_input("builtin").rows
    selection = select_prompts(rows, tokenizer, LengthPolicy(max_length=256, eval_max_tokens=957), 256, 16)
    assert selection.eval == rows[-16:] and selection.train == rows[:256]
    assert selection.rejected == [] and selection.truncated == selection.over_eval_cap == 0
    assert selection.measured == 256 + 16  # the rows between them are never tokenized


def test_an_over_length_evaluation_candidate_is_skipped_and_counted(tokenizer: Any) -> None:
    rows = _rows(30, r28=HUGE)
    selection = select_prompts(rows, tokenizer, LengthPolicy(max_length=64), num_samples=100, eval_prompts=4)
    assert [row["id"] for row in selection.eval] == ["r25", "r26", "r27", "r29"]  # r28 replaced by r25
    assert [row["id"] for row in selection.train] == [f"r{i}" for i in range(25)]
    (rejected,) = selection.rejected
    assert rejected["id"] == "r28" and rejected["kind"] == OVER_LENGTH
    assert rejected["reason"].startswith("over data.max_length: prompt has ")
    assert rejected["reason"].endswith("tokens, data.max_length is 64")
    assert count_rejections(selection.rejected) == {OVER_LENGTH: 1}
    assert selection.summary()["length_rejected"] == 1


def test_truncate_cuts_the_first_user_turn_to_leave_room_for_the_answer(tokenizer: Any) -> None:
    rows = _rows(12, r3=HUGE, r11=HUGE)
    rows[3] = {
        **rows[3],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HUGE}],
    }
    policy = LengthPolicy(max_length=64, over_length="truncate", answer_room=16, eval_max_tokens=64)
    selection = select_prompts(rows, tokenizer, policy, num_samples=10, eval_prompts=2)
    assert selection.rejected == [] and selection.truncated == 2
    cut_eval = next(row for row in selection.eval if row["id"] == "r11")
    cut_train = next(row for row in selection.train if row["id"] == "r3")
    for row in (cut_eval, cut_train):
        assert HUGE.startswith(row["prompt"]) and len(row["prompt"]) < 400
        assert 40 <= _tokens(tokenizer, row) <= 64 - 16  # as long as it may be, and no longer
    assert cut_train["messages"][0] == {"role": "system", "content": "Be brief."}  # kept whole
    assert cut_train["messages"][1]["content"] == cut_train["prompt"]
    assert rows[11]["prompt"] == HUGE  # the input row itself is left as read


def test_the_evaluation_cap_passes_long_rows_over_for_evaluation_only(tokenizer: Any) -> None:
    medium = "Explain " + "this and that " * 12  # fits data.max_length, not the evaluation cap
    rows = _rows(10, r8=medium)
    policy = LengthPolicy(max_length=128, eval_max_tokens=24)
    assert 24 < _tokens(tokenizer, {"prompt": medium}) < 127
    selection = select_prompts(rows, tokenizer, policy, num_samples=20, eval_prompts=3)
    assert [row["id"] for row in selection.eval] == ["r6", "r7", "r9"]
    assert selection.over_eval_cap == 1 and selection.rejected == []
    # training takes the rows before the held-out ones, then the passed-over row when they run short
    assert [row["id"] for row in selection.train] == [f"r{i}" for i in range(6)] + ["r8"]


def test_the_policy_of_a_config(tmp_path: Path) -> None:
    config = ExperimentConfig.load(
        TINY_LLAMA,
        {"target.path": str(tmp_path / "t"), "storage.root": str(tmp_path / "runs")},
        check_environment=False,
    )
    policy = LengthPolicy.from_config(config)
    # the cap is data.max_length, and never more than the engine serves with the evaluation's answer
    assert (policy.max_length, policy.over_length, policy.eval_max_tokens) == (256, "skip", 256)
    small_engine = config.model_copy(
        update={"engine": config.engine.model_copy(update={"max_model_len": 128})}
    )
    assert LengthPolicy.from_config(small_engine).eval_max_tokens == 128 - 64 - 3
    assert policy.answer_room == 96


def test_shortfall_is_a_warning_and_beyond_the_fraction_an_error() -> None:
    counts = RowCounts(
        input_rows=69, input_rejected=8, length_rejected=0, held_out=16, training_prompts=45, not_answered=0
    )
    assert shortfall_warning(45, 45, counts) is None
    assert shortfall_warning(256, 45, counts) == (
        "data.num_samples=256 but 45 training conversations were made (211 short): 45 training prompts were "
        "left of 69 rows (8 rejected on input, 0 by the length policy, 16 held out for evaluation)"
    )
    unanswered = RowCounts(**{**counts.__dict__, "not_answered": 2})
    assert str(shortfall_warning(256, 43, unanswered)).endswith("; 2 of them were not answered")
    assert shortfall_error(256, 45, 1.0) is None
    assert shortfall_error(256, 200, 0.25) is None
    error = shortfall_error(256, 45, 0.5)
    assert (
        error is not None and "45 of data.num_samples=256" in error and "max_shortfall_fraction=0.5" in error
    )
