"""The `draftloop` command line: a thin layer over flows and infra.

Each command group lives in draftloop/commands/<area>.py and registers itself here.
"""

from __future__ import annotations

import typer

from draftloop import __version__
from draftloop.commands import (
    config_cmd,
    diagnose,
    engine,
    export,
    models,
    refresh,
    run,
    services,
    simulate,
    status,
    sweep,
)

app = typer.Typer(
    name="draftloop",
    help="One retryable run for a full EAGLE-3 drafter cycle: synthesize, extract, train, serve, measure.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """draftloop: synthesize -> extract -> train -> serve -> measure -> register, as one retryable run."""


_COMMANDS = (run, sweep, refresh, models, config_cmd, simulate, diagnose, export, engine, services, status)
for _module in _COMMANDS:
    _module.register(app)


@app.command()
def version() -> None:
    """Print draftloop's version."""
    typer.echo(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
