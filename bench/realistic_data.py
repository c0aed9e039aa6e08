"""The realistic-lengths bench's data and FLOP count (bench/bench_realistic.py, bench/bench_online.py):
synthetic hidden-state shards, the first steps of one epoch order shared by every run, and the matmul
FLOPs the product computes per sample (the logits at counted positions only, kernels/counted.py)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from draftloop.kernels.data import ShardedSamples, ShardRef, StepShare
from draftloop.kernels.drafter import DrafterConfig
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.objective import sample_ttt_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import target_config

SAMPLES_PER_SHARD = 16
MEDIAN_TOKENS, SIGMA, MIN_TOKENS = 600, 0.8, 16


class SyntheticHiddenStates:
    """Deterministic samples per shard: lognormal lengths (or all ``fixed_length`` long), random ids,
    hidden states viewed from one shared random buffer at a random offset (so any number of samples
    costs no memory); the first ``prompt_fraction`` of each sample is out of the loss."""

    def __init__(
        self,
        s: dict[str, int],
        cap: int,
        seed: int = 0,
        prompt_fraction: float = 0.0,
        fixed_length: int | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.s, self.cap, self.seed = s, cap, seed
        self.prompt_fraction, self.fixed_length = prompt_fraction, fixed_length
        self.aux = torch.randn(2 * cap, 3 * s["H"], generator=gen).to(torch.bfloat16)
        self.last = torch.randn(2 * cap, s["H"], generator=gen).to(torch.bfloat16)

    def lengths(self, shard: int) -> list[int]:
        if self.fixed_length is not None:
            return [self.fixed_length] * SAMPLES_PER_SHARD
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + shard)
        raw = torch.exp(math.log(MEDIAN_TOKENS) + SIGMA * torch.randn(SAMPLES_PER_SHARD, generator=gen))
        return [int(x) for x in raw.round().clamp(MIN_TOKENS, self.cap)]

    def load_shard(self, name: str) -> list[dict[str, torch.Tensor]]:
        shard = int(name.rsplit("-", 1)[1])
        gen = torch.Generator().manual_seed(self.seed * 7_000_003 + shard)
        samples = []
        for length in self.lengths(shard):
            offset = int(torch.randint(0, self.cap, (1,), generator=gen))
            loss_mask = torch.ones(length, dtype=torch.uint8)
            loss_mask[: int(self.prompt_fraction * length)] = 0
            samples.append(
                {
                    "input_ids": torch.randint(0, self.s["V"], (length,), generator=gen),
                    "loss_mask": loss_mask,
                    "aux_hidden": self.aux[offset : offset + length],
                    "last_hidden": self.last[offset : offset + length],
                }
            )
        return samples

    def dataset(self, num_shards: int) -> ShardedSamples:
        refs = [ShardRef(f"shard-{i}", SAMPLES_PER_SHARD, sum(self.lengths(i))) for i in range(num_shards)]
        return ShardedSamples(refs, self.load_shard, window_shards=8, prefetch_shards=2)


class FirstSteps:
    """The first ``steps`` optimizer steps of ``data``'s epoch 0 as a `TrainingData` of their own: every
    run (draftloop's, the peer's, any length) draws from one dataset, so the same step trains the same
    samples in every run. Sample ids are renumbered 0..n-1 by their position in the epoch (the loop
    counts trained samples by id, up to its data's num_samples)."""

    def __init__(self, data: ShardedSamples, steps: int, samples_per_step: int) -> None:
        self.data, self.steps, self.samples_per_step = data, steps, samples_per_step
        order = data.epoch_order(0, 0)[: steps * samples_per_step]
        if len(order) < steps * samples_per_step:
            raise ValueError(f"{steps} steps of {samples_per_step} samples need more than {len(order)}")
        self.position = {data.first_sample_id[shard] + index: i for i, (shard, index) in enumerate(order)}

    @property
    def num_samples(self) -> int:
        return self.steps * self.samples_per_step

    def rank_steps(
        self, epoch: int, seed: int, samples_per_step: int, start: int, rank: int, world: int
    ) -> Iterator[StepShare]:
        if (epoch, seed, samples_per_step) != (0, 0, self.samples_per_step):
            raise ValueError("FirstSteps serves epoch 0, seed 0 at its own samples per step")
        shares = self.data.rank_steps(0, 0, samples_per_step, start, rank, world)
        try:
            for _ in range(start // samples_per_step, self.steps):
                share = next(shares)
                ids = [self.position[i] for i in share.sample_ids]
                yield StepShare(share.step_samples, share.keys, share.samples, ids)
        finally:
            shares.close()  # (its shard prefetcher stops)


def drafter_config(s: dict[str, int], variant: str = "eagle3") -> DrafterConfig:
    """The bench's drafter for shapes ``s``: ``variant`` as kernels/variants/ names it (EAGLE 3.1 with its
    published defaults)."""
    return DrafterConfig.for_target(
        target_config(s), LayerIds.default_for_depth(s["L"]), draft_vocab_size=s["VD"], variant=variant
    )


def sample_flops(cfg: DrafterConfig, length: int, counted: list[int], train_lm_head: bool) -> float:
    """Matmul FLOPs of one sample's TTT training step as the product computes it (fwd 2, fwd+bwd 6 per
    weight): the decoder layer at every position of every step, fc at every position, the drafter's
    logits (fwd + dX, + dW when the head trains) at each step's ``counted`` positions only, the target's
    logits once at step 0's counted positions (the target table, no gradient), and the attention
    scores and values (causal within the sample, plus the TTT chain diagonal)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    ttt = len(counted)
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size  # q/k/v take 2h inputs
    head = (6 if train_lm_head else 4) * h * cfg.draft_vocab_size  # a frozen head still needs dX, not dW
    fc = 4 * cfg.num_aux_layers * cfg.target_hidden_size * h  # fwd + dW (its input needs no gradient)
    target_head = 2 * cfg.target_hidden_size * cfg.draft_vocab_size
    scores = sum(3 * 2 * 2 * q * (length * (length + 1) / 2 + length * j) for j in range(ttt))
    return float(length * (ttt * 6 * layer + fc) + head * sum(counted) + target_head * counted[0] + scores)


def step_flops(
    cfg: DrafterConfig, data: FirstSteps, ttt: int, train_lm_head: bool
) -> tuple[list[float], list[int]]:
    """(FLOPs, real tokens) of each of ``data``'s optimizer steps over all ranks (from a one-rank pass:
    synthetic shards cost nothing to read)."""
    flops, tokens = [], []
    for share in data.rank_steps(0, 0, data.samples_per_step, 0, 0, 1):
        lengths = [int(x["input_ids"].shape[0]) for x in share.samples]
        counted = [sample_ttt_tokens(x, ttt, None) for x in share.samples]
        flops.append(
            sum(sample_flops(cfg, n, c, train_lm_head) for n, c in zip(lengths, counted, strict=True))
        )
        tokens.append(sum(lengths))
    return flops, tokens


def useful_flops_per_token(
    cfg: DrafterConfig, data: SyntheticHiddenStates, shards: int, ttt: int, train_lm_head: bool
) -> float:
    """`sample_flops` per real token over the samples of ``data``'s first ``shards`` shards."""
    total, tokens = 0.0, 0
    for shard in range(shards):
        for n in data.lengths(shard):
            mask = torch.ones(n, dtype=torch.uint8)
            mask[: int(data.prompt_fraction * n)] = 0
            counted = sample_ttt_tokens({"input_ids": mask, "loss_mask": mask}, ttt, None)
            total += sample_flops(cfg, n, counted, train_lm_head)
            tokens += n
    return total / max(1, tokens)
