"""Deploy-and-measure: baseline server vs speculative server, engine counters vs the simulator.

`evaluate(...)` refuses an impossible drafter/target pairing, starts the baseline server (no drafter) and
measures it at each concurrency (benchmark.py), then the speculative server (drafter, k) the same way,
runs the simulator in the engine's numeric mode along the speculative server's own output
(simulator.py), and decides (verdict.py):

- throughput (client-side output tokens/s), TTFT and TPOT per concurrency; speedup = spec / baseline;
- the engine's speculative counters, differenced around each level (acceptance rate = accepted / draft
  tokens, mean acceptance length = 1 + accepted / drafts, per-position = accepted_per_position[i] / drafts);
- lossless: greedy outputs of both servers identical prompt by prompt, up to numerical ties;
- consistency: engine vs simulator acceptance on the same text; beyond `acceptance_tolerance`, the engine
  is not running the drafter the way it was trained (wrong layer ids, format, attention...):
  `integration_fault`, never `weak_drafter`.

It writes run_dir/eval_report.json and run_dir/plots/*.png.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, EngineConfigError, EngineError, read_json
from draftloop.infra.engines.pairing import ServingContract, check_drafter_pairing
from draftloop.infra.evaluation.benchmark import BenchmarkPlan, ServerRun, benchmark_server
from draftloop.infra.evaluation.plots import write_plots
from draftloop.infra.evaluation.report import EvalReport
from draftloop.infra.evaluation.simulator import (
    SimulatorFigures,
    encode_prompts,
    engine_numeric_mode,
    mode_mismatch,
    run_simulator,
    simulator_numeric_mode,
)
from draftloop.infra.evaluation.verdict import (
    SPEEDUP_MEASUREMENT_ERROR,
    SPEEDUP_UNMEASURED,
    LevelSpeedup,
    compare_acceptance,
    compare_outputs,
    decide_verdict,
    engine_acceptance,
    exported_layer_id_mismatch,
    level_speedups,
)
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.kernels.families.base import family_for_config

# start_server(name, drafter_dir, num_speculative_tokens): a context manager yielding a running server.
StartServer = Callable[[str, Path | None, int | None], AbstractContextManager[Any]]


def _default_start_server(engine: Engine, target_dir: Path, run_dir: Path) -> StartServer:
    from draftloop.infra.engines.server import EngineServer

    @contextlib.contextmanager
    def start(name: str, drafter_dir: Path | None, k: int | None) -> Iterator[EngineServer]:
        server = EngineServer(
            engine, target_dir, run_dir, name=name, drafter_dir=drafter_dir, num_speculative_tokens=k
        )
        with server:
            yield server

    return start


def _benchmark(
    start: StartServer,
    name: str,
    drafter_dir: Path | None,
    k: int | None,
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    levels: Sequence[int],
    plan: BenchmarkPlan,
) -> ServerRun:
    with start(name, drafter_dir, k) as server:
        smoke = server.smoke_test() if hasattr(server, "smoke_test") else None
        return benchmark_server(
            server, engine, prompt_ids, levels, plan, name=name, smoke_content=getattr(smoke, "content", None)
        )


def predicted_acceptance_length(per_position: Sequence[float | None], k: int) -> float | None:
    """AL at k from the unconditional per-position acceptance (position i accepted = positions 0..i
    were): 1 + sum of the first k. Chain drafting proposes the same first tokens whatever k is, so one
    simulation at the largest k predicts every smaller k."""
    head = list(per_position[:k])
    if len(head) < k or any(value is None for value in head):
        return None
    return 1.0 + sum(float(value) for value in head if value is not None)


def category_acceptance(
    categories: Sequence[str], simulator: SimulatorFigures | None, speculative: ServerRun
) -> dict[str, dict[str, Any]]:
    """Acceptance rate and AL per prompt category: the simulator's (per prompt, on the engine's own text
    when it replayed it) and the engine's where it reports counters per request."""
    engine_prompts = speculative.prompt_counters()
    figures: dict[str, dict[str, Any]] = {}
    for category in sorted(set(categories)):
        members = [i for i, c in enumerate(categories) if c == category]
        entry: dict[str, Any] = {"prompts": len(members), "simulator": None, "engine": None}
        if simulator is not None and len(simulator.prompts) == len(categories):
            chosen = [simulator.prompts[i] for i in members]
            entry["simulator"] = _acceptance(
                sum(p.num_drafts for p in chosen),
                sum(p.num_draft_tokens for p in chosen),
                sum(p.num_accepted_tokens for p in chosen),
            )
        if engine_prompts is not None and len(engine_prompts) == len(categories):
            counted = [engine_prompts[i] for i in members]
            entry["engine"] = _acceptance(
                sum(c.num_drafts for c in counted),
                sum(c.num_draft_tokens for c in counted),
                sum(c.num_accepted_tokens for c in counted),
            )
        figures[category] = entry
    return figures


def _acceptance(drafts: float, draft_tokens: float, accepted: float) -> dict[str, float | None]:
    return {
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts > 0 else None,
    }


def recommend_k(sweep: Mapping[int, Sequence[LevelSpeedup]]) -> dict[int, int | None]:
    """Per concurrency, the k of the highest speedup among the figures not flagged measurement_error
    (None when every k is flagged or unmeasured there)."""
    best: dict[int, tuple[float, int] | None] = {}
    for k, levels in sorted(sweep.items()):
        for level in levels:
            best.setdefault(level.concurrency, None)
            if level.speedup is None or level.status in (SPEEDUP_MEASUREMENT_ERROR, SPEEDUP_UNMEASURED):
                continue
            current = best[level.concurrency]
            if current is None or level.speedup > current[0]:
                best[level.concurrency] = (level.speedup, k)
    return {c: (choice[1] if choice is not None else None) for c, choice in sorted(best.items())}


def evaluate(
    engine: Engine,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    *,
    plan: BenchmarkPlan | None = None,
    concurrency: Sequence[int] = (1, 4, 16),
    num_speculative_tokens: int | None = None,
    speculative_tokens_sweep: Sequence[int] | None = None,
    categories: Sequence[str] | None = None,
    acceptance_tolerance: float = 0.05,
    min_acceptance_length: float | None = None,
    speedup_bound_tolerance: float = 0.1,
    throughput_consistency_factor: float = 2.0,
    simulator: SimulatorFigures | None = None,
    run_simulator_if_missing: bool = True,
    start_server: StartServer | None = None,
    baseline: ServerRun | None = None,
    trust_remote_code: bool = False,
) -> EvalReport:
    """Baseline vs speculative on `prompts`; writes eval_report.json and the plots under run_dir.

    `plan`: how each server is measured (default: BenchmarkPlan(max_tokens=64)). The speculative server
    runs at the engine's k and at every k of `speculative_tokens_sweep`; the engine's k carries the
    verdict (lossless, consistency). `categories`: one per prompt, for per-category acceptance.
    `simulator`: figures measured before on the same prompts (k, max_tokens), compared as given; when
    None (and `run_simulator_if_missing`), the simulator runs here, in the engine's numeric mode, along
    the speculative server's output. `start_server(name, drafter_dir, k)` returns a context manager
    yielding a running server (default: an EngineServer in this process). `baseline`: a ServerRun
    measured before on the same prompts (skips the baseline server). `trust_remote_code`: the simulator
    and the prompts' tokenizer run the Python code the target folder ships.
    """
    target_dir = Path(target_dir).resolve()
    drafter_dir = Path(drafter_dir).resolve()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = plan or BenchmarkPlan(max_tokens=64)
    max_tokens = plan.max_tokens
    k = int(num_speculative_tokens or engine.settings.num_speculative_tokens)
    ks = sorted({k, *(int(value) for value in speculative_tokens_sweep or ())})
    if not prompts:
        raise EngineConfigError("evaluation prompts", "no prompts to evaluate")
    if categories is not None and len(categories) != len(prompts):
        raise EngineConfigError(
            "evaluation prompts", f"{len(categories)} categories for {len(prompts)} prompts"
        )
    # Refuse impossible pairings before spending a minute on a server start.
    # Contract errors refuse the pair; its warnings (served dtype or quantization other than trained on)
    # become verdict reasons.
    contract_warnings = check_drafter_pairing(target_dir, drafter_dir, ServingContract.from_engine(engine))
    engine.check_python()
    start = start_server or _default_start_server(engine, target_dir, run_dir)
    prompt_ids = encode_prompts(target_dir, prompts, trust_remote_code=trust_remote_code)
    levels = [int(c) for c in concurrency]

    if baseline is None:
        baseline = _benchmark(start, "baseline", None, None, engine, prompt_ids, levels, plan)
    attention = family_for_config(read_json(target_dir / "config.json")).drafter_attention
    engine_mode = engine_numeric_mode(engine.settings, target_dir, attention)
    simulator_mode = simulator_numeric_mode(engine_mode, attention)
    # The sweep's AL predictions, before any speculative server: one simulation at the largest k, along
    # the baseline's output (the text a lossless speculative server produces).
    prediction: SimulatorFigures | None = None
    if simulator is None and run_simulator_if_missing and max(ks) > k:
        follow = baseline.output_token_ids
        prediction = run_simulator(
            target_dir, drafter_dir, prompts, max(ks), max_tokens, mode=simulator_mode,
            follow_token_ids=follow if len(follow) == len(prompts) and all(follow) else None,
            engine_outputs=baseline.outputs, trust_remote_code=trust_remote_code,
        )  # fmt: skip

    layer_id_mismatch = exported_layer_id_mismatch(engine, drafter_dir)
    runs: dict[int, ServerRun] = {}
    for value in ks:
        name = "speculative" if value == k else f"speculative-k{value}"
        try:
            runs[value] = _benchmark(start, name, drafter_dir, value, engine, prompt_ids, levels, plan)
        except EngineError as error:
            if layer_id_mismatch is None:
                raise
            # The engine could not run the drafter with the ids it was given (vLLM's DeepSeek-V2 model
            # has no residual to capture before layer 0): the export is the cause, so say that first.
            raise EngineConfigError(
                str(drafter_dir / "config.json"),
                f"integration fault: {layer_id_mismatch}; the speculative server failed with them: {error}",
            ) from error
    speculative = runs[k]

    mismatch: str | None = None
    if simulator is None and run_simulator_if_missing:
        mismatch = mode_mismatch(engine_mode, simulator_mode)
        # Replay needs the engine's output token ids for every prompt; else the simulator runs free.
        follow = speculative.output_token_ids
        replay = len(follow) == len(prompts) and all(follow)
        simulator = run_simulator(
            target_dir,
            drafter_dir,
            prompts,
            k,
            max_tokens,
            mode=simulator_mode,
            follow_token_ids=follow if replay else None,
            engine_outputs=speculative.outputs,
            trust_remote_code=trust_remote_code,
        )

    mismatched, numeric_ties = compare_outputs(baseline, speculative)
    acceptance = engine_acceptance(speculative)
    comparison = compare_acceptance(acceptance, speculative, simulator)
    verdict, reasons = decide_verdict(
        engine_rate=comparison.engine_rate,
        simulator_rate=comparison.simulator_rate,
        tolerance=acceptance_tolerance,
        lossless=not mismatched,
        mean_acceptance_length=acceptance.get("mean_acceptance_length") if acceptance else None,
        min_acceptance_length=min_acceptance_length,
        layer_id_mismatch=layer_id_mismatch,
        numeric_mode_mismatch=mismatch,
        comparable=comparison.comparable,
    )
    speedups = {
        value: level_speedups(
            baseline,
            run,
            acceptance_length=(engine_acceptance(run) or {}).get("mean_acceptance_length"),
            bound_tolerance=speedup_bound_tolerance,
            consistency_factor=throughput_consistency_factor,
        )
        for value, run in runs.items()
    }
    predictor = prediction or simulator
    per_position = predictor.per_position if predictor is not None else []
    sweep = [
        {
            "k": value,
            "server": runs[value].name,
            "predicted_mean_acceptance_length": predicted_acceptance_length(per_position, value),
            "measured_mean_acceptance_length": (engine_acceptance(runs[value]) or {}).get(
                "mean_acceptance_length"
            ),
            "measured_acceptance_rate": (engine_acceptance(runs[value]) or {}).get("acceptance_rate"),
            "levels": [asdict(level) for level in speedups[value]],
        }
        for value in ks
    ]
    recommended = recommend_k(speedups)
    # The single k to serve: the best at the lowest concurrency (where speculation pays most), else the
    # engine's k when no figure there is trustworthy.
    serve_k = recommended.get(min(levels)) or k
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
        speedup={level.concurrency: level.speedup for level in speedups[k]},
        lossless=not mismatched,
        mismatched_prompts=mismatched,
        numeric_ties=numeric_ties,
        engine_acceptance=acceptance,
        simulator=asdict(simulator) if simulator is not None else None,
        acceptance_gap=comparison.gap,
        acceptance_tolerance=acceptance_tolerance,
        verdict=verdict,
        reasons=[*reasons, *(f"contract warning: {warning}" for warning in contract_warnings)],
        engine_layer_ids=(
            {
                "ids": list(engine_ids.ids),
                "convention": engine_ids.convention,
                "layer_input": list(engine_ids.as_input()),
            }
            if engine_ids is not None
            else None
        ),
        numeric_modes={
            "engine": engine_mode.to_json(),
            "simulator": simulator.numeric_mode if simulator is not None else None,
            "mismatch": mismatch,
        },
        consistency=comparison.to_json(),
        speedup_levels=[asdict(level) for level in speedups[k]],
        benchmark_plan=asdict(plan) | {"request_rates": list(plan.request_rates)},
        k_sweep=sweep,
        sweep_runs={value: run for value, run in runs.items() if value != k},
        recommended_k=recommended,
        serving_k=serve_k,
        category_acceptance=(
            category_acceptance(categories, simulator, speculative) if categories is not None else {}
        ),
    )
    report.plots = write_plots(report, run_dir / "plots")
    report.write(run_dir / "eval_report.json")
    return report


def benchmark_plan(config: ExperimentConfig) -> BenchmarkPlan:
    """The BenchmarkPlan of an `evaluation` section."""
    evaluation = config.evaluation
    return BenchmarkPlan(
        max_tokens=int(evaluation.max_tokens),
        repeats=int(evaluation.repeats),
        min_output_tokens=int(evaluation.min_output_tokens),
        min_seconds=float(evaluation.min_seconds),
        warmup_rounds=int(evaluation.warmup_rounds),
        request_rates=[float(rate) for rate in evaluation.request_rates],
        open_loop_requests=int(evaluation.open_loop_requests),
        tpot_target_s=evaluation.tpot_target_s,
    )


def evaluate_from_config(
    config: ExperimentConfig,
    engine: Engine,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    **kwargs: Any,
) -> EvalReport:
    """`evaluate` with the `evaluation`, `engine` and `target` sections of an ExperimentConfig (the engine
    was built from the same engine section: its numeric mode is the simulator's)."""
    evaluation = config.evaluation
    return evaluate(
        engine,
        target_dir,
        drafter_dir,
        prompts,
        run_dir,
        plan=benchmark_plan(config),
        concurrency=list(evaluation.concurrency),
        num_speculative_tokens=int(config.engine.num_speculative_tokens),
        speculative_tokens_sweep=evaluation.speculative_tokens_sweep,
        acceptance_tolerance=float(evaluation.acceptance_tolerance),
        min_acceptance_length=evaluation.gate.min_acceptance_length,
        speedup_bound_tolerance=float(evaluation.speedup_bound_tolerance),
        throughput_consistency_factor=float(evaluation.throughput_consistency_factor),
        trust_remote_code=bool(config.target.trust_remote_code),
        **kwargs,
    )
