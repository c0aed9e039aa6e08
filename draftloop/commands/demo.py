"""`draftloop demo`: one full cycle with embedded services (ephemeral Prefect, local Ray, SQLite MLflow).

All state lands under ./.draftloop/. The demo runs the same flow a deployment runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

STAGE_TITLES = {
    "synthesize": "synthesize conversations",
    "extract": "extract hidden states",
    "train": "train the drafter",
    "evaluate": "deploy + evaluate",
    "register": "register in MLflow",
}


def demo_environment(state: Path) -> dict[str, str]:
    """Embedded defaults: an ephemeral Prefect whose home is under .draftloop/, no telemetry."""
    return {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "DO_NOT_TRACK": "1",
        "DRAFTLOOP_RAY_LOG_TO_DRIVER": "0",
    }


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """["training.epochs=2", ...] -> {"training.epochs": 2} (values parsed as YAML); exit 2 when malformed."""
    import yaml

    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            Console().print(f"[red]config error:[/red] --set {pair!r}: expected section.field=value")
            raise typer.Exit(2)
        parsed[key.strip()] = yaml.safe_load(value)
    return parsed


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"draftloop cycle {summary.get('config')}: {summary.get('status')}")
    table.add_column("item")
    table.add_column("value")
    for stage, timing in summary.get("stages", {}).items():
        table.add_row(
            f"stage {stage}", f"{timing['seconds']:.1f} s" + (" (cache hit)" if timing["cache_hit"] else "")
        )
    for key in ("acceptance_rate", "mean_acceptance_length", "simulator_acceptance_rate", "consistent"):
        value = summary.get(key)
        table.add_row(key.replace("_", " "), f"{value:.3f}" if isinstance(value, float) else str(value))
    for concurrency, speedup in (summary.get("speedup") or {}).items():
        table.add_row(f"speedup @ concurrency {concurrency}", f"{speedup:.3f}x")
    registered = summary.get("registered_model") or {}
    if registered:
        table.add_row(
            "model version",
            f"{registered.get('name')} v{registered.get('version')} ({registered.get('alias_status')})",
        )
        gate = registered.get("gate") or {}
        for reason in gate.get("reasons", []):
            table.add_row("gate: rejected", reason)
        for note in gate.get("notes", []):
            table.add_row("gate: note", note)
    table.add_row("total", f"{summary.get('total_seconds', 0):.1f} s")
    table.add_row("summary.json", f"{summary.get('run_folder')}/summary.json")
    return table


def register(app: typer.Typer) -> None:
    """Add `demo` to the `draftloop` app."""

    @app.command()
    def demo(
        config: Path = typer.Option(Path("configs/tiny-llama.yaml"), "--config", help="Experiment config"),
        overrides: list[str] = typer.Option([], "--set", help='Config override "section.field=value"'),
    ) -> None:
        """Run one full cycle locally: synthesize, extract, train, deploy+evaluate, register."""
        console = Console()
        state = Path(".draftloop").resolve()
        state.mkdir(parents=True, exist_ok=True)
        for key, value in demo_environment(state).items():
            os.environ[key] = value
        (state / "prefect").mkdir(exist_ok=True)  # sqlite cannot create the folder of its database
        os.environ.pop("PREFECT_API_URL", None)  # ephemeral: never a server someone left configured

        from draftloop.tasks._stage import PROGRESS_LISTENERS, STAGES, stage_availability

        missing = {stage: why for stage, why in stage_availability().items() if why}
        if missing:
            for stage, why in missing.items():
                console.print(f"[yellow]stage {stage} not available yet:[/yellow] {why}")
        runnable = [stage for stage in STAGES if stage not in missing]
        until = None
        for stage in STAGES:
            if stage in missing:
                break
            until = stage
        if until is None:
            console.print("[red]no stage can run yet[/red]")
            raise typer.Exit(1)

        from draftloop.flows.train_and_eval import TrainAndEvalParams, load_config

        params = TrainAndEvalParams(config=str(config), overrides=parse_overrides(overrides))
        try:
            load_config(params)
        except Exception as error:
            if type(error).__name__ == "ConfigError" or isinstance(error, FileNotFoundError):
                console.print(f"[red]config error:[/red] {error}")
                raise typer.Exit(2) from error
            raise

        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            bars = {stage: progress.add_task(STAGE_TITLES[stage], total=1, start=False) for stage in runnable}

            def on_event(stage: str, event: str) -> None:
                bar = bars.get(stage)
                if bar is None:
                    return
                if event == "started":
                    progress.start_task(bar)
                elif event == "done":
                    progress.update(bar, completed=1)
                elif event == "failed":
                    progress.update(bar, description=f"[red]{STAGE_TITLES[stage]} (failed)")

            PROGRESS_LISTENERS.append(on_event)
            try:
                summary = _run(params, until)
            except Exception as error:
                progress.stop()
                console.print(f"[red]cycle failed:[/red] {error}")
                raise typer.Exit(1) from error
            finally:
                PROGRESS_LISTENERS.remove(on_event)
        console.print(summary_table(summary))
        if missing:
            console.print(f"[yellow]cycle stopped after {until}: missing {', '.join(missing)}[/yellow]")
            raise typer.Exit(1)


def _run(params: Any, until: str) -> dict[str, Any]:
    from draftloop.flows import stages
    from draftloop.flows.train_and_eval import train_and_eval

    chosen: Any = train_and_eval if until == "register" else getattr(stages, f"{until}_flow")
    result: dict[str, Any] = chosen(params)
    json.dumps(result)  # summary.json's content: must stay JSON
    return result
