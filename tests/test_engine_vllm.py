"""The real vLLM (CPU) engine: drafters trained by draftloop served with EAGLE-3, engine vs simulator.

Each server start costs about a minute on this machine, so servers are shared: one evaluation per target
(baseline + speculative server) feeds several tests, and the off-by-one drafter reuses the baseline run.
The MLA pair (tiny-deepseek, served in bf16) is evaluated through the product's flow in test_flow_mla.py.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_engine import (
    evaluation_plan,
    export_for_vllm,
    require_vllm_env,
    shift_exported_layer_ids,
    vllm_settings,
)
from fixtures_kernels import trained_drafter
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.engines.base import Speculation, get_engine
from draftloop.infra.engines.doctor import run_doctor
from draftloop.infra.engines.pairing import DrafterPairingError
from draftloop.infra.engines.server import EngineServer, EngineStartError
from draftloop.infra.evaluation.benchmark import benchmark_server
from draftloop.infra.evaluation.diagnose import Diagnosis, diagnose, format_diagnosis
from draftloop.infra.evaluation.report import EvalReport
from draftloop.infra.evaluation.run import evaluate
from draftloop.infra.evaluation.simulator import SimulatorFigures, encode_prompts
from draftloop.infra.evaluation.verdict import VERDICT_FAULT
from draftloop.kernels.checkpoint import load_drafter
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.families.base import get_family
from draftloop.kernels.files import DrafterFormatError
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.simulate import simulate_acceptance

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MAX_TOKENS = 32
CONCURRENCY = [1, 4]
K = 3
TOLERANCE = 0.05


def _evaluate_pair(pair: Any, root: Path) -> tuple[Path, SimulatorFigures, EvalReport]:
    require_vllm_env()
    drafter_dir = export_for_vllm(pair.drafter, root / "drafter")
    simulation = simulate_acceptance(
        pair.target, pair.tokenizer, pair.drafter, pair.held_out_prompts, k=K, max_new_tokens=MAX_TOKENS
    )
    simulator = SimulatorFigures.from_report(simulation)
    engine = get_engine("vllm", vllm_settings())
    plan = evaluation_plan(
        k=K, max_tokens=MAX_TOKENS, concurrency=CONCURRENCY, acceptance_tolerance=TOLERANCE
    )
    report = evaluate(
        engine, plan, pair.target_dir, drafter_dir, pair.held_out_prompts, root / "eval", simulator=simulator
    )
    print(
        f"\n[{pair.recipe}] startup baseline {report.baseline.startup_s:.1f}s "
        f"spec {report.speculative.startup_s:.1f}s; "
        f"acceptance engine {report.engine_acceptance and report.engine_acceptance['acceptance_rate']} "
        f"simulator {simulator.acceptance_rate}; speedup {report.speedup}; verdict {report.verdict}"
    )
    return drafter_dir, simulator, report


@pytest.fixture(scope="module")
def llama_eval(
    trained_pair: Callable[[str], Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Path, SimulatorFigures, EvalReport]:
    pair = trained_pair("tiny-llama")
    drafter_dir, simulator, report = _evaluate_pair(pair, tmp_path_factory.mktemp("vllm-llama"))
    return pair, drafter_dir, simulator, report


def _assert_consistent(report: EvalReport, simulator: SimulatorFigures) -> None:
    acceptance = report.engine_acceptance
    assert acceptance is not None, "the speculative server reported no spec-decode counters"
    assert acceptance["num_drafts"] > 0 and acceptance["num_draft_tokens"] > 0
    assert report.lossless, f"greedy outputs differ for prompts {report.mismatched_prompts}"
    assert simulator.acceptance_rate is not None
    # The drafter must be worth measuring: well above the ~0 of an untrained one.
    assert simulator.acceptance_rate > 0.2, simulator.acceptance_rate
    gap = abs(acceptance["acceptance_rate"] - simulator.acceptance_rate)
    assert gap <= TOLERANCE, (acceptance, simulator)
    assert report.verdict != VERDICT_FAULT, report.reasons
    for plot in report.plots:
        assert Path(plot).stat().st_size > 1000


def test_tiny_llama_engine_matches_simulator_and_is_lossless(llama_eval: Any) -> None:
    _pair, _drafter_dir, simulator, report = llama_eval
    _assert_consistent(report, simulator)
    assert set(report.speedup) == set(CONCURRENCY)
    assert report.engine_layer_ids == {
        "ids": [1, 3, 5],
        "convention": "layer_input",
        "layer_input": [1, 3, 5],
    }


def _diagnose(llama_eval: Any, drafter: Path, run_dir: Path) -> Diagnosis:
    """diagnose() of `drafter` on tiny-llama, the evaluation's baseline reused (one server started)."""
    pair, _drafter_dir, _simulator, good = llama_eval
    engine = get_engine("vllm", vllm_settings())
    plan = evaluation_plan(k=K, max_tokens=MAX_TOKENS, concurrency=[1], acceptance_tolerance=TOLERANCE)
    diagnosis = diagnose(
        engine, plan, pair.target_dir, drafter, pair.held_out_prompts, run_dir, baseline=good.baseline
    )
    print("\n" + format_diagnosis(diagnosis))
    return diagnosis


def test_off_by_one_layer_ids_are_an_integration_fault_named_by_diagnose(
    llama_eval: Any, tmp_path: Path
) -> None:
    """The conventions bug: ids exported one lower (layer_output written where vLLM reads layer_input).

    Every check must see it: the engine-vs-simulator acceptance comparison (tiny-llama's layers carry
    distinct markers, like real models' layer-specific activations, so the shift costs acceptance), the
    comparison of the exported ids with the ids recorded at training, and diagnose's readings: the
    simulator fed the layers vLLM reads reproduces the engine's acceptance, fed the trained ones it
    accepts more — the cause, with the export command that fixes it.
    """
    pair, drafter_dir, simulator, _good = llama_eval
    shifted = shift_exported_layer_ids(drafter_dir, tmp_path / "shifted", -1)
    engine = get_engine("vllm", vllm_settings())
    doctor = run_doctor(engine, pair.target_dir, shifted)
    assert doctor["layer_ids"]["consistent"] is False
    assert doctor["layer_ids"]["layer_input_ids"] == [0, 2, 4]
    assert doctor["layer_ids"]["trained_layer_input_ids"] == [1, 3, 5]
    diagnosis = _diagnose(llama_eval, shifted, tmp_path / "eval")
    report = diagnosis.report
    assert report is not None
    acceptance = report.engine_acceptance
    print(
        f"\n[off-by-one] engine {acceptance and acceptance['acceptance_rate']} vs {simulator.acceptance_rate}"
    )
    assert report.verdict == VERDICT_FAULT
    assert any("trained on layer_input [1, 3, 5]" in reason for reason in report.reasons), report.reasons
    assert acceptance is not None and simulator.acceptance_rate - acceptance["acceptance_rate"] > TOLERANCE
    assert report.lossless  # still lossless: the verifier rejects the bad drafts
    assert diagnosis.verdict == VERDICT_FAULT and diagnosis.exit_code == 4
    assert diagnosis.cause is not None and diagnosis.cause.name == "layer_id_convention", diagnosis.cause
    served, trained = (
        next(f for f in diagnosis.readings if f.reading.engine_reads == e) for e in (True, False)
    )
    assert served.reading.capture_ids == (0, 2, 4) and trained.reading.capture_ids == (1, 3, 5)
    # The engine's acceptance is the one the simulator gives when fed what vLLM reads.
    assert (
        served.acceptance_rate is not None
        and abs(served.acceptance_rate - acceptance["acceptance_rate"]) <= TOLERANCE
    )
    assert diagnosis.cause.fix == f"draftloop export --drafter {shifted} --engine vllm --out {shifted}-vllm"
    fixed = CliRunner().invoke(app, diagnosis.cause.fix.split()[1:])
    assert fixed.exit_code == 0, fixed.output
    assert json.loads(Path(f"{shifted}-vllm", "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"
    ] == [1, 3, 5]


def test_diagnose_says_ok_for_the_speculators_export_with_the_native_acceptance(
    llama_eval: Any, tmp_path: Path
) -> None:
    """The speculators-format export (the speculators library's config, the draftloop record kept) served
    by vLLM: `ok`, no cause, and the acceptance the native export has in the same engine."""
    pair, drafter_dir, _simulator, good = llama_eval
    out = tmp_path / "speculators"
    command = ["export", "--drafter", str(drafter_dir), "--engine", "speculators", "--out", str(out)]
    exported = CliRunner().invoke(app, [*command, "--target", str(pair.target_dir)])
    assert exported.exit_code == 0, exported.output
    diagnosis = _diagnose(llama_eval, out, tmp_path / "eval")
    assert diagnosis.folder.format == "speculators"
    assert diagnosis.verdict == "ok" and diagnosis.exit_code == 0, diagnosis.reasons
    assert diagnosis.cause is None and len(diagnosis.readings) == 1  # vLLM reads what it learnt on
    assert diagnosis.engine is not None and diagnosis.simulator is not None
    gap = abs(diagnosis.engine["acceptance_rate"] - diagnosis.simulator["acceptance_rate"])
    assert gap <= TOLERANCE
    native = good.engine_acceptance
    assert (
        native is not None
        and abs(diagnosis.engine["acceptance_rate"] - native["acceptance_rate"]) <= TOLERANCE
    )
    assert diagnosis.served_command is not None and "--speculative-config" in diagnosis.served_command
    assert diagnosis.smoke_text


def test_a_published_sglang_folder_on_vllm_is_named_a_convention_fault(
    llama_eval: Any, tmp_path: Path
) -> None:
    """An SGLang/SpecForge folder (ids in layer_output, eagle_config) without a draftloop record served by
    vLLM: read both ways, the layer_output reading is the one it was trained on; the fix is an export."""
    pair = llama_eval[0]
    published = tmp_path / "published-sglang"
    get_engine("sglang").export_drafter(pair.drafter, published)
    config = json.loads((published / "config.json").read_text())
    del config["draftloop"]  # as published: no record of the convention
    (published / "config.json").write_text(json.dumps(config))
    diagnosis = _diagnose(llama_eval, published, tmp_path / "eval")
    assert diagnosis.folder.format == "sglang" and "both" in diagnosis.folder.stated
    assert diagnosis.verdict == VERDICT_FAULT and diagnosis.cause is not None
    assert (
        diagnosis.cause.name == "layer_id_convention"
        and "layer_output convention" in diagnosis.cause.explanation
    )
    assert diagnosis.cause.fix is not None and "--convention layer_output" in diagnosis.cause.fix
    fixed = CliRunner().invoke(app, diagnosis.cause.fix.split()[1:])
    assert fixed.exit_code == 0, fixed.output
    exported = json.loads(Path(f"{published}-vllm", "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # what it was trained on, for vLLM


@pytest.fixture(scope="module")
def published_eagle31(llama_eval: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """An EAGLE 3.1 drafter (fc_norm + norm_output, the published layer) trained on the pair's samples,
    written as a published vLLM folder: the vLLM field names, no draftloop block."""
    pair = llama_eval[0]
    drafter = trained_drafter(
        pair.target, pair.drafter.config.aux_layer_ids, pair.train_samples, variant="eagle3.1"
    )
    published = tmp_path_factory.mktemp("published-3.1") / "drafter"
    get_engine("vllm").export_drafter(drafter, published)
    config = json.loads((published / "config.json").read_text())
    del config["draftloop"]
    (published / "config.json").write_text(json.dumps(config))
    return drafter, published


def _with_fields(folder: Path, out: Path, **fields: bool) -> Path:
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return out


def test_a_published_eagle31_folder_loads_simulates_and_is_served_as_simulated(
    llama_eval: Any, published_eagle31: tuple[Any, Path], tmp_path: Path
) -> None:
    """The folder's fields as vLLM names them pick the EAGLE 3.1 layer on both sides: load_drafter
    computes what was trained, and vLLM serves it with the simulator's acceptance (and diagnose reads
    norm_output the other way too: that reading accepts far less)."""
    trained, published = published_eagle31
    config = json.loads((published / "config.json").read_text())
    assert {name: config[name] for name in ("fc_norm", "norm_before_fc", "norm_output")} == {
        "fc_norm": True, "norm_before_fc": False, "norm_output": True
    }  # fmt: skip
    with safe_open(str(published / "model.safetensors"), "pt") as weights:
        assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= set(weights.keys())
    loaded = load_drafter(published, convention="layer_input")
    assert (
        loaded.config.variant == "eagle3.1"
        and loaded.config.variant_options == trained.config.variant_options
    )
    for name, tensor in trained.weights_state_dict().items():
        assert torch.equal(loaded.weights_state_dict()[name], tensor), name

    diagnosis = _diagnose(llama_eval, published, tmp_path / "eval")
    assert diagnosis.folder.norm_output is True
    engine, simulator = diagnosis.engine or {}, diagnosis.simulator or {}
    assert simulator["acceptance_rate"] > 0.5, simulator  # a trained drafter, not noise matching noise
    assert abs(engine["acceptance_rate"] - simulator["acceptance_rate"]) <= TOLERANCE, (engine, simulator)
    assert diagnosis.verdict != VERDICT_FAULT and diagnosis.cause is None, diagnosis.reasons
    served, flipped = [f for f in diagnosis.readings if f.reading.capture_ids == (1, 3, 5)]
    assert served.reading.engine_reads and served.acceptance_rate == simulator["acceptance_rate"]
    assert flipped.reading.norm_output is False
    assert (
        flipped.acceptance_rate is not None
        and flipped.acceptance_rate < served.acceptance_rate - 2 * TOLERANCE
    )


def test_a_published_eagle31_folder_with_a_flag_flipped_is_an_integration_fault(
    llama_eval: Any, published_eagle31: tuple[Any, Path], tmp_path: Path
) -> None:
    """norm_output flipped in config.json: vLLM serves another layer than was trained, and acceptance
    falls; diagnose names the flag (the reading with it on accepts clearly more), with the fix. fc_norm
    flipped leaves weights no layer reads: refused by name before anything runs."""
    _trained, published = published_eagle31
    flipped = _with_fields(published, tmp_path / "norm-output-off", norm_output=False)
    diagnosis = _diagnose(llama_eval, flipped, tmp_path / "eval")
    assert diagnosis.verdict == VERDICT_FAULT, diagnosis.reasons
    assert diagnosis.cause is not None and diagnosis.cause.name == "final_norm", diagnosis.cause
    assert diagnosis.cause.fix == f'set "norm_output": true in {flipped.resolve()}/config.json'
    engine, simulator = diagnosis.engine or {}, diagnosis.simulator or {}
    assert abs(engine["acceptance_rate"] - simulator["acceptance_rate"]) <= TOLERANCE  # served as read

    no_fc_norm = _with_fields(published, tmp_path / "fc-norm-off", fc_norm=False)
    with pytest.raises(DrafterFormatError, match=r"unexpected tensors.*fc_norm\.0\.weight"):
        load_drafter(no_fc_norm, convention="layer_input")


def test_standard_attention_drafter_on_mla_target_refused_before_startup(
    trained_pair: Callable[[str], Any], tmp_path: Path
) -> None:
    pair = trained_pair("tiny-deepseek")
    llama_style = Eagle3Drafter(
        DrafterConfig.for_target(pair.target.config, LayerIds((1, 2, 3)), family=get_family("llama"))
    )
    drafter_dir = get_engine("vllm").export_drafter(llama_style, tmp_path / "llama-drafter")
    started = time.monotonic()
    with pytest.raises(DrafterPairingError) as info:
        evaluate(
            get_engine("vllm", vllm_settings()), evaluation_plan(max_tokens=4, concurrency=[1]),
            pair.target_dir, drafter_dir, ["hi"], tmp_path / "eval",
        )  # fmt: skip
    assert time.monotonic() - started < 10  # refused, not started
    assert "No common block size" in str(info.value) and "Eagle3DeepseekV2ForCausalLM" in str(info.value)
    assert not (tmp_path / "eval" / "server-baseline.log").exists()


def test_architecture_without_eagle3_served_after_plugin_patch(
    tiny_stablelm_dir: Path, tmp_path: Path
) -> None:
    """StableLM has no SupportsEagle3 in vLLM 0.32.0: the plugin's enabler makes EAGLE-3 work."""
    require_vllm_env()
    engine = get_engine("vllm", vllm_settings())
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_stablelm_dir)
    drafter = Eagle3Drafter(DrafterConfig.for_target(config, LayerIds((1, 3, 5))))
    drafter_dir = engine.export_drafter(drafter, tmp_path / "drafter")

    doctor = run_doctor(engine, tiny_stablelm_dir, drafter_dir)
    assert doctor["eagle3"] == {
        "support": "plugin:eagle3_enabler",
        "class": "StablelmForCausalLM",
        "native": False,
    }
    assert doctor["drafter"]["engine_layer_ids"]["ids"] == [1, 3, 5]

    prompts = ["Write a haiku about rain.", "What is 7 times 8?"]
    prompt_ids = encode_prompts(tiny_stablelm_dir, prompts)
    server = EngineServer(engine, tiny_stablelm_dir, tmp_path / "run", name="speculative",
                          speculation=Speculation(drafter_dir, K))  # fmt: skip
    with server:
        run = benchmark_server(
            server, engine, prompt_ids, [1], evaluation_plan(max_tokens=16).benchmark, name="speculative",
            num_speculative_tokens=K,
        )  # fmt: skip
    print(f"\n[stablelm] startup {server.startup_s:.1f}s counters {run.levels[0].counters}")
    counters = run.levels[0].counters
    assert counters is not None and counters["num_drafts"] > 0
    records = [
        json.loads(line) for line in (tmp_path / "run" / "plugin-report.jsonl").read_text().splitlines()
    ]
    enabled = [
        r for r in records if r.get("patch") == "eagle3_enabler" and r.get("class") == "StablelmForCausalLM"
    ]
    assert enabled and enabled[0]["status"] == "applied"
    assert "EAGLE-3 enabled for StablelmForCausalLM" in server.log_path.read_text()

    # Speculation stays lossless: the served greedy text equals Hugging Face's greedy generation.
    target = AutoModelForCausalLM.from_pretrained(tiny_stablelm_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_stablelm_dir)
    for ids, served in zip(prompt_ids, run.outputs, strict=True):
        with torch.no_grad():
            out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, pad_token_id=0)
        assert tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True) == served


def test_bad_flag_fails_fast_with_log_excerpt(zoo_target_dir: Callable[[str], Path], tmp_path: Path) -> None:
    require_vllm_env()
    engine = get_engine("vllm", vllm_settings(extra_args=("--no-such-flag", "1")))
    server = EngineServer(engine, zoo_target_dir("tiny-llama"), tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(EngineStartError) as info, server:
        pass
    elapsed = time.monotonic() - started
    print(f"\n[bad flag] failed after {elapsed:.1f}s: {info.value.summary}")
    assert elapsed < 60, elapsed
    assert "--no-such-flag" in info.value.log_excerpt
    assert server.process is not None and server.process.poll() is not None


def test_engine_doctor_cli_on_a_native_target(zoo_target_dir: Callable[[str], Path]) -> None:
    require_vllm_env()
    target = zoo_target_dir("tiny-llama")
    result = CliRunner().invoke(
        app, ["engine", "doctor", "--target", str(target), "--python", str(vllm_settings().python), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["vllm_version"] == "0.32.0"
    assert report["eagle3"] == {"support": "native", "class": "LlamaForCausalLM", "native": True}
    statuses = {patch["name"]: patch["status"] for patch in report["patches"]}
    assert statuses == {
        "speculative_whitelist": "noop",
        "eagle3_enabler": "applied",
        "kimi_media_alias": "noop",
        "cpu_rope_3d_query": "applied",
        "cpu_hidden_states_writer": "applied",  # the CPU platform: the connector's writer needs it
        "cpu_fork_engine_core": "applied",  # the CPU platform forces spawn
    }
