"""Stage 1, synthesize: prompts -> conversations answered by the target itself.

Two backends (`synthesis.backend`): `in_process` hosts the Hugging Face target in a Ray actor and answers
greedily in bounded batches (small targets); `engine` asks the engine server's OpenAI API with bounded
concurrency (big targets, where only the engine can hold the model). Reasoning is kept apart from the
answer. Rows that cannot be answered go to `rejected.jsonl` with a reason and are counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from draftloop.infra.engines.actors import start_server_actor
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord, state_dir
from draftloop.infra.runtime.ray_cluster import ensure_ray, kill_actors
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, storage_options
from draftloop.infra.synthesis.conversations import (
    CONVERSATIONS_SHARD_PREFIX,
    EVAL_PROMPTS_SHARD,
    REJECTED_SHARD,
    SynthesisResult,
    count_rejections,
    prompt_too_long,
    templated_prompt,
    to_jsonl,
)
from draftloop.infra.synthesis.engine import input_messages, regenerate_from_config, synthesis_engine
from draftloop.infra.synthesis.generator import remote_target_generator
from draftloop.infra.synthesis.prompts import DataError, input_fingerprint, read_input_from_config
from draftloop.infra.synthesis.selection import (
    LengthPolicy,
    PromptSelection,
    RowCounts,
    select_prompts,
    shortfall_error,
    shortfall_warning,
)
from draftloop.infra.targets.resolve import ensure_target, target_fingerprint
from draftloop.tasks.cache import StageError
from draftloop.tasks.stage import Figure, Stage, StageRequest
from draftloop.tasks.summaries import SynthesisSummary

ROWS_PER_SHARD = 1024

PromptRow = dict[str, Any]  # {"id", "prompt", "messages"?, "category"?} (infra/synthesis/prompts.py)


def split_prompts(config: ExperimentConfig, target_path: str, rows: list[PromptRow]) -> PromptSelection:
    """The training prompts and the held-out eval prompts (the last `data.eval_prompts` rows), every one
    through the one length policy in the target's tokens (infra/synthesis/selection.py), before any
    answer is generated; a shortfall beyond `data.max_shortfall_fraction` is a data error here."""
    from transformers import AutoTokenizer

    held_out, wanted = int(config.data.eval_prompts), int(config.data.num_samples)
    if held_out >= len(rows):
        raise StageError(
            "synthesize", f"data.eval_prompts={held_out} leaves no training prompts of {len(rows)}"
        )
    tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=config.target.trust_remote_code)
    selection = select_prompts(rows, tokenizer, LengthPolicy.from_config(config), wanted, held_out)
    error = shortfall_error(wanted, len(selection.train), float(config.data.max_shortfall_fraction))
    if error is not None or not selection.train:
        refused = count_rejections(selection.rejected)
        raise DataError(str(config.data.prompts), None, f"{error or 'no training prompt left'} ({refused})")
    return selection


def _warn(message: str) -> None:
    """A warning in the run's log (the Prefect run logger inside a flow)."""
    try:
        get_run_logger().warning(message)
    except MissingContextError:
        logging.getLogger(__name__).warning(message)


def _generate_in_process(
    config: ExperimentConfig, target_path: str, prompts: list[PromptRow], pids: PidRecord
) -> SynthesisResult:
    ensure_ray(config.ray.address, pids)
    actor_class = remote_target_generator(float(config.synthesis.num_gpus))
    actor = actor_class.remote(
        target_path, dtype=str(config.extraction.dtype), trust_remote_code=config.target.trust_remote_code
    )
    try:
        result: SynthesisResult = ray.get(
            actor.generate.remote(
                prompts,
                max_new_tokens=int(config.synthesis.max_new_tokens),
                temperature=float(config.synthesis.temperature),
                max_length=int(config.data.max_length),
                batch_size=int(config.synthesis.concurrency),
            )
        )
        return result
    finally:
        kill_actors([actor])


def _refuse_overlong_prompts(
    config: ExperimentConfig, target_path: str, prompts: list[PromptRow]
) -> tuple[list[PromptRow], list[dict[str, str]]]:
    """(prompts to send, rejected rows): each row's input turns through the target's chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=config.target.trust_remote_code)
    kept: list[PromptRow] = []
    refused: list[dict[str, str]] = []
    for row in prompts:
        try:
            _, tokens = templated_prompt(tokenizer, input_messages(row))
        except Exception as error:  # a template that refuses the turns (e.g. roles)
            refused.append({"id": str(row["id"]), "reason": f"chat template failed: {error}"})
            continue
        too_long = prompt_too_long(tokens, int(config.data.max_length))
        if too_long is not None:
            refused.append({"id": str(row["id"]), "reason": too_long})
        else:
            kept.append(row)
    return kept, refused


def _generate_with_engine(
    config: ExperimentConfig, target_path: str, prompts: list[PromptRow], pids: PidRecord
) -> SynthesisResult:
    """Start the engine (no speculation) in a Ray actor, regenerate the conversations over HTTP, stop it.

    The over-length policy is the in-process path's: a prompt with no room for an answer within
    `data.max_length` tokens is rejected with its length, before any request is sent."""
    prompts, refused = _refuse_overlong_prompts(config, target_path, prompts)
    if not prompts:
        return SynthesisResult(rejected=refused)
    ensure_ray(config.ray.address, pids)
    run_dir = state_dir() / "work" / str(config.name) / "synthesize-engine"
    run_dir.mkdir(parents=True, exist_ok=True)
    engine = synthesis_engine(config)
    server = start_server_actor(engine, target_path, run_dir, "synthesis", pids=pids)
    try:
        result = regenerate_from_config(config, server.base_url, server.model_name, prompts)
        result.rejected[:0] = refused
        return result
    finally:
        server.stop()
        pids.forget("engine-synthesis")


def produce(request: StageRequest) -> Manifest:
    """Answer the training prompts with the target; hold the evaluation prompts out."""
    config = request.config
    options = storage_options(config)
    input_data = read_input_from_config(config, options)  # bad data fails before the target is built
    target_path = ensure_target(config)
    selection = split_prompts(config, target_path, input_data.rows)
    train_prompts, eval_prompts = selection.train, selection.eval
    started = time.perf_counter()
    backend = str(config.synthesis.backend)
    if backend == "engine":
        result = _generate_with_engine(config, target_path, train_prompts, request.pids)
    else:
        result = _generate_in_process(config, target_path, train_prompts, request.pids)
    seconds = time.perf_counter() - started
    if not result.conversations:
        seen = sorted({row["reason"] for row in result.rejected})[:5]
        raise StageError("synthesize", f"every prompt was rejected: {seen}")
    writer = DatasetWriter(request.work.uri, storage_options=options)
    rows = result.conversations
    for index, start in enumerate(range(0, len(rows), ROWS_PER_SHARD)):
        chunk = rows[start : start + ROWS_PER_SHARD]
        writer.write_shard(f"{CONVERSATIONS_SHARD_PREFIX}{index:05d}.jsonl", to_jsonl(chunk), rows=len(chunk))
    writer.write_shard(EVAL_PROMPTS_SHARD, to_jsonl(eval_prompts), rows=len(eval_prompts))
    # input rows set aside (file, line, reason), prompts the length policy refused, and prompts the target
    # could not answer: every rejection, counted by kind
    rejected: list[dict[str, Any]] = [*input_data.rejected, *selection.rejected, *result.rejected]
    writer.write_shard(REJECTED_SHARD, to_jsonl(rejected), rows=len(rejected))
    generating = result.seconds
    wanted = int(config.data.num_samples)
    counts = RowCounts(
        input_rows=input_data.read,
        input_rejected=len(input_data.rejected),
        length_rejected=len(selection.rejected),
        held_out=len(eval_prompts),
        training_prompts=len(train_prompts),
        not_answered=len(result.rejected),
    )
    warning = shortfall_warning(wanted, len(rows), counts)
    if warning is not None:
        _warn(f"synthesize: {warning}")
    error = shortfall_error(wanted, len(rows), float(config.data.max_shortfall_fraction))
    if error is not None:
        raise DataError(str(config.data.prompts), None, error)
    summary = {
        "backend": backend,
        "target": target_path,
        "requested": wanted,
        "rows": len(rows),
        "shortfall": wanted - len(rows) if warning else None,
        "warnings": [warning] if warning else [],
        **input_data.summary(),
        **selection.summary(),
        "rejected": len(rejected),
        "rejected_reasons": count_rejections(rejected),
        "eval_prompts": len(eval_prompts),
        "with_reasoning": sum(1 for row in rows if row.get("reasoning")),
        "generated_tokens": result.generated_tokens,
        "shortened_at_max_length": result.shortened,
        "seconds": round(seconds, 3),
        # rates over the generation alone: loading the target or starting its server is start-up
        "startup_seconds": round(max(0.0, seconds - generating), 3),
        "generation_seconds": round(generating, 3),
        "rows_per_s": round(len(rows) / generating, 3) if generating > 0 else None,
        "tokens_per_s": round(result.generated_tokens / generating, 3) if generating > 0 else None,
    }
    return writer.commit("synthesize", inputs=request.work.inputs, summary=summary)


def key_fields(config: ExperimentConfig) -> dict[str, str]:
    """The prompts' and the target's files themselves, not only their paths: edited prompts or weights
    replaced in place are synthesized again (and every later stage follows through the manifests)."""
    return {
        "data.files": input_fingerprint(str(config.data.prompts), storage_options(config)),
        "target.files": target_fingerprint(config),
    }


def gpus(config: ExperimentConfig) -> float:
    return float(
        config.engine.num_gpus if config.synthesis.backend == "engine" else config.synthesis.num_gpus
    )


STAGE = Stage(
    name="synthesize",
    produce=produce,
    summary=SynthesisSummary,
    sections=("target", "data", "synthesis"),
    key_fields=key_fields,
    gpus=gpus,
    figures=(
        Figure("rows", "conversations"),
        Figure("shortfall", "short of data.num_samples"),
        Figure("rejected", "rejected"),
        Figure("rows_per_s", "rows/s"),
        Figure("tokens_per_s", "tokens/s"),
    ),
    description="Only synthesize the training conversations with the target.",
)
