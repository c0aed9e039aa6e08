"""What each stage writes into the Prefect run log, and Ray Train's silenced cleaner warnings."""

from __future__ import annotations

import logging

from draftloop.flows.pipeline import CYCLE
from draftloop.infra.runtime.ray_logging import RAY_TRAIN_CLEANER_LOGGER, quiet_ray_train_cleaner


def test_stage_report_shows_rounded_key_figures() -> None:
    line = CYCLE.stage("synthesize").report(
        {"rows": 240, "rejected": 16, "rows_per_s": 12.3456789, "tokens_per_s": 1034.5678, "target": "/x"},
        seconds=19.44,
        cache_hit=False,
    )
    assert line == "synthesize: done, 19.4 s, conversations 240, rejected 16, rows/s 12.3, tokens/s 1,035"


def test_train_report_shows_loss_and_held_out_acceptance_per_epoch() -> None:
    summary = {
        "epochs": 3,
        "loss_per_epoch": [5.91234, 4.5, 4.123456],
        "held_out_acceptance_length": [1.24, 1.8466, 2.61],
        "exported_epoch": 2,
        "tokens_per_s": 696.4,
    }
    line = CYCLE.stage("train").report(summary, seconds=199.5, cache_hit=False)
    assert "loss per epoch [5.91, 4.5, 4.12]" in line
    assert "held-out AL per epoch [1.24, 1.85, 2.61], exported epoch 2" in line


def test_cycle_summary_artifact_leads_with_the_verdict_rounds_and_links() -> None:
    from draftloop.flows.cycle import mlflow_links, summary_markdown

    summary = {
        "config": "tiny-llama",
        "status": "completed",
        "verdict": "ok",
        "acceptance_rate": 0.412345,
        "mean_acceptance_length": 2.23712,
        "speedup": {"1": 0.66056, "4": 1.8093},
        "speedup_status": {"1": "inconclusive: speedup interval [0.377, 1.327] contains 1.0", "4": "ok"},
        "drafter_epoch": {"exported_epoch": 7, "held_out_acceptance_length": 3.1892},
        "registered_model": {
            "name": "drafter-tiny-llama",
            "version": "2",
            "alias_status": "rejected",
            "verdict": "rejected (AL 2.24 does not beat champion v1's 2.50): AL 2.24 ...",
            "gate": {"reasons": ["mean acceptance length 2.237 does not beat the champion's 2.500"]},
        },
        "links": mlflow_links("http://127.0.0.1:5000", "1", "abc", "drafter-tiny-llama"),
        "stages": {"train": {"seconds": 12.3456, "cache_hit": False}},
    }
    text = summary_markdown(summary)
    assert text.splitlines()[2] == "**rejected (AL 2.24 does not beat champion v1's 2.50): AL 2.24 ...**"
    assert "| mean acceptance length | 2.24 tokens/step |" in text
    assert "| acceptance rate | 41.2 % |" in text  # a rate reads in % wherever it is shown
    assert "| speedup @ concurrency 1 | 0.66x (inconclusive) |" in text
    assert "| speedup @ concurrency 4 | 1.81x |" in text
    assert "| exported epoch | 7 (held-out AL 3.19) |" in text
    assert "| gate | rejected: mean acceptance length 2.237 does not beat the champion's 2.500 |" in text
    assert "http://127.0.0.1:5000/#/experiments/1/runs/abc" in text
    assert "| train | 12.3 | run | - | - | `-` |" in text
    assert mlflow_links("sqlite:///x.db", "1", "abc", None) == {}  # no UI behind a file store


def test_stage_report_reads_nested_evaluation_results() -> None:
    summary = {
        "verdict": "ok",
        "engine": "vllm",
        "results": {"mean_acceptance_length": 2.2371, "acceptance_rate": 0.41234, "speedup": {"1": 1.912}},
    }
    line = CYCLE.stage("evaluate").report(summary, seconds=120.0, cache_hit=False)
    assert "acceptance length 2.24" in line
    assert "acceptance 41.2 %" in line and "speedup @ c=1 1.91x" in line  # a percentage, a speedup
    assert "recommended k" not in line  # absent figures are left out, not shown as None
    line = CYCLE.stage("evaluate").report(summary | {"recommended_k": {"1": 3, "4": 2}}, 1.0, False)
    assert line.endswith("recommended k 3 @ c=1, 2 @ c=4")


def test_cached_stage_says_it_was_reused() -> None:
    assert "reused" in CYCLE.stage("train").report({"final_loss": 1.0}, seconds=0.1, cache_hit=True)


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
