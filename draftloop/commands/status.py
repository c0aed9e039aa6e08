"""`draftloop status`: the experiment's recent cycles from MLflow, newest first, with their verdicts.

Each cycle is one parent run (tag `draftloop.kind = cycle`); a sweep (`draftloop.kind = sweep`) is one
line with its winner's figures (its variants' cycles have lines of their own); a refresh
(`draftloop.kind = refresh`) one line with the champion's drift and the decision (its challenger's cycle
has its own). A cycle's figures come
from the `summary.json` the flow logs on it (also for a failed cycle), or from the run's metrics while
that is missing. The table fits 80 columns: one short cell per figure, and what does not fit a cell (a
gate's reason, a flagged speedup, the model's name) in notes under it.
"""

from __future__ import annotations

import json
import tempfile
import textwrap
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from draftloop.infra.registry.figures import as_number, format_figure
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig

# The same default as `draftloop run`/`demo` and the flow's form: its store is `draftloop up`'s.
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-llama.yaml"


@dataclass
class CycleRow:
    """One line of `draftloop status`."""

    started: str  # local time, month-day hours:minutes
    name: str
    status: str  # MLflow run status, lower case: finished, failed, killed, running
    verdict: str
    acceptance_length: str
    speedup_c1: str
    model_version: str
    gate: str
    note: str | None = None  # what the cells leave out of a sweep or a sweep's variant


def _load_summary(client: Any, run_id: str) -> dict[str, Any] | None:
    """The cycle's summary.json, or None (a running cycle has none yet; a crash may leave none)."""
    return _load_artifact(client, run_id, "summary.json")


def _load_artifact(client: Any, run_id: str, name: str) -> dict[str, Any] | None:
    """A JSON artifact of the run, or None when absent or unreadable."""
    with tempfile.TemporaryDirectory(prefix="draftloop-status-") as scratch:
        try:
            path = client.download_artifacts(run_id, name, scratch)
            loaded: dict[str, Any] = json.loads(Path(path).read_text())
        except Exception:  # absent or unreadable: the row shows what the run itself holds
            return None
        return loaded


def cycle_row(client: Any, run: Any) -> CycleRow:
    summary = _load_summary(client, run.info.run_id) or {}
    metrics = run.data.metrics
    length = summary.get("mean_acceptance_length", metrics.get("mean_acceptance_length"))
    speedup = (summary.get("speedup") or {}).get("1", metrics.get("speedup_c1"))
    speedup_text = format_figure(as_number(speedup), 2, "x", missing="-")
    flag = str((summary.get("speedup_status") or {}).get("1", "ok"))
    if speedup is not None and flag != "ok":
        speedup_text += f" ({flag.split(':')[0]})"  # a flagged figure is not one to act on
    registered = summary.get("registered_model") or {}
    if registered:
        model_version = f"{registered.get('name')} v{registered.get('version')}"
        gate_info = registered.get("gate") or {}
        if registered.get("champion"):
            gate = "passed: champion"
        else:
            gate = "rejected: " + "; ".join(gate_info.get("reasons") or ["gate not passed"])
    else:
        until = run.data.tags.get("draftloop.until", "register")
        model_version = "-"
        gate = f"not registered (until {until})" if until != "register" else "-"
    return CycleRow(
        started=datetime.fromtimestamp(run.info.start_time / 1000).strftime("%m-%d %H:%M"),
        name=_cycle_name(run),
        status=str(run.info.status).lower(),
        verdict=str(summary.get("verdict") or "-"),
        acceptance_length=format_figure(as_number(length), 2, missing="-"),
        speedup_c1=speedup_text,
        model_version=model_version,
        gate=gate,
        note=f"variant {run.data.tags['draftloop.variant']}"
        if "draftloop.variant" in run.data.tags
        else None,
    )


def _cycle_name(run: Any) -> str:
    """The run's name; a sweep's variant (named by its swept values in MLflow) as `sweep <key>`, its
    values in the notes, so that a line fits 80 columns."""
    if "draftloop.variant" in run.data.tags:
        return f"sweep-{run.data.tags.get('draftloop.sweep_key', '')[:8]}"
    if "draftloop.refresh_key" in run.data.tags:
        return f"challenger-{run.data.tags['draftloop.refresh_key'][:8]}"
    return str(run.info.run_name or run.info.run_id)


def _gate_cell(registered: dict[str, Any]) -> str:
    if not registered:
        return "-"
    if registered.get("champion"):
        return "passed: champion"
    return "rejected: " + "; ".join((registered.get("gate") or {}).get("reasons") or ["gate not passed"])


def refresh_row(client: Any, run: Any) -> CycleRow:
    """A refresh's parent run as one line: the champion's AL on the new traffic, its drop, the decision
    and the challenger's version (flows/refresh.py)."""
    metrics = run.data.metrics
    refresh = _load_artifact(client, run.info.run_id, "refresh/refresh.json") or {}
    registered = refresh.get("registered_model") or {}
    drop = as_number(metrics.get("drift.drop"))
    decision = str(refresh.get("status") or run.data.tags.get("draftloop.decision") or "")
    verdict = {"retrained": "refreshed", "champion_fits": "refresh: fits"}.get(decision, "refresh")
    return CycleRow(
        started=datetime.fromtimestamp(run.info.start_time / 1000).strftime("%m-%d %H:%M"),
        name=run.info.run_name or run.info.run_id,
        status=str(run.info.status).lower(),
        verdict=verdict,
        acceptance_length=format_figure(
            as_number(metrics.get("drift.all.mean_acceptance_length")), 2, missing="-"
        ),
        speedup_c1="-",
        model_version=f"{registered.get('name')} v{registered.get('version')}" if registered else "-",
        gate=_gate_cell(registered),
        note=(
            f"{int(metrics.get('new_rows', 0))} new rows; champion's AL on them"
            + (f", drop {drop:+.1%}" if drop is not None else "")
        ),
    )


def sweep_row(client: Any, run: Any) -> CycleRow:
    """A sweep's parent run as one line: its winner's figures, version and gate (flows/sweep.py)."""
    metrics, tags = run.data.metrics, run.data.tags
    sweep = _load_artifact(client, run.info.run_id, "sweep/sweep.json") or {}
    registered = sweep.get("registered_model") or {}
    winner = tags.get("draftloop.winner")
    variants = int(metrics.get("variants", len(sweep.get("variants") or [])))
    gate = _gate_cell(registered)
    return CycleRow(
        started=datetime.fromtimestamp(run.info.start_time / 1000).strftime("%m-%d %H:%M"),
        name=run.info.run_name or run.info.run_id,
        status=str(run.info.status).lower(),
        verdict=f"sweep of {variants}",
        acceptance_length=format_figure(
            as_number(metrics.get("winner.mean_acceptance_length")), 2, missing="-"
        ),
        speedup_c1=format_figure(as_number(metrics.get("winner.speedup_c1")), 2, "x", missing="-"),
        model_version=f"{registered.get('name')} v{registered.get('version')}" if registered else "-",
        gate=gate,
        note=f"winner {winner}" if winner and winner != "none" else "no winner",
    )


def recent_cycles(tracking_uri: str, experiment: str, limit: int) -> list[CycleRow] | None:
    """The `limit` newest cycles of `experiment`, newest first; None when the experiment does not exist."""
    # Imported here: mlflow is slow to import for the other commands. The registry package (figures, above)
    # has already turned MLflow's download progress bars off (an environment default it sets).
    from mlflow.tracking import MlflowClient

    from draftloop.infra.registry.runs import resolve_tracking_uri

    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = [
        run
        for kind in ("cycle", "sweep", "refresh")
        for run in client.search_runs(
            [found.experiment_id],
            filter_string=f"tags.`draftloop.kind` = '{kind}'",
            order_by=["attributes.start_time DESC"],
            max_results=limit,
        )
    ]
    runs = sorted(runs, key=lambda run: run.info.start_time, reverse=True)[:limit]
    rows = {"sweep": sweep_row, "refresh": refresh_row}
    return [rows.get(run.data.tags.get("draftloop.kind", ""), cycle_row)(client, run) for run in runs]


FLAGGED = "*"  # marks a speedup not to act on (inconclusive, a measurement error): the notes say which


def _result(row: CycleRow) -> str:
    """How the cycle ended: running, failed, killed, or (finished) its evaluation verdict, or the stage
    a partial cycle stopped after (`until train`)."""
    if row.status != "finished":
        return row.status
    if row.gate.startswith("not registered (until "):
        return row.gate.removeprefix("not registered (").removesuffix(")")
    return row.verdict if row.verdict != "-" else "finished"


def _gate(row: CycleRow) -> tuple[str, str | None]:
    """The gate cell (champion, rejected, -) and the note that explains it, if any."""
    if row.gate.startswith("passed"):
        return "champion", None
    if row.gate.startswith("rejected: "):
        return "rejected", row.gate
    return ("-", None) if row.gate.startswith("not registered") else (row.gate, None)


def cycles_table(rows: list[CycleRow], title: str) -> Table:
    """The cycles, one line each: started, cycle, result, AL, speedup @ c=1, model version, gate."""
    # No borders, one space between columns: realistic values fit 80 columns on one line per cycle.
    table = Table(
        title=title,
        title_justify="left",
        box=None,
        pad_edge=False,
        collapse_padding=True,
        header_style="bold",
    )
    for column, justify in (
        ("started", "left"), ("cycle", "left"), ("result", "left"), ("AL", "right"),
        ("c=1", "right"), ("ver", "left"), ("gate", "left"),
    ):  # fmt: skip
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in rows:
        speedup, _, flag = row.speedup_c1.partition(" (")
        version = row.model_version.rsplit(" ", 1)[-1]
        table.add_row(
            row.started,
            row.name,
            _result(row),
            row.acceptance_length,
            speedup + (FLAGGED if flag else ""),
            version,
            _gate(row)[0],
        )
    return table


def cycle_notes(rows: list[CycleRow], width: int) -> list[str]:
    """What the cells leave out, one note per cycle that has one, wrapped to `width`."""
    notes: list[str] = []
    models = sorted({row.model_version.rsplit(" ", 1)[0] for row in rows if row.model_version != "-"})
    if models:
        notes.append(f"versions of {', '.join(models)}")
    for row in rows:
        _, _, flag = row.speedup_c1.partition(" (")
        reason = _gate(row)[1]
        said = [row.note] if row.note else []
        said += [f"speedup @ c=1 {flag.rstrip(')')}, not a figure to act on"] if flag else []
        said += [reason] if reason else []
        if said:
            notes += textwrap.wrap(
                f"{row.name}: {'; '.join(said)}",
                width=width,
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
    return notes


def register(app: typer.Typer) -> None:
    """Add `status` to the `draftloop` app."""

    @app.command()
    def status(
        config: Path = typer.Option(
            DEFAULT_CONFIG, "--config", help="Experiment config whose MLflow store and experiment to read."
        ),
        tracking_uri: str | None = typer.Option(
            None,
            "--tracking-uri",
            help="MLflow store or server instead of the config's, e.g. http://127.0.0.1:5000",
        ),
        limit: int = typer.Option(10, "--limit", min=1, help="How many recent cycles to list."),
    ) -> None:
        """List the recent cycles: when, status, verdict, acceptance length, speedup, model version, gate."""
        try:
            # Only the tracking section is read: no engine or storage probe.
            loaded = ExperimentConfig.load(config, check_environment=False)
        except ConfigError as error:
            typer.echo(f"config error: {error.field}: {error.reason}", err=True)
            raise typer.Exit(code=2) from None
        uri = tracking_uri or loaded.tracking.mlflow_uri
        local_db = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
        if local_db is not None and not Path(local_db).exists():
            # Opening it would create an empty store; nothing has run against it yet.
            typer.echo(f"no cycles recorded yet: no MLflow database at {local_db}")
            return
        experiment = loaded.tracking.experiment
        rows = recent_cycles(uri, experiment, limit)
        if not rows:
            typer.echo(f"no cycles recorded yet in experiment {experiment!r} at {uri}")
            return
        console = Console()
        console.print(f"MLflow: {uri}", overflow="fold", soft_wrap=False)
        console.print(cycles_table(rows, title=f"recent cycles of experiment {experiment!r}"))
        for note in cycle_notes(rows, width=min(console.width, 100)):
            console.print(note, highlight=False, markup=False, overflow="fold")
