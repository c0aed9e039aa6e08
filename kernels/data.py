"""Training data: what the training loop reads (`TrainingData`), and its two sources, shards streamed
in a seeded global order (`ShardedSamples`) and samples already in memory (`InMemorySamples`).

The loop asks a source only for its sample count per epoch and, for one rank, that rank's part of each
optimizer step of an epoch from a data position on (`rank_steps`). A data position is (epoch, samples
consumed), so a resume works with any number of workers. Every rank must see the same steps with the
same sizes (the gradient sum is a collective); a rank may own none of a step's samples (it then
contributes a zero gradient). A source that receives samples while training runs implements the same
two members.

Shards: every epoch has one global order of samples that does not depend on the number of workers:

1. the shards are shuffled (seeded by seed and epoch) and cut into windows of ``window_shards``;
2. the samples of each window are shuffled together (the bounded shuffle buffer: at most one window
   of shards is ever held), windows following each other.

Optimizer step k of the epoch trains samples ``order[k*S : (k+1)*S]`` (S samples per step). How ranks
split a step (``split``):

- ``"shards"``: inside each window, shards go to ranks by estimated tokens (longest-processing-time
  first), and a rank trains the samples of each step that come from its shards. Every rank reads only
  its own shards, but a step's shares differ (whole shards; bench/RESULTS.md: a 0.90 bound on 2 GPUs).
- ``"tokens"``: each step's samples are dealt to ranks longest first, each to the rank with the fewest
  tokens so far (ties: the lower rank), so the shares of every step differ by less than one sample's
  tokens; the split depends only on the step's samples and the world size. The price is in reads: the
  lengths are those of the loaded samples and a step's samples come from every shard of its window, so
  every rank reads every shard (world x the reads of ``"shards"``; a remote producer computes each shard
  once per rank). A shard is dropped once the order has passed its last sample.

Either way every sample is trained exactly once per epoch, by exactly one rank, and shards are read
lazily, a bounded number of shards ahead. The shard reader is injected: ``load_shard(name) ->
samples`` (read on a background thread), or ``submit_shard(name) -> a callable that returns the
samples`` (the reader starts the work itself, e.g. a remote producer, and the loop keeps
``prefetch_shards`` submitted ahead): kernels know nothing of storage or of where a shard is computed.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol, get_args

from torch import Tensor

__all__ = [
    "HeldOut",
    "InMemorySamples",
    "RankSplit",
    "SampleKey",
    "ShardRef",
    "ShardSubmit",
    "ShardedSamples",
    "StepShare",
    "TrainingData",
    "deal_by_tokens",
    "split_held_out",
]

# (shard index in the dataset's shard list, sample index inside the shard)
SampleKey = tuple[int, int]
Samples = Sequence[Mapping[str, Tensor]]
# Starts reading (or computing) one shard; the returned callable blocks until its samples are there.
ShardSubmit = Callable[[str], Callable[[], Samples]]
# How ranks split each optimizer step (module docstring).
RankSplit = Literal["shards", "tokens"]


@dataclass(frozen=True)
class ShardRef:
    name: str
    num_samples: int
    work: int  # estimated training cost (tokens, or bytes ~ tokens): balances shards between ranks


@dataclass(frozen=True)
class StepShare:
    """One rank's part of one optimizer step."""

    step_samples: int  # samples of the whole step, over all ranks
    keys: list[SampleKey]  # this rank's samples, in global order
    samples: list[Mapping[str, Tensor]]
    # Each of this rank's samples as one number 0..num_samples-1 (the same sample, the same number, in
    # every epoch and for every worker count): what the loop counts to prove exactly-once training.
    sample_ids: list[int]


class TrainingData(Protocol):
    """What the training loop reads from a source of samples."""

    @property
    def num_samples(self) -> int:
        """Samples of one epoch (the loop derives its steps and the learning-rate schedule from it)."""
        ...

    def rank_steps(
        self, epoch: int, seed: int, samples_per_step: int, start: int, rank: int, world: int
    ) -> Iterator[StepShare]:
        """``rank``'s share of every optimizer step of ``epoch`` (``samples_per_step`` samples over all
        ``world`` ranks, seeded by ``seed``) from global sample position ``start`` on. Every rank gets
        the same steps with the same ``step_samples``."""
        ...


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    """The generator of an epoch's sample shuffle (the same for every source and worker count)."""
    return random.Random(seed * 1_000_003 + epoch)


class InMemorySamples:
    """Samples already in memory: a full seeded shuffle every epoch. They are one unit of work, so rank 0
    trains them all (to spread data over ranks, stream it as `ShardedSamples`)."""

    def __init__(self, samples: Samples) -> None:
        self.samples = list(samples)
        if not self.samples:
            raise ValueError("no training samples")

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def epoch_order(self, epoch: int, seed: int) -> list[int]:
        order = list(range(len(self.samples)))
        _epoch_rng(seed, epoch).shuffle(order)
        return order

    def rank_steps(
        self, epoch: int, seed: int, samples_per_step: int, start: int, rank: int, world: int
    ) -> Iterator[StepShare]:
        order = self.epoch_order(epoch, seed)
        for step_start in range(start, len(order), samples_per_step):
            step = order[step_start : step_start + samples_per_step]
            mine = step if rank == 0 else []
            yield StepShare(
                step_samples=len(step),
                keys=[(0, i) for i in mine],
                samples=[self.samples[i] for i in mine],
                sample_ids=list(mine),
            )


@dataclass(frozen=True)
class HeldOut:
    """Samples kept out of training: the last ``per_shard[name]`` samples of each named shard."""

    per_shard: dict[str, int]

    @property
    def num_samples(self) -> int:
        return sum(self.per_shard.values())


def split_held_out(shards: Sequence[ShardRef], num_samples: int, seed: int) -> tuple[list[ShardRef], HeldOut]:
    """Hold ``num_samples`` samples out of training, taken from as few shards as possible (so reading
    them each epoch costs a shard or two, whatever the dataset's size): shards in a seeded order, each
    giving its last samples until enough are held out. Returns the training shards (counts reduced,
    emptied shards dropped) and the held-out plan; every sample is in exactly one of the two."""
    order = list(range(len(shards)))
    random.Random(f"held-out:{seed}").shuffle(order)
    remaining = max(0, num_samples)
    held: dict[str, int] = {}
    for index in order:
        if remaining == 0:
            break
        take = min(remaining, shards[index].num_samples)
        if take:
            held[shards[index].name] = take
            remaining -= take
    training = []
    for shard in shards:
        kept = shard.num_samples - held.get(shard.name, 0)
        if kept > 0:
            training.append(ShardRef(shard.name, kept, shard.work * kept // max(1, shard.num_samples)))
    return training, HeldOut(held)


class ShardedSamples:
    """Samples spread over shards, read lazily through ``load_shard`` (see the module docstring)."""

    def __init__(
        self,
        shards: Sequence[ShardRef],
        load_shard: Callable[[str], Samples],
        *,
        window_shards: int = 8,
        prefetch_shards: int = 2,
        submit_shard: ShardSubmit | None = None,
        split: RankSplit = "shards",
    ) -> None:
        if not shards or not any(shard.num_samples for shard in shards):
            raise ValueError("no training samples")
        if split not in get_args(RankSplit):
            raise ValueError(f"split must be one of {get_args(RankSplit)}, got {split!r}")
        self.split = split
        if window_shards < 1 or prefetch_shards < 1:
            raise ValueError("window_shards and prefetch_shards must be at least 1")
        self.shards = list(shards)
        self.load_shard = load_shard
        self.submit_shard = submit_shard
        self.window_shards = window_shards
        self.prefetch_shards = prefetch_shards
        self.first_sample_id = [0] * len(self.shards)  # each shard's first sample id
        for index in range(1, len(self.shards)):
            self.first_sample_id[index] = self.first_sample_id[index - 1] + self.shards[index - 1].num_samples

    @property
    def num_samples(self) -> int:
        return sum(shard.num_samples for shard in self.shards)

    def epoch_windows(self, epoch: int, seed: int) -> list[list[int]]:
        """Shard indices of each shuffle window of ``epoch``, each window in index order (so that its
        sample order does not depend on how the shards inside it were permuted)."""
        shard_order = list(range(len(self.shards)))
        random.Random(f"shards:{seed}:{epoch}").shuffle(shard_order)
        size = self.window_shards
        return [sorted(shard_order[i : i + size]) for i in range(0, len(shard_order), size)]

    def epoch_order(self, epoch: int, seed: int) -> list[SampleKey]:
        """The global sample order of ``epoch``: each window's samples shuffled together."""
        rng = _epoch_rng(seed, epoch)
        order: list[SampleKey] = []
        for window in self.epoch_windows(epoch, seed):
            keys = [(shard, index) for shard in window for index in range(self.shards[shard].num_samples)]
            rng.shuffle(keys)
            order.extend(keys)
        return order

    def shard_owners(self, epoch: int, seed: int, world: int) -> dict[int, int]:
        """Rank of each shard in ``epoch``: per window, heaviest shard first to the least-loaded rank."""
        owners: dict[int, int] = {}
        for window in self.epoch_windows(epoch, seed):
            load = [0] * world
            for shard in sorted(window, key=lambda s: (-self.shards[s].work, s)):
                rank = min(range(world), key=lambda r: (load[r], r))
                owners[shard] = rank
                load[rank] += self.shards[shard].work
        return owners

    def rank_steps(
        self, epoch: int, seed: int, samples_per_step: int, start: int, rank: int, world: int
    ) -> Iterator[StepShare]:
        """This rank's share of every optimizer step of ``epoch`` from sample position ``start`` on."""
        order = self.epoch_order(epoch, seed)
        if self.split == "tokens" and world > 1:
            yield from self._token_split_steps(order, samples_per_step, start, rank, world)
            return
        owners = self.shard_owners(epoch, seed, world)
        mine = [key for key in order[start:] if owners[key[0]] == rank]
        remaining = Counter(shard for shard, _ in mine)
        reads = list(dict.fromkeys(shard for shard, _ in mine))  # first-use order
        loaded: dict[int, Samples] = {}
        with self._prefetcher(reads) as prefetcher:
            for step_start in range(start, len(order), samples_per_step):
                step_keys = order[step_start : step_start + samples_per_step]
                keys = [key for key in step_keys if owners[key[0]] == rank]
                samples = [self._take(key, loaded, remaining, prefetcher) for key in keys]
                yield self._share(len(step_keys), keys, samples)

    def _token_split_steps(
        self, order: list[SampleKey], samples_per_step: int, start: int, rank: int, world: int
    ) -> Iterator[StepShare]:
        """``"tokens"``: every rank reads every shard the rest of the order uses and deals each step's
        samples by their lengths (:func:`deal_by_tokens`), keeping its own."""
        rest = order[start:]
        remaining = Counter(shard for shard, _ in rest)
        loaded: dict[int, Samples] = {}
        with self._prefetcher(list(dict.fromkeys(shard for shard, _ in rest))) as prefetcher:
            for step_start in range(start, len(order), samples_per_step):
                step_keys = order[step_start : step_start + samples_per_step]
                step = [self._take(key, loaded, remaining, prefetcher) for key in step_keys]
                ranks = deal_by_tokens([int(sample["input_ids"].shape[0]) for sample in step], world)
                keys = [key for key, owner in zip(step_keys, ranks, strict=True) if owner == rank]
                samples = [sample for sample, owner in zip(step, ranks, strict=True) if owner == rank]
                yield self._share(len(step_keys), keys, samples)

    def _prefetcher(self, reads: list[int]) -> _ShardPrefetcher:
        names = [self.shards[s].name for s in reads]
        return _ShardPrefetcher(self.load_shard, self.submit_shard, names, self.prefetch_shards)

    def _take(
        self,
        key: SampleKey,
        loaded: dict[int, Samples],
        remaining: Counter[int],
        prefetcher: _ShardPrefetcher,
    ) -> Mapping[str, Tensor]:
        """Sample ``key``, its shard read when first needed and dropped after its last sample (the step's
        own references keep what it still needs)."""
        shard, index = key
        if shard not in loaded:
            loaded[shard] = prefetcher.next(self.shards[shard].name)
        sample = loaded[shard][index]
        remaining[shard] -= 1
        if not remaining[shard]:
            del loaded[shard]
        return sample

    def _share(
        self, step_samples: int, keys: list[SampleKey], samples: list[Mapping[str, Tensor]]
    ) -> StepShare:
        ids = [self.first_sample_id[shard] + index for shard, index in keys]
        return StepShare(step_samples=step_samples, keys=keys, samples=samples, sample_ids=ids)


def deal_by_tokens(lengths: Sequence[int], world: int) -> list[int]:
    """The rank of each of one step's samples: longest first, each to the rank with the fewest tokens so
    far (ties: the lower rank; equal lengths keep their order). Depends only on ``lengths`` and ``world``,
    so every rank computes the same split."""
    load = [0] * world
    ranks = [0] * len(lengths)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        ranks[index] = rank
        load[rank] += lengths[index]
    return ranks


class _ShardPrefetcher:
    """Hands out ``names``' samples in order with at most ``depth`` shards submitted ahead of the consumer
    (plus the one it waits on): through ``submit`` when given, else ``load`` on one background thread."""

    def __init__(
        self, load: Callable[[str], Samples], submit: ShardSubmit | None, names: Sequence[str], depth: int
    ) -> None:
        self._names = deque(names)
        self._depth = depth
        self._pool: ThreadPoolExecutor | None = None
        if submit is None:
            pool = self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-prefetch")

            def submit(name: str) -> Callable[[], Samples]:
                return pool.submit(load, name).result

        self._submit = submit
        self._pending: deque[tuple[str, Callable[[], Samples]]] = deque()

    def __enter__(self) -> _ShardPrefetcher:
        self._top_up()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pending.clear()  # (a remote reader's results are dropped with their references)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _top_up(self) -> None:
        while self._names and len(self._pending) <= self._depth:
            name = self._names.popleft()
            self._pending.append((name, self._submit(name)))

    def next(self, expected: str) -> Samples:
        if not self._pending:
            raise RuntimeError(f"shard prefetch out of order: nothing pending, expected {expected!r}")
        name, result = self._pending.popleft()
        if name != expected:
            raise RuntimeError(f"shard prefetch out of order: got {name!r}, expected {expected!r}")
        try:
            samples = result()
        except BaseException as error:
            raise RuntimeError(f"reading shard {name!r} failed: {error}") from error
        self._top_up()
        return samples
