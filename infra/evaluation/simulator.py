"""The simulator's side of the consistency check: kernels' simulator run for a served pair, in the
engine's numeric mode, along the engine's own output where the engine returns its token ids.

Numeric mode. The engine serves in `engine.dtype` (bf16 for DeepSeek-V3 on vLLM's CPU backend, fp16/bf16 on
most GPU deployments); a float32 simulator would follow a different greedy trajectory wherever the
target's top-2 logits are within one low-precision step, and acceptance would then be compared across
different texts. So target and drafter are loaded in the engine's dtype ("auto" = the target's own
`torch_dtype`, as the engines read it). What the simulator cannot reproduce (a quantization, an fp8 KV
cache, a dtype torch cannot run here) stays a difference between the two recorded modes, and the verdict
names it (verdict.py).

Replay. With the speculative server's output token ids, the simulator does not generate its own text: it
replays speculative decoding along the engine's tokens (kernels.simulate `follow_token_ids`). The engine's
acceptance is fully determined by its output and its drafts (a draft is accepted iff it equals the next
output token, and the next draft starts after the accepted ones and the bonus token), so the replay counts
the simulator's drafter's acceptance on exactly the text and the step boundaries the engine counted on:
like with like, for every prompt, with no prompt left out. The target's own greedy choice is still
computed along that text; where it first differs from the engine's token, the prompt is reported as
divergent with the simulator's logprob gap there (a near-tie, or a real difference of the two targets).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from draftloop.infra.engines.base import EngineSettings, read_json
from draftloop.kernels.layer_ids import LayerIds

# The dtypes torch runs a transformers model in on any device.
SIMULATOR_DTYPES = ("float32", "bfloat16", "float16")
# Engine arguments that change the numerics beyond the dtype (`--flag value` or `--flag=value`).
NUMERIC_ENGINE_FLAGS = ("--quantization", "--kv-cache-dtype")

ComparisonMethod = Literal["replay", "free_running", "given"]


@dataclass(frozen=True)
class NumericMode:
    """How one side computes: parameter dtype, quantization / KV-cache dtype, attention path."""

    dtype: str
    attention: str
    quantization: str | None = None
    kv_cache_dtype: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "attention": self.attention,
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
        }


def target_dtype(target_dir: Path) -> str:
    """The dtype a target folder declares (`torch_dtype`, or `dtype` in newer configs); float32 if none."""
    config = read_json(Path(target_dir) / "config.json")
    text_config = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    for source in (config, text_config):
        for key in ("torch_dtype", "dtype"):
            value = source.get(key)
            if value:
                return str(value).removeprefix("torch.")
    return "float32"


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def engine_numeric_mode(settings: EngineSettings, target_dir: Path, drafter_attention: str) -> NumericMode:
    """The engine's mode, from the same settings its server command is built from.

    "auto" is read as the target's declared dtype. (vLLM serves a float32 checkpoint under "auto" in
    its platform's preferred low precision instead; configs that care name the dtype, as the shipped
    ones do.)
    """
    dtype = target_dtype(target_dir) if settings.dtype == "auto" else settings.dtype
    flags = {flag: _flag_value(settings.extra_args, flag) for flag in NUMERIC_ENGINE_FLAGS}
    kv_cache_dtype = flags["--kv-cache-dtype"]
    return NumericMode(
        dtype=dtype,
        attention=f"{settings.kind} kernels ({drafter_attention})",
        quantization=flags["--quantization"],
        kv_cache_dtype=None if kv_cache_dtype in (None, "auto") else kv_cache_dtype,
    )


def simulator_numeric_mode(engine_mode: NumericMode, drafter_attention: str) -> NumericMode:
    """The closest mode the simulator runs in: the engine's dtype when torch can run it, else float32.

    Attention is transformers' (eager or SDPA) with the same attention kind as the engine's: the same
    mathematics, different kernels. Quantization and an fp8 KV cache are not reproduced.
    """
    dtype = engine_mode.dtype if engine_mode.dtype in SIMULATOR_DTYPES else "float32"
    return NumericMode(dtype=dtype, attention=f"transformers ({drafter_attention})")


def simulator_mode_for(settings: EngineSettings, target_dir: Path) -> NumericMode:
    """The simulator's mode for drafters of `target_dir` served with `settings` (its family's attention)."""
    from draftloop.kernels.families.base import family_for_config

    attention = family_for_config(read_json(Path(target_dir) / "config.json")).drafter_attention
    return simulator_numeric_mode(engine_numeric_mode(settings, target_dir, attention), attention)


def mode_mismatch(engine: NumericMode, simulator: NumericMode) -> str | None:
    """What the simulator does not reproduce of the engine's numerics, or None."""
    differences = []
    if engine.dtype != simulator.dtype:
        differences.append(f"dtype {engine.dtype} (engine) vs {simulator.dtype} (simulator)")
    if engine.quantization and engine.quantization != simulator.quantization:
        differences.append(f"engine quantization {engine.quantization}")
    if engine.kv_cache_dtype and engine.kv_cache_dtype != simulator.kv_cache_dtype:
        differences.append(f"engine KV-cache dtype {engine.kv_cache_dtype}")
    return "; ".join(differences) or None


@dataclass
class PromptFigures:
    """One prompt's simulated counts, and where the simulator's greedy choice left the engine's text."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    divergent: bool = False
    # Replay only: first output position where the simulator's target prefers another token, the two
    # tokens, and the simulator's logprob gap between them (nats).
    divergence: dict[str, Any] | None = None


@dataclass
class SimulatorFigures:
    """The simulator's acceptance on the evaluation prompts, and how it was obtained.

    `method`: "replay" (along the engine's output tokens: exact), "free_running" (its own greedy text:
    like with like only where the texts agree), "given" (figures passed in by the caller).
    """

    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: list[float | None]
    num_drafts: int
    capture_layer_ids: list[int]
    method: ComparisonMethod = "given"
    numeric_mode: dict[str, Any] | None = None
    prompts: list[PromptFigures] = field(default_factory=list)

    @classmethod
    def from_report(
        cls,
        report: Any,
        method: ComparisonMethod = "given",
        numeric_mode: NumericMode | None = None,
        prompts: list[PromptFigures] | None = None,
    ) -> SimulatorFigures:
        """From a kernels SimulationReport."""

        def clean(value: Any) -> float | None:
            return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

        return cls(
            acceptance_rate=clean(report.acceptance_rate),
            mean_acceptance_length=clean(report.mean_acceptance_length),
            per_position=[clean(v) for v in report.per_position_acceptance],
            num_drafts=int(report.num_drafts),
            capture_layer_ids=list(getattr(report, "capture_layer_ids", [])),
            method=method,
            numeric_mode=numeric_mode.to_json() if numeric_mode is not None else None,
            prompts=prompts or [],
        )


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def first_divergence(
    target: Any, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> dict[str, Any] | None:
    """Where the target's greedy choice first differs from `output_ids` after `prompt_ids` (one forward
    over the whole text): {position, engine_token, simulator_token, gap_nats}, or None if it never does."""
    import torch

    if not output_ids:
        return None
    ids = torch.tensor([[*prompt_ids, *output_ids]], device=next(target.parameters()).device)
    with torch.inference_mode():
        logits = target(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    choices = logprobs.argmax(dim=-1).tolist()
    for position, (own, engine_token) in enumerate(zip(choices, output_ids, strict=True)):
        if own != engine_token:
            gap = float(logprobs[position, own] - logprobs[position, engine_token])
            return {
                "position": position,
                "engine_token": int(engine_token),
                "simulator_token": int(own),
                "gap_nats": gap,
            }
    return None


@dataclass(frozen=True)
class DrafterReading:
    """How the simulator reads a drafter folder; None fields: as saved.

    `convention`: the ids' convention of a folder without a draftloop record (a published drafter).
    `capture_ids` (layer_input): feed the drafter these target layers instead of its own (what an engine
    may have done with the folder). `folder`: load this view of it instead (the same weights, a config
    completed with ids where the folder names none)."""

    convention: str | None = None
    capture_ids: LayerIds | None = None
    folder: Path | None = None


def run_simulator(
    target_dir: Path,
    drafter_dir: Path,
    prompts: Sequence[str],
    k: int,
    max_tokens: int,
    *,
    mode: NumericMode,
    follow_token_ids: Sequence[Sequence[int]] | None = None,
    engine_outputs: Sequence[str] | None = None,
    trust_remote_code: bool = False,
    reading: DrafterReading | None = None,
) -> SimulatorFigures:
    """Run kernels' simulator in `mode` with the drafter as saved (the ids it was trained on).

    `follow_token_ids` (per prompt, the speculative server's output): replay along them. Otherwise free
    running; `engine_outputs` (the server's texts) then mark the prompts whose texts differ as divergent.
    `trust_remote_code`: run the Python code the target folder ships (target.trust_remote_code).
    `reading`: how to read the drafter folder (None: as saved, with its draftloop record).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftloop.kernels.checkpoint import load_drafter
    from draftloop.kernels.files import load_target_head
    from draftloop.kernels.simulate import simulate_acceptance

    dtype = _torch_dtype(mode.dtype)
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=dtype, trust_remote_code=trust_remote_code
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    reading = reading or DrafterReading()
    drafter = load_drafter(reading.folder or drafter_dir, dtype=dtype, convention=reading.convention)
    embed, _head, _norm = load_target_head(target_dir)
    drafter.attach_embeddings(embed.to(dtype))
    report = simulate_acceptance(
        target,
        tokenizer,
        drafter,
        list(prompts),
        k=k,
        max_new_tokens=max_tokens,
        follow_token_ids=follow_token_ids,
        layer_ids=reading.capture_ids,
        allow_layer_mismatch=reading.capture_ids is not None,
    )
    figures: list[PromptFigures] = []
    for index, result in enumerate(report.results):
        divergence = None
        if follow_token_ids is not None:
            divergence = first_divergence(target, result.prompt_token_ids, follow_token_ids[index])
            divergent = divergence is not None
        else:
            divergent = engine_outputs is not None and result.text != engine_outputs[index]
        figures.append(
            PromptFigures(
                result.num_drafts, result.num_drafts * k, result.num_accepted_tokens, divergent, divergence
            )
        )
    attention = f"{mode.attention}, {getattr(target.config, '_attn_implementation', None) or 'default'}"
    recorded = NumericMode(dtype=mode.dtype, attention=attention)
    method: ComparisonMethod = "replay" if follow_token_ids is not None else "free_running"
    return SimulatorFigures.from_report(report, method, recorded, figures)


def encode_prompts(
    target_dir: Path, prompts: Sequence[str], *, trust_remote_code: bool = False
) -> list[list[int]]:
    """The prompts as token ids, chat template applied, exactly as the simulator encodes them."""
    from transformers import AutoTokenizer

    from draftloop.kernels.simulate import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    return [encode_prompt(tokenizer, prompt) for prompt in prompts]
