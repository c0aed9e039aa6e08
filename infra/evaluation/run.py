"""Deploy-and-measure: baseline server vs speculative server, engine counters vs the simulator.

`evaluate(engine, plan, ...)` runs one `EvaluationPlan` (plan.py, built once from the config) in four
steps: refuse an impossible drafter/target pairing before any server starts; measure the baseline server
(no drafter) and the speculative server at each k the same way, and the simulator in the engine's
numeric mode along the speculative server's own output (measure.py); judge (judge.py, verdict.py):

- throughput (client-side output tokens/s), TTFT and TPOT per concurrency; speedup = spec / baseline;
- the engine's speculative counters, differenced around each level (acceptance rate = accepted / draft
  tokens, mean acceptance length = 1 + accepted / drafts, per-position = accepted_per_position[i] / drafts);
- lossless: greedy outputs of both servers identical prompt by prompt, up to numerical ties;
- consistency: engine vs simulator acceptance on the same text; beyond the plan's
  `acceptance_tolerance`, the engine is not running the drafter the way it was trained (wrong layer ids,
  format, attention...): `integration_fault`, never `weak_drafter`;

and report (report.py): run_dir/eval_report.json and run_dir/plots/*.png.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from draftloop.infra.engines.base import Engine, EngineConfigError
from draftloop.infra.engines.pairing import ServingContract, check_drafter_pairing
from draftloop.infra.engines.server import StartServer, local_server_starter
from draftloop.infra.evaluation.benchmark import ServerRun
from draftloop.infra.evaluation.judge import judge
from draftloop.infra.evaluation.measure import measure
from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.plots import write_plots
from draftloop.infra.evaluation.report import EvalReport, make_report
from draftloop.infra.evaluation.simulator import DrafterReading, SimulatorFigures
from draftloop.infra.runtime.stage_log import STAGE_LOG


def evaluate(
    engine: Engine,
    plan: EvaluationPlan,
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    run_dir: Path,
    *,
    categories: Sequence[str] | None = None,
    start_server: StartServer | None = None,
    baseline: ServerRun | None = None,
    simulator: SimulatorFigures | None = None,
    reading: DrafterReading | None = None,
) -> EvalReport:
    """Baseline vs speculative on `prompts` by `plan`; writes eval_report.json and the plots under run_dir.

    `categories`: one per prompt, for per-category acceptance. `start_server(name, speculation)` returns
    a context manager yielding a running server (None: an EngineServer in this process; the stage's
    runs each in a Ray actor). `baseline`: a ServerRun measured before on the same prompts (skips the
    baseline server). `simulator`: figures measured before on the same prompts (k, max_tokens),
    compared as given (None: the simulator runs here). `reading`: how the simulator reads the drafter
    folder (a published one without a draftloop record: as the engine reads it).
    """
    target_dir = Path(target_dir).resolve()
    drafter_dir = Path(drafter_dir).resolve()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not prompts:
        raise EngineConfigError("evaluation prompts", "no prompts to evaluate")
    if categories is not None and len(categories) != len(prompts):
        raise EngineConfigError(
            "evaluation prompts", f"{len(categories)} categories for {len(prompts)} prompts"
        )
    # Refuse impossible pairings before spending a minute on a server start. Contract errors refuse the
    # pair; its warnings (served dtype or quantization other than trained on) become verdict reasons.
    contract_warnings = check_drafter_pairing(target_dir, drafter_dir, ServingContract.from_engine(engine))
    engine.check_python()
    start = start_server or local_server_starter(engine, target_dir, run_dir)
    STAGE_LOG.info(
        "evaluate: %d prompts; a baseline server%s and a speculative one per k (%s)%s%s",
        len(prompts), " (reused)" if baseline is not None else "", ", ".join(str(k) for k in plan.ks),
        ", measured in turns" if plan.benchmark.interleave and baseline is None else "",
        ", then the simulator" if simulator is None else "",
    )  # fmt: skip
    measured = measure(
        engine, plan, target_dir, drafter_dir, prompts, start, baseline=baseline, simulator=simulator,
        reading=reading,
    )  # fmt: skip
    STAGE_LOG.info("evaluate: servers measured; judging (lossless, consistency, speedups)")
    judged = judge(plan, measured, categories=categories, contract_warnings=contract_warnings)
    report = make_report(engine, plan, target_dir, drafter_dir, len(prompts), measured, judged)
    report.plots = write_plots(report, run_dir / "plots")
    report.write(run_dir / "eval_report.json")
    return report
