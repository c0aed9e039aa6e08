"""Numbers that reproduce while other load on the machine changes: the same drafter evaluated three
times gives the same headline acceptance (one pass over the prompts: the same multiset every time) and
the same speedup at every level, within the machine's own noise, because baseline and speculative servers
are up together and measured in turns. Measured one after the other, the same drift moves the ratio from
run to run far beyond that noise, and the moved interval contradicts the first.

The fake servers sleep per token; a load file makes every token cost more as time goes on (another job
ramping up), on both servers alike; the speculative server's tokens cost half the baseline's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fake_engine import fake_engine
from fixtures_engine import evaluation_plan
from test_evaluation_run import _sim, saved_drafter

from draftloop.infra.evaluation.report import EvalReport
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.evaluation.verdict import SPEEDUP_OK, LevelSpeedup

PROMPTS = ["Write a haiku.", "Add 2 and 3.", "Name a colour.", "Count to five."]
LOAD_SLOPE = 0.2  # per second: every token costs 1 + slope * t times its delay, t since the run began
# What a loaded 2-core CI machine adds to the fake servers' sleeps, beyond what the intervals of four
# repeats see (they missed each other by 0.7% once); the drift moves a sequential ratio by ~40%.
NOISE = 0.08


@pytest.fixture(scope="module")
def served_target(zoo_target_dir: Callable[[str], Path]) -> Path:
    return zoo_target_dir("tiny-llama")


def _evaluations(
    tmp_path: Path, target: Path, drafter: Path, interleave: bool, slopes: list[float]
) -> list[EvalReport]:
    """One evaluation per slope, each under load growing at that slope from its start."""
    load = tmp_path / "load"
    engine = fake_engine(
        "--token-delay", "0.03", "--spec-token-delay-factor", "0.5", "--load-file", str(load)
    )  # fmt: skip
    plan = evaluation_plan(
        max_tokens=8, repeats=4, min_seconds=0.2, concurrency=[1, 4], interleave=interleave
    )
    assert plan.benchmark.interleave is interleave
    reports = []
    for run, slope in enumerate(slopes):
        load.write_text(f"{time.time()} {slope}")
        run_dir = tmp_path / f"interleave-{interleave}-{run}"
        reports.append(evaluate(engine, plan, target, drafter, PROMPTS, run_dir, simulator=_sim(0.4)))
        print(f"interleave {interleave}, load slope {slope}:", _intervals(reports[-1]))
    return reports


def _intervals(report: EvalReport) -> list[tuple[int, float | None, float | None, str]]:
    return [(lv.concurrency, lv.low, lv.high, lv.status) for lv in report.speedup_levels]


def _overlap(a: LevelSpeedup, b: LevelSpeedup) -> bool:
    assert a.low is not None and a.high is not None and b.low is not None and b.high is not None
    return a.low <= b.high and b.low <= a.high


def _agree(a: LevelSpeedup, b: LevelSpeedup) -> bool:
    """The intervals overlap, or the speedups differ by less than the machine's noise."""
    assert a.speedup is not None and b.speedup is not None
    return _overlap(a, b) or abs(a.speedup - b.speedup) <= NOISE * min(a.speedup, b.speedup)


def _contradicted(a: LevelSpeedup, b: LevelSpeedup) -> bool:
    """`a` is ok (its interval excludes 1.0) and `b`'s interval lies apart from it."""
    return a.status == SPEEDUP_OK and not _overlap(a, b)


def test_three_evaluations_under_changing_load_agree(tmp_path: Path, served_target: Path) -> None:
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    # An idle machine, then another job ramping up fast, then slower: each run sees other load.
    interleaved = _evaluations(tmp_path, served_target, drafter, True, [0.0, LOAD_SLOPE, LOAD_SLOPE / 2])
    sequential = _evaluations(tmp_path, served_target, drafter, False, [0.0, LOAD_SLOPE])

    headline = {report.consistency["engine_rate"] for report in interleaved}
    assert len(headline) == 1, headline  # the prompt pass: the same prompts once each, every time
    for report in interleaved:
        assert [level.method for level in report.speedup_levels] == ["interleaved"] * 2
    for a, b in itertools.permutations(interleaved, 2):
        for level_a, level_b in zip(a.speedup_levels, b.speedup_levels, strict=True):
            assert _agree(level_a, level_b), (_intervals(a), _intervals(b))

    # One server after the other: the load grown between the baseline's and the speculative server's
    # turns lands on the speculative side only; the second run's ratio moves, its interval blind to it.
    first, second = (report.speedup_levels for report in sequential)
    assert all(level.method == "sequential" for level in first + second)
    for a, b in zip(first, second, strict=True):
        assert _contradicted(a, b) and not _agree(a, b), (first, second)
