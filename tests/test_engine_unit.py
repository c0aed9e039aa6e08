"""Engine layer without a real engine: command lines, export conventions, metric parsing on recorded
outputs, fatal-log detection, the plugin's patch logic, and server lifecycle/evaluation on a fake server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fake_engine import fake_engine
from fixtures_engine import (
    REPO_ROOT,
    SGLANG_CHAT_RESPONSE_NEWER,
    SGLANG_GENERATE_RESPONSE,
    SGLANG_METRICS,
    VLLM_LOG_BENIGN,
    VLLM_LOG_NO_COMMON_BLOCK,
    VLLM_LOG_WORKER_TRACEBACK,
    VLLM_METRICS_AFTER,
    VLLM_METRICS_BEFORE,
    engine_settings,
    tiny_llama_drafter,
    write_config,
)
from pydantic import model_validator
from pydantic.dataclasses import dataclass as pyd_dataclass
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.engines import server as server_module
from draftloop.infra.engines.base import (
    EngineConfigError,
    EngineError,
    EngineSettings,
    ServerSpec,
    Speculation,
    get_engine,
    known_engines,
)
from draftloop.infra.engines.doctor import describe_family, format_report
from draftloop.infra.engines.leftovers import clean_stale_servers
from draftloop.infra.engines.pairing import DrafterPairingError, check_drafter_contract, check_drafter_pairing
from draftloop.infra.engines.server import EngineServer, EngineSmokeError, EngineStartError
from draftloop.infra.runtime.config import EngineConfig
from draftloop.infra.runtime.processes import is_alive
from draftloop.kernels.counters import SpecCounters
from draftloop.kernels.layer_ids import LayerIds

PLUGIN_DIR = Path(__file__).resolve().parent.parent / "infra" / "engines" / "vllm_plugin_pkg"


@pytest.fixture(scope="module")
def plugin_patches() -> Any:
    sys.path.insert(0, str(PLUGIN_DIR))
    try:
        import draftloop_vllm_plugin.patches as patches

        yield patches
    finally:
        sys.path.remove(str(PLUGIN_DIR))


# ------------------------------------------------------------------------------------------------
# Registry and command lines


def test_registry_knows_both_engines_and_refuses_unknown() -> None:
    assert {"vllm", "sglang"} <= set(known_engines())
    assert get_engine("vllm").kind == "vllm"
    assert get_engine("SGLang").kind == "sglang"
    with pytest.raises(EngineConfigError, match=r"engine\.kind"):
        get_engine("tgi")


def test_engine_settings_are_the_engine_section_without_k() -> None:
    """One place builds them (EngineConfig.settings): a field added to the section and not to the
    settings, or the reverse, fails here; k is each server's (Speculation), never the engine's."""
    settings_fields = {item.name for item in dataclasses.fields(EngineSettings)}
    section_fields = set(EngineConfig.model_fields)
    # (plus the target's: its own code, and a thinking target's reasoning parser)
    assert settings_fields == (section_fields - {"num_speculative_tokens"}) | {
        "trust_remote_code",
        "reasoning_parser",
    }
    assert all(item.default is dataclasses.MISSING for item in dataclasses.fields(EngineSettings))
    section = EngineConfig(max_num_seqs=7, extra_args=["--x"], env={"A": "1"})
    settings = section.settings(trust_remote_code=True)
    assert (settings.max_num_seqs, settings.extra_args, settings.env) == (7, ("--x",), {"A": "1"})
    assert settings.trust_remote_code is True and settings.kv_cache_space_gib == section.kv_cache_space_gib
    with pytest.raises(EngineError, match="1 token or more"):
        Speculation(Path("/d"), 0)


def test_an_engine_without_settings_exports_but_cannot_serve(tmp_path: Path) -> None:
    engine = get_engine("vllm")
    assert engine.parse_metrics(VLLM_METRICS_BEFORE) is not None  # reading counters needs none
    with pytest.raises(EngineError, match="without settings"):
        engine.server_command(ServerSpec(Path("/m"), 8123))


def test_vllm_command_line_and_environment(tmp_path: Path) -> None:
    engine = get_engine("vllm", engine_settings(python="/env/bin/python"))
    baseline = engine.server_command(ServerSpec(Path("/m"), 8123))
    assert baseline[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--speculative-config" not in baseline
    for flag, value in (
        ("--host", "127.0.0.1"),
        ("--port", "8123"),
        ("--dtype", "float32"),
        ("--max-model-len", "1024"),
    ):
        assert baseline[baseline.index(flag) + 1] == value
    assert "--enforce-eager" in baseline
    spec = engine.server_command(ServerSpec(Path("/m"), 8123, speculation=Speculation(Path("/d"), 4)))
    config = json.loads(spec[spec.index("--speculative-config") + 1])
    assert config == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}
    env = engine.server_env(tmp_path)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache")  # /v/bin/python: not a writable env
    environment = tmp_path / "venv"
    (environment / "bin").mkdir(parents=True)
    shared = get_engine("vllm", engine_settings(python=str(environment / "bin" / "python")))
    assert shared.server_env(tmp_path / "run")["VLLM_CACHE_ROOT"] == str(environment / "draftloop-vllm-cache")
    assert env["VLLM_PLUGINS"] == "draftloop_vllm_plugin"
    gpu = get_engine("vllm", engine_settings(num_gpus=1)).server_env(tmp_path)
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu and "LD_PRELOAD" not in gpu


def test_sglang_command_line_counts_k_plus_one_draft_tokens() -> None:
    engine = get_engine("sglang", engine_settings(kind="sglang", python="/sg/bin/python"))
    argv = engine.server_command(ServerSpec(Path("/m"), 30000, speculation=Speculation(Path("/d"), 3)))
    assert argv[:3] == ["/sg/bin/python", "-m", "sglang.launch_server"]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--speculative-algorithm") == "EAGLE3"
    assert value("--speculative-draft-model-path") == "/d"
    assert value("--speculative-num-steps") == "3"
    assert value("--speculative-eagle-topk") == "1"
    assert value("--speculative-num-draft-tokens") == "4"
    assert "--enable-metrics" in argv and value("--host") == "127.0.0.1"
    baseline = engine.server_command(ServerSpec(Path("/m"), 30000))
    assert "--speculative-algorithm" not in baseline


def test_target_trust_remote_code_reaches_both_servers_and_the_serving_command(tmp_path: Path) -> None:
    from draftloop.infra.runtime.config import ExperimentConfig

    def config(trust: bool, kind: str) -> Any:
        overrides = {
            "target.trust_remote_code": trust,
            "engine.kind": kind,
            "target.path": str(tmp_path / "t"),
        }
        return ExperimentConfig.load(
            REPO_ROOT / "configs" / "tiny-llama.yaml", overrides, check_environment=False
        )

    for kind in ("vllm", "sglang"):
        trusted = get_engine(kind, config(True, kind).engine_settings())
        plain = get_engine(kind, config(False, kind).engine_settings())
        spec = ServerSpec(Path("/m"), 8123, speculation=Speculation(Path("/d"), 3))
        assert "--trust-remote-code" in trusted.server_command(spec), kind
        assert "--trust-remote-code" in trusted.user_serving_command("/m", "/d", 3), kind
        assert "--trust-remote-code" not in plain.server_command(spec), kind
        assert "--trust-remote-code" not in plain.user_serving_command("/m", "/d", 3), kind


def test_export_uses_each_engines_layer_id_convention(tmp_path: Path) -> None:
    trained = LayerIds((1, 3, 5), "layer_input")
    drafter = tiny_llama_drafter(trained)
    vllm, sglang = get_engine("vllm"), get_engine("sglang")
    vllm_dir = vllm.export_drafter(drafter, tmp_path / "vllm")
    sglang_dir = sglang.export_drafter(drafter, tmp_path / "sglang")
    vllm_ids = vllm.drafter_layer_ids(vllm_dir)
    sglang_ids = sglang.drafter_layer_ids(sglang_dir)
    assert vllm_ids == LayerIds((1, 3, 5), "layer_input")
    # SGLang numbers by layer OUTPUT: the same tensors are one lower.
    assert sglang_ids == LayerIds((0, 2, 4), "layer_output")
    assert sglang_ids is not None and sglang_ids.as_input() == trained.ids
    nested = json.loads((sglang_dir / "config.json").read_text())["eagle_config"]
    assert nested["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]


# ------------------------------------------------------------------------------------------------
# Metrics


def test_vllm_metrics_parse_and_difference() -> None:
    engine = get_engine("vllm")
    before = engine.parse_metrics(VLLM_METRICS_BEFORE)
    after = engine.parse_metrics(VLLM_METRICS_AFTER)
    assert before == SpecCounters(10, 30, 12, (7, 4, 1))
    assert after is not None and before is not None
    delta = after - before
    assert delta == SpecCounters(100, 300, 150, (70, 50, 30))
    assert delta.acceptance_rate == pytest.approx(0.5)
    assert delta.mean_acceptance_length == pytest.approx(2.5)
    assert delta.per_position_acceptance == pytest.approx([0.7, 0.5, 0.3])
    assert engine.parse_metrics('vllm:num_requests_running{engine="0"} 0.0\n') is None


def test_sglang_counters_from_recorded_responses() -> None:
    engine = get_engine("sglang", engine_settings(kind="sglang"))
    old = engine.counters_from_response(SGLANG_GENERATE_RESPONSE, 3)
    # 32 tokens in 12 verify steps: 20 accepted drafts, acceptance length 32/12.
    assert old == SpecCounters(12, 36, 20, ())
    assert old is not None and old.mean_acceptance_length == pytest.approx(32 / 12)
    newer = engine.counters_from_response(SGLANG_CHAT_RESPONSE_NEWER, 3)
    assert newer is not None
    assert (newer.num_drafts, newer.num_draft_tokens, newer.num_accepted_tokens) == (10, 30, 20)
    # histogram [1,2,3,4] (steps accepting 0..3 drafts) -> position i accepted by steps with j > i.
    assert newer.accepted_per_position == (9, 7, 4)
    # Its /metrics gauges are most-recent-batch values: no cumulative counters to difference.
    assert engine.parse_metrics(SGLANG_METRICS) is None
    assert engine.request_extras() == {"return_meta_info": True}
    assert engine.counters_from_response({"choices": [{"text": "x"}]}, 3) is None


# ------------------------------------------------------------------------------------------------
# Fatal log patterns


def test_fatal_patterns_on_recorded_logs() -> None:
    engine = get_engine("vllm")
    found = engine.find_fatal(VLLM_LOG_NO_COMMON_BLOCK)
    assert found is not None and found[0].name == "no_common_block_size"
    assert "MLA" in found[0].hint
    found = engine.find_fatal(VLLM_LOG_WORKER_TRACEBACK)
    assert found is not None and found[0].name == "exception" and "draft_id_to_target_id" in found[1]
    assert (
        engine.find_fatal("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        is not None
    )
    assert engine.find_fatal("NCCL error in: ../group.cpp:1, unhandled system error")[0].name == "nccl"  # type: ignore[index]


def test_bare_exception_line_without_traceback_is_not_fatal(tmp_path: Path) -> None:
    # The server's check only trusts an exception line that ends a traceback.
    server = EngineServer(fake_engine(), tmp_path, tmp_path)
    assert server._fatal_in_log(VLLM_LOG_BENIGN) is None
    assert server._fatal_in_log(VLLM_LOG_BENIGN + VLLM_LOG_WORKER_TRACEBACK) is not None


# ------------------------------------------------------------------------------------------------
# Plugin patch logic (no vLLM needed)


def test_whitelist_patch_on_a_pydantic_config_like_older_vllm(plugin_patches: Any) -> None:
    class Text:
        def __init__(self, model_type: str) -> None:
            self.model_type = model_type

    class Target:
        def __init__(self, model_type: str) -> None:
            self.hf_text_config = Text(model_type)

    @pyd_dataclass(config={"arbitrary_types_allowed": True})
    class OldSpeculativeConfig:
        method: str
        target_model_config: Any = None

        @model_validator(mode="after")
        def _verify_args(self) -> OldSpeculativeConfig:
            eagle3_target_supported = ["llama", "qwen", "minicpm", "gpt_oss"]
            if (
                self.method == "eagle3"
                and self.target_model_config
                and not any(
                    s in self.target_model_config.hf_text_config.model_type for s in eagle3_target_supported
                )
            ):
                raise ValueError(
                    f"Eagle3 is only supported for {eagle3_target_supported} models. "
                    f"Got {self.target_model_config.hf_text_config.model_type=}"
                )
            return self

    with pytest.raises(ValueError, match="only supported"):
        OldSpeculativeConfig(method="eagle3", target_model_config=Target("kimi_k2"))
    name = plugin_patches.find_whitelist_validator(OldSpeculativeConfig)
    assert name == "_verify_args"
    wrapped = plugin_patches.wrap_whitelist_validator(
        getattr(OldSpeculativeConfig, name), ("kimi_k2", "deepseek_v3")
    )
    plugin_patches.install_validator(OldSpeculativeConfig, name, wrapped)
    assert OldSpeculativeConfig(method="eagle3", target_model_config=Target("kimi_k2")).method == "eagle3"
    assert OldSpeculativeConfig(method="eagle3", target_model_config=Target("deepseek_v3")).method == "eagle3"
    with pytest.raises(ValueError, match="only supported"):  # others are still refused
        OldSpeculativeConfig(method="eagle3", target_model_config=Target("gpt2"))


class _ResidualLayer(torch.nn.Module):
    """vLLM Llama-style: (positions, hidden_states, residual) -> (hidden_states, residual)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(8, 8)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> Any:
        stream = hidden_states if residual is None else hidden_states + residual
        return self.linear(stream), stream


class _PlainLayer(torch.nn.Module):
    """Layers without the residual split (StableLM-style): the stream is hidden_states."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> Any:
        hidden_states.mul_(1.0)  # an in-place op on the input, as fused kernels do
        return hidden_states + self.linear(hidden_states), None


def _toy_model_class(layer_cls: type, residual_style: bool) -> type:
    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList([layer_cls(i) for i in range(5)])

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            hidden, residual = self.embed_tokens(input_ids), None
            self.inputs = []
            for layer in self.layers:
                if residual_style:
                    self.inputs.append(hidden if residual is None else hidden + residual)
                    hidden, residual = layer(positions, hidden, residual)
                else:
                    self.inputs.append(hidden.clone())
                    hidden, _ = layer(positions, hidden)
            return hidden if residual is None else hidden + residual

    class ToyForCausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids, positions)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    return ToyForCausalLM


@pytest.mark.parametrize("layer_cls,residual_style", [(_ResidualLayer, True), (_PlainLayer, False)])
def test_eagle3_enabler_returns_the_inputs_of_the_chosen_layers(
    plugin_patches: Any, layer_cls: type, residual_style: bool
) -> None:
    cls = _toy_model_class(layer_cls, residual_style)
    assert plugin_patches.eagle3_support(cls) == "plugin:eagle3_enabler"
    enabled = plugin_patches.enable_eagle3(cls)
    assert enabled is not cls and enabled.__name__ == cls.__name__ and enabled.supports_eagle3
    assert plugin_patches.enable_eagle3(cls) is enabled  # one subclass per class
    assert plugin_patches.eagle3_support(enabled) == "plugin:eagle3_enabler"
    model = enabled()
    ids, positions = torch.tensor([1, 2, 3]), torch.arange(3)
    plain = model(ids, positions)
    assert isinstance(plain, torch.Tensor)  # no aux layers set: forward unchanged
    assert model.get_eagle3_default_aux_hidden_state_layers() == (2, 2, 2)
    model.set_aux_hidden_state_layers((3, 1, 4))
    hidden, aux = model(ids, positions)
    assert torch.equal(hidden, plain)
    expected = model.model.inputs
    assert len(aux) == 3
    for captured, layer_index in zip(aux, (1, 3, 4), strict=True):  # id order, layer_input convention
        assert torch.allclose(captured, expected[layer_index])
    with pytest.raises(ValueError, match="out of range"):
        model.set_aux_hidden_state_layers((1, 2, 9))


def test_enabler_leaves_native_classes_alone(plugin_patches: Any) -> None:
    class Native(torch.nn.Module):
        supports_eagle3 = True

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    assert plugin_patches.enable_eagle3(Native) is Native
    assert plugin_patches.eagle3_support(Native) == "native"


def test_cpu_rope_patch_rotates_a_flattened_copy_and_writes_back(plugin_patches: Any) -> None:
    """The rotary op sees [tokens, heads * head_size] copies; a strided 3-D query view (MLA's rope
    slice of q) gets the result in place."""
    import torch

    q_full = torch.zeros(3, 4, 8)
    q_full[..., 4:] = torch.arange(3 * 4 * 4, dtype=torch.float32).view(3, 4, 4)
    key = torch.ones(3, 1, 4)
    seen: list[tuple[int, ...]] = []

    def rotate(query_2d: Any, key_2d: Any) -> None:  # stands in for the in-place op: negates
        seen.extend([tuple(query_2d.shape), tuple(key_2d.shape)])
        query_2d.neg_()
        key_2d.mul_(2)

    query = q_full[..., 4:]
    expected = -query.clone()
    returned_query, returned_key = plugin_patches.flattened_rotary_call(rotate, query, key)
    assert seen == [(3, 16), (3, 4)]
    assert returned_query is query and torch.equal(q_full[..., 4:], expected)
    assert torch.equal(q_full[..., :4], torch.zeros(3, 4, 4))
    assert returned_key is key and torch.equal(key, torch.full((3, 1, 4), 2.0))


def test_kimi_media_placeholder_alias(plugin_patches: Any) -> None:
    kimi = SimpleNamespace(model_type="kimi_k25", media_placeholder_token_id=163605)
    assert plugin_patches.add_media_placeholder_alias(kimi) is True
    assert kimi.image_token_index == 163605
    llama = SimpleNamespace(model_type="llama")
    assert plugin_patches.add_media_placeholder_alias(llama) is False
    assert not hasattr(llama, "image_token_index")


# ------------------------------------------------------------------------------------------------
# Pairing refusal and verdicts


def test_standard_attention_drafter_on_mla_target_is_refused(tmp_path: Path) -> None:
    # Kimi-K2.5 wraps a DeepSeek-V3 decoder: its family comes from text_config.
    target = write_config(
        tmp_path / "t",
        {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
         "text_config": {"model_type": "deepseek_v3", "hidden_size": 64, "kv_lora_rank": 512}},
    )  # fmt: skip
    llama_drafter = write_config(
        tmp_path / "d", {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
    )
    with pytest.raises(DrafterPairingError) as info:
        check_drafter_pairing(target, llama_drafter)
    message = str(info.value)
    assert "No common block size" in message and "deepseek" in message
    assert "Eagle3DeepseekV2ForCausalLM" in message
    mla_drafter = write_config(
        tmp_path / "m", {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    )
    # Accepted as far as attention goes (these config-only folders break other clauses).
    assert "attention" not in [issue.check for issue in check_drafter_contract(target, mla_drafter)]
    llama_target = write_config(
        tmp_path / "l", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    )
    with pytest.raises(DrafterPairingError, match="a mla-attention EAGLE-3 drafter"):
        check_drafter_pairing(llama_target, mla_drafter)
    # A model_type no family covers: nothing to compare, nothing refused.
    unknown = write_config(tmp_path / "u", {"architectures": ["FooForCausalLM"], "model_type": "foo"})
    assert "attention" not in [issue.check for issue in check_drafter_contract(unknown, mla_drafter)]


def test_doctor_reports_the_engine_patches_a_family_needs() -> None:
    target = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    applied = [
        {"name": "speculative_whitelist", "status": "noop", "detail": "no whitelist"},
        {"name": "kimi_media_alias", "status": "disabled", "detail": "not in DRAFTLOOP_PLUGIN_PATCHES"},
        {"name": "cpu_rope_3d_query", "status": "applied", "detail": "forward_cpu rotates 2-D copies"},
    ]
    family = describe_family(target, applied)
    assert family["name"] == "deepseek" and family["drafter_attention"] == "mla"
    assert family["engine_patches"] == [
        {"name": "speculative_whitelist", "status": "noop", "ok": True},
        {"name": "kimi_media_alias", "status": "disabled", "ok": False},
        {"name": "cpu_rope_3d_query", "status": "applied", "ok": True},
    ]
    text = format_report({"engine": "vllm", "patches": applied, "family": family})
    assert "target family deepseek" in text
    assert "WARNING: the family needs patch kimi_media_alias, which is disabled" in text
    # An engine that reports no patches (no in-environment probe) cannot confirm them.
    unreported = describe_family({"model_type": "stablelm"}, None)
    assert unreported["engine_patches"] == [{"name": "eagle3_enabler", "status": "not reported", "ok": False}]
    assert describe_family({"model_type": "foo"}, applied) == {"name": None, "model_type": "foo"}


# ------------------------------------------------------------------------------------------------
# Server lifecycle on the fake engine


def _target(tmp_path: Path) -> Path:
    return write_config(tmp_path / "target", {"architectures": ["LlamaForCausalLM"]})


def test_a_thinking_targets_smoke_request_needs_its_reasoning_apart(tmp_path: Path) -> None:
    """With a reasoning parser set, the servers start with `--reasoning-parser P` and the smoke request
    ("What is 2+2?") must come back with reasoning and content apart; a parser that leaves the thinking
    in the content fails by name. (The fake server's parser names are its reply modes.)"""
    from dataclasses import replace

    from draftloop.infra.evaluation.measure import smoke_text

    for parser, error in (("split", None), ("inline", "the reasoning parser 'inline' returned no reasoning")):
        engine = fake_engine()
        engine = type(engine)(replace(engine.settings, reasoning_parser=parser))
        server = EngineServer(engine, _target(tmp_path), tmp_path / f"run-{parser}", name="baseline")
        with server:
            assert server._argv[-2:] == ["--reasoning-parser", parser]
            if error is None:
                assert smoke_text(server) == "[reasoning] Two plus two is four.\n[content] 4"
            else:
                with pytest.raises(EngineSmokeError, match=error) as raised:
                    server.smoke_test()
                assert "<think>" in str(raised.value) and "What is 2+2?" in str(raised.value)


def test_server_starts_answers_and_stops_its_process_group(tmp_path: Path) -> None:
    server = EngineServer(fake_engine(), _target(tmp_path), tmp_path / "run", name="baseline")
    with server:
        assert server.startup_s is not None and server.startup_s < 30
        assert server.smoke_test().content.strip()
        record = json.loads(server.pidfile.read_text())
        assert record["pid"] == server.pid
        pid = server.pid
        assert pid is not None
    assert not server.pidfile.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "fake engine listening" in server.log_path.read_text()


def test_fatal_log_line_fails_fast_with_excerpt(tmp_path: Path) -> None:
    server = EngineServer(fake_engine("--mode", "fatal"), _target(tmp_path), tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(EngineStartError) as info, server:
        pass
    elapsed = time.monotonic() - started
    assert elapsed < 15, elapsed
    assert info.value.pattern == "fake_refused"
    assert "refuses the drafter" in str(info.value) and "--mode fatal" in info.value.log_excerpt
    assert server.process is not None and server.process.poll() is not None  # stopped, not left hanging


def test_server_exit_during_startup_fails_fast(tmp_path: Path) -> None:
    server = EngineServer(fake_engine("--mode", "exit"), _target(tmp_path), tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="exited with code 3") as info, server:
        pass
    assert time.monotonic() - started < 15
    assert "giving up" in info.value.log_excerpt


def test_startup_timeout_stops_the_server(tmp_path: Path) -> None:
    server = EngineServer(fake_engine("--mode", "slow", timeout_s=3), _target(tmp_path), tmp_path / "run")
    with pytest.raises(EngineStartError, match="not ready after"), server:
        pass
    assert server.process is not None and server.process.poll() is not None


# A driver that starts two servers together (in threads, as an evaluation does) and waits: they never
# become ready ("slow"), so a SIGTERM reaches it while both start.
_DRIVER_STARTING_TWO = """
import contextlib, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from fake_engine import fake_engine
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.evaluation.measure import enter_together
run, target = Path(sys.argv[1]), Path(sys.argv[3])
engine = fake_engine("--mode", "slow", timeout_s=300)
servers = [EngineServer(engine, target, run, name=name) for name in ("baseline", "speculative")]
with contextlib.ExitStack() as stack:
    enter_together(stack, servers)
"""


def test_a_driver_terminated_while_its_servers_start_together_stops_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tests_dir = str(Path(__file__).resolve().parent)
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER_STARTING_TWO, str(run_dir), tests_dir, str(_target(tmp_path))]
    )
    pidfiles = [run_dir / "engine-servers" / f"{name}.json" for name in ("baseline", "speculative")]
    deadline = time.monotonic() + 60
    while not all(path.exists() for path in pidfiles) and time.monotonic() < deadline:
        time.sleep(0.1)
    servers = [int(json.loads(path.read_text())["pid"]) for path in pidfiles]
    try:
        assert all(is_alive(pid) for pid in servers)
        time.sleep(1.0)  # both are in their start-up wait, in the driver's threads
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while any(is_alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in servers if is_alive(pid)] == []  # none orphaned
    finally:
        for pid in servers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()


def test_stale_server_of_a_crashed_run_is_killed_on_next_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = EngineServer(fake_engine(), _target(tmp_path), run_dir, name="baseline")
    first.start()
    first.wait_ready()
    stale_pid = first.pid
    assert stale_pid is not None
    server_module._LIVE.discard(first)
    try:
        # While its starter lives, it is a sibling (a baseline measured in turns with a speculative
        # server in the same folder), unless the server about to start has its name.
        assert clean_stale_servers(run_dir, "speculative") == []
        # Simulate a crashed orchestrator: the server lives on, its pidfile names a starter now gone.
        pidfile = run_dir / "engine-servers" / "baseline.json"
        gone = subprocess.Popen(["true"])
        gone.wait()
        pidfile.write_text(json.dumps(json.loads(pidfile.read_text()) | {"owner": gone.pid}))
        assert clean_stale_servers(run_dir, "speculative") == [stale_pid]
        first.process.wait(timeout=10)  # type: ignore[union-attr]
        assert not (run_dir / "engine-servers" / "baseline.json").exists()
    finally:
        if first.process is not None and first.process.poll() is None:
            os.killpg(first.process.pid, signal.SIGKILL)


def test_engine_doctor_cli_reports_user_errors_with_exit_code_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["engine", "doctor", "--target", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "--target" in result.output and "config.json" in result.output
    result = CliRunner().invoke(app, ["engine", "doctor"])
    assert result.exit_code == 2
