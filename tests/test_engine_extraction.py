"""Engine-side extraction (`extraction.backend: engine`): vLLM's `extract_hidden_states` method and its
hidden-states connector, repacked into draftloop's shards, against the in-process capture.

One vLLM (CPU) server in extraction mode serves the whole module (a start takes minutes on this machine).
Tolerance: both sides run the target in float32 with different kernels (vLLM's CPU ops vs transformers'
eager ones), so values agree to float32 rounding accumulated over 6 layers: |engine - in-process| <=
1e-4 + 1e-4 * |in-process| per element (measured on tiny-llama: the largest errors are printed by the
test, about 1e-5 here).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_engine import require_vllm_env, vllm_settings

from draftloop.infra.engines.base import EngineError, ExtractedHiddenStates, get_engine
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.extraction.engine import (
    EngineExtractionError,
    extract_through_server,
    extraction_engine,
    extraction_layer_ids,
    load_final_norm,
    sample_from_engine,
    target_depth,
)
from draftloop.infra.extraction.extractor import HiddenStateExtractor
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes, shard_layer_ids

AUX = LayerIds((1, 3, 5), "layer_input")
PLUGIN_DIR = Path(__file__).resolve().parent.parent / "infra" / "engines" / "vllm_plugin_pkg"
ATOL = RTOL = 1e-4

CONVERSATIONS: list[dict[str, Any]] = [
    {
        "id": "single",
        "messages": [
            {"role": "user", "content": "Write a function that adds two numbers."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        ],
    },
    {
        "id": "multi-turn-with-system",
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is a list?"},
            {"role": "assistant", "content": "An ordered collection of items."},
            {"role": "user", "content": "And a set?"},
            {"role": "assistant", "content": "An unordered collection without duplicates."},
        ],
    },
    {"id": "no-answer", "messages": [{"role": "user", "content": "Nothing comes back."}]},
    {
        "id": "third",
        "messages": [
            {"role": "user", "content": "Sort a list of numbers in Python."},
            {"role": "assistant", "content": "sorted(numbers) returns a new sorted list."},
        ],
    },
]


# ------------------------------------------------------------------------------------------------
# Unit: layer ids, sample repacking, the final norm, engines without the mode


def test_extraction_ids_are_the_aux_layers_then_the_last_layer_output() -> None:
    ids = extraction_layer_ids(AUX, depth=6)
    assert ids.ids == (1, 3, 5, 6) and ids.convention == "layer_input"
    # The same layers in SGLang's / SpecForge's convention: one less each.
    assert ids.to("layer_output").ids == (0, 2, 4, 5)
    assert extraction_layer_ids(LayerIds((0, 2, 4), "layer_output"), depth=6).ids == (1, 3, 5, 6)
    with pytest.raises(EngineExtractionError, match="strictly increasing"):
        extraction_layer_ids(LayerIds((3, 1, 5), "layer_input"), depth=6)


def test_vllm_extraction_args_name_the_ids_and_the_connector(tmp_path: Path) -> None:
    engine = extraction_engine(get_engine("vllm", vllm_settings()), AUX, 6, tmp_path)
    argv = list(engine.settings.extra_args)
    speculative = json.loads(argv[argv.index("--speculative-config") + 1])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5, 6]
    connector = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert connector["kv_connector"] == "ExampleHiddenStatesConnector"
    assert connector["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert "--no-enable-prefix-caching" in argv


def test_sglang_has_no_engine_side_extraction(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no engine-side hidden-state extraction"):
        extraction_engine(get_engine("sglang"), AUX, 6, tmp_path)


def test_sample_refuses_hidden_states_of_other_tokens(zoo_target_dir: Any) -> None:
    target = zoo_target_dir("tiny-llama")
    norm = load_final_norm(target, torch.float32)
    states = ExtractedHiddenStates(token_ids=torch.tensor([5, 6, 7]), hidden_states=torch.zeros(3, 4, 256))
    with pytest.raises(EngineExtractionError, match="not the 3 sent"):
        sample_from_engine(states, [5, 6, 8], [0, 1, 1], norm, torch.float32)
    sample = sample_from_engine(states, [5, 6, 7], [0, 1, 1], norm, torch.float32)
    assert sample["aux_hidden"].shape == (3, 3 * 256) and sample["last_hidden"].shape == (3, 256)


def test_final_norm_is_the_targets_own(zoo_target_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    target = zoo_target_dir("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    norm = load_final_norm(target, torch.float32)
    x = torch.randn(2, 5, 256)
    assert type(norm) is type(model.model.norm)
    torch.testing.assert_close(norm(x), model.model.norm(x), rtol=0, atol=0)


def test_host_only_torch_lets_the_connector_copy_without_cuda() -> None:
    sys.path.insert(0, str(PLUGIN_DIR))
    try:
        from draftloop_vllm_plugin.patches import HostOnlyTorch
    finally:
        sys.path.remove(str(PLUGIN_DIR))
    host = HostOnlyTorch(torch)
    source = torch.arange(6.0).reshape(2, 3)
    with host.cuda.stream(host.cuda.Stream()):
        pinned = host.empty_like(source, device="cpu", pin_memory=True)
        pinned.copy_(source, non_blocking=True)
    event = host.cuda.Event()
    event.record(None)
    assert event.query() and torch.equal(pinned, source) and host.float32 is torch.float32


# ------------------------------------------------------------------------------------------------
# The real vLLM (CPU) server in extraction mode


@pytest.fixture(scope="module")
def extraction_server(zoo_target_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_vllm_env()
    target = zoo_target_dir("tiny-llama")
    run_dir = tmp_path_factory.mktemp("engine-extraction")
    engine = extraction_engine(get_engine("vllm", vllm_settings()), AUX, target_depth(target), run_dir / "hs")
    with EngineServer(engine, target, run_dir, name="extraction") as server:
        yield engine, server, target, run_dir


@pytest.mark.slow
def test_engine_hidden_states_equal_in_process(extraction_server: Any) -> None:
    engine, server, target, run_dir = extraction_server
    result = extract_through_server(
        engine,
        server.base_url,
        "target",
        target,
        CONVERSATIONS,
        AUX,
        samples_per_shard=2,
        max_length=256,
        dtype=torch.float32,
        concurrency=4,
    )
    assert [row["id"] for row in result.skipped] == ["no-answer"]
    assert [count for _, _, count in result.shards] == [2, 1]
    assert not list((run_dir / "hs").glob("*.safetensors")), "read files are removed"
    engine_samples = []
    for _, data, _ in result.shards:
        tensors, metadata = shard_from_bytes(data)
        assert shard_layer_ids(metadata) == AUX
        assert metadata["last_hidden_state"] == "after_final_norm"
        engine_samples.extend(iter_hidden_samples(tensors))

    # In process, with the ids given in each convention: both name the same layers.
    for ids in (AUX, AUX.to("layer_output")):
        extractor = HiddenStateExtractor(str(target), list(ids.ids), ids.convention, "float32")
        written = run_dir / f"in-process-{ids.convention}"
        reference = extractor.extract(CONVERSATIONS, str(written), {}, "hidden-a00", 8, 256)
        assert [row["id"] for row in reference.skip_examples] == ["no-answer"]
        tensors, metadata = shard_from_bytes((written / reference.shards[0].name).read_bytes())
        assert shard_layer_ids(metadata) == AUX
        in_process = list(iter_hidden_samples(tensors))
        assert len(in_process) == len(engine_samples) == 3
        worst = {"aux_hidden": 0.0, "last_hidden": 0.0}
        for ours, theirs in zip(engine_samples, in_process, strict=True):
            assert torch.equal(ours["input_ids"], theirs["input_ids"])
            assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
            for key in worst:
                torch.testing.assert_close(ours[key], theirs[key], rtol=RTOL, atol=ATOL)
                worst[key] = max(worst[key], float((ours[key] - theirs[key]).abs().max()))
        print(f"largest |engine - in-process| ({ids.convention} ids): {worst}")


@pytest.mark.slow
def test_cpu_writer_patch_applied(extraction_server: Any) -> None:
    _, _, _, run_dir = extraction_server
    records = [json.loads(line) for line in (run_dir / "plugin-report.jsonl").read_text().splitlines()]
    statuses = {p["name"]: p["status"] for r in records if r.get("event") == "register" for p in r["patches"]}
    assert statuses["cpu_hidden_states_writer"] == "applied"


# ------------------------------------------------------------------------------------------------
# The MLA target (tiny-deepseek, DeepSeek-V3 shape): vLLM's CPU build serves it in bfloat16 only (its
# MoE kernel refuses float32), so both sides run in bfloat16 and agree to bf16 rounding accumulated over
# 4 layers (attention, MoE routing): the tolerance below is twice the largest error measured (0.125 on
# the aux layers, 0.0625 on last_hidden: one or two bf16 steps at the layer markers' magnitude).
MLA_AUX = LayerIds((1, 2, 3), "layer_input")
MLA_ATOL, MLA_RTOL = 0.25, 0.05


@pytest.mark.slow
def test_online_training_streams_from_the_engine(extraction_server: Any, tmp_path: Path) -> None:
    """`extraction.mode: online, backend: engine`: producer actors ask the server shard by shard, the
    trainer gets every training sample once per epoch, and the connector's files are read and deleted."""
    import yaml
    from fixtures_flow import REPO_ROOT
    from test_extract_actors import _synthesized

    from draftloop.infra.extraction.producer import EngineEndpoint
    from draftloop.infra.runtime.config import ExperimentConfig
    from draftloop.infra.runtime.processes import PidRecord
    from draftloop.infra.runtime.ray_cluster import ensure_ray
    from draftloop.infra.training.job import TrainingJob
    from draftloop.infra.training.stream import stream_from
    from draftloop.infra.training.worker import train_worker

    engine, server, target, run_dir = extraction_server
    ensure_ray(num_cpus=2)
    rows = [{**row, "id": f"{row['id']}-{n}"} for n in range(4) for row in CONVERSATIONS]
    conversations = _synthesized(str(tmp_path / "synth"), rows)
    raw = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    raw["target"]["path"] = str(target)
    raw["extraction"].update({"mode": "online", "backend": "engine", "samples_per_shard": 4})
    raw["training"].update({"epochs": 2, "batch_size": 4, "ttt_length": 2, "held_out_samples": 0})
    config = ExperimentConfig.from_dict(raw, check_environment=False)
    endpoint = EngineEndpoint(engine, server.base_url, "target")
    with stream_from(config, conversations, None, PidRecord(tmp_path / "pids.json"), endpoint) as stream:
        train_worker(
            TrainingJob.from_config(config, stream.hidden, tmp_path / "work", {}),
            rank=0,
            world=1,
            device="cpu",
            report=lambda _metrics: None,
        )
        report = stream.report()
    result = json.loads((tmp_path / "work" / "final" / "result.json").read_text())
    assert report.skipped == 4 and report.samples == 12  # the four "no-answer" rows
    assert [epoch["trained_per_sample"] for epoch in result["epochs"]] == [{"1": 12}] * 2
    assert sum(p.samples for p in report.producers) == 2 * 12  # every epoch asks the engine again
    assert result["stream"]["bytes_received"] > 0
    assert not list((run_dir / "hs").rglob("*.safetensors")), "read files are removed"


@pytest.mark.slow
def test_mla_engine_hidden_states_close_to_in_process(
    zoo_target_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    require_vllm_env()
    target = zoo_target_dir("tiny-deepseek")
    run_dir = tmp_path_factory.mktemp("engine-extraction-mla")
    settings = vllm_settings(dtype="bfloat16")
    engine = extraction_engine(get_engine("vllm", settings), MLA_AUX, target_depth(target), run_dir / "hs")
    with EngineServer(engine, target, run_dir, name="extraction-mla") as server:
        result = extract_through_server(
            engine, server.base_url, "target", target, CONVERSATIONS, MLA_AUX,
            samples_per_shard=8, max_length=256, dtype=torch.bfloat16, concurrency=4,
        )  # fmt: skip
    (shard,) = result.shards
    engine_samples = list(iter_hidden_samples(shard_from_bytes(shard[1])[0]))
    extractor = HiddenStateExtractor(str(target), list(MLA_AUX.ids), "layer_input", "bfloat16")
    written = run_dir / "in-process"
    reference = extractor.extract(CONVERSATIONS, str(written), {}, "hidden-a00", 8, 256)
    in_process = list(
        iter_hidden_samples(shard_from_bytes((written / reference.shards[0].name).read_bytes())[0])
    )
    assert len(engine_samples) == len(in_process) == 3
    worst = {"aux_hidden": 0.0, "last_hidden": 0.0}
    for ours, theirs in zip(engine_samples, in_process, strict=True):
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
        for key in worst:
            difference = (ours[key].float() - theirs[key].float()).abs()
            worst[key] = max(worst[key], float(difference.max()))
            torch.testing.assert_close(ours[key].float(), theirs[key].float(), rtol=MLA_RTOL, atol=MLA_ATOL)
    print(f"largest |engine - in-process| (tiny-deepseek, bfloat16): {worst}")
