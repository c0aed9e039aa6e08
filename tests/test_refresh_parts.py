"""A refresh's pieces on CPU in seconds: new traffic read by content, the parts ledger, the drift report,
the champion-against-challenger interval and how the gate reads it. The refresh itself, with a real
engine, is tests/test_refresh.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftloop.infra.evaluation.drift import DriftPolicy, drift_report
from draftloop.infra.evaluation.simulator import PromptFigures
from draftloop.infra.registry.challenge import challenge
from draftloop.infra.registry.gate import CycleResults, evaluate_gate
from draftloop.infra.runtime.config import GateConfig
from draftloop.infra.synthesis.prompts import DataError
from draftloop.infra.synthesis.traffic import TrafficLedger, part_rows, read_traffic, row_key


def _log_line(row_id: int, text: str, category: str | None = None) -> str:
    row = {"id": row_id, "messages": [{"role": "user", "content": text}]}
    return json.dumps({**row, **({"category": category} if category else {})})


def _serving_log(folder: Path, days: dict[str, list[tuple[str, str | None]]]) -> Path:
    """One JSONL file per day; every day's ids start at 0, as a server's counters do."""
    folder.mkdir(parents=True, exist_ok=True)
    for day, rows in days.items():
        lines = [_log_line(index, text, category) for index, (text, category) in enumerate(rows)]
        (folder / f"{day}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_traffic_rows_are_known_by_content_not_by_id(tmp_path: Path) -> None:
    log = _serving_log(
        tmp_path / "log",
        {
            "day1": [("Add 2 and 3.", "math"), ("Write a haiku.", "writing")],
            "day2": [("Add 2 and 3.", "math"), ("Sort a list in Python.", "code"), ("Name a colour.", None)],
        },
    )
    rows = read_traffic(str(log))
    assert [row["prompt"] for row in rows] == [
        "Add 2 and 3.",
        "Write a haiku.",
        "Sort a list in Python.",
        "Name a colour.",
    ]  # ids 0 and 1 repeat across the days; the same prompt logged twice is one row
    assert [row["id"] for row in rows] == [row_key(row) for row in rows]
    assert [row.get("category") for row in rows] == ["math", "writing", "code", None]


def test_a_bad_traffic_file_is_named(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.mkdir()
    (log / "day1.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"oops": 1}\n')
    with pytest.raises(DataError) as refused:
        read_traffic(str(log), max_rejected_fraction=0.0)
    assert "day1.jsonl" in str(refused.value)


def test_a_part_is_taken_only_once_its_refresh_decided(tmp_path: Path) -> None:
    texts = [(f"Question {i}?", "math" if i % 3 else "code") for i in range(12)]
    log = _serving_log(tmp_path / "log", {"day1": texts})
    ledger = TrafficLedger(str(tmp_path / "runs"), "cfg")
    rows = read_traffic(str(log))
    assert ledger.new_rows(rows) == rows

    part = ledger.part_for(rows, held_out=3)
    assert (part.rows, len(part.held_out)) == (12, 3)
    assert part.categories == {"code": 4, "math": 8}
    stored = part_rows(part)
    assert [row["id"] for row in stored] == part.train + part.held_out  # the held-out rows last
    # Killed before deciding: the same rows are new again, and make the same part.
    assert ledger.new_rows(rows) == rows
    assert ledger.part_for(list(reversed(rows)), held_out=3) == part
    ledger.record_decision(part, {"status": "champion_fits"})
    assert ledger.new_rows(rows) == []
    assert ledger.decision(part) == {"status": "champion_fits"}

    # More traffic: only its rows are new.
    _serving_log(tmp_path / "log", {"day2": [("Question 0?", "math"), ("Something new.", "writing")]})
    assert [row["prompt"] for row in ledger.new_rows(read_traffic(str(log)))] == ["Something new."]
    with pytest.raises(ValueError, match="none to train on"):
        ledger.part_for(rows[:2], held_out=2)


def _figures(pairs: list[tuple[int, int]]) -> list[PromptFigures]:
    """(drafts, accepted tokens) per prompt, k = 3."""
    return [PromptFigures(drafts, drafts * 3, accepted) for drafts, accepted in pairs]


def test_drift_report_per_category_and_the_retrain_decision() -> None:
    figures = _figures([(10, 10), (10, 12), (10, 2), (10, 4)])
    categories = ["math", "math", "code", "code"]
    report = drift_report("3", 2.0, figures, categories, DriftPolicy(retrain_drop=0.1))
    by_name = {row.category: row.mean_acceptance_length for row in report.categories}
    assert by_name == pytest.approx({"code": 1.3, "math": 2.1})
    assert report.overall.mean_acceptance_length == pytest.approx(1.7)
    assert report.drop == pytest.approx(0.15)
    assert report.retrain and "drop +15.0% > refresh drop 10.0%" in report.reason
    assert "| code | 2 | 20 | 1.300 | -35.0% |" in report.markdown()

    kept = drift_report("3", 2.0, figures, categories, DriftPolicy(retrain_drop=0.2))
    assert not kept.retrain and kept.reason.startswith("no retraining")
    forced = drift_report("3", 2.0, figures, categories, DriftPolicy(retrain_drop=0.2, force=True))
    assert forced.retrain and forced.reason.startswith("retrain asked for")


def test_the_challenger_wins_only_beyond_the_interval() -> None:
    champion = _figures([(10, 8), (10, 9), (10, 10), (10, 7), (10, 8), (10, 9)] * 3)
    better = _figures([(10, 15), (10, 16), (10, 14), (10, 15), (10, 17), (10, 15)] * 3)
    noisy = _figures([(10, 14), (10, 2), (10, 16), (10, 1), (10, 9), (10, 8)] * 3)
    won = challenge("4", champion, better)
    assert won.won and won.low > 0 and won.difference == pytest.approx(92 / 60 - 51 / 60)
    assert "beyond the interval" in won.reason and "champion v4" in won.reason
    lost = challenge("4", champion, noisy)
    assert not lost.won and lost.low <= 0 < lost.high
    assert "not beyond the interval" in lost.reason
    with pytest.raises(ValueError):
        challenge("4", champion, better[:3])


def test_the_gate_reads_the_challenge_instead_of_the_records() -> None:
    gate = GateConfig(min_speedup=None, min_acceptance_length=1.0, require_consistency=False)
    results = CycleResults(acceptance_rate=0.5, mean_acceptance_length=1.9)
    champion = _figures([(10, 8)] * 12)
    # The records alone would pass (1.9 beats the champion's recorded 1.5) ...
    assert evaluate_gate(gate, results, champion_length=1.5, champion_version="4").passed
    # ... but measured together on the new prompts the challenger is not better.
    same = challenge("4", champion, _figures([(10, 8)] * 12))
    refused = evaluate_gate(gate, results, champion_length=1.5, champion_version="4", challenge=same)
    assert not refused.passed and refused.reasons == [same.reason]
    better = challenge("4", champion, _figures([(10, 14)] * 12))
    passed = evaluate_gate(gate, results, champion_length=2.5, champion_version="4", challenge=better)
    assert passed.passed and better.reason in passed.notes


def test_the_refresh_form_is_typed_and_deploy_reads_it_from_source() -> None:
    from prefect.utilities.callables import parameter_schema, parameter_schema_from_entrypoint

    from draftloop.flows.refresh import refresh

    fields = parameter_schema(refresh).model_dump_for_openapi()["properties"]
    assert set(fields) == {"config", "config_path", "traffic", "overrides", "retrain_drop", "force"}
    assert (fields["retrain_drop"]["minimum"], fields["retrain_drop"]["maximum"]) == (0.0, 1.0)
    for name, field in fields.items():
        assert field.get("description") and field.get("title"), name
    root = Path(__file__).resolve().parent.parent
    from_source = parameter_schema_from_entrypoint(str(root / "flows" / "refresh.py") + ":refresh")
    assert from_source.model_dump_for_openapi()["properties"] == fields
