"""infra/synthesis/conversations.py: the conversation row both synthesis backends store."""

from __future__ import annotations

from draftloop.infra.synthesis.conversations import SynthesisResult, split_reasoning


def test_reasoning_is_kept_apart_from_the_answer() -> None:
    assert split_reasoning("<think> plan </think> The answer.") == ("The answer.", "plan")
    assert split_reasoning("only thinking opened by the template</think>Hi") == (
        "Hi",
        "only thinking opened by the template",
    )
    assert split_reasoning("  plain  ") == ("plain", None)


def test_answers_become_rows_and_empty_ones_rejections() -> None:
    result = SynthesisResult()
    result.add_answer({"id": "a", "prompt": "Hello?"}, "Hi.", None)
    result.add_answer({"id": "b", "prompt": "Think first"}, *split_reasoning("<think>hmm</think>"))
    assert result.conversations == [
        {
            "id": "a",
            "messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}],
            "reasoning": None,
        }
    ]
    assert result.rejected == [{"id": "b", "reason": "empty answer"}]
