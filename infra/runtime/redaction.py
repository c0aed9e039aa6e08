"""Secrets out of everything draftloop writes: MLflow params, tags, artifacts, Prefect parameters and logs.

One rule set, applied where those are written (infra/registry/runs.py, cards.py, models.py, flows/cycle.py,
flows/train_and_eval.py):

- a value whose key names a secret (`api_key`, `AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`, `password`, ...) in a
  mapping, a `key=value` / `"key": "value"` pair or a `--api-key VALUE` argument;
- the password of a URL (`postgresql://user:pw@host/db` keeps `user`), bearer/basic credentials;
- AWS access key ids (`AKIA...`), and the values of this process's secret-named environment variables
  (`AWS_SECRET_ACCESS_KEY`, ...) and of secrets registered with `register_secrets` (a config's api key),
  wherever they appear in free text.

Redacted values read `***`; the key, user name and the rest of the text stay, so a reader still sees
what was configured.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import traceback
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REDACTED = "***"

# A key name ending in one of these words or pairs names a secret ("max_tokens" does not: "tokens" is
# no such word).
_SECRET_WORDS = frozenset({"token", "apikey", "credential", "credentials", "passphrase", "pat"})
_SECRET_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("auth", "token")})
_SPECIAL_TOKENS = frozenset({"bos", "eos", "pad", "unk", "sep", "cls", "mask", "image", "audio", "video"})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")

_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@\"']*):(?P<secret>[^\s@/\"']+)@")
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b")
_AUTH_HEADER = re.compile(r"(?i)\b(?P<scheme>bearer|basic)\s+(?P<secret>[A-Za-z0-9._~+/=-]{6,})")
_KEY_VALUE = re.compile(
    r"(?P<key>[A-Za-z_][A-Za-z0-9_.-]*)(?P<q1>[\"']?)(?P<sep>\s*[:=]\s*)(?P<q2>[\"']?)"
    r"(?P<value>[^\s\"',;})\]]+)"
)
_FLAG_VALUE = re.compile(r"(?P<flag>--[A-Za-z][A-Za-z0-9_-]*)(?P<sep>[ =])(?P<value>[^\s\"',]+)")
_NOT_A_VALUE = frozenset({"", "null", "None", "none", "~", REDACTED})
_MIN_SECRET_CHARS = 6  # shorter "secrets" (a test's "x") would redact half of every log

_registered: set[str] = set()
_registered_lock = threading.Lock()


def is_secret_name(name: str) -> bool:
    """True when a key, field, flag or environment variable name says its value is a secret.

    "secret" or "password" anywhere (`AWS_SECRET_ACCESS_KEY`, `PGPASSWORD`), or a name ending in a secret
    word or pair (`HF_TOKEN`, `api_key`, `apiKey`): `pad_token_id` and `thinking_token_budget` are not.
    """
    last = re.split(r"[.]", name.strip("-\"' "))[-1]
    words = [word.lower() for word in _WORD.findall(last)]
    if not words:
        return False
    if any("secret" in word or word.endswith(("password", "passwd")) for word in words):
        return True
    if len(words) >= 2 and words[-2] in _SPECIAL_TOKENS:
        return False  # a tokenizer's `eos_token: "</s>"`
    return words[-1] in _SECRET_WORDS or tuple(words[-2:]) in _SECRET_PAIRS


def register_secrets(values: Iterable[str]) -> None:
    """Remember secret values (a config's api key, ...) so free text mentioning them is redacted too."""
    with _registered_lock:
        _registered.update(value for value in values if len(value) >= _MIN_SECRET_CHARS)


def _known_secret_values() -> list[str]:
    from_env = [
        value
        for name, value in os.environ.items()
        if is_secret_name(name) and len(value) >= _MIN_SECRET_CHARS
    ]
    with _registered_lock:
        known = {*from_env, *_registered}
    return sorted(known, key=len, reverse=True)  # longest first: a secret containing another one


def redact_text(text: str) -> str:
    """`text` with every secret it shows replaced by `***`."""
    if not text:
        return text
    for value in _known_secret_values():
        text = text.replace(value, REDACTED)
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}:{REDACTED}@", text)
    text = _AWS_KEY_ID.sub(REDACTED, text)
    text = _AUTH_HEADER.sub(lambda m: f"{m['scheme']} {REDACTED}", text)
    text = _redact_pairs(text)
    return _FLAG_VALUE.sub(_redact_flag, text)


def _redact_pairs(text: str) -> str:
    """`key=value` / `"key": "value"` pairs with a secret-named key; a pair whose key is not one is
    searched again from its value on ("failed: token=abc" holds the pair "token=abc")."""
    pieces: list[str] = []
    position = 0
    while (match := _KEY_VALUE.search(text, position)) is not None:
        if is_secret_name(match["key"]) and match["value"] not in _NOT_A_VALUE:
            pieces.append(text[position : match.start("value")] + REDACTED)
            position = match.end("value")
        else:
            pieces.append(text[position : match.start("value")])
            position = match.start("value")
    return "".join(pieces) + text[position:]


def _redact_flag(match: re.Match[str]) -> str:
    if not is_secret_name(match["flag"]) or match["value"].startswith("-"):
        return match[0]
    return f"{match['flag']}{match['sep']}{REDACTED}"


def redact(value: Any) -> Any:
    """A copy of a JSON-like value (mappings, lists, scalars) with its secrets redacted.

    Under a secret-named key every leaf is redacted (None stays None: it shows nothing); in a list, the
    element after a secret-named flag (`["--api-key", "abc"]`) is; strings elsewhere go through
    `redact_text`.
    """
    if isinstance(value, Mapping):
        return {key: _redact_under(key, item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items: list[Any] = []
        after_secret_flag = False
        for item in value:
            items.append(REDACTED if after_secret_flag and item is not None else redact(item))
            after_secret_flag = isinstance(item, str) and item.startswith("--") and is_secret_name(item)
        return items
    if isinstance(value, str):
        return redact_text(value)
    return value


def _redact_under(key: Any, value: Any) -> Any:
    if not is_secret_name(str(key)):
        return redact(value)
    if isinstance(value, Mapping):
        return {inner: _redact_under(key, item) for inner, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_under(key, item) for item in value]
    return None if value is None else REDACTED


def secret_values(value: Any) -> list[str]:
    """The string values `redact` would hide by their key (to `register_secrets` them)."""
    found: list[str] = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if is_secret_name(str(key)) and isinstance(item, str | int) and not isinstance(item, bool):
                found.append(str(item))
            else:
                found += secret_values(item)
    elif isinstance(value, list | tuple):
        for before, item in zip([None, *value], value, strict=False):
            flagged = isinstance(before, str) and before.startswith("--") and is_secret_name(before)
            found += [str(item)] if flagged and isinstance(item, str) else secret_values(item)
    return found


# Files uploaded as artifacts that are read as text (and so may quote a secret); others (weights) pass.
_TEXT_SUFFIXES = frozenset({".log", ".txt", ".json", ".jsonl", ".yaml", ".yml", ".md", ".csv", ".toml"})
_TEXT_LIMIT_BYTES = 64 * 1024 * 1024


@contextmanager
def redacted_copy(path: Path) -> Iterator[Path]:
    """`path` (a file or folder) as it may be uploaded: text files holding a secret are replaced by
    redacted copies in a temporary folder; without any, `path` itself."""
    texts = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    changed = {
        file: redacted
        for file in texts
        if file.suffix in _TEXT_SUFFIXES and file.stat().st_size <= _TEXT_LIMIT_BYTES
        for original in [file.read_text(encoding="utf-8", errors="replace")]
        for redacted in [redact_text(original)]
        if redacted != original
    }
    if not changed:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="draftloop-redacted-") as tmp:
        copy = Path(tmp) / path.name
        if path.is_dir():
            shutil.copytree(path, copy)
            for file, redacted in changed.items():
                (copy / file.relative_to(path)).write_text(redacted, encoding="utf-8")
        else:
            copy.write_text(changed[path], encoding="utf-8")
        yield copy


class RedactingFilter(logging.Filter):
    """Redacts a record's message and traceback before any handler (Prefect's API handler) sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


# The loggers Prefect's run loggers (get_run_logger, log_prints) write through to the API.
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def install_log_redaction(logger_names: Iterable[str] = PREFECT_RUN_LOGGERS) -> None:
    """Add the redacting filter to these loggers (once each): their records reach Prefect's API."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, RedactingFilter) for existing in logger.filters):
            logger.addFilter(RedactingFilter())
