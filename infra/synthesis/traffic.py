"""New traffic: the rows of a prompts location that no refresh has taken yet, and the parts it took.

A refresh reads a location (a folder or S3 prefix of JSONL/parquet files in any supported format, e.g. a
serving log in OpenAI messages form) and keeps the rows no committed part holds. A row is known by its
content (its turns), not its id: serving logs reuse ids, and the same prompt logged twice is one row.
The new rows become one **part** of the config's traffic: a dataset (`prompts.jsonl` + `manifest.json`)
under `<storage.root>/<name>/refresh/parts/<part key>/`, its manifest listing the row keys it holds, the
held-out ones last (synthesis holds out the last `data.eval_prompts` rows). A part counts as taken once
its refresh recorded a decision (`decision.json` beside it): a refresh killed before that finds the same
new rows, hence the same part, again.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from draftloop.infra.runtime.storage import (
    DatasetWriter,
    Manifest,
    ManifestNotFoundError,
    StorageOptions,
    exists,
    filesystem,
    join,
    read_manifest,
    read_shard,
    read_text,
    write_text_atomic,
)
from draftloop.infra.synthesis.conversations import to_jsonl
from draftloop.infra.synthesis.prompts import input_files, read_input

PART_PROMPTS = "prompts.jsonl"
DECISION_FILE = "decision.json"
UNCATEGORIZED = "uncategorized"


def row_key(row: dict[str, Any]) -> str:
    """A row's identity: a digest of its turns (a single-prompt row is one user turn)."""
    turns = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    return hashlib.sha256(json.dumps(turns, sort_keys=True).encode()).hexdigest()[:20]


def category_of(row: dict[str, Any]) -> str:
    return str(row.get("category") or UNCATEGORIZED)


def read_traffic(
    location: str,
    data_format: str = "auto",
    max_rejected_fraction: float = 0.1,
    options: StorageOptions | None = None,
) -> list[dict[str, Any]]:
    """Every usable row of `location`, once per content, keyed (`id` = `row_key`), in file order.

    Each file is read on its own (ids repeat across a serving log's files); a bad row is set aside as
    `read_input` does, and too many of them fail the read naming the file.
    """
    rows: dict[str, dict[str, Any]] = {}
    for uri in input_files(location, options):
        for row in read_input(uri, data_format, "skip", max_rejected_fraction, options).rows:
            key = row_key(row)
            rows.setdefault(key, {**row, "id": key})
    return list(rows.values())


@dataclass(frozen=True)
class TrafficPart:
    """One part of a config's traffic: its rows' keys (training rows, then the held-out ones)."""

    key: str
    uri: str  # the part's folder; its prompts file is `prompts_uri`
    train: list[str]
    held_out: list[str]
    categories: dict[str, int]  # rows per category, held-out ones included

    @property
    def prompts_uri(self) -> str:
        return join(self.uri, PART_PROMPTS)

    @property
    def rows(self) -> int:
        return len(self.train) + len(self.held_out)


class TrafficLedger:
    """The committed parts of one config's traffic under `<storage.root>/<name>/refresh/parts/`."""

    def __init__(self, root: str, name: str, options: StorageOptions | None = None) -> None:
        self.folder = join(root, name, "refresh", "parts")
        self.options = options

    def _part_folders(self) -> list[str]:
        fs, path = filesystem(self.folder, self.options)
        if not fs.isdir(path):
            return []
        names = sorted(str(name).rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(path, detail=False))
        return [join(self.folder, name) for name in names]

    def taken_keys(self) -> set[str]:
        """The keys of every row a finished refresh took (parts with a decision)."""
        taken: set[str] = set()
        for folder in self._part_folders():
            if not exists(join(folder, DECISION_FILE), self.options):
                continue
            try:
                manifest = read_manifest(folder, self.options)
            except ManifestNotFoundError:
                continue
            summary = manifest.summary
            taken.update(summary["train"], summary["held_out"])
        return taken

    def new_rows(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        taken = self.taken_keys()
        return [row for row in rows if row["id"] not in taken]

    def part_for(self, rows: Sequence[dict[str, Any]], held_out: int) -> TrafficPart:
        """The part holding `rows` (keyed by `read_traffic`): committed now, or found committed by a
        refresh of the same rows that did not finish. The held-out rows are `held_out` rows picked by
        key (not by file order, so a category logged last is not all held out), placed last."""
        if held_out >= len(rows):
            raise ValueError(f"{len(rows)} new rows leave none to train on after {held_out} held out")
        ordered = sorted(rows, key=lambda row: str(row["id"]))
        keys = [str(row["id"]) for row in ordered]
        part_key = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
        uri = join(self.folder, part_key)
        by_key = {str(row["id"]): row for row in rows}
        # Held out: the rows whose key hashes lowest with the part's own salt (a reproducible sample).
        salted = sorted(keys, key=lambda key: hashlib.sha256(f"{part_key}:{key}".encode()).hexdigest())
        held = sorted(salted[:held_out])
        train = [key for key in keys if key not in set(held)]
        part = TrafficPart(
            key=part_key,
            uri=uri,
            train=train,
            held_out=held,
            categories=dict(sorted(Counter(category_of(row) for row in rows).items())),
        )
        try:
            committed = read_manifest(uri, self.options)
        except ManifestNotFoundError:
            committed = None
        if committed is None or committed.summary.get("train") != train:
            writer = DatasetWriter(uri, storage_options=self.options)
            writer.write_shard(PART_PROMPTS, to_jsonl([by_key[key] for key in train + held]), rows=len(keys))
            writer.commit(
                "traffic",
                summary={"train": train, "held_out": held, "categories": part.categories},
            )
        return part

    def record_decision(self, part: TrafficPart, decision: dict[str, Any]) -> None:
        """The part is taken: its refresh decided (retrained or not); later refreshes skip its rows."""
        write_text_atomic(join(part.uri, DECISION_FILE), json.dumps(decision, indent=2), self.options)

    def decision(self, part: TrafficPart) -> dict[str, Any] | None:
        uri = join(part.uri, DECISION_FILE)
        return json.loads(read_text(uri, self.options)) if exists(uri, self.options) else None


def part_rows(part: TrafficPart, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """The part's rows as stored (training rows, then the held-out ones)."""
    manifest: Manifest = read_manifest(part.uri, options)
    lines = read_shard(manifest, PART_PROMPTS, options).decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
