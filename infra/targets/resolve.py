"""The target model's local folder, built from its zoo recipe when it is missing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
from draftloop.infra.targets.zoo import ensure_model


def ensure_target(config: ExperimentConfig) -> str:
    """`target.path`, built from the zoo recipe `target.create` when it is missing or was built from
    another recipe or seed (the cache keys a zoo target by its recipe and seed alone)."""
    path = Path(config.target.path)
    if not config.target.create and not (path / "config.json").exists():
        raise ConfigError("target.path", f"{path} has no config.json and target.create is not set")
    return str(ensure_model(path, config.target.create, seed=config.target.seed))


def target_fingerprint(config: ExperimentConfig) -> str:
    """A digest of the target folder's files (names, sizes, mtimes; nothing read), so that weights or a
    tokenizer replaced in place make every stage run again. A zoo target (`target.create`) is defined by
    its recipe and seed, already in the config: "recipe"."""
    if config.target.create:
        return "recipe"
    folder = Path(config.target.path)
    identity = []
    for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
        name = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in name.parts):  # not .cache/ etc.
            stat = path.stat()
            identity.append([str(name), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
