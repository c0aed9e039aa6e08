"""`draftloop simulate`: acceptance of a drafter on a target, measured in process (no engine).

Greedy chain speculative decoding as vLLM's EAGLE-3 proposer does it (kernels/simulate.py), reporting
vLLM's metrics: acceptance rate, mean acceptance length, per-position acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from draftloop.infra.evaluation.prompt_file import PromptFileError, read_prompts_file


def parse_layer_ids(value: str) -> list[int]:
    """ "2,4,6" -> [2, 4, 6]."""
    try:
        ids = [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not ids:
        raise typer.BadParameter("no layer ids given")
    return ids


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


def _load_tokenizer(path: Path, *, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer, once its folder is known complete (its weights are loaded later)."""
    from transformers import AutoTokenizer

    from draftloop.kernels.files import check_target_weights

    if not (path / "config.json").is_file():
        raise _fail(f"--target: {path} is not a Hugging Face model folder (no config.json)")
    try:
        check_target_weights(path)  # a missing or truncated weights file, named (DrafterFormatError)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise _fail(f"--target: cannot load {path}: {error}") from None


def _load_target_model(path: Path, *, trust_remote_code: bool = False) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise _fail(f"--target: cannot load {path}: {error}") from None
    return model.eval()  # simulate_acceptance moves it to --device


def _refuse_beyond_rope_length(
    tokenizer: Any, prompts: list[str], prompts_file: Path, max_new_tokens: int, drafter: Path, positions: int
) -> None:
    """Refuse, before simulating, a prompt whose tokens plus the output reach beyond the drafter's RoPE
    length: its acceptance there would say nothing about the drafter (it never saw those positions)."""
    from draftloop.kernels.simulate import SimulationInputError, encode_prompt

    try:  # tokenized as simulate_acceptance sends them (chat template applied)
        lengths = [len(encode_prompt(tokenizer, prompt)) for prompt in prompts]
    except SimulationInputError as error:
        raise _fail(str(error)) from None
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_new_tokens > positions:
        raise _fail(
            f"--max-new-tokens: prompt {longest + 1} of {prompts_file} is {lengths[longest]} tokens (the "
            f"target's chat template applied); with --max-new-tokens {max_new_tokens} it reaches "
            f"{lengths[longest] + max_new_tokens} positions, beyond the drafter's max_position_embeddings "
            f"{positions} in {drafter / 'config.json'}: lower --max-new-tokens or shorten the prompt"
        )


def _print_report(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from draftloop.infra.registry.figures import format_figure

    summary = Table(title="speculative decoding (simulated, greedy)")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    rows = [
        ("draft tokens per step (k)", str(report.k)),
        ("prompts", str(len(report.results))),
        ("output tokens", str(report.num_output_tokens)),
        ("drafts", str(report.num_drafts)),
        ("draft tokens", str(report.num_draft_tokens)),
        ("accepted tokens", str(report.num_accepted_tokens)),
        ("acceptance rate", format_figure(report.acceptance_rate, 3)),
        ("mean acceptance length", format_figure(report.mean_acceptance_length, 3)),
        ("tokens/s", format_figure(report.tokens_per_second, 1)),
        ("captured layer ids (layer_input)", str(report.capture_layer_ids)),
        ("drafter's layer ids (layer_input)", str(report.drafter_layer_ids)),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    positions = Table(title="acceptance per draft position")
    positions.add_column("position", justify="right")
    positions.add_column("accepted", justify="right")
    positions.add_column("rate", justify="right")
    rates = report.per_position_acceptance or [None] * report.k  # no rates before any draft
    for index, (count, rate) in enumerate(zip(report.accepted_per_position, rates, strict=True)):
        positions.add_row(str(index), str(count), format_figure(rate, 3))
    console = Console()
    if report.layer_ids_forced:
        console.print(
            "[bold yellow]warning:[/] captured layer ids differ from the drafter's (--force-layer-ids)"
        )
    console.print(summary)
    console.print(positions)


def simulate(
    target: Path = typer.Option(..., "--target", help="Target: a Hugging Face model folder."),
    drafter: Path = typer.Option(..., "--drafter", help="Drafter: a native EAGLE-3 checkpoint folder."),
    prompts: Path = typer.Option(
        ..., "--prompts", help='Prompts: JSONL rows with a "prompt" field, or plain text, one per line.'
    ),
    k: int = typer.Option(3, "-k", "--num-speculative-tokens", min=1, help="Draft tokens per step."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Output tokens per prompt."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
    layer_ids: str | None = typer.Option(
        None, "--layer-ids", help="Capture these target layers (layer_input ids, e.g. 2,4,6)."
    ),
    force_layer_ids: bool = typer.Option(
        False, "--force-layer-ids", help="Run even when --layer-ids differ from the drafter's trained ids."
    ),
    drafter_convention: str | None = typer.Option(
        None,
        "--drafter-convention",
        help="For a published drafter without a draftloop block: its ids' convention (layer_input | "
        "layer_output, or the engine that reads them: vllm | sglang).",
    ),
    device: str = typer.Option("cpu", "--device", help="torch device (cpu, cuda, cuda:1, ...)."),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Run the Python code the --target folder ships (its own model and tokenizer classes); "
        "only for a folder you trust.",
    ),
) -> None:
    """Simulate greedy speculative decoding of TARGET with DRAFTER over PROMPTS; print vLLM's metrics."""
    from draftloop.infra.engines.base import convention_for
    from draftloop.kernels.checkpoint import load_drafter
    from draftloop.kernels.files import DrafterFormatError
    from draftloop.kernels.simulate import LayerIdMismatchError, SimulationInputError, simulate_acceptance

    try:
        prompt_texts = read_prompts_file(prompts)
    except PromptFileError as error:
        raise _fail(f"--prompts: {error}") from None
    requested_ids = parse_layer_ids(layer_ids) if layer_ids is not None else None
    if force_layer_ids and requested_ids is None:
        raise _fail("--force-layer-ids needs --layer-ids")
    try:
        convention = convention_for(drafter_convention) if drafter_convention is not None else None
    except ValueError as error:
        raise _fail(f"--drafter-convention: {error}") from None
    try:
        draft_model = load_drafter(drafter, device=device, convention=convention)
    except DrafterFormatError as error:
        raise _fail(f"--drafter: {error}") from None
    tokenizer = _load_tokenizer(target, trust_remote_code=trust_remote_code)
    _refuse_beyond_rope_length(
        tokenizer, prompt_texts, prompts, max_new_tokens, drafter, draft_model.config.max_position_embeddings
    )
    target_model = _load_target_model(target, trust_remote_code=trust_remote_code)
    try:
        draft_model.attach_embeddings(target_model.get_input_embeddings().weight)
    except ValueError as error:
        raise _fail(f"--drafter: does not fit --target {target}: {error}") from None
    try:
        report = simulate_acceptance(
            target_model,
            tokenizer,
            draft_model,
            prompt_texts,
            k=k,
            max_new_tokens=max_new_tokens,
            device=device,
            layer_ids=requested_ids,
            allow_layer_mismatch=force_layer_ids,
        )
    except LayerIdMismatchError as error:
        raise _fail(f"--layer-ids: {error}") from None
    except SimulationInputError as error:
        raise _fail(str(error)) from None
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        _print_report(report)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `draftloop` app."""
    app.command("simulate")(simulate)
