"""`draftloop up` / `draftloop down`: Prefect server + worker + MLflow server (infra/runtime/services.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from draftloop.infra.runtime.config import TrackingConfig
from draftloop.infra.runtime.services import (
    GPU_LIMIT,
    PROFILES,
    QUICK_RUN_PARAMS,
    WORK_POOL,
    TeamBackends,
    deployment_run_command,
    detected_gpus,
    services_dir,
    with_driver,
)
from draftloop.infra.runtime.services import down as stop_services
from draftloop.infra.runtime.services import up as start_services

# (option, environment variable, what it holds) of the team profile's backends.
TEAM_OPTIONS = (
    ("--prefect-database-url", "DRAFTLOOP_PREFECT_DATABASE_URL", "PostgreSQL database of the Prefect server"),
    ("--mlflow-database-url", "DRAFTLOOP_MLFLOW_DATABASE_URL", "PostgreSQL database of the MLflow server"),
    (
        "--mlflow-artifacts",
        "DRAFTLOOP_MLFLOW_ARTIFACTS",
        "artifact store the MLflow server proxies (s3://...)",
    ),
)


def _required(value: str | None, option: tuple[str, str, str]) -> str:
    flag, variable, what = option
    if not value:
        raise typer.BadParameter(f"{flag} (or {variable}) is required with --profile team: {what}")
    return value


def team_backends(
    prefect_database_url: str | None,
    mlflow_database_url: str | None,
    mlflow_artifacts: str | None,
    s3_endpoint_url: str | None,
) -> TeamBackends:
    """The team profile's backends, or a user error (exit 2) naming the option and its variable."""
    databases = [
        _required(value, option)
        for value, option in zip((prefect_database_url, mlflow_database_url), TEAM_OPTIONS[:2], strict=True)
    ]
    for url, (flag, variable, _) in zip(databases, TEAM_OPTIONS[:2], strict=True):
        try:
            with_driver(url, "psycopg")
        except ValueError as error:
            raise typer.BadParameter(f"{flag} (or {variable}): {error}") from None
    artifacts = _required(mlflow_artifacts, TEAM_OPTIONS[2])
    if "://" not in artifacts:
        raise typer.BadParameter(
            "--mlflow-artifacts (or DRAFTLOOP_MLFLOW_ARTIFACTS): a URI every client can reach (s3://...)"
        )
    return TeamBackends(databases[0], databases[1], artifacts, s3_endpoint_url or None)


# The shipped default config's tracking: the experiment `up` opens MLflow on, the model it links.
DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[2] / "configs" / "tiny-llama.yaml"
_DEFAULT_RAW = yaml.safe_load(DEFAULT_CONFIG_FILE.read_text())
DEFAULT_TRACKING = TrackingConfig.model_validate(_DEFAULT_RAW["tracking"])
DEFAULT_MODEL = DEFAULT_TRACKING.registered_model or f"drafter-{_DEFAULT_RAW['name']}"


@dataclass(frozen=True)
class ExperimentPages:
    experiment: str
    runs: str  # the experiment's runs table
    model: str  # the registered model's page


def experiment_pages(mlflow_url: str | None, team: TeamBackends | None) -> ExperimentPages:
    """The default experiment, created through the server now (model-training kind, so the first page
    people open is not empty of meaning), and its pages' URLs."""
    from draftloop.infra.registry.runs import Tracker

    assert mlflow_url is not None
    # Local profile: the SQLite file the server serves, which Tracker routes through the server.
    store = mlflow_url if team is not None else DEFAULT_TRACKING.mlflow_uri
    tracker = Tracker(store, DEFAULT_TRACKING.artifact_root, DEFAULT_TRACKING.experiment)
    return ExperimentPages(
        experiment=DEFAULT_TRACKING.experiment,
        runs=f"{mlflow_url}/#/experiments/{tracker.experiment_id}/runs",
        model=f"{mlflow_url}/#/models/{DEFAULT_MODEL}",
    )


def register(app: typer.Typer) -> None:
    """Add `up` and `down` to the `draftloop` app."""

    @app.command()
    def up(
        profile: str = typer.Option(
            "local",
            help="local: SQLite + local files; team: PostgreSQL + S3 (--*-database-url, --mlflow-artifacts)",
        ),
        prefect_port: int = typer.Option(4200, help="Prefect server port (a free one if taken)"),
        mlflow_port: int = typer.Option(5000, help="MLflow server port (a free one if taken)"),
        host: str = typer.Option(
            "127.0.0.1", help="Interface the servers bind (0.0.0.0: reachable by a team)"
        ),
        gpus: int | None = typer.Option(
            None, min=0, help=f"Slots of the `{GPU_LIMIT}` concurrency limit (default: this machine's GPUs)"
        ),
        prefect_database_url: str | None = typer.Option(
            None, envvar=TEAM_OPTIONS[0][1], help=f"team: {TEAM_OPTIONS[0][2]}", show_envvar=True
        ),
        mlflow_database_url: str | None = typer.Option(
            None, envvar=TEAM_OPTIONS[1][1], help=f"team: {TEAM_OPTIONS[1][2]}", show_envvar=True
        ),
        mlflow_artifacts: str | None = typer.Option(
            None, envvar=TEAM_OPTIONS[2][1], help=f"team: {TEAM_OPTIONS[2][2]}", show_envvar=True
        ),
        s3_endpoint_url: str | None = typer.Option(
            None, envvar="MLFLOW_S3_ENDPOINT_URL", help="team: a non-AWS S3 endpoint for the artifacts"
        ),
        no_worker: bool = typer.Option(False, "--no-worker", help="Do not start a process worker"),
    ) -> None:
        """Start a Prefect server, the `draftloop` process pool + deployments, a worker and MLflow."""
        console = Console()
        if profile not in PROFILES:
            raise typer.BadParameter(f"--profile: one of {', '.join(PROFILES)}, not {profile!r}")
        team = (
            team_backends(prefect_database_url, mlflow_database_url, mlflow_artifacts, s3_endpoint_url)
            if profile == "team"
            else None
        )
        slots = detected_gpus() if gpus is None else gpus
        try:
            services = start_services(
                Path.cwd(),
                prefect_port=prefect_port,
                mlflow_port=mlflow_port,
                start_worker=not no_worker,
                team=team,
                gpus=slots,
                host=host,
                experiment=DEFAULT_TRACKING.experiment,
            )
        except (RuntimeError, TimeoutError) as error:
            console.print(f"[red]draftloop up failed:[/red] {error}")
            raise typer.Exit(1) from error
        landing = experiment_pages(services["mlflow"].url, team)
        table = Table(title=f"draftloop services ({profile} profile)")
        for column in ("service", "pid", "url", "log"):
            table.add_column(column)
        for service in services.values():
            table.add_row(service.name, str(service.pid), service.url or "-", service.log)
        console.print(table)
        api = services["prefect-server"].url
        mlflow_url = services["mlflow"].url
        # Plain print: a URL rich wraps at the terminal's edge no longer opens.
        print(f"Prefect UI: {api}   (pool: {WORK_POOL})")
        print(f"MLflow runs of experiment {landing.experiment!r}: {landing.runs}")
        print(f"MLflow registered model (after the first registered cycle): {landing.model}")
        if slots:
            console.print(f"Concurrency limit `{GPU_LIMIT}`: {slots} slots; a GPU stage waits for free GPUs.")
        params: dict[str, Any] = dict(QUICK_RUN_PARAMS)
        if team is not None:  # the shipped config tracks into a local SQLite file: point it at this server
            params["overrides"] = {"tracking.mlflow_uri": mlflow_url}
        # Plain print, no wrapping or markup: the command must survive copy-paste intact.
        print(f"Run a small cycle (the form at {api} shows every field):")
        print(f"  {deployment_run_command(f'{api}/api', params)}")
        console.print(f"PIDs recorded under {services_dir(Path.cwd())}; stop with `draftloop down`.")

    @app.command()
    def down() -> None:
        """Stop the services `draftloop up` started (by their recorded PIDs)."""
        stopped = stop_services(Path.cwd())
        Console().print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
