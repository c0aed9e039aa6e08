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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from draftloop.infra.config import ExperimentConfig
from draftloop.infra.engines.base import Engine, EngineConfigError, EngineError, read_json
from draftloop.infra.engines.pairing import ServingContract, check_drafter_pairing
from draftloop.infra.evaluation.benchmark import ServerRun, benchmark_server
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
    compare_acceptance,
    compare_outputs,
    decide_verdict,
    engine_acceptance,
    exported_layer_id_mismatch,
)
from draftloop.kernels.families.base import family_for_config

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


def _benchmark(
    start: StartServer,
    name: str,
    drafter_dir: Path | None,
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    levels: Sequence[int],
    max_tokens: int,
) -> ServerRun:
    with start(name, drafter_dir) as server:
        smoke = server.smoke_test() if hasattr(server, "smoke_test") else None
        return benchmark_server(
            server,
            engine,
            prompt_ids,
            levels,
            max_tokens,
            name=name,
            smoke_content=getattr(smoke, "content", None),
        )


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
    simulator: SimulatorFigures | None = None,
    run_simulator_if_missing: bool = True,
    start_server: StartServer | None = None,
    baseline: ServerRun | None = None,
) -> EvalReport:
    """Baseline vs speculative on `prompts`; writes eval_report.json and the plots under run_dir.

    `simulator`: figures measured before on the same prompts (k, max_tokens), compared as given; when
    None (and `run_simulator_if_missing`), the simulator runs here, in the engine's numeric mode, along
    the speculative server's output. `start_server(name, drafter_dir)` returns a context manager yielding
    a running server (default: an EngineServer in this process). `baseline`: a ServerRun measured before
    on the same prompts (skips the baseline server).
    """
    target_dir = Path(target_dir).resolve()
    drafter_dir = Path(drafter_dir).resolve()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    k = int(num_speculative_tokens or engine.settings.num_speculative_tokens)
    if not prompts:
        raise EngineConfigError("evaluation prompts", "no prompts to evaluate")
    # Refuse impossible pairings before spending a minute on a server start.
    # Contract errors refuse the pair; its warnings (served dtype or quantization other than trained on)
    # become verdict reasons.
    contract_warnings = check_drafter_pairing(target_dir, drafter_dir, ServingContract.from_engine(engine))
    engine.check_python()
    start = start_server or _default_start_server(engine, target_dir, run_dir, k)
    prompt_ids = encode_prompts(target_dir, prompts)
    levels = [int(c) for c in concurrency]

    if baseline is None:
        baseline = _benchmark(start, "baseline", None, engine, prompt_ids, levels, max_tokens)
    layer_id_mismatch = exported_layer_id_mismatch(engine, drafter_dir)
    try:
        speculative = _benchmark(start, "speculative", drafter_dir, engine, prompt_ids, levels, max_tokens)
    except EngineError as error:
        if layer_id_mismatch is None:
            raise
        # The engine could not run the drafter with the ids it was given (vLLM's DeepSeek-V2 model has
        # no residual to capture before layer 0): the export is the cause, so say that first.
        raise EngineConfigError(
            str(drafter_dir / "config.json"),
            f"integration fault: {layer_id_mismatch}; the speculative server failed with them: {error}",
        ) from error

    attention = family_for_config(read_json(target_dir / "config.json")).drafter_attention
    engine_mode = engine_numeric_mode(engine.settings, target_dir, attention)
    mismatch: str | None = None
    if simulator is None and run_simulator_if_missing:
        simulator_mode = simulator_numeric_mode(engine_mode, attention)
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
    )
    report.plots = write_plots(report, run_dir / "plots")
    report.write(run_dir / "eval_report.json")
    return report


def evaluate_from_config(
    config: ExperimentConfig,
    engine: Engine,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    **kwargs: Any,
) -> EvalReport:
    """`evaluate` with the `evaluation` and `engine` sections of an ExperimentConfig (the engine was built
    from the same engine section: its numeric mode is the simulator's)."""
    evaluation = config.evaluation
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
        min_acceptance_length=evaluation.gate.min_acceptance_length,
        **kwargs,
    )
