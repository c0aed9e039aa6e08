"""SGLang's per-request counters on the k-sweep servers, from recorded responses (no SGLang installs here).

SGLang reports acceptance per request in `meta_info`; reading it needs the k the server was started at.
The k sweep serves one drafter at several k while the config's k stays 3: a server at k = 5 proposes 5
tokens per verify step, and its acceptance histogram has 6 buckets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures_engine import (
    SGLANG_K1_GENERATE_RESPONSE,
    SGLANG_K5_COMPLETION_CHUNK,
    SGLANG_K5_GENERATE_RESPONSE,
    SGLANG_METRICS,
    engine_settings,
    evaluation_plan,
)

from draftloop.infra.engines.base import get_engine
from draftloop.infra.evaluation.benchmark import benchmark_server
from draftloop.kernels.counters import SpecCounters

CONFIG_K = 3  # the engine section's k in these tests; the sweep servers below run at other k


@pytest.fixture
def sglang() -> Any:
    return get_engine("sglang", engine_settings(kind="sglang"))


def test_older_sglang_counts_the_draft_tokens_of_the_servers_own_k(sglang: Any) -> None:
    counters = sglang.counters_from_response(SGLANG_K5_GENERATE_RESPONSE, 5)
    # 16 verify steps x 5 proposed; 48 tokens = 32 accepted drafts + 16 tokens of the target's own.
    assert counters == SpecCounters(16, 80, 32, ())
    assert counters.acceptance_rate == pytest.approx(0.4)
    assert counters.mean_acceptance_length == pytest.approx(3.0)
    # Read at the config's k, the same response claimed 48 draft tokens: a rate of 0.67, not 0.4.
    assert sglang.counters_from_response(SGLANG_K5_GENERATE_RESPONSE, CONFIG_K).num_draft_tokens == 48


def test_newer_sglang_per_position_acceptance_spans_the_servers_own_k(sglang: Any) -> None:
    counters = sglang.counters_from_response(SGLANG_K5_COMPLETION_CHUNK, 5)
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (10, 50, 23)
    # histogram [2, 1, 3, 1, 2, 1] (steps accepting 0..5 drafts): position i accepted by steps with j > i.
    assert counters.accepted_per_position == (8, 7, 4, 3, 1)
    assert sum(counters.accepted_per_position) == counters.num_accepted_tokens
    meta = SGLANG_K5_COMPLETION_CHUNK["choices"][0]["meta_info"]
    assert counters.acceptance_rate == pytest.approx(meta["spec_accept_rate"])
    assert counters.mean_acceptance_length == pytest.approx(meta["spec_accept_length"])
    # At the config's k the last two positions were cut off.
    assert len(sglang.counters_from_response(SGLANG_K5_COMPLETION_CHUNK, CONFIG_K).accepted_per_position) == 3


def test_a_server_below_the_configs_k(sglang: Any) -> None:
    counters = sglang.counters_from_response(SGLANG_K1_GENERATE_RESPONSE, 1)
    assert counters == SpecCounters(20, 20, 12, (12,))
    assert counters.per_position_acceptance == pytest.approx([0.6])
    # At the config's k: three times the draft tokens, and two positions that were never proposed.
    wrong = sglang.counters_from_response(SGLANG_K1_GENERATE_RESPONSE, CONFIG_K)
    assert (wrong.num_draft_tokens, wrong.accepted_per_position) == (60, (12, 0, 0))


class _RecordedServer:
    """A ServerHandle whose HTTP answers are recorded SGLang responses (see _replay)."""

    base_url = "http://sglang.test:30000"
    startup_s = 1.0
    log_path = Path("server-speculative-k5.log")

    def metrics_text(self) -> str:
        return SGLANG_METRICS  # gauges only: the benchmark must fall back to the per-request counters


def _replay(chunks: list[Mapping[str, Any]], seen: list[dict[str, Any]]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_the_benchmark_reads_a_sweep_server_at_its_own_k(
    sglang: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path of a k-sweep server in the evaluation: benchmark_server is told the k it was started at."""
    text_chunk = {"choices": [{"index": 0, "text": " the quick", "logprobs": None, "finish_reason": None}]}
    seen: list[dict[str, Any]] = []
    transport = _replay([text_chunk, SGLANG_K5_COMPLETION_CHUNK], seen)
    real_client = httpx.AsyncClient

    def replaying_client(**kwargs: Any) -> httpx.AsyncClient:
        return real_client(transport=transport, **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", replaying_client)
    plan = evaluation_plan(k=CONFIG_K, max_tokens=33, concurrency=[1], repeats=1, warmup_rounds=0)
    run = benchmark_server(
        _RecordedServer(), sglang, [[1, 2, 3]], plan.concurrency, plan.benchmark,
        name="speculative-k5", num_speculative_tokens=5,
    )  # fmt: skip
    assert seen and all(body["return_meta_info"] is True for body in seen)
    expected = SpecCounters(10, 50, 23, (8, 7, 4, 3, 1))
    assert run.output_counters == [expected.to_json()]
    level = run.levels[0]
    assert level.counters == expected.to_json() and level.output_tokens == 33
    assert level.counters["acceptance_rate"] == pytest.approx(0.46)
    assert level.counters["per_position_acceptance"] == pytest.approx([0.8, 0.7, 0.4, 0.3, 0.1])
