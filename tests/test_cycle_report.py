"""What Prefect shows of a finished cycle: the artifact's title says what happened, a partial run lists
what it produced and where, the CLI's table and the last log line read the same figures."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from draftloop.commands.run import summary_table
from draftloop.flows.cycle_report import final_log_line, summary_markdown, summary_title

STAGES = {
    "synthesize": {
        "seconds": 19.44,
        "cache_hit": False,
        "uri": "file:///runs/tiny/synthesize/3beb65",
        "rows": 240,
        "figures": {"conversations": 240, "rejected": 16},
    },
    "extract": {
        "seconds": 31.2,
        "cache_hit": True,
        "uri": "file:///runs/tiny/extract/9f2c4e",
        "rows": 224,
        "figures": {"samples": 224, "tokens": 41234},
    },
}


def _registered(champion: bool, reasons: list[str]) -> dict[str, Any]:
    return {
        "name": "drafter-tiny-llama",
        "version": "2",
        "champion": champion,
        "alias_status": "champion" if champion else "rejected",
        "verdict": "AL 1.80 · 1.20x @ c=1 · vLLM 0.32.0 · ...",
        "gate": {"passed": champion, "reasons": reasons, "notes": []},
    }


def _whole(registered: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "run_id": "1a2b3c4d5e6f",
        "config": "tiny-llama",
        "status": "completed",
        "verdict": "ok",
        "lossless": True,
        "acceptance_rate": 0.454,
        "compared_engine_acceptance_rate": 0.454,
        "simulator_acceptance_rate": 0.4541,
        "consistent": True,
        "mean_acceptance_length": 1.8,
        "speedup": {"1": 1.2},
        "speedup_status": {"1": "ok"},
        "registered_model": registered,
        "stages": {**STAGES, "register": {"seconds": 2.0, "cache_hit": False, "uri": "file:///r", "rows": 1}},
        "cache_hits": ["extract"],
        "total_seconds": 282.4,
        "run_folder": "file:///runs/tiny/cycles/1a2b3c4d5e6f",
        "links": {},
    }


def test_the_title_says_what_happened_to_the_drafter() -> None:
    reason = "mean acceptance length 1.80 < min_acceptance_length 2.0"
    rejected = _whole(_registered(False, [reason]))
    assert summary_title(rejected) == f"rejected: {reason}"
    assert "completed" not in summary_markdown(rejected).splitlines()[0]
    assert summary_title(_whole(_registered(True, []))) == "champion: drafter-tiny-llama v2"
    assert summary_title(_whole(_registered(False, []))) == "registered, not champion: drafter-tiny-llama v2"
    evaluated = {**_whole(None), "stages": STAGES}
    assert summary_title(evaluated) == "evaluated (ok), not registered (until extract)"
    assert summary_title({**_whole(None), "status": "failed", "stages": STAGES}) == "failed after extract"


def test_a_partial_run_lists_what_it_produced_and_where_without_na_rows() -> None:
    partial = {"run_id": "abcd1234", "config": "tiny-llama", "status": "completed", "stages": STAGES}
    text = summary_markdown(partial)
    print(text)
    assert text.splitlines()[0] == "# draftloop cycle `tiny-llama`: stopped after extract (until extract)"
    assert "n/a" not in text
    synthesize = "| synthesize | 19.4 | run | 240 | conversations 240, rejected 16 |"
    assert f"{synthesize} `file:///runs/tiny/synthesize/3beb65` |" in text
    extract = "| extract | 31.2 | hit | 224 | samples 224, tokens 41234 |"
    assert f"{extract} `file:///runs/tiny/extract/9f2c4e` |" in text


def test_a_stage_row_shows_its_figures_as_the_log_line_does() -> None:
    evaluate = {
        "seconds": 60.4,
        "cache_hit": False,
        "uri": "file:///runs/tiny/evaluate/b7cc65",
        "rows": 16,
        "figures": {"acceptance": 0.0253, "speedup @ c=1": 0.513, "loss per epoch": [92.5, 62.8]},
        "shown": {"acceptance": "2.5 %", "speedup @ c=1": "0.51x", "loss per epoch": "[92.5, 62.8]"},
    }
    text = summary_markdown(
        {"run_id": "ab12", "config": "tiny-llama", "status": "completed", "stages": {"evaluate": evaluate}}
    )
    row = "| evaluate | 60.4 | run | 16 | acceptance 2.5 %, speedup @ c=1 0.51x |"  # (lists: own rows)
    assert row in text
    assert "0.0253" not in text


def test_the_artifact_shows_the_simulator_on_the_engines_prompt_mix() -> None:
    text = summary_markdown(_whole(_registered(True, [])))
    assert "| engine vs simulator acceptance (same prompts and mix) | 45.4 % vs 45.4 %, consistent |" in text
    assert "| acceptance rate | 45.4 % |" in text


def test_the_last_log_line_is_a_sentence_with_the_verdict_and_links() -> None:
    summary = _whole(_registered(False, ["mean acceptance length 1.80 does not beat champion v1's 2.24"]))
    summary["links"] = {"MLflow run": "http://127.0.0.1:5000/#/experiments/1/runs/abc"}
    line = final_log_line(summary)
    assert line == (
        "Cycle 1a2b3c4d of tiny-llama: rejected: mean acceptance length 1.80 does not beat champion v1's "
        "2.24. AL 1.80 · acceptance 45.4 % · 1.20x @ c=1. 3 stage(s) in 282 s (1 reused). Summary: "
        "file:///runs/tiny/cycles/1a2b3c4d5e6f/summary.json. "
        "MLflow run: http://127.0.0.1:5000/#/experiments/1/runs/abc"
    )
    assert "{" not in line  # not JSON


def test_the_cli_table_pairs_the_compared_acceptance_and_says_what_happened() -> None:
    summary = _whole(_registered(True, []))
    summary["simulator_acceptance_rate"] = 0.436  # were it the unweighted figure, the table would show it
    console = Console(width=200, record=True)
    console.print(summary_table(summary))
    text = console.export_text()
    assert "draftloop cycle tiny-llama: champion: drafter-tiny-llama v2" in text
    assert "engine vs simulator acceptance (same prompts and mix)" in text and "45.4 % vs 43.6 %" in text
    assert "acceptance rate" in text and "45.4 %" in text and "0.454" not in text
