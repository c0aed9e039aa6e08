"""infra/runtime/config.py and `draftloop config validate`: schema, overrides, validation before side
effects."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from moto_s3 import moto_s3_server
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = REPO / "configs" / "tiny-llama.yaml"
TINY_DEEPSEEK = REPO / "configs" / "tiny-deepseek.yaml"


def _runnable(tmp_path: Path, /, **extra: object) -> dict[str, object]:
    """Overrides that make the tiny-llama config valid inside tmp_path (engine = this Python)."""
    return {"engine.python": sys.executable, "storage.root": str(tmp_path / "runs"), **extra}


def _load(tmp_path: Path, path: Path = TINY_LLAMA, /, **overrides: object) -> ExperimentConfig:
    return ExperimentConfig.load(path, _runnable(tmp_path, **overrides), base_dir=tmp_path)


def _error(tmp_path: Path, path: Path = TINY_LLAMA, /, **overrides: object) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, path, **overrides)
    return caught.value


def test_shipped_configs_load_without_building_anything(tmp_path: Path) -> None:
    for path, depth in ((TINY_LLAMA, 6), (TINY_DEEPSEEK, 4)):
        config = _load(tmp_path, path)
        assert config.target_depth == depth and config.target_hidden_size == 256
        assert Path(config.target.path).is_absolute()
        assert config.target.path.startswith(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created: no model, no runs


def test_overrides_and_derived_values(tmp_path: Path) -> None:
    config = _load(
        tmp_path,
        **{
            "engine.num_speculative_tokens": 5,
            "extraction.layer_id_convention": "sglang",
            "extraction.aux_layer_ids": [0, 2, 4],
            "evaluation.gate.min_speedup": 1.1,
        },
    )
    assert config.engine.num_speculative_tokens == 5
    assert config.extraction.layer_id_convention == "layer_output"
    internal = config.aux_layer_ids_internal()
    assert internal.ids == (1, 3, 5) and internal.convention == "layer_input"
    assert config.evaluation.gate.min_speedup == 1.1
    assert config.registered_model_name == "drafter-tiny-llama"
    assert config.tracking.mlflow_uri == f"sqlite:///{tmp_path}/.draftloop/mlflow.db"


def test_default_aux_ids_follow_the_target_depth(tmp_path: Path) -> None:
    # 6 layers: vLLM's (2, 3, 3) collapses, so the ids are spread instead.
    config = _load(tmp_path, **{"extraction.aux_layer_ids": None})
    assert config.extraction.aux_layer_ids == [1, 3, 5]
    assert config.aux_layer_ids_internal().ids == (1, 3, 5)
    # Filled in the configured convention; internal ids stay the same layers.
    sglang = _load(tmp_path, **{"extraction.aux_layer_ids": None, "extraction.layer_id_convention": "sglang"})
    assert sglang.extraction.aux_layer_ids == [0, 2, 4]
    assert sglang.aux_layer_ids_internal().ids == (1, 3, 5)
    deepseek = _load(tmp_path, TINY_DEEPSEEK, **{"extraction.aux_layer_ids": None})
    assert deepseek.aux_layer_ids_internal().ids == (1, 2, 3)


def test_section_hash_is_stable_and_local(tmp_path: Path) -> None:
    first = _load(tmp_path)
    second = _load(tmp_path)
    changed = _load(tmp_path, **{"training.lr": 1e-4})
    assert first.section_hash("training") == second.section_hash("training")
    assert first.section_hash("training") != changed.section_hash("training")
    assert first.section_hash("data") == changed.section_hash("data")
    assert first.section_hash("name") == second.section_hash("name")
    with pytest.raises(KeyError):
        first.section_hash("nope")


def test_extraction_modes_and_the_storage_budget(tmp_path: Path) -> None:
    hybrid = _load(tmp_path, **{"extraction.mode": "hybrid", "extraction.storage_budget": "200GB"})
    assert hybrid.extraction.storage_budget == 200 * 10**9
    error = _error(tmp_path, **{"extraction.mode": "hybrid"})
    assert error.field == "extraction" and "storage_budget" in error.reason and "hybrid" in error.reason
    error = _error(tmp_path, **{"extraction.storage_budget": "1GB"})  # offline stores everything
    assert "storage_budget" in error.reason and "offline" in error.reason
    assert "extraction.mode" in str(_error(tmp_path, **{"extraction.mode": "streaming"}))
    # Where training runs is not what it computes: a resume on another worker count keeps its key.
    assert _load(tmp_path, **{"training.num_workers": 4}).section_hash("training") == _load(
        tmp_path
    ).section_hash("training")


def test_aux_layer_id_out_of_range_names_field_depth_and_range(tmp_path: Path) -> None:
    error = _error(tmp_path, **{"extraction.aux_layer_ids": [1, 3, 6]})
    assert error.field == "extraction.aux_layer_ids"
    assert "6-layer" in error.reason and "0..5" in error.reason and "layer_input" in error.reason
    error = _error(
        tmp_path, **{"extraction.aux_layer_ids": [1, 3, 5], "extraction.layer_id_convention": "sglang"}
    )
    assert (
        error.field == "extraction.aux_layer_ids"
        and "0..4" in error.reason
        and "layer_output" in error.reason
    )
    error = _error(tmp_path, TINY_DEEPSEEK, **{"extraction.aux_layer_ids": [1, 3, 5]})
    assert "4-layer" in error.reason and "0..3" in error.reason


def test_duplicate_ids_and_wrong_count(tmp_path: Path) -> None:
    error = _error(tmp_path, **{"extraction.aux_layer_ids": [1, 3, 3]})
    assert error.field == "extraction.aux_layer_ids" and "duplicate" in error.reason
    error = _error(tmp_path, **{"extraction.aux_layer_ids": [1, 3]})
    assert error.field == "extraction.aux_layer_ids" and "exactly 3" in error.reason


def test_unknown_engine_and_missing_engine_python(tmp_path: Path) -> None:
    error = _error(tmp_path, **{"engine.kind": "tgi"})
    assert error.field == "engine.kind" and "tgi" in error.reason and "vllm" in error.reason
    error = _error(tmp_path, **{"engine.python": str(tmp_path / "no-env" / "bin" / "python")})
    assert error.field == "engine.python" and "does not exist" in error.reason


def test_drafter_hidden_size_must_match_target(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"hidden_size": 512, "target_hidden_size": 4096}))
    error = _error(tmp_path, **{"training.drafter_init": str(drafter)})
    assert error.field == "training.drafter_init" and "4096" in error.reason and "256" in error.reason
    (drafter / "config.json").write_text(json.dumps({"hidden_size": 256}))
    assert _load(tmp_path, **{"training.drafter_init": str(drafter)}).training.drafter_init == str(drafter)
    error = _error(tmp_path, **{"training.drafter_init": str(tmp_path / "absent")})
    assert error.field == "training.drafter_init"


def test_missing_model_folder_and_existing_folder_shape(tmp_path: Path) -> None:
    error = _error(tmp_path, **{"target.create": None, "target.path": str(tmp_path / "absent")})
    assert error.field == "target.path" and "does not exist" in error.reason
    error = _error(tmp_path, **{"target.create": "tiny-gpt"})
    assert error.field == "target.create" and "tiny-llama" in error.reason
    # An existing folder wins over the recipe: only its config.json is read.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(  # a wrapper (Kimi-K2.5-like): the shape is its text_config's
        json.dumps(
            {
                "model_type": "kimi_k25",
                "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 64},
            }
        )
    )
    config = _load(tmp_path, **{"target.path": str(model), "extraction.aux_layer_ids": [1, 2, 3]})
    assert (config.target_depth, config.target_hidden_size) == (4, 64)
    error = _error(tmp_path, **{"target.path": str(model), "extraction.aux_layer_ids": [1, 2, 4]})
    assert "4-layer" in error.reason


def test_unknown_fields_bad_values_and_bad_yaml(tmp_path: Path) -> None:
    error = _error(tmp_path, **{"engine.tensor_parallel": 2})
    assert (error.field, error.reason) == ("engine.tensor_parallel", "unknown field")
    error = _error(tmp_path, **{"evaluation.gate.max_speedup": 2})
    assert error.field == "evaluation.gate.max_speedup"
    error = _error(tmp_path, **{"training.epochs": 0})
    assert error.field == "training.epochs"
    raw = yaml.safe_load(TINY_LLAMA.read_text())
    raw["colour"] = "blue"
    extra = tmp_path / "extra.yaml"
    extra.write_text(yaml.safe_dump(raw))
    assert _error(tmp_path, extra).field == "colour"
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\ntarget:\n  path: a\n   create: b\n")
    error = _error(tmp_path, broken)
    assert error.field == str(broken) and "line 4" in error.reason
    assert _error(tmp_path, tmp_path / "absent.yaml").reason == "no such file"


def test_storage_root_must_be_writable_without_creating_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    error = _error(tmp_path, **{"storage.root": str(blocker / "runs")})
    assert error.field == "storage.root" and "not a directory" in error.reason
    deep = tmp_path / "x" / "y" / "runs"
    assert _load(tmp_path, **{"storage.root": str(deep)}).storage.root == str(deep)
    assert not (tmp_path / "x").exists()


def test_s3_storage_root_bucket_must_exist(tmp_path: Path) -> None:
    with moto_s3_server(buckets=("present",)) as endpoint:
        config = _load(tmp_path, **{"storage.root": "s3://present/runs", "storage.s3_endpoint_url": endpoint})
        assert config.storage.root == "s3://present/runs"
        error = _error(tmp_path, **{"storage.root": "s3://absent/runs", "storage.s3_endpoint_url": endpoint})
        assert error.field == "storage.root" and "absent" in error.reason


def _cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY_LLAMA, tmp_path / "cfg.yaml")
    result = CliRunner().invoke(
        app, ["config", "validate", "cfg.yaml", "--set", f"engine.python={sys.executable}", *args]
    )
    return result.exit_code, result.stdout, result.stderr


def test_cli_out_of_range_exits_2_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = _cli(tmp_path, monkeypatch, "--set", "extraction.aux_layer_ids=[1, 3, 6]")
    assert code == 2
    assert err.startswith("config error: extraction.aux_layer_ids: ") and "0..5" in err
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]  # no .draftloop, no runs folder


def test_cli_prints_resolved_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = _cli(tmp_path, monkeypatch, "--set", "engine.num_speculative_tokens=4")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["engine"]["num_speculative_tokens"] == 4
    assert printed["storage"]["root"] == str(tmp_path / ".draftloop" / "runs")
    code, _, err = _cli(tmp_path, monkeypatch, "--set", "engine.kind=tgi")
    assert code == 2 and err.startswith("config error: engine.kind: ")
    code, _, err = _cli(tmp_path, monkeypatch, "--set", "novalue")
    assert code == 2 and "--set" in err


def test_missing_prompts_file(tmp_path: Path) -> None:
    error = _error(tmp_path, **{"data.prompts": "prompts/absent.jsonl"})
    assert error.field == "data.prompts" and str(tmp_path / "prompts" / "absent.jsonl") in error.reason


def test_relative_paths_resolve_against_the_config_file_whatever_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "data" / "p.jsonl").write_text('{"id": "a", "prompt": "Hi?"}\n')
    raw = yaml.safe_load(TINY_LLAMA.read_text())
    raw["target"]["path"] = "models/tiny"
    raw["data"]["prompts"] = "data/p.jsonl"
    raw["engine"]["python"] = "venv/bin/python"
    raw["storage"]["root"] = "runs"
    raw["tracking"].update({"mlflow_uri": "sqlite:///state/mlflow.db", "artifact_root": "artifacts"})
    (project / "cfg.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(elsewhere)
    config = ExperimentConfig.load(project / "cfg.yaml", check_environment=False)
    assert config.target.path == str(project / "models" / "tiny")
    assert config.data.prompts == str(project / "data" / "p.jsonl")
    assert config.engine.python == str(project / "venv" / "bin" / "python")
    assert config.storage.root == str(project / "runs")
    assert config.tracking.artifact_root == str(project / "artifacts")
    assert config.tracking.mlflow_uri == f"sqlite:///{project}/state/mlflow.db"
    # a relative path to the config file means the same
    monkeypatch.chdir(tmp_path)
    again = ExperimentConfig.load(Path("project/cfg.yaml"), check_environment=False)
    assert again.target.path == config.target.path and again.engine.python == config.engine.python
    # the shipped configs name repository paths: the engine environment is the repository's
    shipped = ExperimentConfig.load(TINY_LLAMA, check_environment=False)
    assert shipped.engine.python == str(REPO / ".venvs" / "vllm" / "bin" / "python")
    assert shipped.storage.root == str(REPO / ".draftloop" / "runs")
    assert shipped.target.path == str(REPO / ".draftloop" / "models" / "tiny-llama")
    assert sorted(p.name for p in elsewhere.iterdir()) == []
