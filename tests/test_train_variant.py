"""`training.drafter: eagle3.1` from the config to the drafter the train worker builds: checked at load
(an option the variant lacks, a variant the MLA drafter cannot be), recorded in the train stage's cache
key only when used, and trained as that variant."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from draftloop.infra.runtime.config import ConfigError, ExperimentConfig

REPO = Path(__file__).resolve().parent.parent


def _load(tmp_path: Path, recipe: str, target: Path | None = None, **overrides: object) -> ExperimentConfig:
    values: dict[str, object] = {
        "engine.python": sys.executable, "storage.root": str(tmp_path / "runs"), **overrides,
    }  # fmt: skip
    if target is not None:
        values["target.path"] = str(target)
    return ExperimentConfig.load(REPO / "configs" / f"{recipe}.yaml", values, base_dir=tmp_path)


def test_the_variant_and_its_options_are_checked_when_the_config_loads(tmp_path: Path) -> None:
    for recipe, overrides, words in (
        ("tiny-llama", {"training.drafter": "eagle4"}, "unknown drafter variant 'eagle4'"),
        (
            "tiny-llama",
            {"training.drafter": "eagle3.1", "training.drafter_options": {"fc_nrom": True}},
            "fc_nrom",
        ),
        (
            "tiny-deepseek",
            {"training.drafter": "eagle3.1", "training.drafter_options": {"norm_before_fc": True}},
            "norm_before_fc",
        ),
    ):
        with pytest.raises(ConfigError) as caught:
            _load(tmp_path, recipe, **overrides)
        assert caught.value.field == "training.drafter" and words in str(caught.value), caught.value
    _load(tmp_path, "tiny-deepseek", **{"training.drafter": "eagle3.1"})  # the MLA drafter's defaults


def test_the_train_key_changes_only_for_a_config_that_names_a_variant(tmp_path: Path) -> None:
    plain = _load(tmp_path, "tiny-llama")
    named = _load(tmp_path, "tiny-llama", **{"training.drafter": "eagle3"})
    other = _load(tmp_path, "tiny-llama", **{"training.drafter": "eagle3.1"})
    assert plain.section_hash("training") == named.section_hash("training")  # cached runs stay cached
    assert other.section_hash("training") != plain.section_hash("training")


def test_the_worker_builds_the_configured_variant(
    tmp_path: Path, zoo_target_dir: Callable[[str], Path]
) -> None:
    from draftloop.infra.training.job import TrainingJob
    from draftloop.infra.training.worker import _build_drafter
    from draftloop.kernels.variants.base import get_variant

    target = zoo_target_dir("tiny-llama")
    config = _load(
        tmp_path, "tiny-llama", target,
        **{"training.drafter": "eagle3.1", "training.drafter_options": {"norm_output": False}},
    )  # fmt: skip
    job = TrainingJob.from_config(config, None, tmp_path / "work", {})  # type: ignore[arg-type]  # (unread)
    drafter, _ = _build_drafter(job, None, 0, 1)
    assert drafter.config.variant == "eagle3.1"
    expected = get_variant("eagle3.1").resolve_options({"norm_output": False})
    assert dict(drafter.config.variant_options) == expected
    assert any(name.startswith("fc_norm.") for name in drafter.weights_state_dict())
