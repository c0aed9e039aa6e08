"""`draftloop up` / `draftloop down`: local Prefect server + worker + MLflow UI (infra/services.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from draftloop.infra.services import WORK_POOL, deployment_run_command, services_dir
from draftloop.infra.services import down as stop_services
from draftloop.infra.services import up as start_services


def register(app: typer.Typer) -> None:
    """Add `up` and `down` to the `draftloop` app."""

    @app.command()
    def up(
        prefect_port: int = typer.Option(4200, help="Prefect server port on 127.0.0.1 (a free one if taken)"),
        mlflow_port: int = typer.Option(5000, help="MLflow UI port on 127.0.0.1 (a free one if taken)"),
        no_worker: bool = typer.Option(False, "--no-worker", help="Do not start a process worker"),
    ) -> None:
        """Start a local Prefect server, the `draftloop` process pool + deployments, a worker and MLflow."""
        console = Console()
        try:
            services = start_services(
                Path.cwd(), prefect_port=prefect_port, mlflow_port=mlflow_port, start_worker=not no_worker
            )
        except (RuntimeError, TimeoutError) as error:
            console.print(f"[red]draftloop up failed:[/red] {error}")
            raise typer.Exit(1) from error
        table = Table(title="draftloop services")
        for column in ("service", "pid", "url", "log"):
            table.add_column(column)
        for service in services.values():
            table.add_row(service.name, str(service.pid), service.url or "-", service.log)
        console.print(table)
        api = services["prefect-server"].url
        console.print(f"Prefect UI: {api}   MLflow UI: {services['mlflow'].url}   pool: {WORK_POOL}")
        # Plain print, no wrapping or markup: the command must survive copy-paste intact.
        print(f"Run a small cycle (the form at {api} shows every field):")
        print(f"  {deployment_run_command(f'{api}/api')}")
        console.print(f"PIDs recorded under {services_dir(Path.cwd())}; stop with `draftloop down`.")

    @app.command()
    def down() -> None:
        """Stop the services `draftloop up` started (by their recorded PIDs)."""
        stopped = stop_services(Path.cwd())
        Console().print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
