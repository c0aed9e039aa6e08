"""The `diagnose` flow: `draftloop diagnose` as a Prefect deployment with a form (the same request)."""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow

from draftloop.infra.evaluation.diagnose_request import DiagnoseRequest
from draftloop.tasks.diagnose import run_diagnosis


@flow(name="diagnose", log_prints=True)
def diagnose(
    target: str,
    drafter: str,
    engine: Literal["vllm", "sglang"] = "vllm",
    prompts: str = "",
    num_prompts: int = 8,
    k: int = 3,
    max_tokens: int = 32,
    concurrency: list[int] = [1],  # noqa: B006 - a literal so the form shows it; never mutated
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
    max_model_len: int = 1024,
    reasoning_parser: str = "",
    min_acceptance_length: float = 1.5,
) -> dict[str, Any]:
    """Is a bad number the drafter's fault or the engine's? Serve the target with the drafter, simulate
    it on the same prompts, and name the cause.

    Args:
        target: Target model, a Hugging Face model folder.
        drafter: Drafter folder: draftloop's, vLLM-style, SGLang/SpecForge or speculators format.
        engine: Serving engine.
        prompts: Prompts file (JSONL with a "prompt" field, or text); empty uses the shipped set.
        num_prompts: Prompts used from the file.
        k: Draft tokens per step.
        max_tokens: Output tokens per prompt.
        concurrency: Concurrency levels the speedup is measured at.
        dtype: Served dtype.
        max_model_len: Served context length.
        reasoning_parser: A thinking target's reasoning parser (e.g. deepseek_r1); empty: none.
        min_acceptance_length: Under it, a drafter the engine runs right is called weak.
    """
    request = DiagnoseRequest(
        target=target,  # type: ignore[arg-type]  # pydantic converts
        drafter=drafter,  # type: ignore[arg-type]
        engine=engine,
        prompts=prompts or None,  # type: ignore[arg-type]
        num_prompts=num_prompts,
        k=k,
        max_tokens=max_tokens,
        concurrency=concurrency,
        dtype=dtype,
        max_model_len=max_model_len,
        reasoning_parser=reasoning_parser or None,
        min_acceptance_length=min_acceptance_length,
    )
    request.check()  # a bad input fails the run by name before the task starts a server
    diagnosis = run_diagnosis(request)
    print(f"diagnosis: {diagnosis.verdict}" + (f" ({diagnosis.cause.name})" if diagnosis.cause else ""))
    return diagnosis.to_json()
