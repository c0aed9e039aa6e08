"""Storage: fsspec URIs (a local path or s3://bucket/key), atomic writes, datasets with manifests.

A dataset is a folder holding shard files and `manifest.json`. Shards are written under a temporary
name and renamed (local) or uploaded as one whole object (S3, where an object appears atomically);
`manifest.json` is written last and is the commit point: a reader only ever reads shards the manifest
lists, and checks each one's size and sha256. A writer that dies mid-way leaves no manifest (and, locally,
no shard under its final name), so nothing it wrote is visible.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

MANIFEST_NAME = "manifest.json"

StorageOptions = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# URIs and file systems


def storage_options(config_or_endpoint: Any = None) -> StorageOptions:
    """fsspec options for the config's storage (S3 endpoint), or for an endpoint URL given directly.

    Credentials come from the usual environment (AWS_ACCESS_KEY_ID, ...), never from the config.
    """
    if config_or_endpoint is None or isinstance(config_or_endpoint, str):
        endpoint = config_or_endpoint
    else:
        storage = getattr(config_or_endpoint, "storage", config_or_endpoint)
        endpoint = getattr(storage, "s3_endpoint_url", None)
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _local_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or URI with '/' (no normalisation of the scheme)."""
    pieces = [uri.rstrip("/") or "/"] + [part.strip("/") for part in parts if part.strip("/")]
    return "/".join(pieces) if pieces[0] != "/" else "/" + "/".join(pieces[1:])


def filesystem(uri: str, options: StorageOptions | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(file system, path within it) for `uri`; options only apply to remote URIs."""
    fs, path = fsspec.core.url_to_fs(uri, **({} if is_local(uri) else (options or {})))
    return fs, path


def exists(uri: str, options: StorageOptions | None = None) -> bool:
    fs, path = filesystem(uri, options)
    with contextlib.suppress(Exception):
        fs.invalidate_cache(path)
    return bool(fs.exists(path))


def read_bytes(uri: str, options: StorageOptions | None = None) -> bytes:
    fs, path = filesystem(uri, options)
    data: bytes = fs.cat_file(path)
    return data


def read_text(uri: str, options: StorageOptions | None = None) -> str:
    return read_bytes(uri, options).decode("utf-8")


def write_bytes_atomic(uri: str, data: bytes, options: StorageOptions | None = None) -> None:
    """Write `data` so that readers see either the old object or the whole new one, never a part.

    Local: a temporary file in the same folder, fsync, rename. Remote: one whole-object upload.
    """
    write_chunks_atomic(uri, [data], options)


# Below this many bytes a hashing thread costs more than it saves.
_BACKGROUND_HASH_BYTES = 8 << 20


class _Sha256Beside:
    """sha256 of ``chunks`` (``size`` bytes in all), computed on its own thread while the caller writes
    the same chunks.

    hashlib and file writes both release the GIL on large buffers, so a shard takes max(hash, write)
    instead of their sum. That is the latency of the last shard of an extraction, which nothing else
    overlaps (issue: the pipeline's drain).
    """

    def __init__(self, chunks: list[bytes | memoryview], size: int) -> None:
        self._digest = hashlib.sha256()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if size < _BACKGROUND_HASH_BYTES:
            self._hash(chunks)
        else:
            self._thread = threading.Thread(target=self._hash, args=(chunks,), name="sha256", daemon=True)
            self._thread.start()

    def _hash(self, chunks: list[bytes | memoryview]) -> None:
        try:
            for chunk in chunks:
                self._digest.update(chunk)
        except BaseException as error:  # re-raised in the caller's thread by hexdigest()
            self._error = error

    def hexdigest(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()


def write_chunks_atomic(
    uri: str, chunks: Iterable[bytes | memoryview], options: StorageOptions | None = None, fsync: bool = True
) -> tuple[str, int]:
    """Stream ``chunks`` into one object atomically (as :func:`write_bytes_atomic`), hashing beside it.

    Returns (sha256 hex, size). Large zero-copy chunks (memoryviews of pinned host tensors) go to the
    file and the hash with the GIL released, so a writer thread overlaps with the caller's compute and
    the hash with the write. ``fsync=False`` leaves durability to the page cache (the rename is still
    atomic for readers).
    """
    parts = list(chunks)
    size = sum(memoryview(chunk).nbytes for chunk in parts)
    if is_local(uri):
        path = _local_path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
        digest = _Sha256Beside(parts, size)
        written = 0
        try:
            with open(tmp, "wb") as handle:
                for chunk in parts:
                    handle.write(chunk)
                    written += memoryview(chunk).nbytes
                handle.flush()
                if fsync:
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as error:
            if error.filename is not None:
                raise
            # A failed write (ENOSPC, EIO) names no file by itself: say which one, and how far it got.
            raise OSError(error.errno, f"{error.strerror} after {written} bytes", str(path)) from error
        finally:
            tmp.unlink(missing_ok=True)
            sha256 = digest.hexdigest()  # joins the hashing thread on every path
        return sha256, size
    fs, path_in_fs = filesystem(uri, options)
    data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
    digest = _Sha256Beside([data], size)
    fs.pipe_file(path_in_fs, data)
    return digest.hexdigest(), size


def write_text_atomic(uri: str, text: str, options: StorageOptions | None = None) -> None:
    write_bytes_atomic(uri, text.encode("utf-8"), options)


def remove(uri: str, options: StorageOptions | None = None) -> None:
    """Delete a file; a missing one is not an error."""
    fs, path = filesystem(uri, options)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path)


# ---------------------------------------------------------------------------------------------
# Datasets: shards + manifest


class ShardIntegrityError(RuntimeError):
    """A shard's bytes do not match its manifest entry (truncated, tampered with or missing)."""

    def __init__(self, shard: str, dataset: str, reason: str) -> None:
        super().__init__(f"shard {shard!r} of dataset {dataset}: {reason}")
        self.shard = shard
        self.dataset = dataset
        self.reason = reason


class ShardNotListedError(KeyError):
    """The manifest does not list the requested shard (so it must not be read)."""


class ManifestNotFoundError(FileNotFoundError):
    """The dataset has no manifest.json: it was never committed (or is being rewritten)."""


class UnsafeShardNameError(ValueError):
    """A manifest lists a shard whose name would resolve outside its dataset folder (`../x`, `/etc/x`)."""

    def __init__(self, manifest_uri: str, shard: str, reason: str) -> None:
        super().__init__(
            f"{manifest_uri}: refused: shard name {shard!r} {reason} "
            "(a shard must be a plain file name inside the dataset folder)"
        )
        self.manifest_uri = manifest_uri
        self.shard = shard


def shard_name_problem(name: str) -> str | None:
    """Why `name` is not a shard name (a plain file name inside the dataset folder), or None.

    Writers and readers apply the same rule, so a manifest edited by hand or written by something else
    can never make a reader open a file outside the dataset.
    """
    if not name:
        return "is empty"
    if "/" in name or "\\" in name or "\0" in name:
        return "is a path"
    if name.startswith("."):
        return "starts with '.' (a parent folder or a hidden file)"
    if name == MANIFEST_NAME:
        return f"is the dataset's own {MANIFEST_NAME}"
    return None


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    rows: int
    sha256: str
    size: int


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str
    uri: str
    shards: list[ShardInfo]
    inputs: dict[str, str] = Field(default_factory=dict)  # config section hashes + upstream manifest hashes
    summary: dict[str, Any] = Field(default_factory=dict)
    created_at: str

    def content_hash(self) -> str:
        """sha256 over what the dataset holds and what produced it (not where or when it was written)."""
        content = {
            "stage": self.stage,
            "shards": [shard.model_dump() for shard in self.shards],
            "inputs": self.inputs,
            "summary": self.summary,
        }
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def shard(self, name: str) -> ShardInfo:
        for info in self.shards:
            if info.name == name:
                return info
        raise ShardNotListedError(f"dataset {self.uri} lists no shard {name!r}")


class DatasetWriter:
    """Writes one dataset's shards, then commits it by writing its manifest.

    Usage: `w = DatasetWriter(uri, storage_options=...)`; `w.write_shard("shard-00000.jsonl", data, rows)`
    for each shard; `manifest = w.commit(stage, inputs, summary)`. Writing into a folder that already
    holds a manifest first removes that manifest, so readers never mix old and new shards.
    `expected_shards` turns on a progress bar.
    """

    def __init__(
        self,
        uri: str,
        storage_options: StorageOptions | None = None,
        expected_shards: int | None = None,
        description: str | None = None,
        fsync: bool = True,
    ) -> None:
        self.uri = uri.rstrip("/")
        self.options = storage_options or {}
        self._shards: list[ShardInfo] = []
        self._claimed: set[str] = set()
        self._lock = threading.Lock()
        self.fsync = fsync
        self._started = False
        self._committed = False
        self._progress: Any = None
        if expected_shards is not None and expected_shards > 1:
            self._progress = tqdm(
                total=expected_shards,
                desc=description or f"write {Path(self.uri).name}",
                unit="shard",
                leave=False,
            )

    @property
    def shards(self) -> list[ShardInfo]:
        return list(self._shards)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        remove(join(self.uri, MANIFEST_NAME), self.options)
        if is_local(self.uri):
            _local_path(self.uri).mkdir(parents=True, exist_ok=True)

    def write_shard(self, name: str, data: bytes, rows: int) -> ShardInfo:
        """Store one shard atomically and remember it for the manifest."""
        return self.write_shard_chunks(name, [data], rows)

    def _check_new_shard(self, name: str) -> None:
        if self._committed:
            raise RuntimeError(f"dataset {self.uri} is already committed")
        problem = shard_name_problem(name)
        if problem is not None:
            raise ValueError(f"invalid shard name {name!r}: {problem}")
        with self._lock:
            if name in self._claimed:
                raise ValueError(f"shard {name!r} written twice to {self.uri}")
            self._claimed.add(name)
            self._start()

    def _record(self, info: ShardInfo) -> ShardInfo:
        with self._lock:
            self._shards.append(info)
            if self._progress is not None:
                self._progress.update(1)
        return info

    def write_shard_chunks(self, name: str, chunks: Iterable[bytes | memoryview], rows: int) -> ShardInfo:
        """As :meth:`write_shard`, streaming ``chunks`` (e.g. ``kernels.shards.shard_chunks``) without
        joining them into one ``bytes`` first. Safe to call from several writer threads."""
        self._check_new_shard(name)
        sha256, size = write_chunks_atomic(join(self.uri, name), chunks, self.options, fsync=self.fsync)
        return self._record(ShardInfo(name=name, rows=int(rows), sha256=sha256, size=size))

    def adopt_shard(self, info: ShardInfo) -> ShardInfo:
        """List a shard another process wrote into this dataset's folder (e.g. an extraction actor
        through its own writer, never committing); its file must exist with the size it reports."""
        self._check_new_shard(info.name)
        fs, path = filesystem(join(self.uri, info.name), self.options)
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        try:
            size = int(fs.size(path))
        except FileNotFoundError:
            raise ShardIntegrityError(info.name, self.uri, "file is missing") from None
        if size != info.size:
            raise ShardIntegrityError(
                info.name, self.uri, f"size {size} bytes, its writer reported {info.size}"
            )
        return self._record(info)

    def commit(
        self, stage: str, inputs: dict[str, str] | None = None, summary: dict[str, Any] | None = None
    ) -> Manifest:
        """Write manifest.json (last, atomically): from now on readers see the dataset."""
        if self._committed:
            raise RuntimeError(f"dataset {self.uri} is already committed")
        self._start()
        manifest = Manifest(
            stage=stage,
            uri=self.uri,
            shards=sorted(self._shards, key=lambda shard: shard.name),
            inputs=dict(inputs or {}),
            summary=dict(summary or {}),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        write_bytes_atomic(
            join(self.uri, MANIFEST_NAME), manifest.model_dump_json(indent=2).encode("utf-8"), self.options
        )
        self._committed = True
        self.close()
        return manifest

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_manifest(uri: str, options: StorageOptions | None = None) -> Manifest:
    """The committed manifest of the dataset at `uri` (its `uri` set to where it was read)."""
    manifest_uri = join(uri.rstrip("/"), MANIFEST_NAME)
    try:
        raw = read_bytes(manifest_uri, options)
    except FileNotFoundError:
        raise ManifestNotFoundError(f"no committed dataset at {uri} (missing {MANIFEST_NAME})") from None
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as error:
        raise ValueError(f"{manifest_uri} is not a valid manifest: {error}") from None
    for shard in manifest.shards:
        problem = shard_name_problem(shard.name)
        if problem is not None:
            raise UnsafeShardNameError(manifest_uri, shard.name, problem)
    manifest.uri = uri.rstrip("/")
    return manifest


def read_shard(manifest: Manifest, shard_name: str, options: StorageOptions | None = None) -> bytes:
    """A listed shard's bytes, checked against the manifest's size and sha256."""
    info = manifest.shard(shard_name)
    try:
        data = read_bytes(join(manifest.uri, info.name), options)
    except FileNotFoundError:
        raise ShardIntegrityError(info.name, manifest.uri, "file is missing") from None
    if len(data) != info.size:
        raise ShardIntegrityError(
            info.name, manifest.uri, f"size {len(data)} bytes, manifest says {info.size} (truncated?)"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ShardIntegrityError(info.name, manifest.uri, f"sha256 {digest} does not match the manifest")
    return data


def download_shards(
    manifest: Manifest, into: Path, names: Iterable[str], options: StorageOptions | None = None
) -> Path:
    """Write the listed shards `names` of `manifest` as files of the local folder `into` (checked)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in names:
        (into / name).write_bytes(read_shard(manifest, name, options))
    return into
