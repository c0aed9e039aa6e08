"""`draftloop sweep CONFIG --grid key=v1,v2 [--list FILE]`: variants of one config, the best registered.

The plan (every variant's config) is checked before anything starts: a refused value exits 2 naming the
key and the variant. Then the `sweep` flow runs in this process (flows/sweep.py), as `run` does a cycle;
running the same command again after a kill runs only the variants that had not finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from draftloop.commands.config_cmd import parse_set_options, read_data_or_exit
from draftloop.commands.run import failure_exit, prepare_run_environment, use_embedded_defaults
from draftloop.infra.registry.sweep_report import comparison_rows
from draftloop.infra.runtime.config import ConfigError, GateConfig
from draftloop.infra.runtime.sweeps import SweepPlan, parse_grid, plan_sweep, read_variant_list


def plan_or_exit(
    config: Path, grid: dict[str, list[Any]], listed: list[dict[str, Any]], base: dict[str, Any]
) -> SweepPlan:
    """The sweep's plan with every variant's config loaded; a user error is printed and exits 2."""
    try:
        plan = plan_sweep(str(config.resolve()), base, grid, listed)
        read_data_or_exit(plan.check())
    except ConfigError as error:
        typer.echo(f"config error: {error.field}: {error.reason}", err=True)
        raise typer.Exit(code=2) from None
    return plan


def register(app: typer.Typer) -> None:
    """Add `sweep` to the `draftloop` app."""

    @app.command("sweep")
    def sweep_command(
        config: Path = typer.Argument(..., help="Experiment config (YAML)"),
        grid_options: list[str] = typer.Option(
            [], "--grid", help='Swept values, "section.field=v1,v2" (repeatable: every combination)'
        ),
        listed: Path | None = typer.Option(
            None, "--list", help="More variants: a YAML list or JSONL of {key: value} mappings"
        ),
        set_options: list[str] = typer.Option([], "--set", help='A value every variant shares, "key=value"'),
        parallel: int = typer.Option(1, "--parallel", min=1, max=16, help="Variants run at once"),
    ) -> None:
        """Run variants of CONFIG that share their upstream stages; compare them, register the best."""
        console = Console()
        served = use_embedded_defaults()
        try:
            grid = parse_grid(grid_options)
            variants = read_variant_list(listed) if listed is not None else []
            base = parse_set_options(set_options)
        except ConfigError as error:
            typer.echo(f"config error: {error.field}: {error.reason}", err=True)
            raise typer.Exit(code=2) from None
        plan = plan_or_exit(config, grid, variants, base)
        console.print(f"sweep: {len(plan.variants)} variants over {', '.join(plan.swept_keys)}")
        prepare_run_environment(console, served)
        from draftloop.flows.sweep import SweepSummary, sweep

        try:
            returned = sweep(
                config_path=plan.config_path, grid=grid, variants=variants, overrides=base, parallel=parallel
            )
        except Exception as error:
            raise failure_exit(console, error, "sweep") from error
        console.print(sweep_table(SweepSummary.model_validate(returned), plan.check().evaluation.gate))


def sweep_table(summary: Any, gate: GateConfig) -> Table:
    """The comparison as the CLI prints it (the same rows as the MLflow and Prefect artifacts)."""
    best = next((result for result in summary.variants if result.label == summary.winner), None)
    rows = comparison_rows(summary.variants, gate, best)
    table = Table(title=f"draftloop sweep {summary.config}: winner {summary.winner or 'none'}")
    for column in rows[0] if rows else []:
        table.add_column(column)
    for row in rows:
        table.add_row(*row.values())
    registered = summary.registered_model or {}
    if registered:
        name, version, status = (registered.get(k) for k in ("name", "version", "alias_status"))
        table.caption = f"registered {name} v{version} ({status})"
    for label, url in summary.links.items():
        table.add_section()
        table.add_row(label, url)
    return table
