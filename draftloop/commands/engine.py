"""`draftloop engine doctor`: ask the engine what it will do with the target and a drafter."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

engine_app = typer.Typer(help="Serving engines: diagnose the engine environment.", no_args_is_help=True)


@engine_app.command("doctor")
def doctor(
    config: Path | None = typer.Option(None, "--config", help="Experiment config (YAML): engine and target."),
    target: Path | None = typer.Option(None, "--target", help="Target model folder (overrides the config)."),
    drafter: Path | None = typer.Option(None, "--drafter", help="Drafter folder (engine-native export)."),
    kind: str | None = typer.Option(None, "--engine", help="Engine kind (default vllm)."),
    python: str | None = typer.Option(None, "--python", help="The engine's Python (overrides the config)."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON report."),
) -> None:
    """Engine version, which draftloop plugin patches apply, whether the target's class supports EAGLE-3
    (natively or through which patch), and the aux layer ids the engine will capture for the drafter.
    Exits 2 when it finds what the cycle would refuse (the REFUSED lines say what)."""
    from draftloop.commands.config_cmd import load_config_or_exit
    from draftloop.infra.engines.base import EngineConfigError, EngineError, get_engine
    from draftloop.infra.engines.doctor import format_report, refusals, run_doctor
    from draftloop.infra.runtime.config import EngineConfig

    settings = EngineConfig().settings(trust_remote_code=False)  # the engine section's defaults
    # ... whose python names the repository's engine environment, wherever the command runs
    settings = replace(settings, python=str(Path(__file__).resolve().parents[2] / settings.python))
    target_dir = target
    if config is not None:
        loaded = load_config_or_exit(config)
        settings = loaded.engine_settings()
        if target_dir is None:
            target_dir = Path(loaded.target.path)
    if kind is not None:
        settings = replace(settings, kind=kind)
    if python is not None:
        settings = replace(settings, python=python)
    if target_dir is None:
        typer.echo("error: --target: give a target folder or --config", err=True)
        raise typer.Exit(code=2)
    for name, folder in (("--target", target_dir), ("--drafter", drafter)):
        if folder is not None and not (Path(folder) / "config.json").is_file():
            typer.echo(f"error: {name}: {folder} has no config.json", err=True)
            raise typer.Exit(code=2)
    try:
        engine = get_engine(settings.kind, settings)
        report = run_doctor(engine, Path(target_dir), drafter)
    except EngineConfigError as error:
        typer.echo(f"error: {error.field}: {error.reason}", err=True)
        raise typer.Exit(code=2) from None
    except EngineError as error:
        typer.echo(f"engine error: {error}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else format_report(report))
    if refusals(report):
        raise typer.Exit(code=2)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.add_typer(engine_app, name="engine")
