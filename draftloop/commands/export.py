"""`draftloop export`: a drafter folder rewritten as the folder an engine (or the speculators library)
loads — the conversions the train stage does, as a command.

The aux layer ids are converted to the convention the engine reads them in; the draftloop record (the
trained ids and the contract: chat template, target dtype, last hidden state) is kept. A folder
without a record (a published drafter) needs `--convention`: its ids may be in either.
"""

from __future__ import annotations

from pathlib import Path

import typer

EXPORT_FORMATS = ("vllm", "sglang", "speculators")


def export_folder(
    drafter_dir: Path, fmt: str, out_dir: Path, convention: str | None, target_dir: Path | None
) -> Path:
    """Write `drafter_dir` as `fmt` into `out_dir` (DrafterFormatError / ValueError on bad input)."""
    from draftloop.infra.engines.base import convention_for, get_engine
    from draftloop.kernels.checkpoint import load_drafter
    from draftloop.kernels.files import read_json
    from draftloop.kernels.speculators import export_speculators

    reading = convention_for(convention) if convention is not None else None
    drafter = load_drafter(drafter_dir, convention=reading)
    record = read_json(drafter_dir / "config.json").get("draftloop")
    metadata = dict(record.get("metadata") or {}) if isinstance(record, dict) else {}
    if fmt == "speculators":
        if target_dir is None:
            raise ValueError("--target: the speculators format names its verifier (the target folder)")
        return export_speculators(drafter, out_dir, str(target_dir))
    return get_engine(fmt).export_drafter(drafter, out_dir, metadata=metadata)


def export(
    drafter: Path = typer.Option(
        ..., "--drafter", help="Drafter folder: any EAGLE-3 format draftloop reads."
    ),
    engine: str = typer.Option(..., "--engine", help="Write for: vllm | sglang | speculators."),
    out: Path = typer.Option(..., "--out", help="Output folder (created; must not hold a drafter already)."),
    convention: str | None = typer.Option(
        None,
        "--convention",
        help="For a folder without a draftloop record: its ids' convention (layer_input | layer_output, "
        "or the engine it was made for: vllm | sglang).",
    ),
    target: Path | None = typer.Option(
        None, "--target", help="The target folder (speculators: its verifier)."
    ),
) -> None:
    """Rewrite DRAFTER as the folder ENGINE loads: layer ids converted, the draftloop record kept."""
    from draftloop.kernels.files import DrafterFormatError

    def fail(message: str) -> typer.Exit:
        typer.echo(f"error: {message}", err=True)
        return typer.Exit(code=2)

    if engine not in EXPORT_FORMATS:
        raise fail(f"--engine: {engine!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if not (drafter / "config.json").is_file():
        raise fail(f"--drafter: {drafter} has no config.json (not a drafter folder)")
    if (out / "config.json").exists():
        raise fail(f"--out: {out} already holds a config.json; choose an empty folder")
    try:
        written = export_folder(drafter, engine, out, convention, target)
    except DrafterFormatError as error:
        raise fail(f"--drafter: {error}") from None
    except ValueError as error:
        raise fail(str(error)) from None
    typer.echo(f"wrote {written} ({engine})")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.command("export")(export)
