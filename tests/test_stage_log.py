"""What each stage writes into the Prefect run log, and Ray Train's silenced cleaner warnings."""

from __future__ import annotations

import logging

from draftloop.infra.ray_logging import RAY_TRAIN_CLEANER_LOGGER, quiet_ray_train_cleaner
from draftloop.tasks.cycle import stage_report


def test_stage_report_shows_rounded_key_figures() -> None:
    line = stage_report(
        "synthesize",
        {"rows": 240, "rejected": 16, "rows_per_s": 12.3456789, "tokens_per_s": 1034.5678, "target": "/x"},
        seconds=19.44,
        cache_hit=False,
    )
    assert line == "synthesize: done, 19.4 s, conversations 240, rejected 16, rows/s 12.3, tokens/s 1.03e+03"


def test_stage_report_reads_nested_evaluation_results() -> None:
    summary = {
        "verdict": "ok",
        "engine": "vllm",
        "results": {"mean_acceptance_length": 2.2371, "acceptance_rate": 0.41234, "speedup": {"1": 1.912}},
    }
    line = stage_report("evaluate", summary, seconds=120.0, cache_hit=False)
    assert "acceptance length 2.24" in line
    assert "speedup @ concurrency 1 (x) 1.91" in line
    assert "recommended k" not in line  # absent figures are left out, not shown as None


def test_cached_stage_says_it_was_reused() -> None:
    assert "reused" in stage_report("train", {"final_loss": 1.0}, seconds=0.1, cache_hit=True)


def test_ray_train_cleaner_warnings_are_silenced() -> None:
    cleaner = logging.getLogger(RAY_TRAIN_CLEANER_LOGGER)
    before = cleaner.level
    try:
        quiet_ray_train_cleaner()
        assert not cleaner.isEnabledFor(logging.WARNING)
        assert cleaner.isEnabledFor(logging.ERROR)
    finally:
        cleaner.setLevel(before)


def test_the_logger_name_is_ray_trains_own() -> None:
    from ray.train.v2._internal.execution.controller import placement_group_cleaner

    assert placement_group_cleaner.logger.name == RAY_TRAIN_CLEANER_LOGGER
