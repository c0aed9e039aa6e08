"""Conversations: the rows synthesis writes and extraction reads, and how a synthesize dataset holds them.

A row is `{"id", "messages": [user prompt, assistant answer], "reasoning": str | None}`; a synthesize
dataset stores them in `conversations-NNNNN.jsonl` shards next to `eval_prompts.jsonl` (the held-out
prompts, `{"id", "prompt"}`) and `rejected.jsonl` (`{"id", "reason"}`, plus `kind` where the reason's
text varies: input rows and the length policy; `count_rejections` groups them all).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from draftloop.infra.runtime.storage import Manifest, StorageOptions, read_shard

CONVERSATIONS_SHARD_PREFIX = "conversations-"
EVAL_PROMPTS_SHARD = "eval_prompts.jsonl"
REJECTED_SHARD = "rejected.jsonl"

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(content, reasoning): reasoning models wrap their thinking in <think>...</think>; keep it apart."""
    found = _THINK.search(text)
    if found is None:
        if "</think>" in text:  # template opened <think> in the prompt; only the close is generated
            reasoning, _, content = text.partition("</think>")
            return content.strip(), reasoning.strip() or None
        return text.strip(), None
    reasoning = found.group(1).strip()
    content = (text[: found.start()] + text[found.end() :]).strip()
    return content, reasoning or None


def templated_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, int]:
    """(text, tokens) of `messages` through the target's chat template, ready for the answer; raises
    what the template raises (e.g. a role it refuses)."""
    text = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    # verbose=False: a prompt longer than the tokenizer's model_max_length is only being measured here
    return text, len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def prompt_too_long(prompt_tokens: int, max_length: int) -> str | None:
    """Why a prompt is refused for training samples of `max_length` tokens (no room for an answer); the
    text before the first colon is its kind (`rejection_kind`)."""
    if prompt_tokens >= max_length - 1:
        return f"over data.max_length: prompt has {prompt_tokens} tokens, data.max_length is {max_length}"
    return None


def rejection_kind(rejected: Mapping[str, Any]) -> str:
    """The category a rejected row is counted under in the manifest's `rejected_reasons`: its own `kind`
    (input rows, the length policy), else its reason up to the first colon ("generation failed: <detail>"
    -> "generation failed")."""
    kind = str(rejected.get("kind") or str(rejected["reason"]).split(":")[0])
    # the counts become MLflow metric names, which allow only these characters
    return re.sub(r"[^A-Za-z0-9_\-. /]", "", kind).strip() or "other"


def count_rejections(rejected: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many rejected rows of each kind."""
    counts: dict[str, int] = {}
    for row in rejected:
        kind = rejection_kind(row)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@dataclass
class SynthesisResult:
    """Answered conversations, rejected prompts with their reason, and the tokens generated."""

    conversations: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    generated_tokens: int = 0
    seconds: float = 0.0  # generating only: loading the target or starting its server is not counted
    shortened: int = 0  # conversations whose later turns were not asked for: data.max_length was reached

    def reject(self, row_id: str, reason: str) -> None:
        self.rejected.append({"id": row_id, "reason": reason})

    def add_answer(self, prompt: Mapping[str, Any], content: str, reasoning: str | None) -> None:
        """Keep the target's answer to `prompt` (an input row, infra/synthesis/prompts.py) after its first
        user turn (system turns kept); an empty answer is a rejection."""
        if not content:
            self.reject(prompt["id"], "empty answer")
            return
        self.conversations.append(
            {
                "id": prompt["id"],
                "messages": [*first_turns(prompt), {"role": "assistant", "content": content}],
                "reasoning": reasoning,
            }
        )


def first_turns(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """An input row's turns up to its first user turn (system prompts included): what a one-turn
    answer continues. A `{"id", "prompt"}` row is one user turn."""
    turns: list[dict[str, str]] = []
    for message in row.get("messages") or [{"role": "user", "content": row["prompt"]}]:
        turns.append({"role": str(message["role"]), "content": str(message["content"])})
        if message["role"] == "user":
            break
    return turns


def to_jsonl(rows: Iterable[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def _read_jsonl(manifest: Manifest, shard: str, options: StorageOptions | None) -> list[Any]:
    return [json.loads(line) for line in read_shard(manifest, shard, options).decode().splitlines() if line]


def read_conversations(manifest: Manifest, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """All accepted conversations of a synthesize dataset, in shard order."""
    rows: list[dict[str, Any]] = []
    for shard in manifest.shards:
        if shard.name.startswith(CONVERSATIONS_SHARD_PREFIX):
            rows.extend(_read_jsonl(manifest, shard.name, options))
    return rows


def conversation_count(manifest: Manifest) -> int:
    """How many accepted conversations a synthesize dataset holds (from its manifest, reading nothing)."""
    return sum(s.rows for s in manifest.shards if s.name.startswith(CONVERSATIONS_SHARD_PREFIX))


def iter_conversations(
    manifest: Manifest, start: int, end: int, options: StorageOptions | None = None
) -> Iterator[dict[str, Any]]:
    """Conversations `start` to `end` (exclusive, in shard order), reading only the shards that hold them,
    one at a time (an extraction actor reads its own slice; the driver reads none)."""
    first = 0
    for shard in manifest.shards:
        if not shard.name.startswith(CONVERSATIONS_SHARD_PREFIX):
            continue
        last = first + shard.rows
        if last > start and first < end:
            rows = _read_jsonl(manifest, shard.name, options)
            yield from rows[max(0, start - first) : end - first]
        first = last
        if first >= end:
            return


def read_eval_prompts(manifest: Manifest, options: StorageOptions | None = None) -> list[dict[str, str]]:
    """The held-out prompts (`{"id", "prompt"}`) of a synthesize dataset."""
    return _read_jsonl(manifest, EVAL_PROMPTS_SHARD, options)
