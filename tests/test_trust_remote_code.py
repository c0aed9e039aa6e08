"""target.trust_remote_code (and `draftloop simulate --trust-remote-code`) reaches every transformers
loader of the target outside the Ray actors: the simulator, the evaluation's prompt tokenizer, the
engine-side extraction's tokenizer and final norm, the simulate command. Off unless asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_engine import fake_engine
from fixtures_engine import evaluation_plan
from fixtures_kernels import builtin_prompts, load_target, untrained_drafter
from test_evaluation_run import saved_drafter

from draftloop.infra.evaluation.plan import EvaluationPlan
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.evaluation.simulator import NumericMode, encode_prompts, run_simulator
from draftloop.infra.extraction import engine as engine_extraction
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.kernels.checkpoint import save_drafter
from draftloop.kernels.layer_ids import LayerIds

MISSING = "missing"  # the loader was called without trust_remote_code
# Keyword arguments of the function under test -> the trust_remote_code each loader must get.
SETTINGS = pytest.mark.parametrize(
    ("kwargs", "trusted"), [({}, False), ({"trust_remote_code": True}, True)], ids=["default", "trusted"]
)
LOADERS = (
    ("AutoConfig", "from_pretrained"),
    ("AutoTokenizer", "from_pretrained"),
    ("AutoModelForCausalLM", "from_pretrained"),
    ("AutoModelForCausalLM", "from_config"),
)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """(loader, its trust_remote_code) for each call draftloop makes to a transformers Auto loader; the
    loaders still run. Calls transformers makes inside a loader (AutoConfig from AutoTokenizer) are left
    out: only draftloop's own arguments are under test."""
    import transformers

    calls: list[tuple[str, Any]] = []
    depth = 0

    for class_name, method in LOADERS:
        original = getattr(getattr(transformers, class_name), method)

        def record(
            *args: Any, _original: Any = original, _name: str = f"{class_name}.{method}", **kwargs: Any
        ) -> Any:
            nonlocal depth
            if depth == 0:
                calls.append((_name, kwargs.get("trust_remote_code", MISSING)))
            depth += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth -= 1

        monkeypatch.setattr(getattr(transformers, class_name), method, record)
    return calls


@pytest.fixture(scope="module")
def target_dir(zoo_target_dir: Callable[[str], Path]) -> Path:
    return zoo_target_dir("tiny-llama")


@pytest.fixture(scope="module")
def drafter_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target, _ = load_target(target_dir)
    folder = tmp_path_factory.mktemp("pair") / "drafter"
    return save_drafter(untrained_drafter(target, LayerIds((1, 3, 5))), folder)


def _config(target_dir: Path, **target: Any) -> ExperimentConfig:
    raw = {"name": "trust", "target": {"path": str(target_dir), **target}}
    return ExperimentConfig.from_dict(raw, check_environment=False)


@SETTINGS
def test_the_simulator_and_the_prompt_encoder(
    loads: list[tuple[str, Any]], target_dir: Path, drafter_dir: Path, kwargs: dict[str, Any], trusted: bool
) -> None:
    mode = NumericMode("float32", "transformers (llama)")
    figures = run_simulator(target_dir, drafter_dir, builtin_prompts()[:1], 2, 3, mode=mode, **kwargs)
    assert figures.num_drafts > 0
    assert loads == [
        ("AutoModelForCausalLM.from_pretrained", trusted),
        ("AutoTokenizer.from_pretrained", trusted),
    ]
    loads.clear()
    assert encode_prompts(target_dir, ["Hi."], **kwargs)[0]
    assert loads == [("AutoTokenizer.from_pretrained", trusted)]


def test_the_evaluation_plan_carries_the_targets_setting(target_dir: Path) -> None:
    plans = [
        EvaluationPlan.from_config(config)
        for config in (_config(target_dir), _config(target_dir, trust_remote_code=True))
    ]
    assert [plan.trust_remote_code for plan in plans] == [False, True]


def test_evaluate_loads_the_target_with_it(
    loads: list[tuple[str, Any]], target_dir: Path, tmp_path: Path
) -> None:
    """The fake engine's servers, the simulator run here (no figures given): every load is trusted."""
    drafter = saved_drafter(target_dir, tmp_path / "drafter")
    plan = evaluation_plan(max_tokens=4, concurrency=[1], trust_remote_code=True)
    report = evaluate(fake_engine(), plan, target_dir, drafter, ["Hi."], tmp_path / "eval")
    assert report.simulator is not None
    assert loads and all(trusted is True for _, trusted in loads), loads
    assert {name for name, _ in loads} == {
        "AutoTokenizer.from_pretrained",
        "AutoModelForCausalLM.from_pretrained",
    }


@SETTINGS
def test_the_final_norm(
    loads: list[tuple[str, Any]], target_dir: Path, kwargs: dict[str, Any], trusted: bool
) -> None:
    norm = engine_extraction.load_final_norm(target_dir, torch.float32, **kwargs)
    assert norm(torch.ones(1, 2, 256)).shape == (1, 2, 256)
    assert loads == [("AutoConfig.from_pretrained", trusted), ("AutoModelForCausalLM.from_config", trusted)]


class _NoServer:
    """start_server_actor's handle, for conversations that all are skipped before any request."""

    base_url = "http://127.0.0.1:9"
    model_name = "target"

    def stop(self) -> None:
        pass


@SETTINGS
def test_engine_extraction_from_the_config(
    loads: list[tuple[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    target_dir: Path,
    tmp_path: Path,
    kwargs: dict[str, Any],
    trusted: bool,
) -> None:
    monkeypatch.setenv("DRAFTLOOP_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(engine_extraction, "ensure_ray", lambda address, pids=None: None)
    monkeypatch.setattr(engine_extraction, "start_server_actor", lambda *args, **kwargs: _NoServer())
    config = _config(target_dir, **kwargs)
    no_answer = [{"id": "q", "messages": [{"role": "user", "content": "Hi."}]}]
    result = engine_extraction.extract_with_engine(config, str(target_dir), no_answer, None)
    assert [row["id"] for row in result.skipped] == ["q"] and not result.shards
    assert loads == [
        ("AutoTokenizer.from_pretrained", trusted),
        ("AutoConfig.from_pretrained", trusted),
        ("AutoModelForCausalLM.from_config", trusted),
    ]


@pytest.mark.parametrize("trusted", [False, True])
def test_the_simulate_command(
    loads: list[tuple[str, Any]], target_dir: Path, drafter_dir: Path, tmp_path: Path, trusted: bool
) -> None:
    from typer.testing import CliRunner

    from draftloop.cli import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n")
    args = ["simulate", "--target", str(target_dir), "--drafter", str(drafter_dir), "--prompts", str(prompts)]
    args += ["-k", "2", "--max-new-tokens", "2", "--json", *(["--trust-remote-code"] if trusted else [])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert loads == [
        ("AutoTokenizer.from_pretrained", trusted),
        ("AutoModelForCausalLM.from_pretrained", trusted),
    ]


def test_the_simulate_commands_help_says_what_the_flag_runs() -> None:
    from typer.testing import CliRunner

    from draftloop.cli import app

    result = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    words = " ".join(result.output.replace("│", " ").split())
    assert "--trust-remote-code" in words and "Run the Python code the --target folder ships" in words
