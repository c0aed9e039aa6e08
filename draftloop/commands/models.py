"""`draftloop models ...`: build the tiny zoo targets locally (no hub access)."""

from __future__ import annotations

from pathlib import Path

import typer

from draftloop.infra.targets.zoo import RECIPES, create_tiny_model

models_app = typer.Typer(help="Tiny random-weight targets built locally from a seed.", no_args_is_help=True)


@models_app.command("create")
def create(
    recipe: str = typer.Argument(..., help="Zoo recipe (`draftloop models list` shows them all)."),
    out: Path = typer.Option(..., "--out", help="Folder to write the Hugging Face model into."),
    seed: int = typer.Option(0, "--seed", help="Same recipe and seed give byte-identical files."),
) -> None:
    """Build a zoo model folder (config, safetensors weights, tokenizer with chat template)."""
    if recipe not in RECIPES:
        typer.echo(
            f"error: recipe: unknown zoo recipe {recipe!r}; known: {', '.join(sorted(RECIPES))}", err=True
        )
        raise typer.Exit(code=2)
    path = create_tiny_model(recipe, out, seed=seed)
    typer.echo(str(path))


@models_app.command("list")
def list_recipes() -> None:
    """List the zoo recipes with their depth and hidden size."""
    for name, recipe in sorted(RECIPES.items()):
        typer.echo(
            f"{name}\t{recipe.model_type}\tlayers={recipe.num_hidden_layers}\thidden={recipe.hidden_size}"
        )


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.add_typer(models_app, name="models")
