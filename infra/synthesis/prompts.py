"""The prompt data users bring: `{id, prompt}` rows, ShareGPT `{conversations: [{from, value}]}` and
OpenAI `{messages: [{role, content}]}`, as JSONL or parquet, local or on S3 (fsspec). Turns are read in
either shape under either key (many exports put role/content turns under `conversations`).

Every row is normalized to `{"id", "prompt", "messages"?, "category"?}`: `prompt` is the first user
turn (what evaluation and the in-process backend answer), `messages` the whole conversation with roles
`system | user | assistant` when it holds more than one user turn (system prompts and multi-turn rows
are kept for the engine backend, which regenerates each assistant turn). A bad row is a user error
named by file, line (parquet: row) and reason (a row in no known format: which one it looks like), and
its `kind`, the stable category the manifest counts it under; `data.on_bad_row` decides whether it ends
the read or is set aside (in `rejected.jsonl`), and too many set-aside rows still end it.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from draftloop.infra.runtime.storage import StorageOptions, filesystem, is_local

BUILTIN_PROMPTS = "builtin"  # data.prompts naming the prompts bundled with draftloop


# ShareGPT speaker names seen in the wild -> chat roles
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
}
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FORMAT_KEYS = (("messages", "openai"), ("conversations", "sharegpt"), ("prompt", "prompt"))
_INPUT_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """The prompt data cannot be used; names the file, the line (or parquet row) and the reason."""

    def __init__(self, source: str, where: str | None, reason: str) -> None:
        super().__init__(f"{source}:{where}: {reason}" if where else f"{source}: {reason}")
        self.source = source
        self.where = where
        self.reason = reason


class _BadRow(ValueError):
    """A row's shape is wrong; the reader adds the file and line. `kind`: the category it is counted
    under (a reason's text varies with the row, its kind does not)."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass
class InputData:
    """The usable rows of a data source, the rows set aside (with file, line and reason), per-file formats."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)

    @property
    def read(self) -> int:
        return len(self.rows) + len(self.rejected)

    def summary(self) -> dict[str, Any]:
        """What the manifest records about the input."""
        return {
            "input_rows": self.read,
            "input_accepted": len(self.rows),
            "input_rejected": len(self.rejected),
            "input_formats": sorted(set(self.formats.values())),
        }


def builtin_prompts_path() -> Path:
    return Path(__file__).resolve().parents[2] / "draftloop" / "data" / "prompts.jsonl"


def input_files(source: str, options: StorageOptions | None) -> list[str]:
    """The files of `source`: one file, a folder's JSONL/parquet files, or a glob, in name order."""
    if source == BUILTIN_PROMPTS:
        return [str(builtin_prompts_path())]
    fs, path = filesystem(source, options)
    protocol = "" if is_local(source) else source.split("://", 1)[0] + "://"
    if any(char in path for char in "*?["):
        names = sorted(str(name) for name in fs.glob(path))
    elif fs.isdir(path):
        names = sorted(str(name) for name in fs.ls(path, detail=False) if str(name).endswith(_INPUT_SUFFIXES))
    elif fs.exists(path):
        return [source]
    else:
        raise DataError(source, None, "no such file")
    if not names:
        raise DataError(source, None, "holds no .jsonl or .parquet files")
    return [name if is_local(source) or "://" in name else protocol + name for name in names]


# What a store says about a file's version: S3's ETag, GCS's md5, a local or other file's mtime.
_VERSION_FIELDS = ("ETag", "etag", "md5", "mtime", "LastModified", "last_modified")


def input_fingerprint(source: str, options: StorageOptions | None = None) -> str:
    """A digest that changes when `source`'s files change, read from their metadata alone (name, size,
    and the store's ETag or modification time), so a stage cached on it never reads stale prompts and a
    cached re-run reads no data. The bundled prompts are hashed by content (their mtime is the checkout's).
    """
    identity: list[Any] = []
    for uri in input_files(source, options):
        if source == BUILTIN_PROMPTS:
            identity.append([Path(uri).name, hashlib.sha256(Path(uri).read_bytes()).hexdigest()])
            continue
        fs, path = filesystem(uri, options)
        info = fs.info(path)
        version = next((info[key] for key in _VERSION_FIELDS if key in info), None)
        identity.append([uri, info.get("size"), str(version)])
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _file_rows(uri: str, options: StorageOptions | None) -> Iterator[tuple[str, Any]]:
    """(where, row) of each non-blank row; a row that cannot be decoded is a `_BadRow` in place of the row,
    so one bad line never hides the others (UTF-8 is decoded line by line)."""
    fs, path = filesystem(uri, options)
    try:
        with fs.open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise DataError(uri, None, f"cannot read: {error}") from None
    if uri.endswith(".parquet"):
        import pyarrow.parquet as pq  # only parquet inputs need it

        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise DataError(uri, None, f"not a readable parquet file: {error}") from None
        for number, row in enumerate(table.to_pylist(), start=1):
            yield f"row {number}", row
        return
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            yield where, _BadRow(f"invalid UTF-8 at column {error.start + 1}", "invalid UTF-8")
            continue
        if not text.strip():
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as error:
            yield where, _BadRow(f"invalid JSON: {error.msg} (column {error.colno})", "invalid JSON")


def detect_format(row: Any) -> str | None:
    """The format a row is written in, from the field that carries its turns; None when it has none."""
    if isinstance(row, dict):
        for key, name in _FORMAT_KEYS:
            if key in row:
                return name
    return None


def _text(row: dict[str, Any], key: str, what: str) -> str:
    if key not in row:
        raise _BadRow(f"missing '{key}'{what}", f"missing {key}")
    value = row[key]
    if value is None:
        raise _BadRow(f"'{key}' is null{what}", f"missing {key}")
    if not isinstance(value, str):
        raise _BadRow(f"'{key}' must be a string, got {type(value).__name__}{what}", f"{key} not a string")
    if not value.strip():
        raise _BadRow(f"'{key}' is empty{what}", f"empty {key}")
    return value


# The two shapes of a turn: (role key, text key, role names).
_TURN_SHAPES = {"sharegpt": ("from", "value", _SHAREGPT_ROLES), "openai": ("role", "content", _OPENAI_ROLES)}


def _turn_shape(turn: dict[str, Any], data_format: str) -> tuple[str, str, dict[str, str]]:
    """A turn's shape from its own keys (the format's shape when it names neither's)."""
    for shape, (role_key, text_key, _) in _TURN_SHAPES.items():
        if role_key in turn or text_key in turn:
            return _TURN_SHAPES[shape]
    return _TURN_SHAPES["openai" if data_format == "openai" else "sharegpt"]


def _turns(row: dict[str, Any], data_format: str) -> list[dict[str, str]]:
    """A row's turns, under the format's own key (or, missing that, the other format's), each turn
    {from, value} or {role, content}."""
    own, other = ("messages", "conversations") if data_format == "openai" else ("conversations", "messages")
    list_key = other if own not in row and other in row else own
    turns = row.get(list_key)
    if not isinstance(turns, list) or not turns:
        got = "missing" if list_key not in row else "null" if turns is None else "empty or not a list"
        hint = _looks_like(row) if got == "missing" else ""
        raise _BadRow(f"'{list_key}' is {got} ({data_format} format: a list of turns){hint}", "no turns")
    messages: list[dict[str, str]] = []
    for index, turn in enumerate(turns, start=1):
        what = f" in turn {index}"
        if not isinstance(turn, dict):
            raise _BadRow(f"turn {index} is not an object", "bad turn")
        role_key, text_key, roles = _turn_shape(turn, data_format)
        role = _text(turn, role_key, what)
        if role.lower() not in roles:
            known = ", ".join(sorted(roles))
            raise _BadRow(f"unknown role {role!r}{what} (known: {known})", "unknown role")
        messages.append({"role": roles[role.lower()], "content": _text(turn, text_key, what)})
    if not any(m["role"] == "user" for m in messages):
        raise _BadRow("conversation has no user turn", "no user turn")
    return messages


# Row shapes of other corpora, by a field they carry: what a row that matches no format looks like.
_LOOKS_LIKE = (
    ("instruction", "an Alpaca-style {instruction, input, output} row: put the instruction in 'prompt'"),
    ("question", "a question-answer row: put the question in 'prompt'"),
    ("chosen", "a preference pair {chosen, rejected}: give its conversation as 'messages'"),
    ("text", "a plain-text corpus row {text}: draftloop needs prompts ('prompt') or turns ('messages')"),
    ("input", "an {input, output} row: put the input in 'prompt'"),
    ("query", "a query row: put the query in 'prompt'"),
)
_TURN_LIST_KEYS = ("conversation", "dialog", "dialogue", "turns", "chat", "history")


def _no_format(row: Any) -> _BadRow:
    """Why a row matches no format, and which one it looks like (from the fields it has)."""
    reason = "row has no 'prompt', 'messages' or 'conversations' field"
    if not isinstance(row, dict):
        return _BadRow(reason, "unknown format")
    fields = ", ".join(sorted(map(str, row))) or "none"
    return _BadRow(f"{reason}{_looks_like(row) or f' (its fields: {fields})'}", "unknown format")


def _looks_like(row: dict[str, Any]) -> str:
    """ "; it looks like ..." for a row of another corpus's shape (from the fields it has), else nothing."""
    hint = next((text for key, text in _LOOKS_LIKE if key in row), None)
    turn_key = next((key for key in _TURN_LIST_KEYS if isinstance(row.get(key), list)), None)
    if turn_key is not None:
        hint = f"its turns are under '{turn_key}': name that field 'messages' (or 'conversations')"
    return f"; it looks like {hint}" if hint else ""


def normalize_row(row: Any, data_format: str, default_id: str) -> dict[str, Any]:
    """One input row as `{"id", "prompt", "messages"?, "category"?}`; raises `_BadRow` with the reason."""
    if not isinstance(row, dict):
        raise _BadRow(f"expected a JSON object, got {type(row).__name__}", "not an object")
    if "id" in row:
        row_id = row["id"]
        if row_id is None or isinstance(row_id, bool) or not isinstance(row_id, str | int):
            raise _BadRow("'id' must be a string or an integer", "bad id")
        if not str(row_id).strip():
            raise _BadRow("'id' is empty", "bad id")
        row_id = str(row_id)
    else:
        row_id = default_id
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise _BadRow("'category' must be a string when given", "bad category")
    normalized: dict[str, Any] = {"id": row_id}
    if data_format == "prompt":
        hint = "" if "prompt" in row else _looks_like(row)
        normalized["prompt"] = _text(row, "prompt", " (prompt format)" + hint)
    else:
        messages = _turns(row, data_format)
        normalized["prompt"] = next(m["content"] for m in messages if m["role"] == "user")
        if messages != [{"role": "user", "content": normalized["prompt"]}]:
            normalized["messages"] = messages
    if category:
        normalized["category"] = category
    return normalized


def read_input(
    source: str,
    data_format: str = "auto",
    on_bad_row: str = "skip",
    max_rejected_fraction: float = 0.1,
    options: StorageOptions | None = None,
) -> InputData:
    """Read and check every row of `source` (a file, folder or glob; "builtin" = the bundled prompts).

    `data_format` "auto" detects each file's format from its first row that names one. A bad row raises
    `DataError` when `on_bad_row` is "fail"; with "skip" it is set aside, and the read fails only when
    the set-aside rows exceed `max_rejected_fraction` of all rows or no row is usable.
    """
    data = InputData()
    first_seen: dict[str, str] = {}
    for uri in input_files(source, options):
        file_format = None if data_format == "auto" else data_format
        stem = PurePosixPath(uri).stem
        for where, row in _file_rows(uri, options):
            try:
                if isinstance(row, _BadRow):
                    raise row
                if file_format is None:
                    file_format = detect_format(row)
                    if file_format is None:
                        raise _no_format(row)
                    data.formats[uri] = file_format
                normalized = normalize_row(row, file_format, f"{stem}-{where.split()[-1]}")
                if normalized["id"] in first_seen:
                    raise _BadRow(
                        f"duplicate id {normalized['id']!r} (first at {first_seen[normalized['id']]})",
                        "duplicate id",
                    )
            except _BadRow as bad:
                if on_bad_row == "fail":
                    raise DataError(uri, where, str(bad)) from None
                row_id = row.get("id") if isinstance(row, dict) else None
                data.rejected.append(
                    {"id": row_id, "source": uri, "where": where, "reason": str(bad), "kind": bad.kind}
                )
                continue
            first_seen[normalized["id"]] = f"{uri}:{where}"
            if data_format != "auto":
                data.formats[uri] = data_format
            data.rows.append(normalized)
    if not data.rows:
        first = f"; first: {_where(data.rejected[0])}" if data.rejected else ""
        raise DataError(source, None, f"holds no usable rows ({len(data.rejected)} rejected{first})")
    if len(data.rejected) > max_rejected_fraction * data.read:
        raise DataError(
            source,
            None,
            f"{len(data.rejected)} of {data.read} rows rejected, more than "
            f"data.max_rejected_fraction={max_rejected_fraction}; first: {_where(data.rejected[0])}",
        )
    return data


def _where(rejected: dict[str, Any]) -> str:
    return f"{rejected['source']}:{rejected['where']}: {rejected['reason']}"


def read_input_from_config(config: Any, options: StorageOptions | None = None) -> InputData:
    """`read_input` with the config's `data` section."""
    data = config.data
    return read_input(
        str(data.prompts),
        str(data.format),
        str(data.on_bad_row),
        float(data.max_rejected_fraction),
        options,
    )
