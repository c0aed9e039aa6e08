"""`draftloop refresh CONFIG --traffic LOCATION`: the refresh flow in this process (flows/refresh.py).

The config is validated before anything starts; rows of the traffic location no earlier refresh took are
the new traffic. Prints what was found (new rows per category, the champion's drift) and decided.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from draftloop.commands.config_cmd import load_config_or_exit, parse_set_options
from draftloop.commands.run import failure_exit, prepare_run_environment, use_embedded_defaults
from draftloop.infra.evaluation.drift import DEFAULT_RETRAIN_DROP


def refresh_table(summary: Any) -> Table:
    """What the refresh found and decided, one row per figure."""
    table = Table(title=f"draftloop refresh {summary.config}: {summary.status.replace('_', ' ')}")
    table.add_column("item")
    table.add_column("value")
    table.add_row("traffic", f"{summary.traffic}: {summary.rows_seen} rows, {summary.new_rows} new")
    for category, count in summary.categories.items():
        table.add_row(f"new rows: {category}", str(count))
    if summary.drift is not None:
        for row in [*summary.drift.categories, summary.drift.overall]:
            length = row.mean_acceptance_length
            shown = "n/a" if length is None else f"{length:.3f}"
            table.add_row(f"champion v{summary.champion_version} AL: {row.category}", shown)
        if summary.drift.reference_length is not None:
            table.add_row("champion's own held-out AL", f"{summary.drift.reference_length:.3f}")
    registered = summary.registered_model or {}
    if registered:
        table.add_row(
            "model version",
            f"{registered.get('name')} v{registered.get('version')} ({registered.get('alias_status')})",
        )
    table.add_row("decision", summary.reason)
    return table


def register(app: typer.Typer) -> None:
    """Add `refresh` to the `draftloop` app."""

    @app.command("refresh")
    def refresh_command(
        config: Path = typer.Argument(..., help="Experiment config (YAML) of the served drafter"),
        traffic: str = typer.Option(..., "--traffic", help="A folder or S3 prefix of JSONL/parquet prompts"),
        retrain_drop: float = typer.Option(
            DEFAULT_RETRAIN_DROP,
            "--retrain-drop",
            min=0.0,
            max=1.0,
            help="Retrain when the champion's acceptance length on new traffic falls by more than this share",
        ),
        force: bool = typer.Option(False, "--force", help="Retrain whatever the drift"),
        set_options: list[str] = typer.Option([], "--set", help='A config value, "key=value"'),
    ) -> None:
        """Check the champion on new traffic; retrain past a drop; promote only a measured winner."""
        console = Console()
        served = use_embedded_defaults()
        load_config_or_exit(config, set_options)  # creates nothing; a refused config is exit 2 here
        prepare_run_environment(console, served)
        from draftloop.flows.refresh import RefreshSummary, refresh

        try:
            returned = refresh(
                config_path=str(config.resolve()),
                traffic=traffic,
                overrides=parse_set_options(set_options),
                retrain_drop=retrain_drop,
                force=force,
            )
        except Exception as error:
            raise failure_exit(console, error, "refresh") from error
        console.print(refresh_table(RefreshSummary.model_validate(returned)))
