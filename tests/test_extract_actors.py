"""Extraction actors write their shards straight to storage and hand back only ShardInfo.

What crosses from an actor to the driver (and so through Ray's object store) is asserted on: its return
value holds ShardInfo and a few counts, and its pickled size does not grow with the hidden states it
wrote. The driver adopts the shards and commits one manifest; every shard reads back sha-checked.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from fixtures_flow import REPO_ROOT
from moto_s3 import moto_s3_server

from draftloop.infra.extraction.extractor import ExtractedShards, HiddenStateExtractor
from draftloop.infra.extraction.tokenize import tokenize_conversation
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import (
    DatasetWriter,
    Manifest,
    ShardInfo,
    ShardIntegrityError,
    StorageOptions,
    read_manifest,
    read_shard,
)
from draftloop.infra.synthesis.conversations import (
    CONVERSATIONS_SHARD_PREFIX,
    conversation_count,
    iter_conversations,
    read_conversations,
    to_jsonl,
)
from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes

ROWS_PER_CONVERSATION_SHARD = 5
MAX_LENGTH = 512


def _conversations(count: int, answer_words: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"c{index}",
            "messages": [
                {"role": "user", "content": f"Question number {index}?"},
                {
                    "role": "assistant",
                    "content": " ".join(f"w{(index + k) % 13}" for k in range(answer_words)),
                },
            ],
            "reasoning": None,
        }
        for index in range(count)
    ]


def _synthesized(uri: str, rows: list[dict[str, Any]], options: StorageOptions | None = None) -> Manifest:
    """A synthesize-stage dataset holding `rows` in several conversation shards."""
    writer = DatasetWriter(uri, storage_options=options)
    for index, start in enumerate(range(0, len(rows), ROWS_PER_CONVERSATION_SHARD)):
        chunk = rows[start : start + ROWS_PER_CONVERSATION_SHARD]
        writer.write_shard(f"{CONVERSATIONS_SHARD_PREFIX}{index:05d}.jsonl", to_jsonl(chunk), rows=len(chunk))
    return writer.commit("synthesize")


def _config(target: Path, **extraction: Any) -> ExperimentConfig:
    raw = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    raw["target"]["path"] = str(target)
    raw["extraction"].update(extraction)
    return ExperimentConfig.from_dict(raw, check_environment=False)


@pytest.fixture(scope="module")
def extractor(zoo_target_dir: Any) -> HiddenStateExtractor:
    target = zoo_target_dir("tiny-llama")
    ids = _config(target).aux_layer_ids_internal()
    return HiddenStateExtractor(str(target), list(ids.ids), "layer_input", "float32")


def _commit_and_read(uri: str, returned: ExtractedShards, options: StorageOptions | None = None) -> list[Any]:
    """What the task does with an actor's return (adopt, commit), then every sample read back checked."""
    writer = DatasetWriter(uri, storage_options=options)
    for info in returned.shards:
        writer.adopt_shard(info)
    writer.commit("extract")
    manifest = read_manifest(uri, options)
    samples: list[Any] = []
    for info in manifest.shards:
        tensors, _ = shard_from_bytes(read_shard(manifest, info.name, options))  # size + sha256 checked
        samples.extend(iter_hidden_samples(tensors))
    return samples


def test_actor_returns_shard_info_whose_size_does_not_grow_with_the_data(
    extractor: HiddenStateExtractor, tmp_path: Path
) -> None:
    returned: dict[int, ExtractedShards] = {}
    written_bytes: dict[int, int] = {}
    for answer_words in (4, 60):
        rows = _conversations(8, answer_words)
        conversations = _synthesized(str(tmp_path / f"synth-{answer_words}"), rows)
        out = tmp_path / f"hidden-{answer_words}"
        result = extractor.extract_slice(conversations, 0, 8, str(out), {}, "hidden-a00", 4, MAX_LENGTH)
        assert isinstance(result, ExtractedShards)
        assert all(type(info) is ShardInfo for info in result.shards)
        assert [info.name for info in result.shards] == [
            "hidden-a00-00000.safetensors",
            "hidden-a00-00001.safetensors",
        ]
        returned[answer_words] = result
        written_bytes[answer_words] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        assert written_bytes[answer_words] == sum(info.size for info in result.shards)

        samples = _commit_and_read(str(out), result)
        assert len(samples) == 8
        for row, sample in zip(rows, samples, strict=True):
            ids, mask = tokenize_conversation(extractor.tokenizer, row["messages"], MAX_LENGTH)
            assert sample["input_ids"].tolist() == ids
            assert sample["loss_mask"].tolist() == mask

    short, long = (len(pickle.dumps(returned[words])) for words in (4, 60))
    assert written_bytes[60] > 4 * written_bytes[4]  # far more hidden-state bytes written ...
    assert abs(long - short) <= 16  # ... the same return value (only digits of counts differ)
    assert long < 2048 < written_bytes[4]


def test_skipped_conversations_come_back_as_a_count_and_a_few_examples(
    extractor: HiddenStateExtractor, tmp_path: Path
) -> None:
    rows = _conversations(3, 4)
    for index in range(6):  # assistant text entirely beyond max_length: no assistant token kept
        rows.append({**_conversations(1, 4)[0], "id": f"long{index}"})
        rows[-1]["messages"][0]["content"] = "word " * 200
    result = extractor.extract(rows, str(tmp_path / "hidden"), {}, "hidden-a00", 8, 64)
    assert result.skipped == 6
    assert [example["id"] for example in result.skip_examples] == ["long0", "long1", "long2"]
    assert sum(info.rows for info in result.shards) == 3


def test_slices_read_only_the_conversation_shards_they_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftloop.infra.synthesis import conversations as module

    rows = _conversations(23, 2)
    manifest = _synthesized(str(tmp_path / "synth"), rows)
    assert conversation_count(manifest) == 23
    read: list[str] = []
    original = module.read_shard

    def recording(manifest: Manifest, name: str, options: StorageOptions | None = None) -> bytes:
        read.append(name)
        return original(manifest, name, options)

    monkeypatch.setattr(module, "read_shard", recording)
    sliced = list(iter_conversations(manifest, 7, 16))
    assert read == [f"conversations-{i:05d}.jsonl" for i in (1, 2, 3)]  # shards of 5 rows: 5-9, 10-14, 15-19
    assert sliced == read_conversations(manifest)[7:16] == rows[7:16]
    assert list(iter_conversations(manifest, 20, 23)) == rows[20:23]
    assert list(iter_conversations(manifest, 0, 0)) == []


def test_adopted_shards_must_exist_with_their_reported_size(tmp_path: Path) -> None:
    (tmp_path / "hidden-a00-00000.safetensors").write_bytes(b"x" * 10)
    writer = DatasetWriter(str(tmp_path))
    with pytest.raises(ShardIntegrityError, match="writer reported 11"):
        writer.adopt_shard(ShardInfo(name="hidden-a00-00000.safetensors", rows=1, sha256="0" * 64, size=11))
    with pytest.raises(ShardIntegrityError, match="missing"):
        writer.adopt_shard(ShardInfo(name="hidden-a00-00001.safetensors", rows=1, sha256="0" * 64, size=10))


def test_actor_writes_shards_to_s3(extractor: HiddenStateExtractor) -> None:
    with moto_s3_server(buckets=("runs",)) as endpoint:
        options: StorageOptions = {"client_kwargs": {"endpoint_url": endpoint}}
        rows = _conversations(6, 8)
        conversations = _synthesized("s3://runs/synth", rows, options)
        result = extractor.extract_slice(
            conversations, 2, 6, "s3://runs/hidden", options, "hidden-a01", 2, MAX_LENGTH, batch_size=2
        )
        samples = _commit_and_read("s3://runs/hidden", result, options)
        assert [info.name for info in result.shards] == [
            "hidden-a01-00000.safetensors",
            "hidden-a01-00001.safetensors",
        ]
        assert len(samples) == 4
        ids, _ = tokenize_conversation(extractor.tokenizer, rows[2]["messages"], MAX_LENGTH)
        assert samples[0]["input_ids"].tolist() == ids


@pytest.mark.slow  # starts Ray and two actors that each load the target: minutes on a shared 2-core machine
def test_extract_through_ray_actors_commits_what_they_wrote(
    zoo_target_dir: Any, extractor: HiddenStateExtractor, tmp_path: Path
) -> None:
    """The task's path: two Ray actors each extract a slice; the driver sees ShardInfo only."""
    from draftloop.infra.runtime.ray_cluster import ensure_ray
    from draftloop.tasks.extract import _extract_in_process, _slices

    ensure_ray(num_cpus=2)
    config = _config(zoo_target_dir("tiny-llama"), num_actors=2, samples_per_shard=4)
    rows = _conversations(11, 6)
    conversations = _synthesized(str(tmp_path / "synth"), rows)
    slices = _slices(conversation_count(conversations), 2)
    writer = DatasetWriter(str(tmp_path / "hidden"))
    results = _extract_in_process(config, config.target.path, conversations, slices, writer)
    assert all(type(result) is ExtractedShards for result in results)
    assert len(pickle.dumps(results)) < 4096
    assert len(pickle.dumps(conversations)) < 4096  # what is sent: a manifest, not the conversations
    writer.commit("extract")

    manifest = read_manifest(str(tmp_path / "hidden"))
    assert [info.name for info in manifest.shards] == [
        "hidden-a00-00000.safetensors",
        "hidden-a00-00001.safetensors",
        "hidden-a01-00000.safetensors",
        "hidden-a01-00001.safetensors",
    ]
    samples = []
    for info in manifest.shards:
        tensors, _ = shard_from_bytes(read_shard(manifest, info.name))
        samples.extend(iter_hidden_samples(tensors))
    direct = extractor.extract(
        rows, str(tmp_path / "direct"), {}, "hidden-a00", 64, int(config.data.max_length)
    )
    reference = _commit_and_read(str(tmp_path / "direct"), direct)
    assert len(samples) == len(reference) == 11
    for ours, theirs in zip(samples, reference, strict=True):
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        torch.testing.assert_close(ours["aux_hidden"], theirs["aux_hidden"])
