"""Evaluation end to end on the fake engine (no vLLM): benchmark, report, plots, verdict."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from fake_engine import fake_engine
from fixtures_engine import evaluation_plan, shift_exported_layer_ids

from draftloop.infra.engines.base import EngineConfigError, EngineError
from draftloop.infra.evaluation.benchmark import ServerRun
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.evaluation.simulator import SimulatorFigures
from draftloop.infra.evaluation.verdict import VERDICT_FAULT, VERDICT_OK
from draftloop.infra.runtime.stage_log import forwarded_to
from draftloop.kernels.checkpoint import save_drafter
from draftloop.kernels.contract import contract_record
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import LAST_HIDDEN_AFTER_FINAL_NORM


@pytest.fixture(scope="module")
def served_target(zoo_target_dir: Callable[[str], Path]) -> Path:
    """tiny-llama: the fake engine ignores its weights, the pairing check before serving reads them."""
    return zoo_target_dir("tiny-llama")


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def saved_drafter(target: Path, folder: Path) -> Path:
    """An untrained drafter for `target` on layers [1, 3, 5] (layer_input), saved as training does in
    the fake engine's convention (layer_output: ids [0, 2, 4]), keeping the whole drafter contract."""
    config = json.loads((target / "config.json").read_text())
    drafter = Eagle3Drafter(DrafterConfig.for_target(config, LayerIds((1, 3, 5), "layer_input")))
    record = contract_record(target, target_dtype="float32", last_hidden_state=LAST_HIDDEN_AFTER_FINAL_NORM)
    return save_drafter(drafter, folder, convention="layer_output", metadata=record)


def _sim(rate: float) -> SimulatorFigures:
    return SimulatorFigures(
        acceptance_rate=rate, mean_acceptance_length=1 + 3 * rate, per_position=[0.6, 0.4, 0.2],
        num_drafts=10, capture_layer_ids=[1, 3, 5],
    )  # fmt: skip


def test_evaluate_on_fake_engine_reports_speedup_acceptance_and_verdict(
    tmp_path: Path, served_target: Path
) -> None:
    # The fake engine reads layer_output ids: these are the layers the simulator captures (1, 3, 5).
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    prompts = ["Write a haiku.", "Add 2 and 3.", "Name a colour."]
    plan = evaluation_plan(max_tokens=8, concurrency=[1, 2], acceptance_tolerance=0.05)
    lines = _ListHandler()
    run_log = logging.getLogger("test.evaluate.run_log")  # stands in for the Prefect run logger
    run_log.addHandler(lines)
    run_log.setLevel(logging.INFO)
    with forwarded_to(run_log):
        report = evaluate(
            fake_engine("--token-delay", "0.002"), plan, served_target, drafter, prompts, tmp_path / "eval",
            simulator=_sim(0.4),
        )  # fmt: skip
    run_log.removeHandler(lines)
    # Progress while it runs: every server's start, every concurrency level, every k (named by server).
    print("\n".join(lines.messages))
    first = "evaluate: 3 prompts; a baseline server and a speculative one per k (3)"
    assert lines.messages[0].startswith(first), lines.messages
    assert any(m.startswith("evaluate: server baseline up") for m in lines.messages), lines.messages
    assert any(m.startswith("evaluate: server speculative (k=3) up in ") for m in lines.messages)
    for level in (1, 2):
        measured = [m for m in lines.messages if m.startswith(f"evaluate: concurrency {level} measured: ")]
        assert measured and "speculative (k=3)" in "".join(measured), lines.messages
        assert "tok/s" in measured[-1]
    assert report.lossless and report.mismatched_prompts == []
    assert report.engine_acceptance is not None
    assert report.engine_acceptance["acceptance_rate"] == pytest.approx(0.4)
    assert report.engine_acceptance["per_position_acceptance"] == pytest.approx([0.6, 0.4, 0.2])
    assert report.verdict == VERDICT_OK, report.reasons
    assert set(report.speedup) == {1, 2} and all(v is not None and v > 0 for v in report.speedup.values())
    level = report.baseline.levels[0]
    # Three timed repeats of `concurrency` requests; before them the untimed prompt pass sent every prompt
    # once (the per-prompt records, and the counters the engine's acceptance is read from).
    assert [repeat.output_tokens for repeat in level.repeats] == [8, 8, 8]
    assert len(report.speculative.outputs) == len(prompts) and report.baseline.prompt_pass_counters is None
    assert report.speculative.prompt_pass_counters is not None
    assert report.engine_acceptance["prompt_pass"] is True
    assert (
        level.ttft_s["p50"] is not None and level.tpot_s["p99"] is not None and level.itl_s["p90"] is not None
    )
    assert report.baseline.warmup_requests == 1 + 2  # one round at each level, discarded
    assert [entry.k for entry in report.k_sweep] == [3] and report.serving_k == 3
    saved = json.loads((tmp_path / "eval" / "eval_report.json").read_text())
    assert saved["verdict"] == VERDICT_OK and saved["engine_layer_ids"]["layer_input"] == [1, 3, 5]
    for plot in report.plots:
        assert Path(plot).read_bytes()[:4] == b"\x89PNG"

    # Same servers (the baseline reread from the saved report), a simulator that predicts much more
    # acceptance: the engine is not running the drafter as trained -> integration fault, not weak drafter.
    baseline = ServerRun.from_json(saved["baseline"])
    assert baseline == report.baseline
    faulty = evaluate(
        fake_engine(), evaluation_plan(max_tokens=4, concurrency=[1]), served_target, drafter, prompts,
        tmp_path / "eval2", simulator=_sim(0.7), baseline=baseline,
    )  # fmt: skip
    assert faulty.verdict == VERDICT_FAULT and faulty.acceptance_gap == pytest.approx(0.3)


def test_evaluate_flags_lossy_speculation(tmp_path: Path, served_target: Path) -> None:
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    report = evaluate(
        fake_engine("--perturb", "1"), evaluation_plan(max_tokens=4, concurrency=[1]), served_target, drafter,
        ["a", "b"], tmp_path / "eval", simulator=_sim(0.4),
    )  # fmt: skip
    assert not report.lossless and report.mismatched_prompts == [0, 1]
    assert report.verdict == VERDICT_FAULT


@pytest.mark.slow
def test_evaluate_through_ray_actors(tmp_path: Path, served_target: Path) -> None:
    """The flow's path: each server hosted by an EngineServerActor (num_gpus from the config, 0 here)."""
    import ray

    from draftloop.infra.engines.actors import server_starter
    from draftloop.infra.runtime.ray_cluster import ensure_ray

    ensure_ray(num_cpus=2)
    engine = fake_engine()
    drafter = saved_drafter(served_target, tmp_path / "drafter")
    # The actor process must import the fake engine's module (tests/ is not a package).
    tests_dir = str(Path(__file__).resolve().parent)
    starter = server_starter(
        engine, served_target, tmp_path / "eval", runtime_env={"env_vars": {"PYTHONPATH": tests_dir}}
    )
    report = evaluate(
        engine, evaluation_plan(max_tokens=4, concurrency=[1]), served_target, drafter, ["a", "b"],
        tmp_path / "eval", simulator=_sim(0.4), start_server=starter,
    )  # fmt: skip
    assert report.verdict == VERDICT_OK, report.reasons
    assert report.baseline.startup_s is not None and report.lossless
    assert not list((tmp_path / "eval" / "engine-servers").glob("*.json"))  # both servers stopped
    assert ray.is_initialized()


def test_a_server_that_dies_on_a_mismatched_export_is_reported_as_the_exports_fault(
    tmp_path: Path, served_target: Path
) -> None:
    good = saved_drafter(served_target, tmp_path / "good")
    plan = evaluation_plan(max_tokens=4, concurrency=[1])
    first = evaluate(fake_engine(), plan, served_target, good, ["a"], tmp_path / "eval", simulator=_sim(0.4))
    # Exported one off, and the server dies serving it (as vLLM's DeepSeek-V2 does for layer 0).
    shifted = shift_exported_layer_ids(good, tmp_path / "shifted", 1)
    with pytest.raises(EngineConfigError) as refused:
        evaluate(
            fake_engine("--mode", "exit"), plan, served_target, shifted, ["a"], tmp_path / "eval2",
            simulator=_sim(0.4), baseline=first.baseline,
        )  # fmt: skip
    message = str(refused.value)
    assert "integration fault" in message and "trained on layer_input [1, 3, 5]" in message
    # A server failure with a consistent export stays the engine's own error.
    with pytest.raises(EngineError) as failed:
        evaluate(
            fake_engine("--mode", "exit"), plan, served_target, good, ["a"], tmp_path / "eval3",
            simulator=_sim(0.4), baseline=first.baseline,
        )  # fmt: skip
    assert "integration fault" not in str(failed.value)
