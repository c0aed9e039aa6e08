"""Deploy-and-measure: baseline server vs speculative server, engine counters vs the simulator.

`evaluate(...)` starts the baseline server (no drafter) and measures it at each concurrency, then the
speculative server (drafter, k) the same way, and compares:

- throughput (client-side output tokens/s), TTFT and TPOT per concurrency; speedup = spec / baseline;
- the engine's speculative counters, differenced around each concurrency level (eagle3.md definitions:
  acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts,
  per-position = accepted_per_pos[i] / drafts);
- lossless: greedy outputs of both servers identical, prompt by prompt;
- the simulator's acceptance on the same prompts (kernels/simulate.py): |engine - simulator| acceptance
  rate beyond `acceptance_tolerance` means the engine is not running the drafter the way it was trained
  (wrong layer ids, wrong format, wrong attention...): verdict `integration_fault`, never `weak_drafter`.

Prompts are sent as token ids (the chat template applied here, as the simulator does) to /v1/completions,
streamed, so both servers and the simulator see exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from draftloop.infra.engines.base import Engine, EngineConfigError, read_json, stored_layer_ids
from draftloop.infra.engines.pairing import check_drafter_pairing
from draftloop.kernels.counters import SpecCounters

VERDICT_OK = "ok"
VERDICT_WEAK = "weak_drafter"
VERDICT_FAULT = "integration_fault"


# ------------------------------------------------------------------------------------------------
# Benchmark client


@dataclass
class RequestResult:
    index: int
    text: str
    output_tokens: int
    ttft_s: float | None
    latency_s: float
    error: str | None = None
    response_counters: SpecCounters | None = None
    # Per generated token: (token text, its top-2 logprobs {text: logprob}) when the server returned them.
    token_logprobs: list[tuple[str, dict[str, float]]] = field(default_factory=list)

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
    name: str
    startup_s: float | None
    log_path: str | None
    smoke_content: str | None
    levels: list[ConcurrencyResult]
    outputs: list[str]  # greedy output per prompt (from the first level)
    # Per prompt, per token: (token text, top-2 logprobs), from the first level (numeric-tie check).
    output_logprobs: list[list[tuple[str, dict[str, float]]]] = field(default_factory=list)


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
    token_logprobs: list[tuple[str, dict[str, float]]] = []
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
    return RequestResult(index, "".join(pieces), tokens, first, latency, None, counters, token_logprobs)


def _choice_logprobs(choice: Mapping[str, Any]) -> list[tuple[str, dict[str, float]]]:
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


# A greedy flip between two tokens whose logprobs, under the baseline's own numerics, differ by less than
# this is a numerical tie (bf16 kernels of a multi-token verify step vs single-token decode), not a loss.
NUMERIC_TIE_NATS = 0.15


def numeric_tie_at_divergence(
    baseline: Sequence[tuple[str, Mapping[str, float]]],
    speculative: Sequence[tuple[str, Mapping[str, float]]],
    tolerance: float = NUMERIC_TIE_NATS,
) -> dict[str, Any] | None:
    """Where two greedy token streams first differ, the baseline's logprob gap between its token and the
    speculative server's; a dict when that gap is within ``tolerance`` (a tie), else None."""
    for position, ((base_token, top), (spec_token, _)) in enumerate(zip(baseline, speculative, strict=False)):
        if base_token == spec_token:
            continue
        if base_token not in top or spec_token not in top:
            return None
        gap = top[base_token] - top[spec_token]
        if gap > tolerance:
            return None
        return {"position": position, "baseline": base_token, "speculative": spec_token, "gap_nats": gap}
    return None


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


class ServerHandle(Protocol):
    """What evaluation needs of a running server (EngineServer, or a proxy to a Ray actor)."""

    @property
    def base_url(self) -> str: ...

    @property
    def startup_s(self) -> float | None: ...

    @property
    def log_path(self) -> Path: ...

    def metrics_text(self) -> str: ...


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
    outputs: list[str] = []
    output_logprobs: list[list[tuple[str, dict[str, float]]]] = []
    for level_index, level in enumerate(concurrency):
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
        if level_index == 0:
            by_index = {r.index: r for r in results}
            outputs = [by_index[i].text if by_index[i].error is None else "" for i in range(len(prompt_ids))]
            output_logprobs = [by_index[i].token_logprobs for i in range(len(prompt_ids))]
            failed = [r for r in results if r.error is not None]
            if failed:
                raise RuntimeError(
                    f"server {name!r}: {len(failed)} requests failed, first: {failed[0].error}"
                )
    return ServerRun(
        name=name,
        startup_s=server.startup_s,
        log_path=str(server.log_path),
        smoke_content=smoke_content,
        levels=levels,
        outputs=outputs,
        output_logprobs=output_logprobs,
    )


# ------------------------------------------------------------------------------------------------
# Simulator


@dataclass
class SimulatorFigures:
    """The simulator's acceptance on the evaluation prompts (kernels.simulate.SimulationReport)."""

    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: list[float | None]
    num_drafts: int
    capture_layer_ids: list[int]
    outputs_token_ids: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_report(cls, report: Any) -> SimulatorFigures:
        def clean(value: Any) -> float | None:
            return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

        return cls(
            acceptance_rate=clean(report.acceptance_rate),
            mean_acceptance_length=clean(report.mean_acceptance_length),
            per_position=[clean(v) for v in report.per_position_acceptance],
            num_drafts=int(report.num_drafts),
            capture_layer_ids=list(getattr(report, "capture_layer_ids", [])),
            outputs_token_ids=[list(r.output_token_ids) for r in getattr(report, "results", [])],
        )


def run_simulator(
    target_dir: Path, drafter_dir: Path, prompts: Sequence[str], k: int, max_tokens: int
) -> SimulatorFigures:
    """Run kernels' simulator with the drafter as saved (the ids it was trained on, layer_input)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftloop.kernels.drafter import load_drafter, load_target_head
    from draftloop.kernels.simulate import simulate_acceptance

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = load_drafter(drafter_dir, dtype=torch.float32)
    embed, _head, _norm = load_target_head(target_dir)
    drafter.attach_embeddings(embed.float())
    report = simulate_acceptance(target, tokenizer, drafter, list(prompts), k=k, max_new_tokens=max_tokens)
    return SimulatorFigures.from_report(report)


def encode_prompts(target_dir: Path, prompts: Sequence[str]) -> list[list[int]]:
    """The prompts as token ids, chat template applied, exactly as the simulator encodes them."""
    from transformers import AutoTokenizer

    from draftloop.kernels.simulate import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [encode_prompt(tokenizer, prompt) for prompt in prompts]


# ------------------------------------------------------------------------------------------------
# Report


@dataclass
class EvalReport:
    engine: str
    engine_version: str | None
    target: str
    drafter: str
    num_speculative_tokens: int
    max_tokens: int
    num_prompts: int
    concurrency: list[int]
    baseline: ServerRun
    speculative: ServerRun
    speedup: dict[int, float | None]
    lossless: bool
    mismatched_prompts: list[int]  # greedy outputs differ beyond a numerical tie
    engine_acceptance: dict[str, Any] | None
    simulator: dict[str, Any] | None
    acceptance_gap: float | None
    acceptance_tolerance: float
    verdict: str
    reasons: list[str]
    engine_layer_ids: dict[str, Any] | None = None
    plots: list[str] = field(default_factory=list)
    # Prompts whose greedy outputs differ only from a numerical tie at the first divergence (see
    # numeric_tie_at_divergence): prompt index -> {position, baseline, speculative, gap_nats}.
    numeric_ties: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["speedup"] = {str(k): v for k, v in self.speedup.items()}
        return data

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path


def engine_acceptance(run: ServerRun) -> dict[str, Any] | None:
    """Counters of the first level that had drafts (concurrency 1 first: closest to the simulator)."""
    for level in sorted(run.levels, key=lambda lv: lv.concurrency):
        if level.counters is not None:
            return dict(level.counters, concurrency=level.concurrency)
    return None


def decide_verdict(
    *,
    engine_rate: float | None,
    simulator_rate: float | None,
    tolerance: float,
    lossless: bool,
    mean_acceptance_length: float | None,
    min_acceptance_length: float | None,
    layer_id_mismatch: str | None = None,
) -> tuple[str, list[str]]:
    """integration_fault (the engine does not run the drafter as trained) before weak_drafter."""
    faults: list[str] = []
    if layer_id_mismatch:
        faults.append(layer_id_mismatch)
    if engine_rate is None:
        faults.append("the speculative server reported no drafts (speculation not running)")
    if not lossless:
        faults.append("greedy outputs of the speculative server differ from the baseline's")
    if (
        engine_rate is not None
        and simulator_rate is not None
        and abs(engine_rate - simulator_rate) > tolerance
    ):
        faults.append(
            f"engine acceptance rate {engine_rate:.3f} vs simulator {simulator_rate:.3f}: "
            f"|difference| {abs(engine_rate - simulator_rate):.3f} > tolerance {tolerance:.3f} "
            "(wrong aux layer ids / layer-id convention, drafter format or attention type?)"
        )
    if faults:
        return VERDICT_FAULT, faults
    if (
        min_acceptance_length is not None
        and mean_acceptance_length is not None
        and mean_acceptance_length < min_acceptance_length
    ):
        return VERDICT_WEAK, [
            f"mean acceptance length {mean_acceptance_length:.2f} < required {min_acceptance_length:.2f} "
            "(engine and simulator agree: the drafter itself is weak)"
        ]
    return VERDICT_OK, []


def exported_layer_id_mismatch(engine: Engine, drafter_dir: Path) -> str | None:
    """A reason when the ids the engine will read from the drafter's config are not, in draftloop's
    convention, the ids the drafter was trained on (its `draftloop` block); None when they agree or
    the folder carries no training record (a published drafter)."""
    config = read_json(Path(drafter_dir) / "config.json")
    trained = stored_layer_ids(config)
    served = engine.drafter_layer_ids(drafter_dir)
    if trained is None or served is None:
        return None
    if served.as_input() == trained.as_input():
        return None
    return (
        f"the drafter's config makes {engine.kind} capture layers {list(served.ids)} ({served.convention}) "
        f"= layer_input {list(served.as_input())}, but it was trained on layer_input "
        f"{list(trained.as_input())} (layer-id convention mix-up at export?)"
    )


def write_plots(report: EvalReport, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[str] = []

    engine_pos = list((report.engine_acceptance or {}).get("per_position_acceptance") or [])
    sim_pos = [v if v is not None else 0.0 for v in (report.simulator or {}).get("per_position", [])]
    width = max(len(engine_pos), len(sim_pos), 1)
    positions = list(range(width))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if engine_pos:
        ax.bar(
            [p - 0.2 for p in positions[: len(engine_pos)]], engine_pos, width=0.4, label=f"{report.engine}"
        )
    if sim_pos:
        ax.bar([p + 0.2 for p in positions[: len(sim_pos)]], sim_pos, width=0.4, label="simulator")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(positions)
    ax.set_title(f"Acceptance per position ({report.verdict})")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "acceptance_per_position.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(str(path))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for run in (report.baseline, report.speculative):
        xs = [lv.concurrency for lv in run.levels]
        ys = [lv.output_tokens_per_s for lv in run.levels]
        ax.plot(xs, ys, marker="o", label=run.name)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_title("Throughput vs concurrency")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "throughput_vs_concurrency.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(str(path))
    return paths


# ------------------------------------------------------------------------------------------------
# Orchestration

StartServer = Callable[[str, Path | None], AbstractContextManager[Any]]


def _default_start_server(engine: Engine, target_dir: Path, run_dir: Path, k: int) -> StartServer:
    from draftloop.infra.engines.server import EngineServer

    @contextlib.contextmanager
    def start(name: str, drafter_dir: Path | None) -> Iterator[EngineServer]:
        server = EngineServer(
            engine,
            target_dir,
            run_dir,
            name=name,
            drafter_dir=drafter_dir,
            num_speculative_tokens=k if drafter_dir is not None else None,
        )
        with server:
            yield server

    return start


def evaluate(
    engine: Engine,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    *,
    max_tokens: int = 64,
    concurrency: Sequence[int] = (1, 4, 16),
    num_speculative_tokens: int | None = None,
    acceptance_tolerance: float = 0.05,
    min_acceptance_length: float | None = None,
    simulator: SimulatorFigures | Any | None = None,
    run_simulator_if_missing: bool = True,
    start_server: StartServer | None = None,
    baseline: ServerRun | None = None,
) -> EvalReport:
    """Baseline vs speculative on `prompts`; writes eval_report.json and the plots under run_dir.

    `simulator`: SimulatorFigures or a kernels SimulationReport on the same prompts (k, max_tokens);
    computed here when None and `run_simulator_if_missing`. `start_server(name, drafter_dir)` returns a
    context manager yielding a running server (default: an EngineServer in this process).
    `baseline`: a ServerRun measured before on the same prompts (skips the baseline server).
    """
    target_dir = Path(target_dir).resolve()
    drafter_dir = Path(drafter_dir).resolve()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    k = int(num_speculative_tokens or engine.settings.num_speculative_tokens)
    if not prompts:
        raise EngineConfigError("evaluation prompts", "no prompts to evaluate")
    # Refuse impossible pairings before spending a minute on a server start.
    check_drafter_pairing(target_dir, drafter_dir)
    engine.check_python()
    start = start_server or _default_start_server(engine, target_dir, run_dir, k)
    prompt_ids = encode_prompts(target_dir, prompts)
    levels = [int(c) for c in concurrency]

    if baseline is None:
        with start("baseline", None) as server:
            smoke = server.smoke_test() if hasattr(server, "smoke_test") else None
            baseline = benchmark_server(
                server,
                engine,
                prompt_ids,
                levels,
                max_tokens,
                name="baseline",
                smoke_content=getattr(smoke, "content", None),
            )
    with start("speculative", drafter_dir) as server:
        smoke = server.smoke_test() if hasattr(server, "smoke_test") else None
        speculative = benchmark_server(
            server,
            engine,
            prompt_ids,
            levels,
            max_tokens,
            name="speculative",
            smoke_content=getattr(smoke, "content", None),
        )

    if simulator is None and run_simulator_if_missing:
        simulator = run_simulator(target_dir, drafter_dir, prompts, k, max_tokens)
    if simulator is not None and not isinstance(simulator, SimulatorFigures):
        simulator = SimulatorFigures.from_report(simulator)

    differing = [
        i for i, (a, b) in enumerate(zip(baseline.outputs, speculative.outputs, strict=True)) if a != b
    ]
    # Lossless within one numeric mode: a differing prompt is excused only when its first divergence is
    # a near-tie in the baseline's own logprobs.
    numeric_ties: dict[int, dict[str, Any]] = {}
    for i in differing:
        if i < len(baseline.output_logprobs) and i < len(speculative.output_logprobs):
            tie = numeric_tie_at_divergence(baseline.output_logprobs[i], speculative.output_logprobs[i])
            if tie is not None:
                numeric_ties[i] = tie
    mismatched = [i for i in differing if i not in numeric_ties]
    acceptance = engine_acceptance(speculative)
    engine_rate = acceptance.get("acceptance_rate") if acceptance else None
    sim_rate = simulator.acceptance_rate if simulator is not None else None
    gap = abs(engine_rate - sim_rate) if engine_rate is not None and sim_rate is not None else None
    verdict, reasons = decide_verdict(
        engine_rate=engine_rate,
        simulator_rate=sim_rate,
        tolerance=acceptance_tolerance,
        lossless=not mismatched,
        mean_acceptance_length=acceptance.get("mean_acceptance_length") if acceptance else None,
        min_acceptance_length=min_acceptance_length,
        layer_id_mismatch=exported_layer_id_mismatch(engine, drafter_dir),
    )
    speedup: dict[int, float | None] = {}
    baseline_levels = {level.concurrency: level for level in baseline.levels}
    for spec_level in speculative.levels:
        base_level = baseline_levels.get(spec_level.concurrency)
        speedup[spec_level.concurrency] = (
            spec_level.output_tokens_per_s / base_level.output_tokens_per_s
            if base_level is not None and base_level.output_tokens_per_s > 0
            else None
        )
    engine_ids = engine.drafter_layer_ids(drafter_dir)
    try:
        version: str | None = engine.version()
    except Exception:
        version = None
    report = EvalReport(
        engine=engine.kind,
        engine_version=version,
        target=str(target_dir),
        drafter=str(drafter_dir),
        num_speculative_tokens=k,
        max_tokens=max_tokens,
        num_prompts=len(prompts),
        concurrency=levels,
        baseline=baseline,
        speculative=speculative,
        speedup=speedup,
        lossless=not mismatched,
        mismatched_prompts=mismatched,
        numeric_ties=numeric_ties,
        engine_acceptance=acceptance,
        simulator=asdict(simulator) if simulator is not None else None,
        acceptance_gap=gap,
        acceptance_tolerance=acceptance_tolerance,
        verdict=verdict,
        reasons=reasons,
        engine_layer_ids=(
            {
                "ids": list(engine_ids.ids),
                "convention": engine_ids.convention,
                "layer_input": list(engine_ids.as_input()),
            }
            if engine_ids is not None
            else None
        ),
    )
    if report.simulator is not None:
        report.simulator.pop("outputs_token_ids", None)
    report.plots = write_plots(report, run_dir / "plots")
    report.write(run_dir / "eval_report.json")
    return report


def evaluate_from_config(
    config: Any,
    engine: Engine,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    **kwargs: Any,
) -> EvalReport:
    """`evaluate` with the `evaluation` and `engine` sections of an ExperimentConfig."""
    evaluation = config.evaluation
    gate = getattr(evaluation, "gate", None)
    return evaluate(
        engine,
        target_dir,
        drafter_dir,
        prompts,
        run_dir,
        max_tokens=int(evaluation.max_tokens),
        concurrency=list(evaluation.concurrency),
        num_speculative_tokens=int(config.engine.num_speculative_tokens),
        acceptance_tolerance=float(evaluation.acceptance_tolerance),
        min_acceptance_length=getattr(gate, "min_acceptance_length", None),
        **kwargs,
    )
