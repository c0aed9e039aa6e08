"""The target model's local folder, built from its zoo recipe when it is missing."""

from __future__ import annotations

from pathlib import Path

from draftloop.infra.config import ConfigError, ExperimentConfig
from draftloop.infra.zoo import create_tiny_model


def ensure_target(config: ExperimentConfig) -> str:
    """`target.path`, created from the zoo recipe `target.create` when it has no config.json yet."""
    path = Path(config.target.path)
    if (path / "config.json").exists():
        return str(path)
    if not config.target.create:
        raise ConfigError("target.path", f"{path} has no config.json and target.create is not set")
    create_tiny_model(config.target.create, path, seed=config.target.seed)
    return str(path)
