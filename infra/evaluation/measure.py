"""Measure: every server of an evaluation plan over HTTP, and the simulator on the same prompts.

In order: one speculative server per k, each measured with a baseline server (no drafter) — both up
together and measured in turns when the plan interleaves, else the baseline once, alone, before them
(or a baseline measured before, given); for a k sweep, the prediction (the simulator at the largest k
along the baseline's output, the text a lossless speculative server produces); then the simulator at
the engine's k in the engine's numeric mode, replaying the speculative server's own output where the
engine returns its token ids (simulator.py). Nothing here judges: judge.py does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import Engine, EngineConfigError, EngineError, Speculation, read_json
from draftloop.infra.engines.server import StartServer
from draftloop.infra.evaluation.benchmark import (
    ServerRun,
    ServerToMeasure,
    benchmark_server,
    benchmark_servers,
)
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.simulator import (
    DrafterReading,
    NumericMode,
    SimulatorFigures,
    encode_prompts,
    engine_numeric_mode,
    mode_mismatch,
    run_simulator,
    simulator_numeric_mode,
)
from draftloop.infra.evaluation.verdict import exported_drafter_mismatch
from draftloop.kernels.families.base import family_for_config


@dataclass(frozen=True)
class Measurements:
    """What the servers and the simulator measured for one plan."""

    baseline: ServerRun
    runs: dict[int, ServerRun]  # per k served (the plan's ks)
    # At the engine's k, along the speculative server's output (or the figures given, measured before).
    simulator: SimulatorFigures | None
    prediction: SimulatorFigures | None  # at the sweep's largest k (None without a sweep beyond k)
    engine_mode: NumericMode
    simulator_mode: NumericMode
    mode_mismatch: str | None  # what the simulator run here does not reproduce of the engine's mode
    export_mismatch: str | None  # the engine reads other layer ids or variant fields than were trained
    # Per k served in turns with a baseline server (plan.benchmark.interleave): that baseline's run.
    paired_baselines: dict[int, ServerRun] = field(default_factory=dict)


def smoke_text(server: object) -> str | None:
    """The server's smoke request's answer (a thinking target's: its reasoning and content apart)."""
    smoke = getattr(server, "smoke_test", None)
    if smoke is None:
        return None
    result = smoke()
    if result.reasoning:
        return f"[reasoning] {result.reasoning}\n[content] {result.content}"
    return str(result.content)


def measure_server(
    start: StartServer,
    name: str,
    speculation: Speculation | None,
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    plan: EvaluationPlan,
) -> ServerRun:
    """Start one server, smoke-test it, benchmark it at every concurrency of the plan, stop it."""
    with start(name, speculation) as server:
        smoke = smoke_text(server)
        return benchmark_server(
            server,
            engine,
            prompt_ids,
            plan.concurrency,
            plan.benchmark,
            name=name,
            num_speculative_tokens=speculation.num_speculative_tokens if speculation is not None else None,
            smoke_content=smoke,
        )


def enter_together(stack: contextlib.ExitStack, managers: Sequence[AbstractContextManager[Any]]) -> list[Any]:
    """Enter `managers` at once, each then exited by `stack` (last first, as nested `with`s would).

    Servers start in parallel this way: a server's start is mostly one process importing its engine
    (single-threaded), so two of them take little more than one (flow-test on 2 CPU cores: the two vLLM
    servers of an evaluation ~70 s one after the other). A failure is raised once every manager that
    did enter is registered, so those are stopped too.
    """
    with ThreadPoolExecutor(max_workers=len(managers), thread_name_prefix="start-server") as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
        wait(futures)
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
    return [future.result() for future in futures]


def measure_pair(
    start: StartServer,
    name: str,
    speculation: Speculation,
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    plan: EvaluationPlan,
) -> tuple[ServerRun, ServerRun]:
    """A baseline server and a speculative one up together, smoke-tested, measured in turns
    (benchmark.benchmark_servers); both stopped. (baseline run, speculative run)."""
    with contextlib.ExitStack() as stack:
        base, spec = enter_together(stack, [start("baseline", None), start(name, speculation)])
        smokes = [smoke_text(server) for server in (base, spec)]
        baseline, speculative = benchmark_servers(
            [
                ServerToMeasure(base, "baseline", None, smokes[0]),
                ServerToMeasure(spec, name, speculation.num_speculative_tokens, smokes[1]),
            ],
            engine, prompt_ids, plan.concurrency, plan.benchmark,
        )  # fmt: skip
    return baseline, speculative


def _replayable(run: ServerRun, num_prompts: int) -> list[list[int]] | None:
    """The server's output token ids for every prompt (what the simulator replays), else None."""
    follow = run.output_token_ids
    return follow if len(follow) == num_prompts and all(follow) else None


def measure(
    engine: Engine,
    plan: EvaluationPlan,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    start: StartServer,
    *,
    baseline: ServerRun | None,
    simulator: SimulatorFigures | None,
    reading: DrafterReading | None = None,
) -> Measurements:
    """Measure the plan's servers on `prompts` (see the module's docstring). `simulator`: figures
    measured before on the same prompts (k, max_tokens), kept as given; None runs the simulator here.
    `reading`: how the simulator reads the drafter folder (simulator.DrafterReading)."""
    prompt_ids = encode_prompts(target_dir, prompts, trust_remote_code=plan.trust_remote_code)
    k, ks = plan.num_speculative_tokens, plan.ks
    interleave = plan.benchmark.interleave and baseline is None
    if baseline is None and not interleave:
        baseline = measure_server(start, "baseline", None, engine, prompt_ids, plan)
    attention = family_for_config(read_json(target_dir / "config.json")).drafter_attention
    engine_mode = engine_numeric_mode(engine.settings, target_dir, attention)
    simulator_mode = simulator_numeric_mode(engine_mode, attention)

    export_mismatch = exported_drafter_mismatch(engine, drafter_dir)
    runs: dict[int, ServerRun] = {}
    paired: dict[int, ServerRun] = {}  # interleaved: the baseline each k's server took turns with
    for value in ks:
        speculation = Speculation(drafter_dir, value)
        try:
            if interleave:
                paired[value], runs[value] = measure_pair(
                    start, plan.server_name(value), speculation, engine, prompt_ids, plan
                )
            else:
                runs[value] = measure_server(
                    start, plan.server_name(value), speculation, engine, prompt_ids, plan
                )
        except EngineError as error:
            if export_mismatch is None:
                raise
            # The engine could not run the drafter with the ids it was given (vLLM's DeepSeek-V2 model
            # has no residual to capture before layer 0): the export is the cause, so say that first.
            raise EngineConfigError(
                str(drafter_dir / "config.json"),
                f"integration fault: {export_mismatch}; the speculative server failed with them: {error}",
            ) from error
    if baseline is None:
        baseline = paired[k]

    prediction: SimulatorFigures | None = None
    if simulator is None and max(ks) > k:
        # One simulation at the largest k predicts every smaller k (judge.predicted_acceptance_length).
        prediction = run_simulator(
            target_dir, drafter_dir, prompts, max(ks), plan.max_tokens, mode=simulator_mode,
            follow_token_ids=_replayable(baseline, len(prompts)), engine_outputs=baseline.outputs,
            trust_remote_code=plan.trust_remote_code, reading=reading,
        )  # fmt: skip

    mismatch: str | None = None
    if simulator is None:
        mismatch = mode_mismatch(engine_mode, simulator_mode)
        # Replay needs the engine's output token ids for every prompt; else the simulator runs free.
        speculative = runs[k]
        simulator = run_simulator(
            target_dir,
            drafter_dir,
            prompts,
            k,
            plan.max_tokens,
            mode=simulator_mode,
            follow_token_ids=_replayable(speculative, len(prompts)),
            engine_outputs=speculative.outputs,
            trust_remote_code=plan.trust_remote_code,
            reading=reading,
        )
    return Measurements(
        baseline=baseline,
        runs=runs,
        simulator=simulator,
        prediction=prediction,
        engine_mode=engine_mode,
        simulator_mode=simulator_mode,
        mode_mismatch=mismatch,
        export_mismatch=export_mismatch,
        paired_baselines=paired,
    )
