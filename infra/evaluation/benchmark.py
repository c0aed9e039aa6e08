"""HTTP benchmark client: one running server measured at each concurrency level.

Prompts are sent as token ids (the chat template applied by the caller, as the simulator does) to
/v1/completions, streamed, greedy, with the top-2 logprobs of every token (to tell a numerical tie from a
real difference) and, where the engine returns them, the output token ids (so the simulator can replay the
engine's own text; see simulator.py). The engine's speculative counters are differenced around each level.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import httpx

from draftloop.infra.engines.base import Engine
from draftloop.kernels.counters import SpecCounters

# Per generated token: (token text, its top-2 logprobs {text: logprob}).
TokenLogprobs = list[tuple[str, dict[str, float]]]


@dataclass
class RequestResult:
    index: int
    text: str
    output_tokens: int
    ttft_s: float | None
    latency_s: float
    error: str | None = None
    response_counters: SpecCounters | None = None
    token_logprobs: TokenLogprobs = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # empty when the engine does not return them

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ConcurrencyResult:
    concurrency: int
    num_requests: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    tpot_mean_s: float | None
    tpot_p50_s: float | None
    errors: int
    counters: dict[str, Any] | None = None  # SpecCounters.to_json() of this level (speculative only)


@dataclass
class ServerRun:
    """One server's measurements. The per-prompt records come from its lowest concurrency level
    (`reference_concurrency`), the level whose counters the consistency check compares."""

    name: str
    startup_s: float | None
    log_path: str | None
    smoke_content: str | None
    levels: list[ConcurrencyResult]
    outputs: list[str]  # greedy output text per prompt
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)  # per prompt; empty lists if unknown
    # Per prompt: SpecCounters.to_json() of its request, for engines that report counters per response.
    output_counters: list[dict[str, Any] | None] = field(default_factory=list)
    reference_concurrency: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerRun:
        """A ServerRun from its EvalReport JSON (to reuse a measured baseline)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["levels"] = [ConcurrencyResult(**level) for level in data.get("levels") or []]
        values["output_logprobs"] = [
            [(str(token), dict(top)) for token, top in prompt] for prompt in data.get("output_logprobs") or []
        ]
        return cls(**values)

    def prompt_counters(self) -> list[SpecCounters] | None:
        """Per-prompt counters of the reference level, when the engine reported them for every prompt."""
        if not self.output_counters or any(c is None for c in self.output_counters):
            return None
        return [
            SpecCounters(
                num_drafts=float(c["num_drafts"]),
                num_draft_tokens=float(c["num_draft_tokens"]),
                num_accepted_tokens=float(c["num_accepted_tokens"]),
                accepted_per_position=tuple(float(v) for v in c.get("accepted_per_position") or ()),
            )
            for c in self.output_counters
            if c is not None
        ]


class ServerHandle(Protocol):
    """What evaluation needs of a running server (EngineServer, or a proxy to a Ray actor)."""

    @property
    def base_url(self) -> str: ...

    @property
    def startup_s(self) -> float | None: ...

    @property
    def log_path(self) -> Path: ...

    def metrics_text(self) -> str: ...


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    index: int,
    engine: Engine,
) -> RequestResult:
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage_tokens: int | None = None
    chunks_with_text = 0
    counters: SpecCounters | None = None
    token_logprobs: TokenLogprobs = []
    token_ids: list[int] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(
                    index, "", 0, None, time.perf_counter() - started, f"{response.status_code}: {text[:300]}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") or ""
                    if text:
                        if first is None:
                            first = time.perf_counter() - started
                        pieces.append(text)
                        chunks_with_text += 1
                    token_logprobs.extend(_choice_logprobs(choice))
                    token_ids.extend(int(t) for t in choice.get("token_ids") or ())
                usage = chunk.get("usage")
                if isinstance(usage, Mapping) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                found = engine.counters_from_response(chunk)
                if found is not None:
                    counters = found
    except httpx.HTTPError as exc:
        return RequestResult(index, "".join(pieces), 0, first, time.perf_counter() - started, repr(exc))
    tokens = usage_tokens if usage_tokens is not None else chunks_with_text
    latency = time.perf_counter() - started
    return RequestResult(
        index, "".join(pieces), tokens, first, latency, None, counters, token_logprobs, token_ids
    )


def _choice_logprobs(choice: Mapping[str, Any]) -> TokenLogprobs:
    """(token, top logprobs) pairs of an OpenAI completions chunk's `logprobs`, if present."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, Mapping):
        return []
    tokens = logprobs.get("tokens") or []
    tops = logprobs.get("top_logprobs") or [{} for _ in tokens]
    return [
        (str(t), {str(k): float(v) for k, v in (top or {}).items()})
        for t, top in zip(tokens, tops, strict=False)
    ]


async def _run_level(
    base_url: str,
    model: str,
    prompt_ids: Sequence[Sequence[int]],
    concurrency: int,
    max_tokens: int,
    engine: Engine,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(concurrency)
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def bounded(index: int, ids: Sequence[int]) -> RequestResult:
            body: dict[str, Any] = {
                "model": model,
                "prompt": list(ids),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": 2,  # top-2 per token: tells a numerical tie from a real loss
                **engine.request_extras(),
            }
            async with semaphore:
                return await _one_request(client, url, body, index, engine)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(i, ids) for i, ids in enumerate(prompt_ids)))
        duration = time.perf_counter() - started
    return list(results), duration


def benchmark_server(
    server: ServerHandle,
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    concurrency: Sequence[int],
    max_tokens: int,
    *,
    name: str,
    served_model_name: str = "target",
    smoke_content: str | None = None,
    requests_per_level: int | None = None,
    timeout_s: float = 600.0,
) -> ServerRun:
    """Measure one running server at each concurrency; counters differenced around each level."""
    levels: list[ConcurrencyResult] = []
    reference = min(int(level) for level in concurrency)
    by_index: dict[int, RequestResult] = {}
    for level in concurrency:
        # At least `level` requests so that the level is really reached; prompts are cycled.
        count = max(len(prompt_ids), int(level), int(requests_per_level or 0))
        batch = [prompt_ids[i % len(prompt_ids)] for i in range(count)]
        before = engine.parse_metrics(server.metrics_text())
        results, duration = asyncio.run(
            _run_level(server.base_url, served_model_name, batch, int(level), max_tokens, engine, timeout_s)
        )
        after = engine.parse_metrics(server.metrics_text())
        counters: SpecCounters | None = None
        if after is not None:
            counters = after - (before or SpecCounters())
        else:
            per_request = [r.response_counters for r in results if r.response_counters is not None]
            if per_request:
                counters = sum(per_request[1:], per_request[0])
        ok = [r for r in results if r.error is None]
        tokens = sum(r.output_tokens for r in ok)
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
        levels.append(
            ConcurrencyResult(
                concurrency=int(level),
                num_requests=len(results),
                output_tokens=tokens,
                duration_s=duration,
                output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
                ttft_mean_s=_mean(ttfts),
                ttft_p50_s=_median(ttfts),
                tpot_mean_s=_mean(tpots),
                tpot_p50_s=_median(tpots),
                errors=len(results) - len(ok),
                counters=counters.to_json() if counters is not None and counters.num_drafts > 0 else None,
            )
        )
        if int(level) == reference and not by_index:
            failed = [r for r in results if r.error is not None]
            if failed:
                raise RuntimeError(
                    f"server {name!r}: {len(failed)} requests failed, first: {failed[0].error}"
                )
            by_index = {r.index: r for r in results if r.index < len(prompt_ids)}
    records = [by_index[i] for i in range(len(prompt_ids))]
    return ServerRun(
        name=name,
        startup_s=server.startup_s,
        log_path=str(server.log_path),
        smoke_content=smoke_content,
        levels=levels,
        outputs=[r.text for r in records],
        output_logprobs=[r.token_logprobs for r in records],
        output_token_ids=[r.token_ids for r in records],
        output_counters=[
            r.response_counters.to_json() if r.response_counters is not None else None for r in records
        ],
        reference_concurrency=reference,
    )
