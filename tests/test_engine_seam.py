"""The engine seam: an engine added by one module (tests/fake_engine.py) is known to the registry and the
config, exports drafters in its own format, reads their layer ids back and parses its own metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fake_engine import DOCTOR_PATCH, FakeEngine, fake_engine
from fixtures_engine import tiny_llama_drafter, write_config

from draftloop.infra.engines.base import EngineError, Speculation, get_engine, known_engines, register_engine
from draftloop.infra.engines.doctor import format_report, run_doctor
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
from draftloop.kernels.layer_ids import LayerIds

TINY_LLAMA = Path(__file__).resolve().parent.parent / "configs" / "tiny-llama.yaml"


def _config(tmp_path: Path, **overrides: object) -> ExperimentConfig:
    values = {"engine.python": sys.executable, "storage.root": str(tmp_path / "runs"), **overrides}
    return ExperimentConfig.load(TINY_LLAMA, values, base_dir=tmp_path)


def test_the_fake_engine_is_registered_and_accepted_by_the_config(tmp_path: Path) -> None:
    assert "fake" in known_engines() and {"vllm", "sglang"} <= set(known_engines())
    assert isinstance(get_engine("fake"), FakeEngine)
    config = _config(
        tmp_path,
        **{
            "engine.kind": "fake",
            "extraction.layer_id_convention": "fake",
            "extraction.aux_layer_ids": [0, 2, 4],
        },
    )
    assert config.engine.kind == "fake"
    assert config.aux_layer_ids_internal() == LayerIds((1, 3, 5), "layer_input")
    # A convention given by engine name resolves through that engine's class.
    assert config.extraction.layer_id_convention == FakeEngine.layer_id_convention == "layer_output"


def test_an_unknown_engine_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, **{"engine.kind": "tgi"})
    assert caught.value.field == "engine.kind"
    assert "tgi" in caught.value.reason
    for kind in ("fake", "sglang", "vllm"):
        assert kind in caught.value.reason
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, **{"extraction.layer_id_convention": "tgi"})
    assert caught.value.field == "extraction.layer_id_convention" and "vllm" in caught.value.reason


def test_registering_a_kind_twice_is_an_error() -> None:
    class AnotherFake(FakeEngine):
        pass

    with pytest.raises(EngineError, match="registered twice"):
        register_engine(AnotherFake)
    assert type(get_engine("fake")) is FakeEngine


def test_export_and_layer_ids_go_through_the_engine(tmp_path: Path) -> None:
    trained = LayerIds((1, 3, 5), "layer_input")
    engine = get_engine("fake")
    out = engine.export_drafter(tiny_llama_drafter(trained), tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    # layer_output numbering: the same tensors one lower, in the engine's own block too.
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert config["fake_engine"] == {"aux_layer_ids": [0, 2, 4]}
    assert config["draftloop"]["engine"] == "fake"
    read_back = engine.drafter_layer_ids(out)
    assert read_back == LayerIds((0, 2, 4), "layer_output")
    assert read_back is not None and read_back.as_input() == trained.ids
    # The same folder read by vLLM (layer_input) names other layers: the conventions do differ.
    vllm_ids = get_engine("vllm").drafter_layer_ids(out)
    assert vllm_ids is not None and vllm_ids.as_input() != trained.ids


def test_a_served_fake_engine_reports_its_own_counters(tmp_path: Path) -> None:
    engine = fake_engine()
    target = write_config(tmp_path / "target", {"architectures": ["LlamaForCausalLM"]})
    drafter = write_config(tmp_path / "drafter", {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]})
    with EngineServer(engine, target, tmp_path / "run", speculation=Speculation(drafter, 3)) as server:
        before = engine.parse_metrics(server.metrics_text())
        server.smoke_test()
        after = engine.parse_metrics(server.metrics_text())
    assert before is not None and after is not None
    delta = after - before
    assert delta.num_drafts > 0 and delta.num_draft_tokens == 3 * delta.num_drafts
    assert delta.per_position_acceptance == pytest.approx([0.6, 0.4, 0.2])
    assert engine.parse_metrics("fake_requests_running 0.0\n") is None


def test_doctor_asks_the_engine_and_reports_the_patches_the_family_needs(tmp_path: Path) -> None:
    engine = fake_engine()
    # StableLM's family declares the plugin's eagle3_enabler; the fake's probe reports it applied.
    target = write_config(
        tmp_path / "target", {"model_type": "stablelm", "architectures": ["StableLmForCausalLM"]}
    )
    drafter = engine.export_drafter(tiny_llama_drafter(LayerIds((1, 3, 5))), tmp_path / "drafter")
    report = run_doctor(engine, target, drafter)
    assert report["engine_version"] == "fake-0.1" and report["patches"] == [DOCTOR_PATCH]
    assert report["family"]["name"] == "stablelm"
    assert report["family"]["engine_patches"] == [{"name": "eagle3_enabler", "status": "applied", "ok": True}]
    assert report["layer_ids"]["engine_convention"] == "layer_output"
    assert report["layer_ids"]["engine_ids"] == [0, 2, 4] and report["layer_ids"]["consistent"] is True
    # The contract check ran too (this target folder has no weights: refused, and said so).
    assert report["pairing"]["ok"] is False and "weights" in report["pairing"]["reason"]
    text = format_report(report)
    assert "target family stablelm: engine patches needed: eagle3_enabler (applied)" in text
    assert "WARNING" not in text
