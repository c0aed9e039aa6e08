"""infra/runtime/storage.py: atomic shards, manifests as commit points, integrity checks, local and S3."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from moto_s3 import moto_s3_server

from draftloop.infra.runtime import storage
from draftloop.infra.runtime.storage import (
    DatasetWriter,
    ManifestNotFoundError,
    ShardIntegrityError,
    ShardNotListedError,
    read_manifest,
    read_shard,
)

SHARDS = {f"shard-{i:05d}.bin": os.urandom(1000 + 37 * i) for i in range(3)}


def _write_dataset(uri: str, options: dict | None = None) -> storage.Manifest:
    writer = DatasetWriter(uri, storage_options=options, expected_shards=len(SHARDS))
    for rows, (name, data) in enumerate(SHARDS.items(), start=1):
        writer.write_shard(name, data, rows=rows)
    return writer.commit("unit", inputs={"config.data": "abc"}, summary={"rows": 6})


def _round_trip(uri: str, options: dict | None = None) -> None:
    written = _write_dataset(uri, options)
    manifest = read_manifest(uri, options)
    assert [s.name for s in manifest.shards] == list(SHARDS)
    assert manifest.rows == 6
    assert manifest.content_hash() == written.content_hash()
    for name, data in SHARDS.items():
        assert read_shard(manifest, name, options) == data
        assert manifest.shard(name).sha256 == hashlib.sha256(data).hexdigest()
    with pytest.raises(ShardNotListedError):
        read_shard(manifest, "shard-99999.bin", options)


def test_local_round_trip_and_content_hash(tmp_path: Path) -> None:
    uri = str(tmp_path / "runs" / "ds")
    _round_trip(uri)
    manifest = read_manifest(uri)
    # The hash ignores where and when, but not what.
    moved = manifest.model_copy(update={"uri": "s3://elsewhere/ds", "created_at": "2000-01-01"})
    assert moved.content_hash() == manifest.content_hash()
    changed = manifest.model_copy(update={"summary": {"rows": 7}})
    assert changed.content_hash() != manifest.content_hash()
    # No temporary files are left next to the shards.
    assert sorted(p.name for p in Path(uri).iterdir()) == sorted([*SHARDS, "manifest.json"])


def test_truncated_and_tampered_shards_are_refused(tmp_path: Path) -> None:
    uri = str(tmp_path / "ds")
    manifest = _write_dataset(uri)
    first, second = list(SHARDS)[:2]
    path = Path(uri) / first
    path.write_bytes(SHARDS[first][:-10])
    with pytest.raises(ShardIntegrityError) as truncated:
        read_shard(manifest, first)
    assert truncated.value.shard == first and first in str(truncated.value) and uri in str(truncated.value)
    tampered = bytearray(SHARDS[second])
    tampered[5] ^= 0xFF
    (Path(uri) / second).write_bytes(bytes(tampered))
    with pytest.raises(ShardIntegrityError, match=second):
        read_shard(manifest, second)
    (Path(uri) / second).unlink()
    with pytest.raises(ShardIntegrityError, match="missing"):
        read_shard(manifest, second)


def test_crash_mid_shard_leaves_nothing_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = str(tmp_path / "ds")
    writer = DatasetWriter(uri)
    writer.write_shard("shard-00000.bin", b"complete shard", rows=1)

    def crash(fd: int) -> None:
        raise RuntimeError("simulated crash while writing")

    # The crash hits after the bytes went to the temporary file, before the rename.
    monkeypatch.setattr(storage.os, "fsync", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        writer.write_shard("shard-00001.bin", b"x" * 10_000, rows=5)
    monkeypatch.undo()
    names = sorted(p.name for p in Path(uri).iterdir())
    assert names == ["shard-00000.bin"]  # no partial shard under its final name, no temporary left
    with pytest.raises(ManifestNotFoundError):
        read_manifest(uri)


def test_rewriting_a_dataset_uncommits_the_old_manifest(tmp_path: Path) -> None:
    uri = str(tmp_path / "ds")
    _write_dataset(uri)
    writer = DatasetWriter(uri)
    writer.write_shard("shard-00000.bin", b"new content", rows=1)
    # Mid-rewrite, the old manifest no longer claims shards that are being replaced.
    with pytest.raises(ManifestNotFoundError):
        read_manifest(uri)
    writer.commit("unit")
    assert read_shard(read_manifest(uri), "shard-00000.bin") == b"new content"


def test_writer_rejects_bad_names_and_double_commit(tmp_path: Path) -> None:
    writer = DatasetWriter(str(tmp_path / "ds"))
    for bad in ("", "a/b", ".hidden", "manifest.json"):
        with pytest.raises(ValueError):
            writer.write_shard(bad, b"x", rows=1)
    writer.write_shard("a.bin", b"x", rows=1)
    with pytest.raises(ValueError, match="twice"):
        writer.write_shard("a.bin", b"y", rows=1)
    writer.commit("unit")
    with pytest.raises(RuntimeError, match="committed"):
        writer.commit("unit")


def test_text_files_and_shard_downloads(tmp_path: Path) -> None:
    uri = storage.join(str(tmp_path), "a", "b.json")
    assert uri == f"{tmp_path}/a/b.json"
    assert storage.join("s3://bucket/", "/x/", "y") == "s3://bucket/x/y"
    assert not storage.exists(uri)
    storage.write_text_atomic(uri, '{"k": [1, 2]}')
    assert storage.exists(uri) and storage.read_text(uri) == '{"k": [1, 2]}'
    manifest = _write_dataset(str(tmp_path / "ds"))
    names = sorted(SHARDS)[:2]
    back = storage.download_shards(manifest, tmp_path / "back", names)
    assert sorted(path.name for path in back.iterdir()) == names
    assert all((back / name).read_bytes() == SHARDS[name] for name in names)
    (tmp_path / "ds" / names[0]).write_bytes(b"tampered")
    with pytest.raises(ShardIntegrityError, match=names[0]):
        storage.download_shards(manifest, tmp_path / "again", names)


def test_storage_options_from_config_or_endpoint() -> None:
    class _Storage:
        s3_endpoint_url = "http://127.0.0.1:9"

    class _Config:
        storage = _Storage()

    expected = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert storage.storage_options(_Config()) == expected
    assert storage.storage_options("http://127.0.0.1:9") == expected
    assert storage.storage_options(None) == {}


def test_builtin_prompts_match_their_generator() -> None:
    from draftloop.data.make_prompts import OUTPUT_PATH, make_prompts

    expected = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in make_prompts())
    assert OUTPUT_PATH.read_text(encoding="utf-8") == expected


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3_server(buckets=("draftloop-test",)) as endpoint:
        yield endpoint


def test_s3_round_trip_integrity_and_crash(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    options = storage.storage_options(s3_endpoint)
    uri = "s3://draftloop-test/runs/ds"
    _round_trip(uri, options)

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    first = next(iter(SHARDS))
    fs.pipe_file(f"draftloop-test/runs/ds/{first}", SHARDS[first][:-1] + b"?")
    with pytest.raises(ShardIntegrityError, match=first):
        read_shard(read_manifest(uri, options), first, options)

    # A crash during an upload: the object never appears and there is no manifest.
    crash_uri = "s3://draftloop-test/runs/crashed"
    writer = DatasetWriter(crash_uri, storage_options=options)
    writer.write_shard("shard-00000.bin", b"ok", rows=1)

    def failing_upload(path: str, data: bytes, **kwargs: object) -> None:
        raise RuntimeError("simulated crash during upload")

    # fsspec hands out one cached file-system instance per options; make its upload fail.
    s3, _ = storage.filesystem(crash_uri, options)
    monkeypatch.setattr(s3, "pipe_file", failing_upload)
    with pytest.raises(RuntimeError, match="simulated crash"):
        writer.write_shard("shard-00001.bin", b"y" * 1000, rows=1)
    monkeypatch.undo()
    assert not storage.exists(storage.join(crash_uri, "shard-00001.bin"), options)
    with pytest.raises(ManifestNotFoundError):
        read_manifest(crash_uri, options)

    # Run-folder text files and a dataset's shards downloaded into a local folder.
    text_uri = "s3://draftloop-test/runs/summary.json"
    storage.write_text_atomic(text_uri, '{"a": 1}', options)
    assert storage.exists(text_uri, options) and storage.read_text(text_uri, options) == '{"a": 1}'
    clean = _write_dataset("s3://draftloop-test/runs/clean", options)
    back = storage.download_shards(clean, tmp_path / "back", sorted(SHARDS), options)
    assert all((back / name).read_bytes() == data for name, data in SHARDS.items())


def test_large_chunks_hash_beside_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards above the threshold are hashed on a second thread: same digest and bytes as in line, and
    the hashing thread is joined before the writer returns (also when the write fails)."""
    chunks = [memoryview(os.urandom(storage._BACKGROUND_HASH_BYTES)), b"tail", memoryview(os.urandom(999))]
    whole = b"".join(chunks)
    threads: list[str] = []
    real_hash = storage._Sha256Beside._hash

    def recording_hash(self: storage._Sha256Beside, parts: list) -> None:
        import threading

        threads.append(threading.current_thread().name)
        real_hash(self, parts)

    monkeypatch.setattr(storage._Sha256Beside, "_hash", recording_hash)
    sha256, size = storage.write_chunks_atomic(str(tmp_path / "big.bin"), chunks, fsync=False)
    assert (sha256, size) == (hashlib.sha256(whole).hexdigest(), len(whole))
    assert (tmp_path / "big.bin").read_bytes() == whole
    small_sha, _ = storage.write_chunks_atomic(str(tmp_path / "small.bin"), [b"abc"], fsync=False)
    assert small_sha == hashlib.sha256(b"abc").hexdigest()
    assert threads == ["sha256", "MainThread"]  # the big shard on its own thread, the small one in line

    def failing_write(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.os, "replace", failing_write)
    with pytest.raises(OSError, match="No space left"):
        storage.write_chunks_atomic(str(tmp_path / "full.bin"), chunks, fsync=False)
    assert not list(tmp_path.glob(".full.bin.tmp-*")) and not (tmp_path / "full.bin").exists()
