"""Stage 1, synthesize: prompts -> conversations answered by the target itself.

Two backends (`synthesis.backend`): `in_process` hosts the Hugging Face target in a Ray actor and answers
greedily in bounded batches (small targets); `engine` asks the engine server's OpenAI API with bounded
concurrency (big targets, where only the engine can hold the model). Reasoning is kept apart from the
answer. Rows that cannot be answered go to `rejected.jsonl` with a reason and are counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from draftloop.tasks._stage import StageError, StageOutcome, StageWork, run_cached, storage_options

SECTIONS = ("target", "data", "synthesis")
ROWS_PER_SHARD = 1024
EVAL_PROMPTS_SHARD = "eval_prompts.jsonl"
REJECTED_SHARD = "rejected.jsonl"


def ensure_target(config: Any) -> str:
    """The target's local folder; built from the zoo recipe (`target.create`) when missing."""
    path = Path(str(config.target.path))
    if (path / "config.json").exists():
        return str(path)
    recipe = getattr(config.target, "create", None)
    if not recipe:
        raise StageError("synthesize", f"target.path {path} has no config.json and target.create is not set")
    from draftloop.infra.zoo import create_tiny_model

    create_tiny_model(recipe, path, seed=config.target.seed)
    return str(path)


def load_prompts(config: Any) -> list[dict[str, str]]:
    """Prompt rows {"id", "prompt"} from the built-in set or a JSONL path/URI (infra.storage)."""
    from draftloop.infra.storage import load_prompts as load

    return [
        {"id": row.id, "prompt": row.prompt}
        for row in load(str(config.data.prompts), storage_options(config))
    ]


def split_prompts(
    config: Any, rows: list[dict[str, str]]
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training prompts, held-out eval prompts): the eval prompts are the last `data.eval_prompts` rows."""
    held_out = int(config.data.eval_prompts)
    if held_out >= len(rows):
        raise StageError(
            "synthesize", f"data.eval_prompts={held_out} leaves no training prompts of {len(rows)}"
        )
    eval_rows = rows[len(rows) - held_out :] if held_out else []
    train_rows = rows[: len(rows) - held_out][: int(config.data.num_samples)]
    return train_rows, eval_rows


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def _generate_in_process(config: Any, target_path: str, prompts: list[dict[str, str]]) -> Any:
    import ray

    from draftloop.infra.actors import ensure_ray, kill_actors, remote_target_generator

    ensure_ray(config.ray.address)
    actor_class = remote_target_generator(float(config.synthesis.num_gpus))
    actor = actor_class.remote(target_path, dtype=str(getattr(config.extraction, "dtype", "float32")))
    try:
        return ray.get(
            actor.generate.remote(
                prompts,
                max_new_tokens=int(config.synthesis.max_new_tokens),
                temperature=float(config.synthesis.temperature),
                max_length=int(config.data.max_length),
                batch_size=int(config.synthesis.concurrency),
            )
        )
    finally:
        kill_actors([actor])


async def _ask_all(
    base_url: str,
    model: str,
    prompts: list[dict[str, str]],
    max_tokens: int,
    temperature: float,
    concurrency: int,
) -> Any:
    import httpx

    from draftloop.infra.actors import SynthesisResult, split_reasoning

    limit = asyncio.Semaphore(max(1, concurrency))
    conversations: list[dict[str, Any]] = []
    rejected: list[dict[str, str]] = []
    generated = 0

    async def ask(client: httpx.AsyncClient, row: dict[str, str]) -> None:
        nonlocal generated
        async with limit:
            try:
                response = await client.post(
                    f"{base_url.rstrip('/')}/v1/chat/completions",
                    json={
                        "model": model,
                        "messages": [{"role": "user", "content": row["prompt"]}],
                        "max_tokens": max_tokens,
                        "temperature": temperature,
                    },
                )
                response.raise_for_status()
                body = response.json()
            except Exception as error:
                rejected.append({"id": row["id"], "reason": f"request failed: {error}"})
                return
        message = body["choices"][0]["message"]
        content, reasoning = split_reasoning(message.get("content") or "")
        reasoning = message.get("reasoning_content") or message.get("reasoning") or reasoning
        generated += int(body.get("usage", {}).get("completion_tokens", 0))
        if not content:
            rejected.append({"id": row["id"], "reason": "empty answer"})
            return
        conversations.append(
            {
                "id": row["id"],
                "messages": [
                    {"role": "user", "content": row["prompt"]},
                    {"role": "assistant", "content": content},
                ],
                "reasoning": reasoning,
            }
        )

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(ask(client, row) for row in prompts))
    order = {row["id"]: index for index, row in enumerate(prompts)}
    conversations.sort(key=lambda row: order[row["id"]])
    return SynthesisResult(conversations, rejected, generated)


def _generate_with_engine(config: Any, target_path: str, prompts: list[dict[str, str]], cleanup: Any) -> Any:
    """Start the engine (no speculation), ask it over HTTP, stop it."""
    from draftloop.tasks.evaluate import start_engine

    server = start_engine(config, target_path, drafter_dir=None, cleanup=cleanup)
    try:
        return asyncio.run(
            _ask_all(
                server.base_url,
                server.model_name,
                prompts,
                int(config.synthesis.max_new_tokens),
                float(config.synthesis.temperature),
                int(config.synthesis.concurrency),
            )
        )
    finally:
        server.stop()


def run(config: Any, cleanup: Any = None, on_start: Any = None) -> StageOutcome:
    """Synthesize conversations (cached on target + data + synthesis sections)."""

    def body(work: StageWork) -> Any:
        from draftloop.infra.storage import DatasetWriter

        target_path = ensure_target(config)
        train_prompts, eval_prompts = split_prompts(config, load_prompts(config))
        started = time.perf_counter()
        backend = str(config.synthesis.backend)
        if backend == "engine":
            result = _generate_with_engine(config, target_path, train_prompts, cleanup)
        else:
            result = _generate_in_process(config, target_path, train_prompts)
        seconds = time.perf_counter() - started
        if not result.conversations:
            seen = sorted({row["reason"] for row in result.rejected})[:5]
            raise StageError("synthesize", f"every prompt was rejected: {seen}")
        writer = DatasetWriter(work.uri, storage_options=storage_options(config))
        rows = result.conversations
        for index, start in enumerate(range(0, len(rows), ROWS_PER_SHARD)):
            chunk = rows[start : start + ROWS_PER_SHARD]
            writer.write_shard(f"conversations-{index:05d}.jsonl", _jsonl(chunk), rows=len(chunk))
        writer.write_shard(EVAL_PROMPTS_SHARD, _jsonl(eval_prompts), rows=len(eval_prompts))
        writer.write_shard(REJECTED_SHARD, _jsonl(result.rejected), rows=len(result.rejected))
        reasons: dict[str, int] = {}
        for row in result.rejected:
            kind = row["reason"].split(":")[0]  # "generation failed: <detail>" -> "generation failed"
            reasons[kind] = reasons.get(kind, 0) + 1
        summary = {
            "backend": backend,
            "target": target_path,
            "requested": len(train_prompts),
            "rows": len(rows),
            "rejected": len(result.rejected),
            "rejected_reasons": reasons,
            "eval_prompts": len(eval_prompts),
            "with_reasoning": sum(1 for row in rows if row.get("reasoning")),
            "generated_tokens": result.generated_tokens,
            "seconds": round(seconds, 3),
            "rows_per_s": round(len(rows) / seconds, 3) if seconds > 0 else None,
            "tokens_per_s": round(result.generated_tokens / seconds, 3) if seconds > 0 else None,
        }
        return writer.commit("synthesize", inputs=work.inputs, summary=summary)

    return run_cached("synthesize", config, SECTIONS, {}, body, on_start=on_start)


def read_conversations(manifest: Any, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """All accepted conversations of a synthesize manifest, in shard order."""
    from draftloop.infra.storage import read_shard

    rows: list[dict[str, Any]] = []
    for shard in manifest.shards:
        if shard.name.startswith("conversations-"):
            rows.extend(
                json.loads(line)
                for line in read_shard(manifest, shard.name, options).decode().splitlines()
                if line
            )
    return rows


def read_eval_prompts(manifest: Any, options: dict[str, Any] | None = None) -> list[dict[str, str]]:
    from draftloop.infra.storage import read_shard

    data = read_shard(manifest, EVAL_PROMPTS_SHARD, options).decode()
    return [json.loads(line) for line in data.splitlines() if line]


def _task(ctx: Any) -> StageOutcome:
    from draftloop.tasks._stage import execute_stage

    return execute_stage(
        ctx, "synthesize", lambda _run, on_start: run(ctx.config, cleanup=ctx, on_start=on_start)
    )


def synthesize_task() -> Any:
    """The Prefect task (built lazily so importing this module does not import Prefect)."""
    from prefect import task

    from draftloop.tasks._stage import task_options

    return task(name="synthesize", **task_options())(_task)
