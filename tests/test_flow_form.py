"""The flows' Prefect form: flat fields, each with the default config's value and a description."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.utilities.callables import parameter_schema
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from draftloop.flows.cycle import TrainAndEvalParams, run_cycle
from draftloop.flows.pipeline import CYCLE
from draftloop.flows.train_and_eval import train_and_eval
from draftloop.infra.runtime.services import deployment_run_command

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())


def test_form_fields_are_flat_with_config_defaults() -> None:
    schema = parameter_schema(train_and_eval).model_dump_for_openapi()
    fields: dict[str, Any] = schema["properties"]
    assert set(fields) == {
        "config",
        "config_path",
        "target_path",
        "num_samples",
        "epochs",
        "engine_kind",
        "num_speculative_tokens",
        "drafter_init",
        "overrides",
        "until",
    }
    assert fields["until"]["default"] == CYCLE.names[-1] == "register"
    assert fields["config"]["default"] == "configs/tiny-llama.yaml"
    assert fields["num_samples"]["default"] == DEFAULT_CONFIG["data"]["num_samples"] == 256
    assert fields["num_speculative_tokens"]["default"] == DEFAULT_CONFIG["engine"]["num_speculative_tokens"]
    assert fields["engine_kind"]["default"] == DEFAULT_CONFIG["engine"]["kind"] == "vllm"
    assert fields["epochs"]["default"] == DEFAULT_CONFIG["training"]["epochs"]
    assert fields["target_path"]["default"] == DEFAULT_CONFIG["target"]["path"]
    for name, field in fields.items():
        assert "anyOf" not in field, f"{name} shows a type toggle: {field}"
        assert field.get("description"), f"{name} has no description"
        assert "\n" not in field["description"]
    assert fields["num_samples"]["type"] == "integer"
    assert fields["overrides"]["type"] == "object"


def _registered_here() -> list[str]:
    """The engines infra/engines/ registers (not a test's fake one)."""
    from draftloop.infra.engines.base import engine_class, known_engines

    return [kind for kind in known_engines() if engine_class(kind).__module__.startswith("draftloop.infra")]


def test_choices_are_dropdowns_of_what_exists() -> None:
    """Enums (Prefect's dropdowns): every shipped config, every registered engine, every stage in order."""
    fields = parameter_schema(train_and_eval).model_dump_for_openapi()["properties"]
    shipped = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "configs").glob("*.yaml"))
    assert sorted(fields["config"]["enum"]) == shipped
    assert fields["config"]["default"] in shipped
    assert sorted(fields["engine_kind"]["enum"]) == sorted(_registered_here())
    assert fields["until"]["enum"] == list(CYCLE.names)
    assert fields["config_path"]["type"] == "string" and "enum" not in fields["config_path"]


def test_numbers_carry_the_configs_limits_and_every_field_a_title() -> None:
    from draftloop.infra.runtime.config import DataConfig, EngineConfig, TrainingConfig

    fields = parameter_schema(train_and_eval).model_dump_for_openapi()["properties"]

    def lower_limit(model: type[BaseModel], name: str) -> int:
        return next(item.ge for item in model.model_fields[name].metadata if hasattr(item, "ge"))

    for name, model, key in (
        ("num_samples", DataConfig, "num_samples"),
        ("epochs", TrainingConfig, "epochs"),
        ("num_speculative_tokens", EngineConfig, "num_speculative_tokens"),
    ):
        assert fields[name]["minimum"] == lower_limit(model, key), name
        assert fields[name]["maximum"] > fields[name]["default"], name
    assert fields["num_speculative_tokens"]["maximum"] == 16
    for name, field in fields.items():
        assert field["title"] != name and field["title"][0].isupper(), (name, field["title"])


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"epochs": 1001}, "epochs"),
        ({"engine_kind": "vlm"}, "engine_kind"),
        ({"until": "deploy"}, "until"),
        ({"config": "configs/missing.yaml"}, "config"),
    ],
)
def test_a_bad_value_is_refused_by_the_schema_and_by_the_flow(parameters: dict[str, Any], named: str) -> None:
    """What Prefect's server checks a deployment run against (the UI form the same), and the flow's own
    validation of a direct call (pydantic, from the same signature)."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate
    from pydantic import validate_call

    schema = parameter_schema(train_and_eval).model_dump_for_openapi()
    validate({"num_samples": 8, "until": "extract"}, schema, raise_on_error=True)  # a good one passes
    with pytest.raises(ValidationError, match=named):
        validate(parameters, schema, raise_on_error=True)
    with pytest.raises(PydanticValidationError, match=named):
        validate_call(train_and_eval.fn)(**parameters)


def test_config_path_replaces_the_shipped_config() -> None:
    assert TrainAndEvalParams(config="/elsewhere/c.yaml").config == "/elsewhere/c.yaml"


def test_fields_left_at_defaults_keep_the_chosen_configs_values() -> None:
    assert TrainAndEvalParams(config="configs/other.yaml").config_overrides() == {}
    changed = TrainAndEvalParams(num_samples=32, drafter_init="d", overrides={"training.lr": 0.1})
    assert changed.config_overrides() == {
        "data.num_samples": 32,
        "training.drafter_init": "d",
        "training.lr": 0.1,
    }


def test_up_prints_a_complete_small_run_command() -> None:
    words = shlex.split(deployment_run_command("http://127.0.0.1:4200/api"))
    assert words[:2] == ["env", "PREFECT_API_URL=http://127.0.0.1:4200/api"]
    assert Path(words[2]).is_absolute() and words[2].endswith("/prefect")
    assert words[3:6] == ["deployment", "run", "train-and-eval/train-and-eval"]
    params = json.loads(words[words.index("--params") + 1])
    assert params["num_samples"] < DEFAULT_CONFIG["data"]["num_samples"]
    TrainAndEvalParams(**params)  # every key is a form field
    assert words[-1] == "--watch"


def test_deploy_reads_the_same_form_from_source() -> None:
    """`prefect deploy` builds the schema from the entrypoint's source, not the imported flow."""
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    imported = parameter_schema(train_and_eval).model_dump_for_openapi()["properties"]
    from_source = parameter_schema_from_entrypoint(
        str(REPO_ROOT / "flows" / "train_and_eval.py") + ":train_and_eval"
    ).model_dump_for_openapi()["properties"]
    assert from_source == imported


def test_each_stage_deployment_is_the_one_flow_stopped_after_its_stage() -> None:
    deployments = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]
    by_name = {deployment["name"]: deployment for deployment in deployments}
    assert by_name.pop("diagnose")["entrypoint"] == "flows/diagnose.py:diagnose"  # its own flow
    assert by_name.pop("sweep")["entrypoint"] == "flows/sweep.py:sweep"  # its own flow, too
    refresh = by_name.pop("refresh")
    assert refresh["entrypoint"] == "flows/refresh.py:refresh"
    assert [schedule["active"] for schedule in refresh["schedules"]] == [False]  # off until turned on
    assert set(by_name) == {"train-and-eval", *CYCLE.names[:-1]}
    for name, deployment in by_name.items():
        assert deployment["entrypoint"] == "flows/train_and_eval.py:train_and_eval"
        assert deployment["parameters"] == ({} if name == "train-and-eval" else {"until": name})
        assert deployment["description"]
        if name != "train-and-eval":  # a stage's deployment says what its declaration says
            assert deployment["description"] == CYCLE.stage(name).description


def test_an_unknown_stage_is_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"until: unknown stage 'deploy'; stages: synthesize, extract"):
        run_cycle(TrainAndEvalParams(), until="deploy")
