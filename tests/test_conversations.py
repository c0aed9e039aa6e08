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


def test_rejections_are_counted_by_kind_under_names_mlflow_takes() -> None:
    """The counts become MLflow metric names (rejected_reasons.<kind>), which allow only a few characters."""
    import re

    from draftloop.infra.synthesis.conversations import count_rejections

    rejected = [
        {"id": "a", "reason": "missing 'content' in turn 1", "kind": "missing content"},
        {"id": "b", "reason": "generation failed: CUDA error 'x'"},
        {"id": "c", "reason": "generation failed: out of memory"},
        {"id": "d", "reason": "over data.max_length: prompt has 400007 tokens, data.max_length is 256"},
        {"id": "e", "reason": "odd 'quoted' (kind)"},
    ]
    counts = count_rejections(rejected)
    assert counts == {
        "missing content": 1,
        "generation failed": 2,
        "over data.max_length": 1,
        "odd quoted kind": 1,
    }
    assert all(re.fullmatch(r"[A-Za-z0-9_\-. :/]+", kind) for kind in counts)
