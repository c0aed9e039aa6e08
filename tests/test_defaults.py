"""One set of defaults: a value that the config, a kernel's own config, a settings object or a flow's
form all name must have one default, or the same one everywhere it is declared.

A default declared twice drifts (TrainConfig once said 1 epoch and lr 1e-4 where the config said 8 and
3e-3): this test lists every such pair it finds and fails on any disagreement.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from draftloop.infra.runtime import config as config_module

REPO_ROOT = Path(__file__).resolve().parent.parent
_NONE = object()  # no default declared


def _model_defaults(model: type[BaseModel]) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            defaults[name] = info.default_factory()  # type: ignore[call-arg]
        elif info.default is not PydanticUndefined:
            defaults[name] = info.default
    return defaults


def _declared_defaults(target: Any) -> dict[str, Any]:
    """Defaults declared by a pydantic model, a dataclass or a function's keyword parameters."""
    if isinstance(target, type) and issubclass(target, BaseModel):
        return _model_defaults(target)
    if dataclasses.is_dataclass(target):
        found: dict[str, Any] = {}
        for item in dataclasses.fields(target):
            if item.default is not dataclasses.MISSING:
                found[item.name] = item.default
            elif item.default_factory is not dataclasses.MISSING:
                found[item.name] = item.default_factory()
        return found
    return {
        name: parameter.default
        for name, parameter in inspect.signature(target).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def _normalized(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_normalized(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _disagreements(section: type[BaseModel], others: list[Any]) -> list[str]:
    ours = _model_defaults(section)
    found = []
    for other in others:
        theirs = _declared_defaults(other)
        for name in sorted(set(ours) & set(theirs)):
            if _normalized(ours[name]) != _normalized(theirs[name]):
                where = getattr(other, "__qualname__", repr(other))
                found.append(f"{section.__name__}.{name} = {ours[name]!r} but {where} says {theirs[name]!r}")
    return found


def _pairs() -> list[tuple[type[BaseModel], list[Any]]]:
    from draftloop.infra.engines.base import EngineSettings
    from draftloop.infra.evaluation import judge, measure, plan, report, run
    from draftloop.kernels.train import TrainConfig

    evaluation_entry_points: list[Callable[..., Any]] = [
        obj
        for module in (judge, measure, plan, report, run)
        for name, obj in vars(module).items()
        if inspect.isfunction(obj) and obj.__module__ == module.__name__ and not name.startswith("_")
    ]
    return [
        (config_module.TrainingConfig, [TrainConfig]),
        (config_module.EngineConfig, [EngineSettings]),
        (config_module.EvaluationConfig, [plan.BenchmarkPlan, plan.EvaluationPlan, *evaluation_entry_points]),
    ]


def test_a_default_is_declared_once_or_the_same_everywhere() -> None:
    problems = [problem for section, others in _pairs() for problem in _disagreements(section, others)]
    assert not problems, "\n".join(problems)


def test_the_check_itself_catches_a_disagreement() -> None:
    class Section(BaseModel):
        epochs: int = 8
        lr: float = 3e-3

    @dataclasses.dataclass
    class Kernel:
        epochs: int = 1
        lr: float = 3e-3

    def entry(*, lr: float = 1e-4, other: int = 2) -> None:
        pass

    assert _disagreements(Section, [Kernel, entry]) == [
        "Section.epochs = 8 but test_the_check_itself_catches_a_disagreement.<locals>.Kernel says 1",
        "Section.lr = 0.003 but test_the_check_itself_catches_a_disagreement.<locals>.entry says 0.0001",
    ]


def test_the_flow_form_defaults_are_the_default_config_and_one_another() -> None:
    from draftloop.flows.cycle import DEFAULT_CONFIG, TrainAndEvalParams
    from draftloop.flows.train_and_eval import train_and_eval

    form = _model_defaults(TrainAndEvalParams)
    signature = _declared_defaults(train_and_eval.fn)
    assert {name: signature[name] for name in form} == form
    shipped = yaml.safe_load((REPO_ROOT / DEFAULT_CONFIG).read_text())
    assert form["num_samples"] == shipped["data"]["num_samples"]
    assert form["epochs"] == shipped["training"]["epochs"]
    assert form["engine_kind"] == shipped["engine"]["kind"]
    assert form["num_speculative_tokens"] == shipped["engine"]["num_speculative_tokens"]
    assert form["target_path"] == shipped["target"]["path"]
