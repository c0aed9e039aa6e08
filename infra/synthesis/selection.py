"""Which input rows a cycle uses: one length policy for every row, evaluation prompts no row can dominate,
and the shortfall against `data.num_samples`.

Every row the synthesize stage takes, training or evaluation, goes through one length policy on its
prompt (its turns up to the first user turn, through the target's chat template, counted in the target's
tokens): a prompt that leaves no room for an answer within `data.max_length` is skipped (rejected with
kind "over data.max_length") or, with `data.over_length: truncate`, its first user turn is cut to leave
`answer_room` tokens for the answer. Evaluation prompts are the last `data.eval_prompts` rows that fit
the evaluation cap too: `data.eval_prompt_max_tokens` (default `data.max_length`) and what the engine
can serve with the evaluation's answer (`engine.max_model_len` minus `evaluation.max_tokens` and the
largest k), so no single row can dominate the evaluation or exceed the server's context; a row over
the cap may still train. Training prompts are the first `data.num_samples` other rows that pass. Rows
are measured lazily, from the end for evaluation and from the start for training, so a big corpus
costs only the rows the run uses. A `data.num_samples` the rows cannot meet is a shortfall: a warning
(`shortfall_warning`), and an error beyond `data.max_shortfall_fraction`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from draftloop.infra.synthesis.conversations import first_turns, prompt_too_long, templated_prompt

PromptRow = dict[str, Any]  # {"id", "prompt", "messages"?, "category"?} (infra/synthesis/prompts.py)
OVER_LENGTH = "over data.max_length"  # the rejection kind of a prompt the policy skips


@dataclass(frozen=True)
class LengthPolicy:
    """The one length policy (module docstring) and the evaluation cap, in target tokens."""

    max_length: int
    over_length: Literal["skip", "truncate"] = "skip"
    answer_room: int = 96  # tokens a truncated prompt leaves for its answer
    eval_max_tokens: int | None = None  # None: max_length

    @classmethod
    def from_config(cls, config: Any) -> LengthPolicy:
        """The policy of an ExperimentConfig: its data section, and the engine's room for evaluation."""
        data, engine, evaluation = config.data, config.engine, config.evaluation
        max_length = int(data.max_length)
        largest_k = max([int(engine.num_speculative_tokens), *(evaluation.speculative_tokens_sweep or [])])
        servable = int(engine.max_model_len) - int(evaluation.max_tokens) - largest_k
        cap = int(data.eval_prompt_max_tokens or max_length)
        return cls(
            max_length=max_length,
            over_length=data.over_length,
            answer_room=min(int(config.synthesis.max_new_tokens), max_length // 2),
            eval_max_tokens=min(cap, servable),
        )


@dataclass
class PromptSelection:
    """The training and evaluation prompts (file order), the rows the policy refused, what it counted."""

    train: list[PromptRow] = field(default_factory=list)
    eval: list[PromptRow] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)  # {"id", "reason", "kind"}
    truncated: int = 0  # prompts cut to fit data.max_length (over_length: truncate)
    over_eval_cap: int = 0  # evaluation candidates passed over for their length (they may train)
    measured: int = 0  # rows put through the tokenizer

    def summary(self) -> dict[str, int]:
        """What the manifest records about the selection."""
        return {
            "training_prompts": len(self.train),
            "length_rejected": len(self.rejected),
            "truncated_at_max_length": self.truncated,
            "eval_prompts_over_cap": self.over_eval_cap,
        }


def select_prompts(
    rows: Sequence[PromptRow], tokenizer: Any, policy: LengthPolicy, num_samples: int, eval_prompts: int
) -> PromptSelection:
    """The evaluation prompts (the last `eval_prompts` rows that pass the policy and fit the evaluation
    cap) and the training prompts (the first `num_samples` other rows that pass it)."""
    selection = PromptSelection()
    checked: dict[int, PromptRow | None] = {}  # row index -> the row as used, None: refused

    def passed(index: int) -> PromptRow | None:
        if index not in checked:
            checked[index] = _apply_policy(rows[index], tokenizer, policy, selection)
        return checked[index]

    eval_cap = policy.eval_max_tokens if policy.eval_max_tokens is not None else policy.max_length
    chosen: list[int] = []
    for index in range(len(rows) - 1, -1, -1):
        if len(chosen) == eval_prompts:
            break
        row = passed(index)
        if row is None:
            continue
        if _prompt_tokens(row, tokenizer) > eval_cap:
            selection.over_eval_cap += 1
            continue
        chosen.append(index)
    selection.eval = [row for index in sorted(chosen) if (row := checked[index]) is not None]
    held = set(chosen)
    # Training rows: those before the first evaluation row (the held-out tail stays unseen), then, only
    # when those run short, rows between evaluation rows that the evaluation cap passed over.
    first_eval = min(chosen) if chosen else len(rows)
    order = [*range(first_eval), *(i for i in range(first_eval, len(rows)) if i not in held)]
    for index in order:
        if len(selection.train) == num_samples:
            break
        row = passed(index)
        if row is not None:
            selection.train.append(row)
    return selection


def _prompt_tokens(row: PromptRow, tokenizer: Any) -> int:
    return templated_prompt(tokenizer, first_turns(row))[1]


def _apply_policy(
    row: PromptRow, tokenizer: Any, policy: LengthPolicy, selection: PromptSelection
) -> PromptRow | None:
    """`row` as the run uses it (truncated when the policy says so), or None when refused (recorded)."""
    selection.measured += 1
    row_id = str(row["id"])
    try:
        tokens = _prompt_tokens(row, tokenizer)
    except Exception as error:  # a template that refuses the turns (e.g. roles)
        selection.rejected.append(
            {"id": row_id, "reason": f"chat template failed: {error}", "kind": "chat template failed"}
        )
        return None
    too_long = prompt_too_long(tokens, policy.max_length)
    if too_long is None:
        return row
    if policy.over_length == "truncate":
        cut = _truncated(row, tokenizer, policy.max_length - policy.answer_room)
        if cut is not None:
            selection.truncated += 1
            return cut
        too_long += " (truncating its first user turn cannot make it fit)"
    selection.rejected.append({"id": row_id, "reason": too_long, "kind": OVER_LENGTH})
    return None


def _truncated(row: PromptRow, tokenizer: Any, budget: int) -> PromptRow | None:
    """`row` with its first user turn cut to the longest prefix (in tokens) whose templated prompt has at
    most `budget` tokens; None when even one token of it does not fit."""
    content = str(row["prompt"])
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]

    def with_prefix(count: int) -> PromptRow:
        return _with_first_user_turn(row, str(tokenizer.decode(ids[:count])).strip() or content[:1])

    def fits(count: int) -> bool:
        return _prompt_tokens(with_prefix(count), tokenizer) <= budget

    # The largest fitting prefix (fitting shrinks with length); the content alone has at most `budget`
    # tokens of it, so a 400k-token turn costs a few short tokenizations.
    low, high = 0, min(len(ids), budget) + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return with_prefix(low) if low > 0 else None


def _with_first_user_turn(row: PromptRow, content: str) -> PromptRow:
    """A copy of `row` whose prompt (its first user turn) is `content`."""
    copy: PromptRow = {**row, "prompt": content}
    if "messages" in row:
        messages = [dict(message) for message in row["messages"]]
        first = next(i for i, message in enumerate(messages) if message["role"] == "user")
        messages[first]["content"] = content
        copy["messages"] = messages
    return copy


@dataclass(frozen=True)
class RowCounts:
    """Where the input rows went, for the shortfall warning."""

    input_rows: int
    input_rejected: int
    length_rejected: int
    held_out: int
    training_prompts: int
    not_answered: int


def shortfall_warning(requested: int, made: int, counts: RowCounts) -> str | None:
    """The warning for `made` training conversations of `requested` (None when none are missing)."""
    if made >= requested:
        return None
    unanswered = f"; {counts.not_answered} of them were not answered" if counts.not_answered else ""
    return (
        f"data.num_samples={requested} but {made} training conversations were made ({requested - made} "
        f"short): {counts.training_prompts} training prompts were left of {counts.input_rows} rows "
        f"({counts.input_rejected} rejected on input, {counts.length_rejected} by the length policy, "
        f"{counts.held_out} held out for evaluation){unanswered}"
    )


def shortfall_error(requested: int, made: int, max_fraction: float) -> str | None:
    """Why the run stops when more than `max_fraction` of `requested` conversations are missing."""
    missing = requested - made
    if requested and missing / requested > max_fraction:
        return (
            f"{made} of data.num_samples={requested} training conversations ({missing} short), more than "
            f"data.max_shortfall_fraction={max_fraction} of them missing"
        )
    return None
