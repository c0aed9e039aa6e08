"""A conversation as the target sees it: token ids through its chat template, and the loss mask."""

from __future__ import annotations

from typing import Any

import torch


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], max_length: int
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation through the chat template; 1 marks assistant tokens.

    Each assistant turn's tokens are those the template adds after the prefix that ends with the
    generation prompt; truncated to `max_length`.
    """
    ids: list[int] = []
    mask: list[int] = []
    for turn in range(len(messages)):
        if messages[turn]["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True, tokenize=False)
        through = tokenizer.apply_chat_template(messages[: turn + 1], tokenize=False)
        prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        through_ids = tokenizer(through, add_special_tokens=False)["input_ids"]
        if through_ids[: len(prefix_ids)] != prefix_ids:
            # The template re-renders earlier turns differently: fall back to a per-turn split by length.
            prefix_ids = through_ids[: len(prefix_ids)]
        new_prompt = prefix_ids[len(ids) :]
        ids.extend(new_prompt)
        mask.extend([0] * len(new_prompt))
        answer = through_ids[len(prefix_ids) :]
        ids.extend(answer)
        mask.extend([1] * len(answer))
    return ids[:max_length], mask[:max_length]


def token_sample(tokenizer: Any, messages: list[dict[str, str]], max_length: int) -> dict[str, torch.Tensor]:
    """The conversation as a sample's token tensors: `input_ids` (long) and `loss_mask` (uint8)."""
    ids, mask = tokenize_conversation(tokenizer, messages, max_length)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
    }
