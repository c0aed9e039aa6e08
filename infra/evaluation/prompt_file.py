"""A prompts file as `simulate` and `diagnose` take it: JSONL rows with a "prompt" field, or plain text."""

from __future__ import annotations

import json
from pathlib import Path


class PromptFileError(ValueError):
    """A prompts file that cannot be read; the message names the file (and line)."""


def read_prompts_file(path: Path) -> list[str]:
    """Prompts from `path`: JSONL rows with a string "prompt" field, or one plain-text prompt per line.

    The file is JSONL when its name ends in .jsonl or its first non-blank line starts with "{"; then
    every non-blank line must be such a row. Blank lines are skipped.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PromptFileError(f"{path}: cannot read ({error})") from None
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    is_jsonl = str(path).endswith(".jsonl") or first.lstrip().startswith("{")
    prompts: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not is_jsonl:
            prompts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise PromptFileError(f'{path}:{number}: expected an object with a non-empty string "prompt"')
        prompts.append(row["prompt"])
    return prompts
