"""`draftloop diagnose` on bad input (exit 2, one line, before any server) and `draftloop export`: the
conversions between engine folders, ids converted, the draftloop record kept. No engine runs here;
the diagnoses themselves are in tests/test_engine_vllm.py (served by the real vLLM)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.engines.base import get_engine
from draftloop.infra.evaluation.diagnose import read_folder, readings_of
from draftloop.kernels.checkpoint import load_drafter
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds

RUNNER = CliRunner()


@pytest.fixture
def target(zoo_target_dir: Callable[[str], Path]) -> Path:
    return zoo_target_dir("tiny-llama")


def _drafter(target: Path) -> Eagle3Drafter:
    config = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    return Eagle3Drafter(DrafterConfig.for_target(config, LayerIds((1, 3, 5)), None))


def _errors(result: object) -> list[str]:
    output = getattr(result, "stderr", "") or getattr(result, "output", "")
    return [line for line in output.splitlines() if line.strip()]


def test_a_folder_that_is_no_drafter_exits_2_in_one_line(target: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    result = RUNNER.invoke(app, ["diagnose", "--target", str(target), "--drafter", str(target)])
    assert result.exit_code == 2, result.output
    (line,) = _errors(result)
    assert line.startswith("error: --drafter: ") and str(target) in line
    empty = tmp_path / "empty"
    empty.mkdir()
    result = RUNNER.invoke(app, ["diagnose", "--target", str(target), "--drafter", str(empty)])
    assert result.exit_code == 2 and _errors(result) == [
        f"error: --drafter: {empty} is not a drafter folder (no config.json)"
    ]
    result = RUNNER.invoke(app, ["diagnose", "--target", str(empty), "--drafter", str(empty)])
    assert result.exit_code == 2 and "--target" in _errors(result)[0]
    assert time.monotonic() - started < 30


def test_readings_of_a_published_folder_cover_both_conventions(target: Path, tmp_path: Path) -> None:
    published = get_engine("sglang").export_drafter(_drafter(target), tmp_path / "sglang")
    config = json.loads((published / "config.json").read_text())
    del config["draftloop"]
    (published / "config.json").write_text(json.dumps(config))
    folder = read_folder(published)
    assert folder.format == "sglang" and folder.config_ids == [0, 2, 4] and folder.trained_ids is None
    readings = readings_of(get_engine("vllm"), folder, depth=6)
    # vLLM reads [0, 2, 4] as layer_input (= that trained candidate); as layer_output they are [1, 3, 5].
    assert [(r.capture_ids, r.engine_reads, r.trained, r.norm_output) for r in readings] == [
        ((0, 2, 4), True, True, None),
        ((1, 3, 5), False, True, None),
        ((0, 2, 4), False, True, True),  # nothing records the handed-on state either: the other one
    ]


def test_export_converts_ids_and_keeps_the_record(target: Path, tmp_path: Path) -> None:
    native = get_engine("vllm").export_drafter(
        _drafter(target), tmp_path / "native", metadata={"note": "kept"}
    )
    for engine, ids in (("sglang", [0, 2, 4]), ("vllm", [1, 3, 5])):
        out = tmp_path / f"as-{engine}"
        result = RUNNER.invoke(
            app, ["export", "--drafter", str(native), "--engine", engine, "--out", str(out)]
        )
        assert result.exit_code == 0, result.output
        config = json.loads((out / "config.json").read_text())
        assert config["eagle_aux_hidden_state_layer_ids"] == ids
        assert config["draftloop"]["aux_layer_ids"] == [1, 3, 5]  # trained ids, layer_input
        assert config["draftloop"]["metadata"] == {"note": "kept"}
    out = tmp_path / "speculators"
    result = RUNNER.invoke(
        app,
        [
            "export",
            "--drafter",
            str(native),
            "--engine",
            "speculators",
            "--out",
            str(out),
            "--target",
            str(target),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    reloaded = load_drafter(out)
    assert reloaded.config.aux_layer_ids.as_input() == (1, 3, 5)


def test_export_of_a_folder_without_record_needs_its_convention(target: Path, tmp_path: Path) -> None:
    published = get_engine("sglang").export_drafter(_drafter(target), tmp_path / "published")
    config = json.loads((published / "config.json").read_text())
    del config["draftloop"]
    (published / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = RUNNER.invoke(
        app, ["export", "--drafter", str(published), "--engine", "vllm", "--out", str(out)]
    )
    assert result.exit_code == 2 and "either convention" in result.output, result.output
    assert not out.exists(), "nothing written on a refusal"
    result = RUNNER.invoke(
        app,
        [
            "export",
            "--drafter",
            str(published),
            "--engine",
            "vllm",
            "--convention",
            "sglang",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    again = RUNNER.invoke(app, ["export", "--drafter", str(published), "--engine", "vllm", "--out", str(out)])
    assert again.exit_code == 2 and "already holds" in again.output
    shutil.rmtree(out)


def test_the_diagnose_deployment_has_a_typed_form_and_refuses_a_non_drafter(target: Path) -> None:
    from prefect.utilities.callables import parameter_schema

    from draftloop.flows.diagnose import diagnose
    from draftloop.infra.evaluation.diagnose_request import DiagnoseInputError

    schema = parameter_schema(diagnose).model_dump_for_openapi()
    properties = schema["properties"]
    assert properties["engine"]["enum"] == ["vllm", "sglang"]
    assert properties["dtype"]["enum"] == ["float32", "bfloat16", "float16", "auto"]
    assert set(schema["required"]) == {"target", "drafter"}
    with pytest.raises(DiagnoseInputError, match=r"^drafter: .* no fc.weight"):
        diagnose.fn(target=str(target), drafter=str(target))


def _named_up_front(target: Path, folder: Path, out: Path) -> dict[str, Any]:
    """`draftloop diagnose --json` of a pairing that cannot work as served: exit 4 in seconds, from the
    contract and the folder alone (no server starts in this module)."""
    started = time.monotonic()
    args = ["diagnose", "--target", str(target), "--drafter", str(folder), "--json", "--out", str(out)]
    result = RUNNER.invoke(app, args)
    assert result.exit_code == 4, result.output
    assert time.monotonic() - started < 30
    diagnosis: dict[str, Any] = json.loads(result.stdout)
    return diagnosis


def _saved(drafter: Eagle3Drafter, out: Path) -> Path:
    return get_engine("vllm").export_drafter(drafter, out)


def test_a_drafter_that_cannot_work_as_served_is_named_before_any_server(
    target: Path, tmp_path: Path
) -> None:
    """RoPE shorter than the served length, d2t holding target ids: integration faults with the cause
    named (exit 4) in seconds, from the contract, before a server would start."""
    from draftloop.kernels.vocab import build_draft_vocab

    config = json.loads((target / "config.json").read_text())
    short = Eagle3Drafter(
        dataclasses.replace(
            DrafterConfig.for_target(config, LayerIds((1, 3, 5)), None), max_position_embeddings=128
        )
    )
    ids_d2t = Eagle3Drafter(DrafterConfig.for_target(config, LayerIds((1, 3, 5)), 64))
    counts = torch.arange(ids_d2t.config.vocab_size).flip(0)
    ids_d2t.set_vocab_mapping(*build_draft_vocab(counts, ids_d2t.config.vocab_size, 64))
    ids_d2t.d2t = torch.arange(64) + ids_d2t.d2t  # target ids where offsets belong
    for drafter, cause, words in (
        (short, "rope_shorter_than_served", "max_position_embeddings 128 < served engine.max_model_len 1024"),
        (ids_d2t, "d2t_as_ids", "d2t holds absolute target ids, not offsets"),
    ):
        folder = _saved(drafter, tmp_path / cause)
        diagnosis = _named_up_front(target, folder, tmp_path / "o")
        assert diagnosis["verdict"] == "integration_fault" and diagnosis["cause"]["name"] == cause
        assert words in diagnosis["cause"]["explanation"], diagnosis["cause"]


def _without_ids(folder: Path, *, keep_record: bool) -> Path:
    config = json.loads((folder / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    if not keep_record:
        del config["draftloop"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_config_without_layer_ids_is_named_missing_ids_before_any_server(
    target: Path, tmp_path: Path
) -> None:
    """vLLM's fallback (2, N//2, N-3) on the 6-layer target is (2, 3, 3): two layers for an fc that
    fuses three, a server that dies at its first request. Named up front, with the fix: from the
    record, `draftloop export` writes the trained ids back."""
    for keep_record, fix in (
        (True, "draftloop export --drafter"),
        (False, "eagle_aux_hidden_state_layer_ids"),
    ):
        folder = _without_ids(
            _saved(_drafter(target), tmp_path / f"record-{keep_record}"), keep_record=keep_record
        )
        diagnosis = _named_up_front(target, folder, tmp_path / "o")
        assert diagnosis["cause"]["name"] == "missing_layer_ids", diagnosis["cause"]
        assert fix in diagnosis["cause"]["fix"]
    explanation = diagnosis["cause"]["explanation"]
    assert "no eagle_aux_hidden_state_layer_ids" in explanation
    fixed = tmp_path / "fixed"
    result = RUNNER.invoke(
        app, ["export", "--drafter", str(tmp_path / "record-True"), "--engine", "vllm", "--out", str(fixed)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((fixed / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


def test_on_a_deep_target_the_engine_defaults_are_a_reading_the_simulator_can_name() -> None:
    """An 8-layer target: the defaults (2, 4, 5) are distinct and served; the record's (1, 3, 5) is what
    the drafter learnt on. When that reading accepts clearly more, the cause is the missing ids."""
    from draftloop.infra.evaluation.diagnose import FolderReading, ReadingFigures, find_cause

    engine = get_engine("vllm")
    folder = FolderReading("/d", "draftloop", None, [1, 3, 5], "stated")
    served, trained = readings_of(engine, folder, depth=8)
    assert (served.capture_ids, served.engine_reads) == ((2, 4, 5), True)
    assert (trained.capture_ids, trained.trained) == ((1, 3, 5), True)
    figures = [ReadingFigures(served, 0.05, 1.15, []), ReadingFigures(trained, 0.6, 2.8, [])]
    cause = find_cause(engine, folder, figures, engine_rate=0.06, tolerance=0.05)
    assert cause is not None and cause.name == "missing_layer_ids"
    assert (
        "matches this reading's 0.050" in cause.explanation and cause.fix and "draftloop export" in cause.fix
    )
    close = [ReadingFigures(served, 0.55, 2.6, []), ReadingFigures(trained, 0.6, 2.8, [])]
    assert find_cause(engine, folder, close, engine_rate=0.55, tolerance=0.05) is None


def test_a_drafter_trained_on_hidden_states_before_the_final_norm_is_named_before_any_server(
    target: Path, tmp_path: Path
) -> None:
    """The final norm flipped: its record says the last hidden states it learnt from were taken before
    the target's final norm; every engine gives them after it (logits = lm_head(last hidden state))."""
    folder = _saved(_drafter(target), tmp_path / "flipped")
    config = json.loads((folder / "config.json").read_text())
    config["draftloop"]["metadata"]["last_hidden_state"] = "before_final_norm"
    (folder / "config.json").write_text(json.dumps(config))
    cause = _named_up_front(target, folder, tmp_path / "o")["cause"]
    assert cause["name"] == "final_norm" and "'before_final_norm'" in cause["explanation"], cause


def test_a_norm_output_reading_that_accepts_clearly_more_is_named() -> None:
    """A published folder whose config says norm_output true, the engine matching that reading, and the
    reading without it accepting clearly more: `final_norm`, the fix the flag to set."""
    from draftloop.infra.evaluation.diagnose import FolderReading, ReadingFigures, find_cause

    engine = get_engine("vllm")
    folder = FolderReading("/d", "vllm", [1, 3, 5], None, "stated", norm_output=True)
    readings = readings_of(engine, folder, depth=6)
    served, flipped = (r for r in readings if r.capture_ids == (1, 3, 5))
    assert served.engine_reads and served.norm_output is None  # as the config says
    assert flipped.norm_output is False and flipped.trained and not flipped.engine_reads
    figures = [ReadingFigures(r, 0.1, 1.3, []) for r in readings if r is not flipped]
    figures.append(ReadingFigures(flipped, 0.6, 2.8, []))
    cause = find_cause(engine, folder, figures, engine_rate=0.1, tolerance=0.05)
    assert cause is not None and cause.name == "final_norm", cause
    assert (
        "after its final norm" in cause.explanation
        and cause.fix == 'set "norm_output": false in /d/config.json'
    )
