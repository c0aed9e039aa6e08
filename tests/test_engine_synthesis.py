"""Engine-backed synthesis (`synthesis.backend: engine`): conversations regenerated through the chat API.

Recorded responses (httpx's MockTransport) cover retries, rejections, reasoning kept apart and SGLang's
response shape; one real vLLM (CPU) server on the thinking zoo target (tiny-llama-think, started with
`--reasoning-parser deepseek_r1`) covers multi-turn regeneration and the reasoning parser end to end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures_engine import require_vllm_env, vllm_settings

from draftloop.infra.engines.base import get_engine
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.synthesis.engine import (
    RequestPolicy,
    parse_chat_answer,
    regenerate_conversations,
    synthesis_engine,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
FAST = RequestPolicy(concurrency=4, max_attempts=3, timeout_s=30, backoff_s=0.0)


def chat_body(content: str | None, reasoning: str | None = None, tokens: int = 5) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens},
    }


# SGLang 0.5's /v1/chat/completions with `--reasoning-parser deepseek-r1` (recorded on a GPU machine).
SGLANG_CHAT_WITH_REASONING = {
    "id": "5f1e0c3d8f0b4a0f9d1d7b1e2c3a4b5c",
    "object": "chat.completion",
    "created": 1764500000,
    "model": "default",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "\n\nThe answer is 4.",
                "reasoning_content": "2 + 2 is 4.\n",
                "tool_calls": None,
            },
            "logprobs": None,
            "finish_reason": "stop",
            "matched_stop": 1,
        }
    ],
    "usage": {
        "prompt_tokens": 12,
        "total_tokens": 24,
        "completion_tokens": 12,
        "prompt_tokens_details": None,
    },
}


def run_with(
    handler: Callable[[dict[str, Any]], httpx.Response], rows: list[dict[str, Any]], **kw: Any
) -> Any:
    def transport_handler(request: httpx.Request) -> httpx.Response:
        return handler(json.loads(request.content))

    return asyncio.run(
        regenerate_conversations(
            "http://engine",
            "target",
            rows,
            max_tokens=16,
            temperature=0.0,
            policy=kw.pop("policy", FAST),
            transport=httpx.MockTransport(transport_handler),
            **kw,
        )
    )


# ------------------------------------------------------------------------------------------------
# Recorded responses


def test_multi_turn_regenerated_in_order_with_user_and_system_turns_kept() -> None:
    seen: list[list[dict[str, str]]] = []

    def answer(body: dict[str, Any]) -> httpx.Response:
        seen.append(body["messages"])
        users = sum(1 for m in body["messages"] if m["role"] == "user")
        return httpx.Response(200, json=chat_body(f"answer {users}"))

    row = {
        "id": "c1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "old answer 1"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "old answer 2"},
            {"role": "user", "content": "u3"},
        ],
    }
    result = run_with(answer, [row])
    assert result.rejected == []
    (conversation,) = result.conversations
    assert conversation["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": "u3"},
        {"role": "assistant", "content": "answer 3"},  # a final user turn gets its answer
    ]
    # Each request carried the turns before it, earlier answers already regenerated.
    assert seen[1] == conversation["messages"][:4]
    assert seen[2] == conversation["messages"][:6]
    assert result.generated_tokens == 15


def test_conversation_stops_at_the_answer_that_reaches_max_length() -> None:
    """Later turns of a conversation already at data.max_length are not asked for (training would cut
    them, and their history could exceed the server's context); shorter conversations go on."""
    asked: list[int] = []

    def answer(body: dict[str, Any]) -> httpx.Response:
        users = sum(1 for m in body["messages"] if m["role"] == "user")
        asked.append(users)
        prompt_tokens = 30 * users  # the history grows with every turn
        reply = chat_body(f"answer {users}", tokens=20)
        reply["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 20}
        return httpx.Response(200, json=reply)

    turns = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]
    turns += [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    turns += [{"role": "user", "content": "u3"}]
    # turn 1 reaches 50 tokens, turn 2 80, turn 3 110
    result = run_with(answer, [{"id": "c", "messages": turns}], max_length=80)
    assert result.rejected == []
    assert [m["content"] for m in result.conversations[0]["messages"]] == ["u1", "answer 1", "u2", "answer 2"]
    assert asked == [1, 2] and result.shortened == 1 and result.generated_tokens == 40
    asked.clear()
    longer = run_with(answer, [{"id": "c", "messages": turns}], max_length=111)
    assert asked == [1, 2, 3] and longer.shortened == 0
    assert longer.conversations[0]["messages"][-1] == {"role": "assistant", "content": "answer 3"}


def test_prompt_rows_are_one_user_turn() -> None:
    result = run_with(
        lambda body: httpx.Response(200, json=chat_body("hi")), [{"id": "p", "prompt": "hello"}]
    )
    assert result.conversations[0]["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
    ]


def test_transient_failures_retried_then_rejected_with_reason() -> None:
    attempts: dict[str, int] = {}

    def flaky(body: dict[str, Any]) -> httpx.Response:
        prompt = body["messages"][-1]["content"]
        attempts[prompt] = attempts.get(prompt, 0) + 1
        if prompt == "recovers" and attempts[prompt] < 3:
            return httpx.Response(503, text="overloaded")
        if prompt == "always-down":
            return httpx.Response(503, text="overloaded")
        if prompt == "too-long":
            return httpx.Response(400, text="prompt is longer than the maximum model length")
        if prompt == "silent":
            return httpx.Response(200, json=chat_body(""))
        return httpx.Response(200, json=chat_body("fine"))

    rows = [{"id": p, "prompt": p} for p in ("recovers", "always-down", "too-long", "silent", "ok")]
    result = run_with(flaky, rows)
    assert [row["id"] for row in result.conversations] == ["recovers", "ok"]
    reasons = {row["id"]: row["reason"] for row in result.rejected}
    assert reasons["always-down"] == "request failed: HTTP 503: overloaded (after 3 attempts)"
    assert reasons["too-long"].startswith("request failed: HTTP 400") and "not retried" in reasons["too-long"]
    assert reasons["silent"] == "request failed: empty answer at turn 1"
    assert attempts == {"recovers": 3, "always-down": 3, "too-long": 1, "silent": 1, "ok": 1}


def test_connection_errors_are_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=chat_body("back"))

    result = asyncio.run(
        regenerate_conversations(
            "http://engine",
            "target",
            [{"id": "a", "prompt": "x"}],
            max_tokens=4,
            temperature=0.0,
            policy=FAST,
            transport=httpx.MockTransport(handler),
        )
    )
    assert calls == 2 and result.conversations[0]["messages"][-1]["content"] == "back"


def test_reasoning_kept_apart_from_the_answer() -> None:
    # A server with a reasoning parser (vLLM / SGLang): reasoning_content.
    parsed = parse_chat_answer(chat_body("The answer.", reasoning="Let me think."))
    assert (parsed.content, parsed.reasoning) == ("The answer.", "Let me think.")
    # vLLM's newer field name.
    body = chat_body("A.")
    body["choices"][0]["message"]["reasoning"] = "R."
    assert parse_chat_answer(body).reasoning == "R."
    # No parser: a <think> block in the content is split off.
    raw = parse_chat_answer(chat_body("<think>hmm</think>\nThe answer."))
    assert (raw.content, raw.reasoning) == ("The answer.", "hmm")
    # Every turn keeps its own; the row joins them.
    result = run_with(
        lambda b: httpx.Response(200, json=chat_body("c", reasoning=f"r{len(b['messages'])}")),
        [{"id": "t", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                                  {"role": "user", "content": "b"}]}],
    )  # fmt: skip
    messages = result.conversations[0]["messages"]
    assert [m.get("reasoning") for m in messages] == [None, "r1", None, "r3"]
    assert result.conversations[0]["reasoning"] == "r1\n\nr3"


def test_sglang_recorded_chat_response() -> None:
    result = run_with(
        lambda body: httpx.Response(200, json=SGLANG_CHAT_WITH_REASONING), [{"id": "s", "prompt": "2+2?"}]
    )
    (row,) = result.conversations
    assert row["messages"][-1] == {
        "role": "assistant",
        "content": "The answer is 4.",
        "reasoning": "2 + 2 is 4.",
    }
    assert result.generated_tokens == 12


def test_extra_body_and_reasoning_parser_reach_request_and_server(tmp_path: Any) -> None:
    bodies: list[dict[str, Any]] = []

    def record(body: dict[str, Any]) -> httpx.Response:
        bodies.append(body)
        return httpx.Response(200, json=chat_body("x"))

    run_with(record, [{"id": "a", "prompt": "p"}], extra_body={"thinking_token_budget": 8})
    assert bodies[0]["thinking_token_budget"] == 8 and bodies[0]["max_tokens"] == 16
    for kind in ("vllm", "sglang"):
        config = ExperimentConfig.load(
            REPO_ROOT / "configs" / "tiny-llama.yaml",
            {"engine.kind": kind, "synthesis.reasoning_parser": "deepseek_r1"},
            check_environment=False,
        )
        # Every server of the engine starts with them (EngineServer.start; tests/test_engine_unit.py).
        assert synthesis_engine(config).reasoning_args() == ["--reasoning-parser", "deepseek_r1"]


# ------------------------------------------------------------------------------------------------
# The real vLLM (CPU) server on the thinking target


@pytest.fixture(scope="module")
def thinking_server(zoo_target_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    require_vllm_env()
    target = zoo_target_dir("tiny-llama-think")
    engine = get_engine("vllm", vllm_settings(extra_args=("--reasoning-parser", "deepseek_r1")))
    with EngineServer(
        engine, target, tmp_path_factory.mktemp("synthesis-server"), name="synthesis"
    ) as server:
        yield server


def ask(server: EngineServer, messages: list[dict[str, str]], extra: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "target", "messages": messages, "max_tokens": 24, "temperature": 0.0, **extra}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


@pytest.mark.slow
def test_multi_turn_regeneration_on_vllm_with_reasoning_parser(thinking_server: EngineServer) -> None:
    budget = {"thinking_token_budget": 6}
    rows = [
        {
            "id": "two-turns",
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Write a function that adds two numbers."},
                {"role": "assistant", "content": "PLACEHOLDER ONE"},
                {"role": "user", "content": "Now make it subtract."},
                {"role": "assistant", "content": "PLACEHOLDER TWO"},
            ],
        },
        {"id": "prompt", "prompt": "Sort a list of numbers in Python."},
    ]
    result = asyncio.run(
        regenerate_conversations(
            thinking_server.base_url,
            "target",
            rows,
            max_tokens=24,
            temperature=0.0,
            policy=RequestPolicy(concurrency=2, max_attempts=2),
            extra_body=budget,
        )
    )
    assert result.rejected == [], result.rejected
    by_id = {row["id"]: row for row in result.conversations}
    messages = by_id["two-turns"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert (
        messages[0]["content"] == "You answer briefly." and messages[3]["content"] == "Now make it subtract."
    )
    assert "PLACEHOLDER" not in messages[2]["content"] + messages[4]["content"]
    # Turn by turn: each answer is the target's own greedy answer to the conversation before it, the
    # earlier answers being the regenerated ones.
    history = [{"role": m["role"], "content": m["content"]} for m in messages]
    for turn in (2, 4):
        direct = parse_chat_answer(ask(thinking_server, history[:turn], budget))
        assert (direct.content, direct.reasoning) == (messages[turn]["content"], messages[turn]["reasoning"])
    # The reasoning parser's reasoning is apart from the content: never a think tag in the answer.
    for row in result.conversations:
        for message in row["messages"]:
            if message["role"] == "assistant":
                assert message.get("reasoning") and "think>" not in message["content"]
    assert result.generated_tokens > 0


def test_engine_path_refuses_over_long_prompts_before_any_request(tmp_path: Path) -> None:
    from draftloop.infra.targets.zoo import create_tiny_model
    from draftloop.tasks import synthesize

    target = tmp_path / "tiny-llama"
    create_tiny_model("tiny-llama", target, seed=0)
    config = ExperimentConfig.load(
        REPO_ROOT / "configs" / "tiny-llama.yaml",
        {"target.path": str(target), "data.max_length": 24, "synthesis.backend": "engine"},
        check_environment=False,
    )
    short = {"id": "short", "prompt": "Hi."}
    long = {"id": "long", "prompt": " ".join(["word"] * 60)}
    kept, refused = synthesize._refuse_overlong_prompts(config, str(target), [short, long])
    assert kept == [short]
    assert [row["id"] for row in refused] == ["long"]
    assert "tokens, data.max_length is 24" in refused[0]["reason"]
    # nothing left to send: no server is started, the refusal is the result
    result = synthesize._generate_with_engine(config, str(target), [long], pids=None)
    assert result.conversations == [] and [row["id"] for row in result.rejected] == ["long"]
