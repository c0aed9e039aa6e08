"""A sweep's plan: which variants of one config to run, from `--grid key=v1,v2` and `--list FILE`.

A variant is the base config plus a few dotted overrides (the same form as `--set`). Every variant keeps
the base config's `name`, so the variants share its storage folders, and with them every stage whose
cache key they share: an lr sweep synthesizes and extracts once (tasks/cache.py). The plan's `key`
hashes the base config and the variants, so running the same sweep again finds its own earlier run (and
its finished variants) instead of starting a new one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from draftloop.infra.runtime.config import ConfigError, ExperimentConfig, parse_override_value

# More variants than this is a typo in a grid (and hours of engine time): refused by name.
MAX_VARIANTS = 64


@dataclass(frozen=True)
class SweepVariant:
    """One point of the sweep: its swept values, as dotted config keys."""

    overrides: dict[str, Any]

    @property
    def label(self) -> str:
        """`training.lr=0.001,training.ttt_length=5`: what the MLflow child run and the tables are called."""
        return ",".join(f"{key}={_shown(value)}" for key, value in self.overrides.items())

    @property
    def key(self) -> str:
        return hashlib.sha256(_canonical(self.overrides)).hexdigest()[:12]


@dataclass(frozen=True)
class SweepPlan:
    """The base config (a file plus overrides every variant shares) and the variants."""

    config_path: str
    base_overrides: dict[str, Any]
    variants: tuple[SweepVariant, ...]
    swept_keys: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        """Identifies this sweep: the resolved base config and every variant's overrides."""
        base = ExperimentConfig.load(self.config_path, self.base_overrides).model_dump(mode="json")
        payload = {"base": base, "variants": [variant.overrides for variant in self.variants]}
        return hashlib.sha256(_canonical(payload)).hexdigest()[:16]

    def variant_config(self, variant: SweepVariant) -> ExperimentConfig:
        return ExperimentConfig.load(self.config_path, {**self.base_overrides, **variant.overrides})

    def check(self) -> ExperimentConfig:
        """Load every variant's config (nothing is created); the first refusal names the variant.
        Returns the base config."""
        base = ExperimentConfig.load(self.config_path, self.base_overrides)
        for variant in self.variants:
            try:
                config = self.variant_config(variant)
            except ConfigError as error:
                raise ConfigError(error.field, f"{error.reason} (sweep variant {variant.label})") from None
            if config.name != base.name:
                raise ConfigError("name", f"a sweep variant may not rename the config ({variant.label})")
        return base


def parse_grid(options: list[str]) -> dict[str, list[Any]]:
    """`--grid key=v1,v2` options into {key: [values]}; values use `--set`'s YAML syntax."""
    grid: dict[str, list[Any]] = {}
    for option in options:
        key, sep, values = option.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ConfigError("--grid", f"expected key=value1,value2,..., got {option!r}")
        if key in grid:
            raise ConfigError("--grid", f"{key} is given twice")
        parsed = [_number_or_value(value.strip()) for value in _split_values(values)]
        if len(set(map(_canonical, parsed))) != len(parsed):
            raise ConfigError("--grid", f"{key} repeats a value: {values}")
        grid[key] = parsed
    return grid


def _number_or_value(text: str) -> Any:
    """`--set`'s YAML value, with YAML 1.1's strings `1e-3` and `3E5` read as the numbers people mean
    (the label, the plot's axis and the sweep's key then see 0.001)."""
    value = parse_override_value(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets, so a list value survives: `aux=[1,2,3],[2,3,4]`."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def read_variant_list(path: Path) -> list[dict[str, Any]]:
    """A file of variants: a YAML list of mappings of dotted keys (`- {training.lr: 0.001}`), or JSONL
    (one mapping per line). Errors name the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(str(path), f"cannot read: {error}") from None
    if path.suffix == ".jsonl":
        rows: list[Any] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}", f"not JSON: {error.msg}") from None
            if not isinstance(rows[-1], dict) or not rows[-1]:
                raise ConfigError(f"{path}:{number}", "each line must be a non-empty mapping of config keys")
        return rows
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(where, f"invalid YAML: {getattr(error, 'problem', error)}") from None
    if not isinstance(data, list) or not all(isinstance(row, dict) and row for row in data):
        raise ConfigError(str(path), "must be a list of non-empty mappings of config keys")
    return data


def plan_sweep(
    config_path: str,
    base_overrides: dict[str, Any],
    grid: dict[str, list[Any]],
    listed: list[dict[str, Any]] | None = None,
) -> SweepPlan:
    """The grid's cartesian product, then the listed variants (duplicates once); at least two variants."""
    rows: list[dict[str, Any]] = [
        dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())
    ]
    rows = rows if grid else []
    rows += [dict(row) for row in listed or []]
    variants: list[SweepVariant] = []
    for row in rows:
        variant = SweepVariant({str(key): value for key, value in row.items()})
        if variant.key not in {seen.key for seen in variants}:
            variants.append(variant)
    if len(variants) < 2:
        raise ConfigError("--grid", f"a sweep needs at least two variants (got {len(variants)})")
    if len(variants) > MAX_VARIANTS:
        raise ConfigError("--grid", f"{len(variants)} variants: more than {MAX_VARIANTS}")
    swept = tuple(dict.fromkeys(key for variant in variants for key in variant.overrides))
    return SweepPlan(config_path, dict(base_overrides), tuple(variants), swept)


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
