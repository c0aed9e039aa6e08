"""Placeholder: filled in by the issue that owns this command group."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
