"""Where engine and reference first part, for an integration fault no known cause explains."""

from __future__ import annotations

from typing import Any

from draftloop.infra.evaluation.benchmark import ServerRun
from draftloop.infra.evaluation.divergence import first_divergence


def _run(name: str, tokens: list[str], counters: list[dict[str, Any] | None] | None = None) -> ServerRun:
    return ServerRun(
        name, None, None, None, [], outputs=["".join(tokens)],
        output_logprobs=[[(token, {token: 0.0}) for token in tokens]], output_counters=counters or [],
    )  # fmt: skip


def _simulator(divergence: dict[str, Any] | None = None, accepted: int = 6) -> dict[str, Any]:
    prompt = {
        "num_drafts": 4,
        "num_draft_tokens": 12,
        "num_accepted_tokens": accepted,
        "divergence": divergence,
    }
    return {"prompts": [prompt], "per_position": [0.75, 0.5, 0.25]}


def test_a_speculative_text_leaving_the_baseline_is_named_by_prompt_position_and_tokens() -> None:
    found = first_divergence(
        _run("b", ["a", "b", "c"]), _run("s", ["a", "x", "c"]), [0], _simulator(), None, 0.05
    )
    assert found is not None and (found.where, found.prompt, found.position) == ("outputs", 0, 1)
    assert (found.engine, found.reference) == ("x", "b")
    assert "output position 1" in found.describe() and "'x'" in found.describe()


def test_the_targets_parting_along_the_engine_text_comes_next() -> None:
    split = {"position": 5, "engine_token": 17, "simulator_token": 42, "gap_nats": 0.4}
    same = _run("s", ["a"])
    found = first_divergence(_run("b", ["a"]), same, [], _simulator(split), None, 0.05)
    assert found is not None and (found.where, found.position, found.engine, found.reference) == (
        "target_numerics", 5, "17", "42",
    )  # fmt: skip


def test_acceptance_apart_per_prompt_then_per_draft_position() -> None:
    counters = [{"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 1}]
    found = first_divergence(_run("b", ["a"]), _run("s", ["a"], counters), [], _simulator(), None, 0.05)
    assert found is not None and (found.where, found.prompt, found.position) == ("acceptance", 0, None)
    assert (found.engine, found.reference) == ("0.083", "0.500")
    engine = {"num_drafts": 4, "accepted_per_position": [3, 0, 0]}  # position 0 agrees (0.75), 1 does not
    found = first_divergence(_run("b", ["a"]), _run("s", ["a"]), [], _simulator(), engine, 0.05)
    assert found is not None and (found.prompt, found.position, found.engine) == (None, 1, "0.000")
    agreeing = {"num_drafts": 4, "accepted_per_position": [3, 2, 1]}
    assert first_divergence(_run("b", ["a"]), _run("s", ["a"]), [], _simulator(), agreeing, 0.05) is None
