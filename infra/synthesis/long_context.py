"""The long-context evaluation set: prompts of 2k-8k target tokens built from draftloop's own text.

EAGLE 3.1 claims its gain over EAGLE-3 on long contexts, so the evaluation can add prompts of chosen
lengths (`evaluation.long_context_tokens`, e.g. [2048, 4096, 8192]; `evaluation.long_context_prompts`
of each) to the held-out prompts, each with the category `long_<length>` (`long_2k`, ...) so the report's
per-category table shows acceptance by length.

Each prompt is a document followed by a task: summarize it, answer a question about one of its
sections, or continue it. The document is the module docstrings of draftloop's own packages (every
module of the packages setuptools installs, read with `ast`, never imported), each under its import
name, in import-name order, starting at a different module for each prompt. That text ships with every
install of draftloop, so a commit builds the same set on every machine; it is English prose about code,
as a real long prompt would be, and no prompt repeats text (repetition would flatter a drafter).

A prompt's length is counted as the engine sees it: the target's chat template applied, in the target's
own tokens. The document is filled line by line, then word by word, to the largest prefix whose prompt
is at most the length asked for, so a prompt is within a few tokens of it and never over. A length the
text cannot fill (about 38k tiny-llama tokens, 18k of a tokenizer of 4 characters per token) is refused.
`source_fingerprint()` digests the text, so the evaluation's cache key follows a docstring's edit.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftloop.infra.synthesis.conversations import templated_prompt

CATEGORY_PREFIX = "long_"
# The packages whose module docstrings make the documents (pyproject's packages, recursed below).
SOURCE_PACKAGES = ("draftloop", "draftloop.kernels", "draftloop.infra", "draftloop.tasks", "draftloop.flows")
# Consecutive prompts start this many modules apart, so prompts of one length share little text.
_START_STRIDE = 17
_TASKS = ("summarize", "question", "continue")
_PREAMBLE = (
    "Below is a document: the documentation of the modules of draftloop, a platform that trains "
    "speculative-decoding drafters. Read it, then do the task that follows it.\n\n<document>\n"
)


class LongContextError(ValueError):
    """The long-context set cannot be built as asked (a length the text cannot fill)."""


@dataclass(frozen=True)
class Section:
    """One module's docstring: its import name and text."""

    name: str
    text: str


@dataclass(frozen=True)
class LongContextPrompt:
    """One prompt of the set: `tokens` is its length with the target's chat template applied."""

    id: str
    prompt: str
    category: str
    tokens: int
    task: str
    sections: tuple[str, ...]  # the modules its document quotes, in order

    def row(self) -> dict[str, str]:
        """As an evaluation prompt row (`read_eval_prompts`' shape, with its category)."""
        return {"id": self.id, "prompt": self.prompt, "category": self.category}


def category_for(length: int) -> str:
    """`long_2k` for 2048 tokens (whole kibitokens), else `long_<length>`."""
    return f"{CATEGORY_PREFIX}{length // 1024}k" if length % 1024 == 0 else f"{CATEGORY_PREFIX}{length}"


def _package_modules(package: str) -> list[tuple[str, Path]]:
    """(import name, file) of the package's own modules: its folder's .py files, and those of its
    subfolders that are packages (an __init__.py), as setuptools installs them; subpackages listed
    separately in SOURCE_PACKAGES (mapped elsewhere) are not reached from here."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LongContextError(f"package {package} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    modules: list[tuple[str, Path]] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        folders = [root.joinpath(*parts[:depth]) for depth in range(1, len(parts))]
        if all((folder / "__init__.py").is_file() for folder in folders):
            stem = parts[:-1] if parts[-1] == "__init__.py" else (*parts[:-1], path.stem)
            modules.append((".".join((package, *stem)), path))
    return modules


def source_sections() -> list[Section]:
    """Every documented module of SOURCE_PACKAGES, in import-name order."""
    sections = []
    for package in SOURCE_PACKAGES:
        for name, path in _package_modules(package):
            docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
            if docstring and docstring.strip():
                sections.append(Section(name, docstring.strip()))
    return sorted(sections, key=lambda section: section.name)


def source_fingerprint() -> str:
    """A digest of the text the documents are cut from (and of how prompts are framed)."""
    digest = hashlib.sha256(_PREAMBLE.encode())
    for section in source_sections():
        digest.update(f"\0{section.name}\0{section.text}".encode())
    return digest.hexdigest()[:24]


def _task_text(task: str, question_about: str) -> str:
    if task == "summarize":
        return "Summarize the document above in a few sentences: what the platform does and how."
    if task == "question":
        return f"Question: according to the document above, what is the job of `{question_about}`?"
    return "Continue the document above from where it stops, in the same style."


def _document_lines(sections: Sequence[Section], start: int) -> list[tuple[str, str]]:
    """(line, section name) of the whole text, beginning with section `start` and wrapping around."""
    lines: list[tuple[str, str]] = []
    for offset in range(len(sections)):
        section = sections[(start + offset) % len(sections)]
        lines.append((f"## {section.name}", section.name))
        lines.extend((line, section.name) for line in section.text.splitlines())
        lines.append(("", section.name))
    return lines


def _largest_fitting(count: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 0..count with fits(n), fits being true up to some n and false after it."""
    low, high = 0, count
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _build_prompt(
    tokenizer: Any, sections: Sequence[Section], start: int, length: int, task: str
) -> tuple[str, int, tuple[str, ...]]:
    """(prompt, tokens, quoted module names) of the longest document from section `start` whose prompt
    (chat template applied) is at most `length` target tokens."""
    lines = _document_lines(sections, start)
    about = sections[start].name  # the document's first module: quoted in a document of any length

    def prompt_of(body: str) -> str:
        return f"{_PREAMBLE}{body}\n</document>\n\n{_task_text(task, about)}"

    def tokens_of(body: str) -> int:
        return templated_prompt(tokenizer, [{"role": "user", "content": prompt_of(body)}])[1]

    def body_of(count: int) -> str:
        return "\n".join(line for line, _ in lines[:count])

    if tokens_of("") > length:
        raise LongContextError(f"{length} tokens cannot hold the task alone ({tokens_of('')} tokens)")
    whole = _largest_fitting(len(lines), lambda count: tokens_of(body_of(count)) <= length)
    if whole == len(lines):
        raise LongContextError(
            f"{length} tokens is more than draftloop's module documentation fills "
            f"({tokens_of(body_of(whole))} tokens with this tokenizer): ask for a shorter length"
        )
    body = body_of(whole)
    words = lines[whole][0].split(" ")
    partial = 0
    if not lines[whole][0].startswith("## "):  # cut, a heading would name no module (a bare "##")
        partial = _largest_fitting(
            len(words), lambda count: tokens_of(body + "\n" + " ".join(words[:count])) <= length
        )
    if partial:
        body += "\n" + " ".join(words[:partial])
    quoted = tuple(dict.fromkeys(name for _, name in lines[: whole + (1 if partial else 0)]))
    return prompt_of(body), tokens_of(body), quoted


def long_context_prompts(
    tokenizer: Any, lengths: Sequence[int], per_length: int, sections: Sequence[Section] | None = None
) -> list[LongContextPrompt]:
    """`per_length` prompts of each length in `lengths` (target tokens, chat template applied), tasks in
    turn summarize / question / continue, each document starting at another module. Deterministic:
    the same tokenizer and text give the same prompts."""
    sections = list(sections) if sections is not None else source_sections()
    if not sections:
        raise LongContextError("no documented module to build long-context prompts from")
    prompts = []
    for length_index, length in enumerate(lengths):
        for index in range(per_length):
            number = length_index * per_length + index
            start = (number * _START_STRIDE) % len(sections)
            task = _TASKS[number % len(_TASKS)]
            text, tokens, quoted = _build_prompt(tokenizer, sections, start, int(length), task)
            category = category_for(int(length))
            prompts.append(LongContextPrompt(f"{category}-{index:02d}", text, category, tokens, task, quoted))
    return prompts


def long_context_rows(config: Any, target_dir: str | Path) -> list[dict[str, str]]:
    """The evaluation rows `config.evaluation` asks for (none when `long_context_tokens` is empty),
    measured with the tokenizer of the target in `target_dir`."""
    lengths = list(config.evaluation.long_context_tokens)
    if not lengths:
        return []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=config.target.trust_remote_code)
    prompts = long_context_prompts(tokenizer, lengths, config.evaluation.long_context_prompts)
    return [prompt.row() for prompt in prompts]


def long_context_key_fields(config: Any) -> dict[str, str]:
    """The evaluation's cache-key field for the set's text (none when the set is off, so keys stay)."""
    return {"long_context_text": source_fingerprint()} if config.evaluation.long_context_tokens else {}
