"""Streamed training over shards: equal to in-memory training, every sample exactly once per epoch
whatever the number of ranks, and a mid-epoch resume from 1 to 2 workers (gloo, two processes)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from synthetic_training import LAYERS, TARGET, new_drafter, synthetic_samples, target_tensors

from draftloop.infra.training.best_epoch import BEST_WEIGHTS
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.sources import StoredHiddenStates
from draftloop.kernels.data import (
    InMemorySamples,
    SampleKey,
    ShardedSamples,
    ShardRef,
    StepShare,
    split_held_out,
)
from draftloop.kernels.train import TrainConfig, train_drafter

Sample = dict[str, torch.Tensor]


class LoadedShard(list[Sample]):
    """A shard's samples as the loader returns them (a list that can be weakly referenced)."""


class RecordingShards(ShardedSamples):
    """Shards of in-memory samples; records each shard read, how many shards are held at once, and
    which samples each step trains."""

    def __init__(self, shards: Sequence[Sequence[Sample]], **options: Any) -> None:
        self.contents = {f"shard-{i:02d}": list(samples) for i, samples in enumerate(shards)}
        refs = [
            ShardRef(name, len(samples), sum(len(s["input_ids"]) for s in samples))
            for name, samples in self.contents.items()
        ]
        super().__init__(refs, self._load, **options)
        self.reads: list[str] = []
        self.trained: list[tuple[int, SampleKey]] = []
        self.lock = threading.Lock()
        self.loaded: list[weakref.ref[LoadedShard]] = []

    def _load(self, name: str) -> Sequence[Sample]:
        shard = LoadedShard(self.contents[name])  # a fresh object per read, to see when it is dropped
        with self.lock:
            self.reads.append(name)
            self.loaded.append(weakref.ref(shard))
        return shard

    def held(self) -> int:
        """Shards read and not dropped yet."""
        return sum(ref() is not None for ref in self.loaded)

    def rank_steps(
        self, epoch: int, seed: int, samples_per_step: int, start: int, rank: int, world: int
    ) -> Iterator[StepShare]:
        for share in super().rank_steps(epoch, seed, samples_per_step, start, rank, world):
            self.trained.extend((epoch, key) for key in share.keys)
            yield share


def split(samples: list[Sample], sizes: Sequence[int]) -> list[list[Sample]]:
    out, start = [], 0
    for size in sizes:
        out.append(samples[start : start + size])
        start += size
    assert start == len(samples)
    return out


CFG = {"ttt_length": 2, "epochs": 2, "batch_size": 3, "grad_accum": 2, "lr": 3e-3, "show_progress": False}


def test_streamed_training_equals_in_memory() -> None:
    embed, lm_head = target_tensors()
    samples = synthetic_samples(22, seed=7)
    cfg = TrainConfig(**CFG)
    in_memory = new_drafter(embed)
    want = train_drafter(in_memory, InMemorySamples(samples), lm_head, cfg)
    # One shuffle window over every shard: the same global order as in memory, so the same weights.
    shards = RecordingShards(split(samples, [5, 9, 1, 7]), window_shards=4, prefetch_shards=1)
    streamed = new_drafter(embed)
    got = train_drafter(streamed, shards, lm_head, cfg)
    assert [h["loss"] for h in got.history] == [h["loss"] for h in want.history]
    for name, tensor in in_memory.state_dict().items():
        assert torch.equal(streamed.state_dict()[name], tensor), name
    assert Counter(shards.reads) == {name: cfg.epochs for name in shards.contents}  # once per epoch


def test_bounded_window_reads_lazily_and_trains_every_sample_once() -> None:
    embed, lm_head = target_tensors()
    samples = synthetic_samples(22, seed=7)
    shards = RecordingShards(split(samples, [5, 9, 1, 7]), window_shards=1, prefetch_shards=1)
    held: list[int] = []  # shards in memory after each step: the window's, one queued, one being read
    result = train_drafter(
        new_drafter(embed),
        shards,
        lm_head,
        TrainConfig(**CFG),
        on_step=lambda _s, _r: held.append(shards.held()),
    )
    assert max(held) <= 3, held
    for epoch in range(2):
        keys = [key for e, key in shards.trained if e == epoch]
        assert sorted(keys) == sorted(
            (s, i) for s, ref in enumerate(shards.shards) for i in range(ref.num_samples)
        )
    # One shard per window: shards are read in the epoch's shard order, one after the other.
    per_epoch = [shards.reads[:4], shards.reads[4:]]
    assert per_epoch[0] != per_epoch[1] and sorted(per_epoch[0]) == sorted(shards.contents)
    assert result.epochs[-1]["real_tokens"] == sum(len(s["input_ids"]) for s in samples)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_ranks_drop_no_sample(world: int) -> None:
    """Shards of very different sizes over 1-4 ranks: per epoch every sample exactly once over all ranks,
    every rank the same number of optimizer steps (some with nothing to train), same step sizes."""
    samples = synthetic_samples(31, seed=11, max_len=8)
    data = RecordingShards(split(samples, [1, 12, 2, 3, 9, 4]), window_shards=3)
    everything = sorted((s, i) for s, ref in enumerate(data.shards) for i in range(ref.num_samples))
    for epoch in range(3):
        steps = [list(data.rank_steps(epoch, 0, 4, 0, rank, world)) for rank in range(world)]
        assert len({len(rank_steps) for rank_steps in steps}) == 1 and len(steps[0]) == 8  # ceil(31 / 4)
        for index in range(len(steps[0])):
            shares = [rank_steps[index] for rank_steps in steps]
            assert len({share.step_samples for share in shares}) == 1
            assert sum(len(share.keys) for share in shares) == shares[0].step_samples
        seen = [key for rank_steps in steps for share in rank_steps for key in share.keys]
        assert sorted(seen) == everything
        if world > 1:  # each rank reads only its own shards
            owners = data.shard_owners(epoch, 0, world)
            for rank, rank_steps in enumerate(steps):
                assert all(owners[s] == rank for share in rank_steps for s, _ in share.keys)


# ---------------------------------------------------------------------------------------- resume 1 -> 2


def _resumed_worker(rank: int, world: int, init_file: str, job: Mapping[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        drafter = new_drafter(job["embed"])
        drafter.load_state_dict(job["weights"])
        data = RecordingShards(job["shards"], window_shards=2)
        result = train_drafter(
            drafter, data, job["lm_head"], job["cfg"], rank=rank, world=world, resume_state=job["state"]
        )
        torch.save(
            {"trained": data.trained, "weights": drafter.state_dict(), "history": result.history},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


class Interrupted(Exception):
    pass


def test_mid_epoch_resume_from_one_to_two_workers(tmp_path: Path) -> None:
    embed, lm_head = target_tensors()
    samples = synthetic_samples(26, seed=13)
    shards = split(samples, [6, 3, 8, 2, 7])
    cfg = TrainConfig(**CFG, checkpoint_every_steps=2)  # 5 steps per epoch, 10 in all
    straight_drafter = new_drafter(embed)
    straight = train_drafter(straight_drafter, RecordingShards(shards, window_shards=2), lm_head, cfg)

    # One worker, interrupted right after the checkpoint of step 2: mid-epoch 0, 12 of 26 samples done.
    drafter = new_drafter(embed)
    first = RecordingShards(shards, window_shards=2)
    saved: dict[str, Any] = {}

    def checkpoint(state: dict[str, Any]) -> None:
        if state["global_step"] == 2:
            saved.update(state=state, weights={k: v.clone() for k, v in drafter.state_dict().items()})
            raise Interrupted

    with pytest.raises(Interrupted):
        train_drafter(drafter, first, lm_head, cfg, on_checkpoint=checkpoint)
    assert saved["state"]["epoch"] == 0 and saved["state"]["consumed"] == 12
    done_before = first.trained[:12]

    job = {"embed": embed, "lm_head": lm_head, "shards": shards, "cfg": cfg, **saved}
    mp.spawn(_resumed_worker, args=(2, str(tmp_path / "pg"), job, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    everything = sorted((s, i) for s, part in enumerate(shards) for i in range(len(part)))
    for epoch in range(2):
        trained = [key for e, key in done_before if e == epoch]
        trained += [key for rank in ranks for e, key in rank["trained"] if e == epoch]
        assert sorted(trained) == everything, f"epoch {epoch}"
    assert all(rank["trained"] for rank in ranks)  # both workers did work
    # The global steps do not depend on the worker count: the resumed run ends where the straight one does.
    assert [h["samples"] for h in ranks[0]["history"]] == [h["samples"] for h in straight.history]
    assert [h["loss"] for h in ranks[0]["history"]] == pytest.approx(
        [h["loss"] for h in straight.history], rel=1e-4
    )
    for name, tensor in straight_drafter.state_dict().items():
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(ranks[1]["weights"][name], ranks[0]["weights"][name]), name


# ---------------------------------------------------------------------------------------- train worker


def _worker_job(root: Path, work: str, held_out: int = 0) -> TrainingJob:
    """What tasks/train.py's loop_config hands each worker, for the synthetic dataset under ``root``."""
    from draftloop.infra.runtime.storage import read_manifest

    return TrainingJob(
        hidden=StoredHiddenStates(read_manifest(str(root / "hidden")), {}),
        target_path=str(root / "target"),
        aux_layer_ids=LAYERS,
        draft_vocab_size=32,
        drafter_init=None,
        init_norm_from_target=True,
        engine="vllm",
        drafter_metadata={},
        work_dir=root / work,
        shuffle_window_shards=2,
        prefetch_shards=1,
        rank_split="shards",
        held_out_samples=held_out,
        acceptance_k=3,
        train=TrainConfig(**CFG, max_length=64, pack_tokens=40, checkpoint_every_steps=2),
    )


def _train_worker_process(rank: int, world: int, root: str) -> None:
    from draftloop.infra.training.worker import train_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world)
    try:
        train_worker(
            _worker_job(Path(root), "cut"), rank=rank, world=world, device="cpu", report=lambda _m: None
        )
    finally:
        dist.destroy_process_group()


def _write_hidden_dataset(root: Path, sizes: Sequence[int]) -> None:
    """A tiny target under root/target and a committed hidden-state dataset under root/hidden."""
    from transformers import AutoModelForCausalLM

    from draftloop.infra.runtime.storage import DatasetWriter
    from draftloop.kernels.shards import pack_hidden_shard, shard_metadata, shard_to_bytes

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TARGET).save_pretrained(root / "target")
    samples = synthetic_samples(sum(sizes), seed=13)
    writer = DatasetWriter(str(root / "hidden"), fsync=False)
    for index, part in enumerate(split(samples, sizes)):
        tensors = pack_hidden_shard(part)
        writer.write_shard(
            f"hidden-{index:05d}.safetensors", shard_to_bytes(tensors, shard_metadata(LAYERS, "t")), len(part)
        )
    writer.commit("extract", summary={"aux_layer_ids": list(LAYERS.ids)})


def test_split_held_out_takes_few_shards_and_loses_no_sample() -> None:
    shards = [ShardRef(f"s{i}", n, 10 * n) for i, n in enumerate([6, 3, 8, 2, 7])]
    for wanted in (0, 1, 5, 9, 26):
        training, held = split_held_out(shards, wanted, seed=0)
        assert held.num_samples == wanted
        assert sum(s.num_samples for s in training) + held.num_samples == 26
        # Whole shards first: at most one shard is split between training and held out.
        sizes = {shard.name: shard.num_samples for shard in shards}
        split_shards = [name for name, count in held.per_shard.items() if count < sizes[name]]
        assert len(split_shards) <= 1
        assert split_held_out(shards, wanted, seed=0) == (training, held)  # seeded


def test_train_worker_exports_the_best_held_out_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held-out samples are never trained on; after every epoch the drafter's acceptance length on them
    is estimated, and the exported drafter is the best epoch's, not the last (recorded in result.json).
    The estimate is rigged (1.2, 1.8, 1.5 over three epochs) so that the best epoch is not the last; the
    estimate itself is tested in test_simulate / test_acceptance_training."""
    from safetensors.torch import load_file

    import draftloop.infra.training.worker as worker
    from draftloop.kernels.counters import SpecCounters

    rigged = iter([1.2, 1.8, 1.5])
    seen: list[int] = []

    def estimate(drafter: Any, samples: Sequence[Any], head: Any, k: int) -> SpecCounters:
        seen.append(len(samples))
        length = next(rigged)
        return SpecCounters(10.0, 10.0 * k, 10.0 * (length - 1.0))

    monkeypatch.setattr(worker, "teacher_forced_acceptance", estimate)
    _write_hidden_dataset(tmp_path, [6, 3, 8, 2, 7])
    job = _worker_job(tmp_path, "run", held_out=2)
    train = dataclasses.replace(job.train, epochs=3, checkpoint_every_steps=None)
    job = dataclasses.replace(job, train=train)
    reports: list[dict[str, Any]] = []
    worker.train_worker(job, rank=0, world=1, device="cpu", report=reports.append)
    result = json.loads((tmp_path / "run" / "final" / "result.json").read_text())
    lengths = [e["held_out_acceptance_length"] for e in result["epochs"]]
    assert seen == [2, 2, 2] and result["held_out_samples"] == 2 and result["samples"] == 24
    assert lengths == pytest.approx([1.2, 1.8, 1.5])
    assert [r["held_out_acceptance_length"] for r in reports if "epoch" in r] == pytest.approx(lengths)
    assert result["best_epoch"] == 1 and result["best_held_out_acceptance_length"] == pytest.approx(1.8)
    assert result["exported_epoch"] == 1
    best = torch.load(tmp_path / "run" / BEST_WEIGHTS, weights_only=True)
    last = torch.load(sorted((tmp_path / "run").glob("step-*"))[-1] / "drafter.pt", weights_only=True)
    exported = load_file(tmp_path / "run" / "final" / "drafter" / "model.safetensors")
    assert torch.equal(exported["fc.weight"], best["fc.weight"].to(exported["fc.weight"].dtype))
    assert not torch.equal(best["fc.weight"], last["fc.weight"])  # the last epoch was not exported
    config = json.loads((tmp_path / "run" / "final" / "drafter" / "config.json").read_text())
    assert config["draftloop"]["metadata"]["exported_epoch"] == 1


@pytest.mark.slow
def test_train_worker_resumes_mid_epoch_on_two_workers(tmp_path: Path) -> None:
    """The train stage's worker body over a stored dataset: killed after a mid-epoch checkpoint of a
    1-worker run, resumed by 2 workers, it ends with the drafter of an uninterrupted run."""
    from safetensors.torch import load_file

    from draftloop.infra.training.worker import latest_checkpoint, train_worker

    _write_hidden_dataset(tmp_path, [6, 3, 8, 2, 7])

    def no_report(_metrics: dict[str, Any]) -> None:
        pass

    train_worker(_worker_job(tmp_path, "straight"), rank=0, world=1, device="cpu", report=no_report)
    train_worker(_worker_job(tmp_path, "cut"), rank=0, world=1, device="cpu", report=no_report)
    # As if the run had died after step 8 (epoch 1, mid-way): later checkpoints and the result gone.
    shutil.rmtree(tmp_path / "cut" / "final")
    for later in sorted((tmp_path / "cut").glob("step-*"))[1:]:
        shutil.rmtree(later)
    checkpoint = latest_checkpoint(tmp_path / "cut")
    assert checkpoint is not None and checkpoint.name == "step-00000008"
    state = torch.load(checkpoint / "resume.pt", weights_only=False)
    assert (state["epoch"], state["consumed"]) == (1, 18)

    mp.spawn(_train_worker_process, args=(2, str(tmp_path)), nprocs=2, join=True)
    straight = json.loads((tmp_path / "straight" / "final" / "result.json").read_text())
    resumed = json.loads((tmp_path / "cut" / "final" / "result.json").read_text())
    assert resumed["workers"] == 2 and resumed["resumed_from_epoch"] == 1
    assert [h["samples"] for h in resumed["history"]] == [h["samples"] for h in straight["history"]]
    assert [h["loss"] for h in resumed["history"]] == pytest.approx(
        [h["loss"] for h in straight["history"]], rel=1e-5
    )
    assert resumed["trained_tokens"] == sum(h["real_tokens"] for h in straight["history"][8:])
    want = load_file(tmp_path / "straight" / "final" / "drafter" / "model.safetensors")
    got = load_file(tmp_path / "cut" / "final" / "drafter" / "model.safetensors")
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_the_exported_epoch_is_the_best_held_out_one_else_the_last() -> None:
    from draftloop.infra.training.best_epoch import exported_epoch

    assert exported_epoch(1, epochs=3) == 1
    assert exported_epoch(0, epochs=3) == 0
    assert exported_epoch(None, epochs=3) == 2
