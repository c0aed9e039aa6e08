"""The benchmark method: warm-up, repeats, speedup intervals, physical bounds, the k sweep, per-category
acceptance, the open loop, and what the gate and the registry make of them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_engine import fake_engine
from fixtures_engine import engine_settings, evaluation_plan
from test_evaluation_run import _sim, saved_drafter

from draftloop.data.make_prompts import make_prompts
from draftloop.infra.engines.base import Speculation, get_engine
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.evaluation.benchmark import (
    ConcurrencyResult,
    RepeatResult,
    ServerRun,
    percentile,
    spread,
)
from draftloop.infra.evaluation.judge import category_acceptance, predicted_acceptance_length, recommend_k
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.evaluation.simulator import PromptFigures
from draftloop.infra.evaluation.verdict import (
    SPEEDUP_INCONCLUSIVE,
    SPEEDUP_MEASUREMENT_ERROR,
    SPEEDUP_OK,
    LevelSpeedup,
    level_speedups,
)
from draftloop.infra.registry.cards import description_table
from draftloop.infra.registry.gate import CycleResults, evaluate_gate
from draftloop.infra.runtime.config import GateConfig
from draftloop.infra.synthesis.prompts import builtin_prompts_path
from draftloop.kernels.counters import SpecCounters

FAKE_AL = 1.0 + 0.6 + 0.4 + 0.2  # the fake speculative server's per-position acceptance, summed


@pytest.fixture(scope="module")
def served_target(zoo_target_dir: Callable[[str], Path]) -> Path:
    return zoo_target_dir("tiny-llama")


def _level(
    concurrency: int,
    throughputs: list[float],
    *,
    tokens: int = 64,
    requests: int = 4,
    ttft: float = 0.01,
    tpot: float | None = None,
    al: float | None = None,
) -> ConcurrencyResult:
    """A level whose repeats each produced `tokens` tokens over `requests` requests at `throughputs`;
    its TTFT/TPOT agree with the throughput unless `tpot` says otherwise."""
    repeats = []
    for rate in throughputs:
        duration = tokens / rate
        repeats.append(RepeatResult(requests, tokens, duration, rate, 0, ttft, None, None))
    per_request_tokens = tokens / requests
    median_duration = tokens / sorted(throughputs)[len(throughputs) // 2]
    latency = median_duration * min(concurrency, requests) / requests
    consistent_tpot = (latency - ttft) / (per_request_tokens - 1)
    counters = (
        SpecCounters(10.0, 30.0, 10.0 * (al - 1.0), (0.0, 0.0, 0.0)).to_json() if al is not None else None
    )
    return ConcurrencyResult(
        concurrency=concurrency,
        num_requests=requests * len(throughputs),
        output_tokens=tokens * len(throughputs),
        duration_s=sum(r.duration_s for r in repeats),
        output_tokens_per_s=float(spread(throughputs)["median"] or 0.0),
        errors=0,
        repeats=repeats,
        throughput=spread(throughputs),
        ttft_s=spread([ttft], [ttft]),
        tpot_s=spread([], [tpot if tpot is not None else consistent_tpot]),
        itl_s=spread([]),
        counters=counters,
    )


def _run(name: str, *levels: ConcurrencyResult) -> ServerRun:
    return ServerRun(
        name=name, startup_s=None, log_path=None, smoke_content=None, levels=list(levels), outputs=[]
    )


def _speedups(base: ConcurrencyResult, spec: ConcurrencyResult) -> LevelSpeedup:
    (speedup,) = level_speedups(
        _run("baseline", base), _run("speculative", spec), acceptance_length=None, bound_tolerance=0.1,
        consistency_factor=2.0,
    )  # fmt: skip
    return speedup


def test_percentiles_and_spread() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    figure = spread([3.0, 1.0, 2.0], [0.1, 0.2, 0.3])
    assert (figure["median"], figure["min"], figure["max"]) == (2.0, 1.0, 3.0)
    assert figure["p50"] == pytest.approx(0.2) and figure["p99"] == pytest.approx(0.298)


def test_speedup_interval_status() -> None:
    ok = _speedups(_level(1, [100, 101, 102]), _level(1, [150, 151, 152], al=2.2))
    assert ok.status == SPEEDUP_OK and ok.speedup == pytest.approx(151 / 101)
    assert ok.low == pytest.approx(150 / 102) and ok.high == pytest.approx(152 / 100)
    # Repeats spread across 1.0: not a number to act on.
    mixed = _speedups(_level(1, [90, 100, 115]), _level(1, [95, 105, 112], al=2.2))
    assert mixed.status == SPEEDUP_INCONCLUSIVE and mixed.low is not None and mixed.low < 1.0 < mixed.high
    assert "contains 1.0" in mixed.reasons[0]


def test_speedup_above_the_acceptance_length_is_a_measurement_error() -> None:
    # AL 2.24 bounds the speedup at 2.46 (+10%); 4x cannot be.
    flagged = _speedups(_level(1, [100, 100, 100]), _level(1, [400, 400, 400], al=2.24))
    assert flagged.status == SPEEDUP_MEASUREMENT_ERROR
    assert "exceeds the mean acceptance length 2.240" in flagged.reasons[0]
    # Within the tolerance: allowed.
    assert _speedups(_level(1, [100] * 3), _level(1, [240] * 3, al=2.24)).status == SPEEDUP_OK


def test_throughput_contradicting_its_own_latencies_is_a_measurement_error() -> None:
    # 16 requests of 64 tokens at 1 stream: TTFT 0.008 s and TPOT 0.035 s predict ~2.3 s, it took 16 s.
    slow = _level(1, [1024 / 16.3], tokens=1024, requests=16, ttft=0.008, tpot=0.035)
    flagged = _speedups(slow, _level(1, [1024 / 8.0], tokens=1024, requests=16, al=2.24))
    assert flagged.status == SPEEDUP_MEASUREMENT_ERROR
    assert any("baseline concurrency 1: its repeats took" in reason for reason in flagged.reasons)


def test_gate_never_promotes_on_a_flagged_speedup() -> None:
    gate = GateConfig(
        min_speedup=1.2, min_acceptance_length=None, require_consistency=False, beat_champion=False
    )
    flagged = CycleResults(
        acceptance_rate=0.4, mean_acceptance_length=2.2, speedup={1: 3.9},
        speedup_status={1: "measurement_error: speedup 3.9x exceeds the mean acceptance length 2.2"},
    )  # fmt: skip
    decision = evaluate_gate(gate, flagged, None)
    assert not decision.passed and "flagged: measurement_error" in decision.reasons[0]
    inconclusive = CycleResults(0.4, 2.2, speedup={1: 1.3}, speedup_status={1: "inconclusive: [0.9, 1.5]"})
    assert not evaluate_gate(gate, inconclusive, None).passed
    assert evaluate_gate(
        gate, CycleResults(0.4, 2.2, speedup={1: 1.3}, speedup_status={1: "ok"}), None
    ).passed


class _SlowFirstRequest:
    """start_server: the baseline server's first completion absorbs a 1.5 s warm-up (as a real server's
    first request pays for compilation), the speculative server is already warm."""

    def __init__(self, target: Path, run_dir: Path) -> None:
        self.target, self.run_dir = target, run_dir
        self.cold = fake_engine("--token-delay", "0.002", "--first-request-delay", "1.5")
        self.warm = fake_engine("--token-delay", "0.002")

    @contextlib.contextmanager
    def __call__(self, name: str, speculation: Speculation | None) -> Iterator[EngineServer]:
        engine = self.cold if speculation is None else self.warm
        server = EngineServer(engine, self.target, self.run_dir, name=name, speculation=speculation)
        with server:
            yield server


def test_a_slow_first_request_inflated_the_old_speedup_and_not_the_new_one(
    tmp_path: Path, served_target: Path
) -> None:
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    prompts = ["Write a haiku.", "Add 2 and 3.", "Name a colour."]
    # The old method timed the first requests: no warm-up, one pass, and the baseline's first measured
    # request absorbed the warm-up (the speedup came out above 2x the acceptance length, which the
    # bounds catch as a measurement error). Now, even without warm-up rounds, the first requests are the
    # untimed prompt pass (each prompt once, for outputs and counters), so the timed repeats never see it.
    old = evaluate(
        fake_engine(), evaluation_plan(max_tokens=8, repeats=1, warmup_rounds=0, concurrency=[1]),
        served_target, drafter, prompts, tmp_path / "old", simulator=_sim(0.4),
        start_server=_SlowFirstRequest(served_target, tmp_path / "old"),
    )  # fmt: skip
    (old_level,) = old.speedup_levels
    assert old_level.speedup is not None and old_level.speedup <= FAKE_AL, old_level
    assert old_level.status != SPEEDUP_MEASUREMENT_ERROR, old_level.reasons
    # The new method: warm-up on both servers, repeats. Both fake servers are equally fast.
    new = evaluate(
        fake_engine(), evaluation_plan(max_tokens=8, repeats=3, min_seconds=0.3, concurrency=[1]),
        served_target, drafter, prompts, tmp_path / "new", simulator=_sim(0.4),
        start_server=_SlowFirstRequest(served_target, tmp_path / "new"),
    )  # fmt: skip
    (level,) = new.speedup_levels
    assert level.status != SPEEDUP_MEASUREMENT_ERROR, level.reasons
    assert level.speedup is not None and level.speedup <= FAKE_AL and 0.5 < level.speedup < 2.0
    assert new.baseline.warmup_requests == 1 and len(new.baseline.levels[0].repeats) == 3


def test_k_sweep_predicts_measures_and_recommends(tmp_path: Path, served_target: Path) -> None:
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    plan = evaluation_plan(max_tokens=6, repeats=2, concurrency=[1, 2], speculative_tokens_sweep=[1, 2])
    report = evaluate(
        fake_engine("--token-delay", "0.002"), plan, served_target, drafter, ["a", "b"], tmp_path / "eval",
        simulator=_sim(0.4), categories=["code", "math"],
    )  # fmt: skip
    assert [entry.k for entry in report.k_sweep] == [1, 2, 3]  # the engine's k 3 is always served
    assert [entry.server for entry in report.k_sweep] == ["speculative-k1", "speculative-k2", "speculative"]
    predicted = {entry.k: entry.predicted_mean_acceptance_length for entry in report.k_sweep}
    assert predicted == pytest.approx({1: 1.6, 2: 2.0, 3: 2.2})
    assert all(entry.measured_mean_acceptance_length == pytest.approx(FAKE_AL) for entry in report.k_sweep)
    assert set(report.recommended_k) == {1, 2} and report.serving_k in {1, 2, 3}
    saved = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    assert set(saved["sweep_runs"]) == {"1", "2"} and saved["serving_k"] == report.serving_k
    plots = {Path(plot).name for plot in report.plots}
    assert {"acceptance_length_per_k.png", "acceptance_per_category.png"} <= plots
    assert set(report.category_acceptance) == {"code", "math"}


def test_k_recommendation_skips_flagged_figures() -> None:
    def level(concurrency: int, speedup: float, status: str = SPEEDUP_OK) -> LevelSpeedup:
        return LevelSpeedup(concurrency, speedup, speedup, speedup, status)

    sweep = {
        1: [level(1, 1.3), level(8, 1.1)],
        2: [level(1, 9.0, SPEEDUP_MEASUREMENT_ERROR), level(8, 1.2, SPEEDUP_INCONCLUSIVE)],
        3: [level(1, 1.5), level(8, 0.9)],
    }
    assert recommend_k(sweep) == {1: 3, 8: 2}
    assert predicted_acceptance_length([0.6, 0.4, None], 2) == pytest.approx(2.0)
    assert predicted_acceptance_length([0.6, 0.4, None], 3) is None
    assert predicted_acceptance_length([0.6], 2) is None


def test_serving_command_ends_the_registry_description() -> None:
    results = CycleResults(0.4, 2.2, speedup={1: 1.3}, speedup_status={1: "ok"}, recommended_k=2)
    vllm = get_engine("vllm", engine_settings()).user_serving_command("/models/target", "/models/drafter", 2)
    assert vllm == (
        "vllm serve /models/target --speculative-config "
        '\'{"method": "eagle3", "model": "/models/drafter", "num_speculative_tokens": 2}\''
    )
    sglang = get_engine("sglang", engine_settings(kind="sglang")).user_serving_command(
        "/models/target", "/models/drafter", 2
    )
    assert "--speculative-algorithm EAGLE3" in sglang and "--speculative-num-steps 2" in sglang
    assert "--speculative-num-draft-tokens 3" in sglang
    description = description_table(results, None, vllm)
    assert description.rstrip().endswith(vllm) and "recommended k = 2" in description
    flagged = CycleResults(0.4, 2.2, speedup={1: 3.9}, speedup_status={1: "measurement_error: AL"})
    assert "| speedup @ concurrency 1 | 3.900x measurement_error: AL |" in description_table(flagged)


def test_category_acceptance_per_category() -> None:
    simulator = _sim(0.4)
    simulator.prompts = [PromptFigures(10, 30, 15), PromptFigures(10, 30, 5), PromptFigures(10, 30, 25)]
    speculative = _run("speculative")
    speculative.output_counters = [SpecCounters(5, 15, 6, ()).to_json() for _ in range(3)]
    figures = category_acceptance(["code", "chat", "code"], simulator, speculative)
    assert figures["code"]["prompts"] == 2
    assert figures["code"]["simulator"] == pytest.approx(
        {"acceptance_rate": 40 / 60, "mean_acceptance_length": 3.0}
    )
    assert figures["chat"]["simulator"]["mean_acceptance_length"] == pytest.approx(1.5)
    assert figures["chat"]["engine"] == pytest.approx({"acceptance_rate": 0.4, "mean_acceptance_length": 2.2})


def test_open_loop_goodput(tmp_path: Path, served_target: Path) -> None:
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    plan = evaluation_plan(
        max_tokens=4, repeats=1, concurrency=[1], request_rates=[40.0], open_loop_requests=6,
        tpot_target_s=5.0,
    )  # fmt: skip
    report = evaluate(
        fake_engine(), plan, served_target, drafter, ["a", "b"], tmp_path / "eval", simulator=_sim(0.4)
    )
    (rate,) = report.speculative.open_loop
    assert rate.num_requests == 6 and rate.errors == 0 and rate.tpot_s["p90"] is not None
    # Every request meets a 5 s TPOT target: goodput is the request rate actually achieved.
    assert rate.goodput_requests_per_s == pytest.approx(6 / rate.duration_s)


def test_builtin_prompts_carry_categories() -> None:
    rows = [json.loads(line) for line in builtin_prompts_path().read_text().splitlines()]
    categories = {row["category"] for row in rows}
    assert categories >= {"chat", "code", "math", "translation", "summarization", "reasoning"}
    assert make_prompts() == rows  # the committed file is the generator's output
