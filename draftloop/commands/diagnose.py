"""`draftloop diagnose`: for any EAGLE-3 drafter folder, ours or published — is a bad number the
drafter's fault or the engine's? One verdict with the cause named (infra/evaluation/diagnose.py).

Exit codes: 0 ok, 2 bad input (not a drafter folder, no target), 3 weak_drafter, 4 integration_fault,
5 measurement_error.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def diagnose(
    target: Path = typer.Option(..., "--target", help="Target: a Hugging Face model folder."),
    drafter: Path = typer.Option(
        ..., "--drafter", help="Drafter: any EAGLE-3 folder (native, vLLM, SGLang, speculators)."
    ),
    engine_kind: str = typer.Option("vllm", "--engine", help="Serving engine: vllm | sglang."),
    prompts: Path | None = typer.Option(
        None, "--prompts", help="Prompts (JSONL or text; default: the shipped set)."
    ),
    num_prompts: int = typer.Option(8, "--num-prompts", min=1, help="Prompts used from the file."),
    k: int = typer.Option(3, "-k", "--k", min=1, help="Draft tokens per step."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Output tokens per prompt."),
    concurrency: str = typer.Option("1", "--concurrency", help="Concurrency levels for speedup, e.g. 1,4."),
    python: str | None = typer.Option(
        None, "--python", help="The engine's Python (default: .venvs/<engine>)."
    ),
    dtype: str = typer.Option(
        "float32", "--dtype", help="Served dtype: float32 | bfloat16 | float16 | auto."
    ),
    max_model_len: int = typer.Option(1024, "--max-model-len", min=16, help="Served context length."),
    reasoning_parser: str | None = typer.Option(
        None,
        "--reasoning-parser",
        help="A thinking target's parser (e.g. deepseek_r1): reasoning kept apart.",
    ),
    min_acceptance_length: float = typer.Option(
        1.5, "--min-acceptance-length", min=1.0, help="Under it, a drafter the engine runs right is weak."
    ),
    out: Path = typer.Option(
        Path(".draftloop/diagnose"), "--out", help="Working folder (server logs, report)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
    register_as: str | None = typer.Option(
        None, "--register", help="Register the drafter as an external baseline of this registered model."
    ),
    alias: str | None = typer.Option(
        None, "--alias", help="With --register: the version's alias (e.g. baseline)."
    ),
    tracking_uri: str = typer.Option(
        "sqlite:///.draftloop/mlflow.db", "--tracking-uri", help="MLflow tracking."
    ),
) -> None:
    """Serve TARGET with DRAFTER, simulate it on the same prompts, and name the cause of a bad number."""
    from pydantic import ValidationError

    from draftloop.infra.engines.base import EngineConfigError, EngineError
    from draftloop.infra.evaluation.diagnose import format_diagnosis
    from draftloop.infra.evaluation.diagnose_request import DiagnoseInputError, DiagnoseRequest

    try:
        request = DiagnoseRequest(
            target=target,
            drafter=drafter,
            engine=engine_kind,  # type: ignore[arg-type]  # validated: vllm | sglang
            prompts=prompts,
            num_prompts=num_prompts,
            k=k,
            max_tokens=max_tokens,
            concurrency=[int(part) for part in concurrency.split(",") if part.strip()],
            python=python,
            dtype=dtype,  # type: ignore[arg-type]
            max_model_len=max_model_len,
            reasoning_parser=reasoning_parser,
            min_acceptance_length=min_acceptance_length,
            out=out,
            register_as=register_as,
            alias=alias,
            tracking_uri=tracking_uri,
        )
        request.check()
        result = request.run()
    except ValidationError as error:
        first = error.errors()[0]
        raise _fail(f"--{'-'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    except ValueError as error:  # DiagnoseInputError, or a concurrency that is no integer
        field = error.field if isinstance(error, DiagnoseInputError) else "concurrency"
        message = str(error).removeprefix(f"{field}: ")
        raise _fail(f"--{field.replace('_', '-')}: {message}") from None
    except EngineConfigError as error:
        raise _fail(f"{error.field}: {error.reason}") from None
    except EngineError as error:
        typer.echo(f"engine error: {error}", err=True)
        raise typer.Exit(code=1) from None
    registered = request.register(result)
    typer.echo(json.dumps(result.to_json(), indent=2) if as_json else format_diagnosis(result))
    if registered is not None and not as_json:
        named = f" (alias {registered.alias})" if registered.alias else ""
        typer.echo(f"registered: {registered.name} v{registered.version}{named}, tagged external")
    raise typer.Exit(code=result.exit_code)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.command("diagnose")(diagnose)
