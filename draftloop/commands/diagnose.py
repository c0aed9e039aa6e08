"""`draftloop diagnose`: for any EAGLE-3 drafter folder, ours or published — is a bad number the
drafter's fault or the engine's? One verdict with the cause named (infra/evaluation/diagnose.py).

Exit codes: 0 ok, 2 bad input (not a drafter folder, no target), 3 weak_drafter, 4 integration_fault,
5 measurement_error.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

BUILTIN_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts.jsonl"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def _rate(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def format_diagnosis(diagnosis: Any) -> str:
    """The verdict first, then engine and simulator side by side, the readings, the cause and its fix."""
    lines = [f"verdict: {diagnosis.verdict}"]
    lines += [f"  - {reason}" for reason in diagnosis.reasons]
    lines.append(f"folder: {diagnosis.folder.path} ({diagnosis.folder.format}; {diagnosis.folder.stated})")
    engine, simulator = diagnosis.engine or {}, diagnosis.simulator or {}
    lines.append(f"{'':28}{'engine':>10}{'simulator':>11}")
    for label, key in (
        ("acceptance rate", "acceptance_rate"),
        ("mean acceptance length", "mean_acceptance_length"),
    ):
        lines.append(f"{label:28}{_rate(engine.get(key)):>10}{_rate(simulator.get(key)):>11}")
    positions = max(len(engine.get("per_position") or []), len(simulator.get("per_position") or []))
    for index in range(positions):
        engine_value = (engine.get("per_position") or [None] * positions)[index]
        simulator_value = (simulator.get("per_position") or [None] * positions)[index]
        lines.append(f"{'  position ' + str(index):28}{_rate(engine_value):>10}{_rate(simulator_value):>11}")
    if diagnosis.readings:
        lines.append("readings (the simulator along the engine's output):")
        for figures in diagnosis.readings:
            marks = ", ".join(
                m
                for m, on in (("engine", figures.reading.engine_reads), ("trained", figures.reading.trained))
                if on
            )
            layers = list(figures.reading.capture_ids)
            lines.append(
                f"  layers {layers} ({figures.reading.label}; {marks}): acceptance "
                f"{_rate(figures.acceptance_rate)}, AL {_rate(figures.mean_acceptance_length)}"
            )
    for level, speedup in diagnosis.speedup.items():
        interval = speedup.get("interval") or [None, None]
        lines.append(
            f"speedup at concurrency {level}: {_rate(speedup.get('speedup'), 2)}x "
            f"[{_rate(interval[0], 2)}, {_rate(interval[1], 2)}] {speedup.get('status')}"
        )
    if diagnosis.cause is not None:
        lines.append(f"cause: {diagnosis.cause.name}: {diagnosis.cause.explanation}")
        if diagnosis.cause.fix:
            lines.append(f"fix: {diagnosis.cause.fix}")
    if diagnosis.served_command:
        lines.append(f"served: {diagnosis.served_command}")
    if diagnosis.smoke_text is not None:
        lines.append(f"smoke request: {diagnosis.smoke_text!r}")
    return "\n".join(lines)


def not_a_drafter(folder: Path) -> str | None:
    """Why `folder` is no EAGLE-3 drafter (no weights, or no fc fusing the aux layers), else None. Its
    config may lack layer ids: that is a diagnosis (the engine's defaults), not a bad input."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return f"{folder} holds no .safetensors weights"
    names: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
        except Exception as error:  # a truncated file raises safetensors' own SafetensorError
            return f"{path}: cannot read ({error})"
    if not any(name.split(".")[-2:] == ["fc", "weight"] for name in names):
        return (
            f"{folder} is no EAGLE-3 drafter: its weights have no fc.weight (the layer fusing the aux states)"
        )
    return None


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
    min_acceptance_length: float = typer.Option(
        1.5, "--min-acceptance-length", min=1.0, help="Under it, a drafter the engine runs right is weak."
    ),
    out: Path = typer.Option(
        Path(".draftloop/diagnose"), "--out", help="Working folder (server logs, report)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
) -> None:
    """Serve TARGET with DRAFTER, simulate it on the same prompts, and name the cause of a bad number."""
    from draftloop.commands.simulate import PromptFileError, read_prompts_file
    from draftloop.infra.engines.base import EngineConfigError, EngineError, get_engine
    from draftloop.infra.evaluation.diagnose import clean_run_dir
    from draftloop.infra.evaluation.diagnose import diagnose as run_diagnosis
    from draftloop.infra.evaluation.plan import EvaluationPlan
    from draftloop.infra.runtime.config import EngineConfig, EvaluationConfig, GateConfig

    if not (target / "config.json").is_file():
        raise _fail(f"--target: {target} is not a model folder (no config.json)")
    if not (drafter / "config.json").is_file():
        raise _fail(f"--drafter: {drafter} is not a drafter folder (no config.json)")
    problem = not_a_drafter(drafter)
    if problem is not None:
        raise _fail(f"--drafter: {problem}")
    try:
        prompt_texts = read_prompts_file(prompts or BUILTIN_PROMPTS)[:num_prompts]
        levels = [int(part) for part in concurrency.split(",") if part.strip()]
        section = EvaluationConfig(
            max_tokens=max_tokens,
            concurrency=levels,
            repeats=1,
            warmup_rounds=0,
            gate=GateConfig(min_acceptance_length=min_acceptance_length),
        )
        settings = EngineConfig(kind=engine_kind, dtype=dtype, max_model_len=max_model_len).settings(
            trust_remote_code=False
        )  # type: ignore[arg-type]
    except PromptFileError as error:
        raise _fail(f"--prompts: {error}") from None
    except ValueError as error:
        raise _fail(str(error).splitlines()[0] if str(error) else repr(error)) from None
    settings = replace(settings, python=python or str(REPO_ROOT / f".venvs/{engine_kind}/bin/python"))
    plan = EvaluationPlan.from_sections(section, num_speculative_tokens=k, trust_remote_code=False)
    clean_run_dir(out)
    try:
        result = run_diagnosis(get_engine(engine_kind, settings), plan, target, drafter, prompt_texts, out)
    except EngineConfigError as error:
        raise _fail(f"{error.field}: {error.reason}") from None
    except EngineError as error:
        typer.echo(f"engine error: {error}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(json.dumps(result.to_json(), indent=2) if as_json else format_diagnosis(result))
    raise typer.Exit(code=result.exit_code)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.command("diagnose")(diagnose)
