"""Training on realistic lengths: the product's streamed, packed ``train_drafter`` on synthetic hidden states.

Sample lengths are lognormal (median 600 tokens, sigma 0.8, 16..4096 tokens); the hidden states are
random bf16 (views into one shared buffer, so memory stays small) served through ``ShardedSamples``
with a synthetic shard reader (16 samples a shard, the product's prefetch thread, shuffle windows and
rank split), packed first-fit decreasing into rows of 4,096 tokens, TTT 7, torch.compile on CUDA.
Tokens/s count real (sample) tokens only.

Under ``torchrun`` every rank first trains its share (NCCL), then rank 0 alone repeats the runs on
its GPU (one compilation serves both; losses kept for the 1- vs 2-GPU curves); without it, only the
one-GPU runs. ``--peer`` then times the speculators library's trainer in the same process on the same
steps' samples, packed into the same rows (its own FlexAttention document mask over document ids).
bench/RESULTS.md has the exact commands.

``--tiny`` uses toy shapes (a CPU smoke test of this script).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from draftloop.kernels.data import ShardedSamples, ShardRef
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.packing import collate_rows, pack_first_fit_decreasing
from draftloop.kernels.train import TrainConfig, train_drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import matmul_peak, peer_model, shapes, target_config

SAMPLES_PER_SHARD = 16
MEDIAN_TOKENS, SIGMA, MIN_TOKENS = 600, 0.8, 16
WARM_STEPS = 5  # steps left out of the timing: compilation and the first allocations


def log(message: str) -> None:
    print(message, flush=True)


class SyntheticHiddenStates:
    """Deterministic samples per shard: lognormal lengths, random ids, hidden states viewed from one
    shared random buffer at a random offset (so any number of samples costs no memory)."""

    def __init__(self, s: dict[str, int], cap: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.s, self.cap, self.seed = s, cap, seed
        self.aux = torch.randn(2 * cap, 3 * s["H"], generator=gen).to(torch.bfloat16)
        self.last = torch.randn(2 * cap, s["H"], generator=gen).to(torch.bfloat16)

    def lengths(self, shard: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + shard)
        raw = torch.exp(math.log(MEDIAN_TOKENS) + SIGMA * torch.randn(SAMPLES_PER_SHARD, generator=gen))
        return [int(x) for x in raw.round().clamp(MIN_TOKENS, self.cap)]

    def load_shard(self, name: str) -> list[dict[str, torch.Tensor]]:
        shard = int(name.rsplit("-", 1)[1])
        gen = torch.Generator().manual_seed(self.seed * 7_000_003 + shard)
        samples = []
        for length in self.lengths(shard):
            offset = int(torch.randint(0, self.cap, (1,), generator=gen))
            samples.append(
                {
                    "input_ids": torch.randint(0, self.s["V"], (length,), generator=gen),
                    "loss_mask": torch.ones(length, dtype=torch.uint8),
                    "aux_hidden": self.aux[offset : offset + length],
                    "last_hidden": self.last[offset : offset + length],
                }
            )
        return samples

    def dataset(self, num_shards: int) -> ShardedSamples:
        refs = [ShardRef(f"shard-{i}", SAMPLES_PER_SHARD, sum(self.lengths(i))) for i in range(num_shards)]
        return ShardedSamples(refs, self.load_shard, window_shards=8, prefetch_shards=2)


def drafter_config(s: dict[str, int]) -> DrafterConfig:
    return DrafterConfig.for_target(
        target_config(s), LayerIds.default_for_depth(s["L"]), draft_vocab_size=s["VD"]
    )


def token_flops(cfg: DrafterConfig, ttt: int, train_lm_head: bool) -> float:
    """Matmul FLOPs per token of one TTT training step, attention scores excluded (fwd 2, fwd+bwd 6)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size  # q/k/v take 2h inputs
    head = h * cfg.draft_vocab_size
    per_step = 6 * layer + (6 if train_lm_head else 4) * head  # a frozen head still needs dX, not dW
    fc = 4 * cfg.num_aux_layers * cfg.target_hidden_size * h  # fwd + dW (its input needs no gradient)
    target_head = 2 * cfg.target_hidden_size * cfg.draft_vocab_size  # no gradient
    return float(ttt * per_step + fc + target_head)


def attention_flops(cfg: DrafterConfig, length: int, ttt: int) -> float:
    """Score and value FLOPs of one sample (causal within the sample, plus the TTT chain diagonal)."""
    q = cfg.num_attention_heads * cfg.head_dim
    return float(sum(3 * 2 * 2 * q * (length * (length + 1) / 2 + length * j) for j in range(ttt)))


def useful_flops_per_token(
    cfg: DrafterConfig, data: SyntheticHiddenStates, shards: int, ttt: int, train_lm_head: bool
) -> float:
    lengths = [n for i in range(shards) for n in data.lengths(i)]
    total = sum(token_flops(cfg, ttt, train_lm_head) * n + attention_flops(cfg, n, ttt) for n in lengths)
    return total / sum(lengths)


def spread(values: list[float]) -> dict[str, float]:
    median = statistics.median(values)
    return {
        "median": round(median, 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
        "spread_pct": round(100 * (max(values) - min(values)) / median, 2),
    }


def draftloop_run(
    s: dict[str, int], data: SyntheticHiddenStates, args: argparse.Namespace, dev: str, rank: int, world: int
) -> dict[str, Any]:
    torch.manual_seed(0)  # identical initial weights on every rank
    drafter = Eagle3Drafter(drafter_config(s))
    drafter.attach_embeddings(torch.randn(s["V"], s["H"]) * 0.02)
    head = torch.randn(s["VD"], s["H"]) * 0.02
    cfg = TrainConfig(
        ttt_length=args.ttt,
        epochs=1,  # (TrainConfig's default is the config's now: 8)
        batch_size=args.samples_per_step,
        lr=1e-4,
        compile=True,
        pack_tokens=args.pack_tokens,
        show_progress=False,
        train_lm_head=args.train_lm_head,
        compile_cache_dir=args.compile_cache_dir,
    )
    times: list[float] = []
    records: list[dict[str, Any]] = []

    def on_step(_step: int, record: dict[str, Any]) -> None:
        times.append(time.perf_counter())  # the record's values were read back: the step has finished
        records.append(record)
        if rank == 0 and (_step in (1, WARM_STEPS) or _step % 10 == 0):
            log(f"  world {world} step {_step}: {times[-1] - start:.1f} s, loss {record['loss']:.4f}")

    shards = args.steps * args.samples_per_step // SAMPLES_PER_SHARD
    start = time.perf_counter()
    result = train_drafter(
        drafter, data.dataset(shards), head, cfg, dev, rank=rank, world=world, on_step=on_step
    )
    warm = min(WARM_STEPS, len(records) - 1)
    timed = records[warm:]
    elapsed = times[-1] - times[warm - 1] if warm else times[-1] - start
    real = sum(r["real_tokens"] for r in timed)
    out = {
        "tok_per_s": real / elapsed,
        "timed_steps": len(timed),
        "first_steps_s": round(times[warm - 1] - start, 1) if warm else 0.0,
        "time_to_first_step_s": round(times[0] - start, 1),  # compilation included
        "packing_efficiency": result.final_metrics["packing_efficiency"],
        "loss": [r["loss"] for r in records],
        "real_tokens": [r["real_tokens"] for r in records],
    }
    del drafter, result
    gc.collect()
    if dev == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def peer_run(
    s: dict[str, int], data: SyntheticHiddenStates, args: argparse.Namespace, dev: str
) -> dict[str, Any]:
    """The speculators trainer's step (its compiled model, eager kl_div loss) on the same rows."""
    from speculators.losses.utils import resolve_loss_config

    torch.manual_seed(0)
    model = peer_model(s).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss_cfg = resolve_loss_config("kl_div", "eager")  # its fused loss breaks on torch 2.11
    shards = args.peer_steps * args.samples_per_step // SAMPLES_PER_SHARD
    dataset = data.dataset(shards)
    hidden_dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # no CPU autocast here
    times: list[float] = []
    reals: list[int] = []
    start = time.perf_counter()
    for share in dataset.rank_steps(0, 0, args.samples_per_step, 0, 0, 1):
        lengths = [int(x["input_ids"].shape[0]) for x in share.samples]
        real = 0
        for row in pack_first_fit_decreasing(lengths, args.pack_tokens):
            batch = collate_rows([[share.samples[i] for i in row]], dev, None, None, args.pack_tokens)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                _, loss, _ = model(
                    hidden_states=batch["aux_hidden"].to(hidden_dtype),
                    input_ids=batch["input_ids"],
                    document_ids=batch["segment_ids"],
                    loss_mask=batch["loss_mask"],
                    position_ids=batch["position_ids"],
                    verifier_last_hidden_states=batch["last_hidden"].to(hidden_dtype),
                    ttt_steps=args.ttt,
                    ttt_step_loss_decay=0.8,
                    loss_config=loss_cfg,
                )
            loss.backward()
            real += int(batch["lengths"].sum())
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # wait for the step, as draftloop's step record does
        times.append(time.perf_counter())
        reals.append(real)
    warm = min(WARM_STEPS, len(times) - 1)
    out = {
        "tok_per_s": sum(reals[warm:]) / (times[-1] - times[warm - 1]),
        "timed_steps": len(times) - warm,
        "first_steps_s": round(times[warm - 1] - start, 1),
    }
    del model, opt
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def timed_runs(
    s: dict[str, int],
    data: SyntheticHiddenStates,
    args: argparse.Namespace,
    dev: str,
    rank: int,
    world: int,
    flops_per_token: float,
    peak: float,
) -> dict[str, Any]:
    """``args.runs`` runs: the first of ``args.steps`` steps (its loss curve is compared), the others of
    ``args.repeat_steps`` steps (the spread of tokens/s)."""
    runs = []
    for index in range(args.runs):
        steps = args.steps if index == 0 else args.repeat_steps
        run = draftloop_run(s, data, argparse.Namespace(**{**vars(args), "steps": steps}), dev, rank, world)
        run["mfu"] = run["tok_per_s"] * flops_per_token / peak / world
        log(f"draftloop run {index} world {world}: {run['tok_per_s']:.0f} tok/s mfu {run['mfu']:.3f}")
        runs.append(run)
    return {
        "runs": runs,
        "tok_per_s": spread([r["tok_per_s"] for r in runs]),
        "packing_efficiency": runs[0]["packing_efficiency"],
        "mfu": round(statistics.median(r["mfu"] for r in runs), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--compile-cache-dir",
        default=None,
        help="keep the compiled loss here between processes (the product's)",
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes (after every part)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeat-steps", type=int, default=20)
    parser.add_argument("--peer", action="store_true", help="then the speculators trainer, same samples")
    parser.add_argument("--peer-steps", type=int, default=15)
    parser.add_argument("--peer-start-before-s", type=float, default=1e9, help="skip the peer after this")
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--peer-only", action="store_true", help="only the speculators runs")
    parser.add_argument("--world-only", action="store_true", help="torchrun: only the N-GPU runs")
    parser.add_argument(
        "--train-lm-head",
        action=argparse.BooleanOptionalAction,
        default=TrainConfig.train_lm_head,
        help="draftloop trains its lm_head (default: the loop's; the runs recorded so far had it on)",
    )
    args = parser.parse_args()
    began = time.monotonic()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    s = shapes(args.tiny)
    cap = 256 if args.tiny else 4096
    if args.tiny:
        args.pack_tokens = min(args.pack_tokens, cap)
    data = SyntheticHiddenStates(s, cap)
    shards = args.steps * args.samples_per_step // SAMPLES_PER_SHARD
    peak = matmul_peak(dev)
    flops_per_token = useful_flops_per_token(drafter_config(s), data, shards, args.ttt, args.train_lm_head)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": s,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}
        | {"cap": cap, "median": MEDIAN_TOKENS},
        "bf16_matmul_peak_flops": peak,
        "useful_flops_per_real_token": flops_per_token,
    }

    def write() -> None:
        if rank == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))

    if world > 1:  # all ranks, then rank 0 alone on its GPU: one compilation serves both
        result[f"world{world}"] = timed_runs(s, data, args, dev, rank, world, flops_per_token, peak)
        write()
        dist.destroy_process_group()
        if rank != 0 or args.world_only:
            return
    if not args.peer_only:
        result["world1"] = timed_runs(s, data, args, dev, 0, 1, flops_per_token, peak)
        write()
    if args.peer and time.monotonic() - began < args.peer_start_before_s:
        try:
            peer = [peer_run(s, data, args, dev) for _ in range(args.runs)]
            for run in peer:
                log(f"speculators run: {run['tok_per_s']:.0f} tok/s")
            result["speculators"] = {"runs": peer, "tok_per_s": spread([r["tok_per_s"] for r in peer])}
            if "world1" in result:
                result["training_ratio"] = round(
                    result["world1"]["tok_per_s"]["median"] / result["speculators"]["tok_per_s"]["median"], 3
                )
        except Exception as error:  # report and keep draftloop's figures
            result["speculators_error"] = repr(error)[:600]
    elif args.peer:
        result["speculators_skipped"] = f"not started: {time.monotonic() - began:.0f} s had passed"
    write()
    log(json.dumps({k: v for k, v in result.items() if k != "shapes"})[:3000])


if __name__ == "__main__":
    main()
