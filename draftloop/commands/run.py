"""`draftloop run CONFIG` and `draftloop demo`: one cycle in this process, the same flow a deployment runs.

The config is validated before anything is created: a refused config (exit 2) leaves the working
directory as it was. Then Prefect (an ephemeral API whose home is `.draftloop/prefect`, unless
PREFECT_API_URL names a server), a local Ray (unless `ray.address`) and MLflow (per `tracking`) start,
the flow runs up to `--until`, and a summary table is printed; `summary.json` lands in the run folder.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from draftloop.commands.config_cmd import load_config_or_exit, parse_set_options, read_data_or_exit
from draftloop.infra.runtime.processes import state_dir
from draftloop.infra.runtime.services import served_prefect_api

# The demo's config: a tiny random-weight Llama built locally, served by vLLM on CPU.
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-llama.yaml"


def _embedded_defaults(state: Path) -> dict[str, str]:
    """Environment for a run in this process; anything the user set already wins."""
    return {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The ephemeral API server can take minutes to start on a busy 2-core machine (default: 20 s).
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240",
        "DO_NOT_TRACK": "1",
        # Actor output would interleave with the progress bars; failures still carry remote tracebacks.
        "DRAFTLOOP_RAY_LOG_TO_DRIVER": "0",
    }


def use_embedded_defaults() -> str | None:
    """Set the run's environment: first thing in a command that runs a flow, because Prefect reads its
    settings once, when it is imported (set later, they would be ignored). Creates nothing.

    While `draftloop up`'s Prefect server runs, the cycle runs on it (one history, the `gpus` limit
    shared with the deployments' runs, a flow-run page the MLflow run links to); a set PREFECT_API_URL
    wins. Returns that server's URL when it is the one used. (Its MLflow server is found by the
    tracker: infra/registry/runs.py.)
    """
    for key, value in _embedded_defaults(state_dir()).items():
        os.environ.setdefault(key, value)
    served = served_prefect_api()
    if served and "PREFECT_API_URL" not in os.environ:
        os.environ["PREFECT_API_URL"] = served
        return served
    return None


def prepare_run_environment(console: Console, served: str | None) -> None:
    """Once the config is accepted: say which Prefect runs the flow, and make Prefect's home."""
    if served:
        console.print(f"Prefect: the server of `draftloop up`, {served}")
    # Prefect creates PREFECT_HOME on import without its parents (a warning on a fresh checkout), and
    # sqlite will not create it either: made here, once the config is accepted.
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)


def summary_table(summary: dict[str, Any]) -> Table:
    from draftloop.flows.cycle_report import summary_title  # the flows package: only when a cycle ran
    from draftloop.infra.registry.figures import format_percent

    table = Table(title=f"draftloop cycle {summary.get('config')}: {summary_title(summary)}")
    table.add_column("item")
    table.add_column("value")
    for stage, timing in summary.get("stages", {}).items():
        table.add_row(
            f"stage {stage}", f"{timing['seconds']:.1f} s" + (" (cache hit)" if timing["cache_hit"] else "")
        )
    if summary.get("verdict") is not None:
        engine = summary.get("compared_engine_acceptance_rate")
        engine = summary.get("acceptance_rate") if engine is None else engine
        answers = {True: "yes", False: "no (integration fault)", None: "not compared"}
        consistent = answers[summary.get("consistent")]
        table.add_row("verdict", str(summary.get("verdict")))
        table.add_row("lossless", str(summary.get("lossless")))
        table.add_row("acceptance rate", format_percent(summary.get("acceptance_rate")))
        length = summary.get("mean_acceptance_length")
        table.add_row("mean acceptance length", f"{length:.3f}" if isinstance(length, float) else str(length))
        # The pair the consistency check compares: the same prompts, weighted alike.
        table.add_row(
            "engine vs simulator acceptance (same prompts and mix)",
            f"{format_percent(engine)} vs {format_percent(summary.get('simulator_acceptance_rate'))}",
        )
        table.add_row("engine/simulator consistent", consistent)
    statuses = summary.get("speedup_status") or {}
    for concurrency, speedup in (summary.get("speedup") or {}).items():
        status = str(statuses.get(concurrency, "ok"))
        flag = "" if status == "ok" else f" ({status.split(':')[0]}: not a figure to act on)"
        table.add_row(f"speedup @ concurrency {concurrency}", f"{speedup:.3f}x{flag}")
    if summary.get("recommended_k") is not None:
        table.add_row("recommended k", str(summary["recommended_k"]))
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
    for label, url in (summary.get("links") or {}).items():  # MLflow pages, while `up`'s server runs
        table.add_row(label, url)
    table.add_row("total", f"{summary.get('total_seconds', 0):.1f} s")
    table.add_row("summary.json", f"{summary.get('run_folder')}/summary.json")
    return table


def bad_input_behind(error: BaseException) -> BaseException | None:
    """The user-input error (a refused drafter/target pairing, an unreadable checkpoint, bad prompt data, a
    config or target the cycle refuses) a stage failure comes from, if any, even raised inside a Ray actor:
    the cycle then exits 2 with its one-line message (`one_line`)."""
    from draftloop.infra.engines.base import EngineConfigError
    from draftloop.infra.runtime.config import ConfigError
    from draftloop.infra.synthesis.prompts import DataError
    from draftloop.infra.targets.support import TargetRefusedError
    from draftloop.kernels.families.base import UnknownFamilyError
    from draftloop.kernels.files import DrafterFormatError

    user_errors = (
        EngineConfigError,
        DrafterFormatError,
        DataError,
        ConfigError,
        TargetRefusedError,
        UnknownFamilyError,
    )
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        # A Ray task error is also an instance of the actor's exception class; `cause` is that exception.
        cause = getattr(current, "cause", None)
        if isinstance(current, user_errors):
            return cause if isinstance(cause, user_errors) else current
        seen.add(id(current))
        current = (
            current.__cause__ or current.__context__ or (cause if isinstance(cause, BaseException) else None)
        )
    return None


def one_line(error: BaseException) -> str:
    """The first line of an error's message (a user error's message is one line; a traceback is not)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def failure_exit(console: Console, error: BaseException, what: str) -> typer.Exit:
    """A flow's failure as the CLI reports it: a user error behind it as its one line and exit 2,
    anything else as `<what> failed` and exit 1."""
    bad_input = bad_input_behind(error)
    if bad_input is not None:
        console.print(f"[red]error:[/red] {escape(one_line(bad_input))}")
        return typer.Exit(2)
    console.print(f"[red]{what} failed:[/red] {error}")
    return typer.Exit(1)


def run_cycle_command(config_path: Path, set_options: list[str], until: str) -> None:
    """Validate, then run the cycle up to `until` with progress bars; exit 2 on a refused config or stage."""
    console = Console()
    served = use_embedded_defaults()
    from draftloop.flows.pipeline import pipeline_for  # the stage names (this imports Prefect)

    # creates nothing; bad prompt data is one line and exit 2 here, before any service starts
    config = load_config_or_exit(config_path, set_options)
    pipeline = pipeline_for(config)  # extraction.mode online: no extract stage
    try:
        stages = pipeline.until(until).names
    except ValueError as error:
        console.print(f"[red]error:[/red] --{error} (stages: {', '.join(pipeline.names)})")
        raise typer.Exit(2) from None
    read_data_or_exit(config)
    prepare_run_environment(console, served)
    from draftloop.flows.train_and_eval import train_and_eval
    from draftloop.tasks.cycle import PROGRESS_LOG

    overrides = parse_set_options(set_options)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        bars = {stage: progress.add_task(stage, total=1, start=False) for stage in stages}

        def on_event(stage: str, event: str) -> None:
            bar = bars[stage]
            if event == "started":
                progress.start_task(bar)
            elif event == "done":
                progress.update(bar, completed=1)
            elif event == "failed":
                progress.update(bar, description=f"[red]{stage} (failed)")

        class ProgressBars(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                on_event(getattr(record, "stage", ""), getattr(record, "event", ""))

        bars_handler = ProgressBars()
        PROGRESS_LOG.addHandler(bars_handler)
        try:
            # absolute: the flow resolves the config's paths against its folder, not the cwd
            summary = train_and_eval(config_path=str(config_path.resolve()), overrides=overrides, until=until)
        except Exception as error:
            progress.stop()
            raise failure_exit(console, error, "cycle") from error
        finally:
            PROGRESS_LOG.removeHandler(bars_handler)
    console.print(summary_table(summary))


_SET_HELP = 'Override a config field, "section.field=value" (repeatable)'
_UNTIL_HELP = "Last stage to run (default: register, the whole cycle)"


def register(app: typer.Typer) -> None:
    """Add `run` and `demo` to the `draftloop` app."""

    @app.command("run")
    def run(
        config: Path = typer.Argument(..., help="Experiment config (YAML)"),
        set_options: list[str] = typer.Option([], "--set", help=_SET_HELP),
        until: str = typer.Option("register", "--until", help=_UNTIL_HELP),
    ) -> None:
        """Run one cycle of CONFIG in this process: synthesize, extract, train, deploy+evaluate, register."""
        run_cycle_command(config, set_options, until)

    @app.command()
    def demo(
        set_options: list[str] = typer.Option([], "--set", help=_SET_HELP),
        until: str = typer.Option("register", "--until", help=_UNTIL_HELP),
    ) -> None:
        """`run` with the built-in tiny config (configs/tiny-llama.yaml): CPU only, nothing downloaded."""
        run_cycle_command(DEMO_CONFIG, set_options, until)
