"""HTTP benchmark client: one running server measured at each concurrency level.

Prompts are sent as token ids (the chat template applied by the caller, as the simulator does) to
/v1/completions, streamed, greedy, with the top-2 logprobs of every token (to tell a numerical tie from a
real difference) and, where the engine returns them, the output token ids (so the simulator can replay the
engine's own text; see simulator.py). The engine's speculative counters are differenced around each level.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import httpx

from draftloop.infra.engines.base import Engine
from draftloop.infra.evaluation.plan import BenchmarkPlan
from draftloop.infra.runtime.stage_log import STAGE_LOG
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
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks with text

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, linearly interpolated; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(per_repeat: Sequence[float | None], pooled: Sequence[float] = ()) -> dict[str, float | None]:
    """median / min / max over the repeats' values; p50 / p90 / p99 over the pooled per-request values."""
    values = [v for v in per_repeat if v is not None]
    figure: dict[str, float | None] = {
        "median": statistics.median(values) if values else None,
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }
    if pooled:
        figure.update(p50=percentile(pooled, 50), p90=percentile(pooled, 90), p99=percentile(pooled, 99))
    return figure


@dataclass
class RepeatResult:
    """One measured pass of a level: requests issued until its minimum tokens and seconds were reached."""

    num_requests: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    errors: int
    ttft_p50_s: float | None
    tpot_p50_s: float | None
    itl_p50_s: float | None


@dataclass
class ConcurrencyResult:
    """One concurrency level over its repeats. `output_tokens_per_s` is the median over the repeats;
    `throughput`, `ttft_s`, `tpot_s`, `itl_s` are spread() figures (repeat median/min/max; latencies
    also p50/p90/p99 over every request of every repeat)."""

    concurrency: int
    num_requests: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    errors: int
    repeats: list[RepeatResult]
    throughput: dict[str, float | None]
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    itl_s: dict[str, float | None]
    counters: dict[str, Any] | None = None  # SpecCounters.to_json() of this level (speculative only)
    # Completed requests per prompt index over the level's repeats: the prompt mix its counters cover
    # (repeats cycle the prompts, so some prompts weigh more than others in the level's counters).
    prompt_requests: list[int] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConcurrencyResult:
        values = dict(data)
        values["repeats"] = [RepeatResult(**repeat) for repeat in data.get("repeats") or []]
        return cls(**values)


@dataclass
class OpenLoopResult:
    """Poisson arrivals at `request_rate` requests/s; goodput counts the requests within the TPOT target."""

    request_rate: float
    num_requests: int
    duration_s: float
    output_tokens_per_s: float
    tpot_target_s: float | None
    goodput_requests_per_s: float | None
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    errors: int


@dataclass
class ServerRun:
    """One server's measurements. The per-prompt records and the counters the consistency check compares
    come from its prompt pass: each prompt once at its lowest concurrency (`reference_concurrency`)."""

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
    open_loop: list[OpenLoopResult] = field(default_factory=list)
    warmup_requests: int = 0  # discarded before the first measured level
    # SpecCounters.to_json() of the prompt pass (each prompt once, at `reference_concurrency`); None for a
    # baseline, or a report written before the prompt pass existed.
    prompt_pass_counters: dict[str, Any] | None = None
    # The server measured alternately with this one (both up, repeat by repeat), or None: measured alone.
    interleaved_with: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ServerRun:
        """A ServerRun from its EvalReport JSON (to reuse a measured baseline)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["levels"] = [ConcurrencyResult.from_json(level) for level in data.get("levels") or []]
        values["open_loop"] = [OpenLoopResult(**rate) for rate in data.get("open_loop") or []]
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


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    index: int,
    engine: Engine,
    num_speculative_tokens: int | None,
) -> RequestResult:
    started = time.perf_counter()
    first: float | None = None
    last_chunk: float | None = None
    gaps: list[float] = []
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
                        now = time.perf_counter() - started
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - (last_chunk or now))
                        last_chunk = now
                        pieces.append(text)
                        chunks_with_text += 1
                    token_logprobs.extend(_choice_logprobs(choice))
                    token_ids.extend(int(t) for t in choice.get("token_ids") or ())
                usage = chunk.get("usage")
                if isinstance(usage, Mapping) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                if num_speculative_tokens is not None:  # a speculative server: its own k, not the config's
                    found = engine.counters_from_response(chunk, num_speculative_tokens)
                    if found is not None:
                        counters = found
    except httpx.HTTPError as exc:
        return RequestResult(index, "".join(pieces), 0, first, time.perf_counter() - started, repr(exc))
    tokens = usage_tokens if usage_tokens is not None else chunks_with_text
    latency = time.perf_counter() - started
    return RequestResult(
        index, "".join(pieces), tokens, first, latency, None, counters, token_logprobs, token_ids, gaps
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


class _Client:
    """Request bodies and one HTTP client for a server (greedy, streamed, top-2 logprobs);
    `num_speculative_tokens`: the server's k (None: a baseline server)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        engine: Engine,
        max_tokens: int,
        timeout_s: float,
        width: int,
        *,
        num_speculative_tokens: int | None,
    ):
        self.url = base_url + "/v1/completions"
        self.model = model
        self.engine = engine
        self.max_tokens = max_tokens
        self.num_speculative_tokens = num_speculative_tokens
        limits = httpx.Limits(max_connections=width + 2, max_keepalive_connections=width + 2)
        self.http = httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=engine.request_headers())

    async def send(self, index: int, ids: Sequence[int]) -> RequestResult:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(ids),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 2,  # top-2 per token: tells a numerical tie from a real loss
            **self.engine.request_extras(),
        }
        return await _one_request(self.http, self.url, body, index, self.engine, self.num_speculative_tokens)


async def _closed_loop(
    client: _Client,
    prompt_ids: Sequence[Sequence[int]],
    concurrency: int,
    *,
    min_requests: int,
    min_output_tokens: int,
    min_seconds: float,
) -> tuple[list[RequestResult], float]:
    """`concurrency` workers each send one request after another (prompts cycled in order) until the
    repeat has sent `min_requests`, received `min_output_tokens` and lasted `min_seconds`."""
    results: list[RequestResult] = []
    issued = 0
    received = 0
    started = time.perf_counter()

    def done() -> bool:
        return (
            issued >= min_requests
            and received >= min_output_tokens
            and time.perf_counter() - started >= min_seconds
        )

    async def worker() -> None:
        nonlocal issued, received
        while not done():
            index = issued
            issued += 1
            result = await client.send(index, prompt_ids[index % len(prompt_ids)])
            results.append(result)
            received += result.output_tokens
            if result.error is not None and result.output_tokens == 0 and issued >= min_requests:
                return  # a failing server: do not spin until min_seconds

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - started


async def _open_loop(
    client: _Client, prompt_ids: Sequence[Sequence[int]], rate: float, count: int, seed: int
) -> tuple[list[RequestResult], float]:
    """`count` requests with exponential inter-arrival gaps of mean 1 / `rate` (a Poisson process)."""
    arrivals = random.Random(seed)
    started = time.perf_counter()
    tasks = []
    for index in range(count):
        tasks.append(asyncio.create_task(client.send(index, prompt_ids[index % len(prompt_ids)])))
        await asyncio.sleep(arrivals.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - started


def _repeat_figures(results: Sequence[RequestResult], duration: float) -> RepeatResult:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    return RepeatResult(
        num_requests=len(results),
        output_tokens=tokens,
        duration_s=duration,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        errors=len(results) - len(ok),
        ttft_p50_s=percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50),
        tpot_p50_s=percentile([t for r in ok if (t := r.tpot_s) is not None], 50),
        itl_p50_s=percentile([gap for r in ok for gap in r.itl_s], 50),
    )


def _level_result(
    concurrency: int,
    repeats: Sequence[tuple[list[RequestResult], float]],
    counters: SpecCounters | None,
    num_prompts: int,
) -> ConcurrencyResult:
    figures = [_repeat_figures(results, duration) for results, duration in repeats]
    ok = [r for results, _ in repeats for r in results if r.error is None]
    prompt_requests = [0] * num_prompts
    for request in ok:
        prompt_requests[request.index % num_prompts] += 1
    throughput = spread([f.output_tokens_per_s for f in figures])
    return ConcurrencyResult(
        concurrency=concurrency,
        num_requests=sum(f.num_requests for f in figures),
        output_tokens=sum(f.output_tokens for f in figures),
        duration_s=sum(f.duration_s for f in figures),
        output_tokens_per_s=float(throughput["median"] or 0.0),
        errors=sum(f.errors for f in figures),
        repeats=figures,
        throughput=throughput,
        ttft_s=spread([f.ttft_p50_s for f in figures], [r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=spread([f.tpot_p50_s for f in figures], [t for r in ok if (t := r.tpot_s) is not None]),
        itl_s=spread([f.itl_p50_s for f in figures], [gap for r in ok for gap in r.itl_s]),
        counters=counters.to_json() if counters is not None and counters.num_drafts > 0 else None,
        prompt_requests=prompt_requests,
    )


def _counters_between(
    engine: Engine, before: SpecCounters | None, server: ServerHandle, results: Sequence[RequestResult]
) -> SpecCounters | None:
    after = engine.parse_metrics(server.metrics_text())
    if after is not None:
        return after - (before or SpecCounters())
    per_request = [r.response_counters for r in results if r.response_counters is not None]
    return sum(per_request[1:], per_request[0]) if per_request else None


@dataclass(frozen=True)
class ServerToMeasure:
    """A running server and how it was started: `num_speculative_tokens` None for a baseline."""

    server: ServerHandle
    name: str
    num_speculative_tokens: int | None
    smoke_content: str | None = None


@dataclass
class _Measuring:
    """One server while it is measured: its client and what it has measured so far."""

    target: ServerToMeasure
    client: _Client
    engine: Engine
    warmup: int = 0
    records: dict[int, RequestResult] = field(default_factory=dict)
    pass_counters: SpecCounters | None = None
    levels: list[ConcurrencyResult] = field(default_factory=list)
    open_loop: list[OpenLoopResult] = field(default_factory=list)

    def counters(self) -> SpecCounters | None:
        return self.engine.parse_metrics(self.target.server.metrics_text())

    async def warm_up(self, prompt_ids: Sequence[Sequence[int]], levels: Sequence[int], rounds: int) -> None:
        for _ in range(rounds):
            for level in levels:
                discarded, _ = await _closed_loop(
                    self.client, prompt_ids, level, min_requests=level, min_output_tokens=0, min_seconds=0.0
                )
                self.warmup += len(discarded)

    async def prompt_pass(self, prompt_ids: Sequence[Sequence[int]], reference: int) -> None:
        """At the reference concurrency, each prompt exactly once. Its outputs are the per-prompt records
        (the lossless comparison, the simulator's replay) and its counters the engine's acceptance: a
        prompt mix no timing can change."""
        before = self.counters()
        results, _ = await _closed_loop(
            self.client, prompt_ids, reference, min_requests=len(prompt_ids), min_output_tokens=0,
            min_seconds=0.0,
        )  # fmt: skip
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RuntimeError(
                f"server {self.target.name!r}: {len(failed)} requests failed, first: {failed[0].error}"
            )
        self.records = {r.index: r for r in results}
        self.pass_counters = _counters_between(self.engine, before, self.target.server, results)

    def server_run(self, num_prompts: int, reference: int, interleaved_with: str | None) -> ServerRun:
        records = [self.records[i] for i in range(num_prompts)]
        counters = self.pass_counters
        return ServerRun(
            name=self.target.name,
            startup_s=self.target.server.startup_s,
            log_path=str(self.target.server.log_path),
            smoke_content=self.target.smoke_content,
            levels=self.levels,
            outputs=[r.text for r in records],
            output_logprobs=[r.token_logprobs for r in records],
            output_token_ids=[r.token_ids for r in records],
            output_counters=[
                r.response_counters.to_json() if r.response_counters is not None else None for r in records
            ],
            reference_concurrency=reference,
            open_loop=self.open_loop,
            warmup_requests=self.warmup,
            prompt_pass_counters=(
                counters.to_json() if counters is not None and counters.num_drafts > 0 else None
            ),
            interleaved_with=interleaved_with,
        )


def server_label(target: ServerToMeasure) -> str:
    """`baseline`, `spec-k3 (k=3)`: a server as the progress lines name it."""
    k = target.num_speculative_tokens
    return target.name if k is None or f"k{k}" in target.name else f"{target.name} (k={k})"


def log_server_up(target: ServerToMeasure, levels: Sequence[int], repeats: int) -> None:
    startup = target.server.startup_s
    took = f" in {startup:.0f} s" if startup is not None else ""
    STAGE_LOG.info(
        "evaluate: server %s up%s; measuring at concurrency %s, %d repeat(s) each",
        server_label(target), took, ", ".join(str(level) for level in levels), max(1, repeats),
    )  # fmt: skip


def log_level(level: int, measuring: Sequence[_Measuring]) -> None:
    """One line per concurrency level: each server's output tokens/s there."""
    figures = ", ".join(
        f"{server_label(one.target)} {one.levels[-1].output_tokens_per_s:.1f} tok/s" for one in measuring
    )
    requests = sum(one.levels[-1].num_requests for one in measuring)
    STAGE_LOG.info("evaluate: concurrency %d measured: %s (%d requests)", level, figures, requests)


def benchmark_servers(
    servers: Sequence[ServerToMeasure],
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    concurrency: Sequence[int],
    plan: BenchmarkPlan,
    *,
    served_model_name: str = "target",
) -> list[ServerRun]:
    """Warm every server up and run its prompt pass, then measure them at each concurrency and each
    open-loop rate. Two servers (baseline and speculative, both up) take turns repeat by repeat, in
    ABBA order, so load that changes during the measurement falls on both alike and each adjacent pair
    of repeats gives one speedup (verdict.level_speedups). Counters are differenced around each level,
    per server (each receives only its own requests)."""
    levels = [int(level) for level in concurrency]
    reference = min(levels)
    width = max([*levels, plan.open_loop_requests if plan.request_rates else 1])
    names = [target.name for target in servers]
    partner = {names[0]: names[1], names[1]: names[0]} if len(servers) == 2 else {}

    async def measure() -> None:
        measuring = [
            _Measuring(
                target,
                _Client(
                    target.server.base_url,
                    served_model_name,
                    engine,
                    plan.max_tokens,
                    plan.timeout_s,
                    width,
                    num_speculative_tokens=target.num_speculative_tokens,
                ),
                engine,
            )
            for target in servers
        ]
        try:
            for target in servers:
                log_server_up(target, levels, plan.repeats)
            for one in measuring:
                await one.warm_up(prompt_ids, levels, plan.warmup_rounds)
            for one in measuring:
                await one.prompt_pass(prompt_ids, reference)
            for level in levels:
                before = [one.counters() for one in measuring]
                repeats: list[list[tuple[list[RequestResult], float]]] = [[] for _ in measuring]
                for repeat in range(max(1, plan.repeats)):
                    order = range(len(measuring)) if repeat % 2 == 0 else reversed(range(len(measuring)))
                    for index in order:
                        repeats[index].append(
                            await _closed_loop(
                                measuring[index].client,
                                prompt_ids,
                                level,
                                min_requests=level,
                                min_output_tokens=plan.min_output_tokens,
                                min_seconds=plan.min_seconds,
                            )
                        )
                for one, start_counters, measured in zip(measuring, before, repeats, strict=True):
                    every = [r for results, _ in measured for r in results]
                    counters = _counters_between(engine, start_counters, one.target.server, every)
                    one.levels.append(_level_result(level, measured, counters, len(prompt_ids)))
                log_level(level, measuring)
            for rate in plan.request_rates:
                for one in measuring:
                    one.open_loop.append(await _measure_rate(one.client, prompt_ids, float(rate), plan))
            runs.extend(
                one.server_run(len(prompt_ids), reference, partner.get(one.target.name)) for one in measuring
            )
        finally:
            for one in measuring:
                await one.client.http.aclose()

    runs: list[ServerRun] = []
    asyncio.run(measure())
    return runs


def benchmark_server(
    server: ServerHandle,
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    concurrency: Sequence[int],
    plan: BenchmarkPlan,
    *,
    name: str,
    num_speculative_tokens: int | None,
    served_model_name: str = "target",
    smoke_content: str | None = None,
) -> ServerRun:
    """One server alone (benchmark_servers): `num_speculative_tokens` the k it was started at (None: a
    baseline), for engines whose responses carry the counters."""
    (run,) = benchmark_servers(
        [ServerToMeasure(server, name, num_speculative_tokens, smoke_content)],
        engine, prompt_ids, concurrency, plan, served_model_name=served_model_name,
    )  # fmt: skip
    return run


async def _measure_rate(
    client: _Client, prompt_ids: Sequence[Sequence[int]], rate: float, plan: BenchmarkPlan
) -> OpenLoopResult:
    results, duration = await _open_loop(client, prompt_ids, rate, plan.open_loop_requests, plan.seed)
    ok = [r for r in results if r.error is None]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    good = (
        [r for r in ok if r.tpot_s is not None and r.tpot_s <= plan.tpot_target_s]
        if plan.tpot_target_s is not None
        else None
    )
    return OpenLoopResult(
        request_rate=rate,
        num_requests=len(results),
        duration_s=duration,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration if duration > 0 else 0.0,
        tpot_target_s=plan.tpot_target_s,
        goodput_requests_per_s=len(good) / duration if good is not None and duration > 0 else None,
        ttft_s=spread([], [r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=spread([], tpots),
        errors=len(results) - len(ok),
    )
