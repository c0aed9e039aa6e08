"""`draftloop config validate FILE [--set key=value ...]`: check a config and print it resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from draftloop.infra.runtime.config import ConfigError, ExperimentConfig, parse_override_value
from draftloop.infra.runtime.storage import storage_options
from draftloop.infra.synthesis.prompts import DataError, InputData, read_input_from_config

config_app = typer.Typer(help="Experiment configs: validate and show them resolved.", no_args_is_help=True)


def parse_set_options(values: list[str]) -> dict[str, Any]:
    """`key=value` strings into an overrides dict; values use YAML syntax (5, true, null, [1, 2])."""
    overrides: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        overrides[key.strip()] = parse_override_value(value)
    return overrides


def load_config_or_exit(path: Path, set_options: list[str] | None = None) -> Any:
    """Load and validate a config for a CLI command; on a user error print it and exit 2."""
    try:
        return ExperimentConfig.load(path, parse_set_options(set_options or []))
    except ConfigError as error:
        typer.echo(f"config error: {error.field}: {error.reason}", err=True)
        raise typer.Exit(code=2) from None


def read_data_or_exit(config: ExperimentConfig) -> InputData:
    """Read and check every row of the config's data source (no model); on a data error print its one
    line (file, line, reason) and exit 2."""
    try:
        return read_input_from_config(config, storage_options(config))
    except DataError as error:
        typer.echo(f"data error: {error}", err=True)
        raise typer.Exit(code=2) from None


@config_app.command("validate")
def validate(
    file: Path = typer.Argument(..., help="Experiment config (YAML)."),
    set_options: list[str] = typer.Option(
        [], "--set", help="Override a field: --set engine.num_speculative_tokens=5 (repeatable)."
    ),
) -> None:
    """Validate FILE against its target, engine and storage, check every row of its data source (shapes
    only, no model); print the resolved config, and what the data holds on stderr."""
    config = load_config_or_exit(file, set_options)
    data = read_data_or_exit(config)
    typer.echo(config.to_yaml(), nl=False)
    formats = ", ".join(sorted(set(data.formats.values())))
    typer.echo(f"data: {len(data.rows)} rows ({formats}), {len(data.rejected)} rejected", err=True)
    for rejected in data.rejected[:5]:
        typer.echo(f"  rejected {rejected['source']}:{rejected['where']}: {rejected['reason']}", err=True)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.add_typer(config_app, name="config")
