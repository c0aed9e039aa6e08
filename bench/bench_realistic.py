"""Training on realistic lengths: the product's streamed, packed ``train_drafter`` on synthetic hidden states.

Sample lengths are lognormal (median 600 tokens, sigma 0.8, 16..4096 tokens); the hidden states are
random bf16 (views into one shared buffer, so memory stays small) served through ``ShardedSamples``
with a synthetic shard reader (16 samples a shard, the product's prefetch thread, shuffle windows and
rank split), packed first-fit decreasing into rows of 4,096 tokens, TTT 7, torch.compile on CUDA.
Tokens/s count real (sample) tokens only. ``--prompt-fraction`` masks the first part of every sample out
of the loss (a chat's prompt: the loss then counts, and the FLOPs are counted at, the assistant part only).

Every run, draftloop's and the peer's, trains the first steps of one and the same epoch order (the
dataset's shard count is fixed by the longest run, `FirstSteps` cuts each run), so rows are identical
across runs; the ratio compares both on the same steps (``ratio_window``). MFU counts the matmul FLOPs
the product computes on the timed steps' samples (`sample_flops`: the logits and the target's table at
counted positions only, kernels/counted.py). ``recompiles_after_first_step``: graphs torch.compile built
after the first optimizer step of a run (torch._dynamo's ``unique_graphs`` counter).
``--long-rows 4096,8192,...``: a few steps with samples of exactly that many tokens (one per row), tok/s
and peak memory per length, stopping at the first out-of-memory.

Under ``torchrun`` every rank first trains its share (NCCL), then rank 0 alone repeats the runs on
its GPU (one compilation serves both; losses kept for the 1- vs 2-GPU curves); without it, only the
one-GPU runs. ``--peer`` then times the speculators library's trainer in the same process on the same
steps' samples, packed into the same rows (its own FlexAttention document mask over document ids).
bench/RESULTS.md has the exact commands.

``--tiny`` uses toy shapes (a CPU smoke test of this script: ``--tiny --long-rows 64,128`` too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from draftloop.kernels.data import ShardedSamples
from draftloop.kernels.drafter import Eagle3Drafter
from draftloop.kernels.packing import collate_rows, pack_first_fit_decreasing
from draftloop.kernels.train import TrainConfig, train_drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import matmul_peak, peer_model, shapes
from realistic_data import (
    MEDIAN_TOKENS,
    SAMPLES_PER_SHARD,
    FirstSteps,
    SyntheticHiddenStates,
    drafter_config,
    step_flops,
)
from realistic_data import useful_flops_per_token as useful_flops_per_token  # (bench_online's)

WARM_STEPS = 5  # steps left out of the timing: compilation and the first allocations


def log(message: str) -> None:
    print(message, flush=True)


def other_gpu_processes() -> int | None:
    """Compute processes on this GPU besides this one (nvidia-smi; None where it cannot tell). The bf16
    peak is measured in-process: a GPU shared with other processes deflates it and inflates the MFU
    (1.42 on 2026-12-04, three processes on one H200), so a shared GPU's MFU is not a figure."""
    import subprocess

    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return len([pid for pid in listed if pid.strip() != str(os.getpid())])


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (each recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def spread(values: list[float]) -> dict[str, float]:
    median = statistics.median(values)
    return {
        "median": round(median, 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
        "spread_pct": round(100 * (max(values) - min(values)) / median, 2),
    }


def rate(tokens: list[int], times: list[float], begin: int, end: int) -> float:
    """Real tokens per second of steps begin..end-1 (0-based; ``times[i]``: when step i finished)."""
    return sum(tokens[begin:end]) / (times[end - 1] - times[begin - 1])


def draftloop_run(
    s: dict[str, int],
    data: FirstSteps,
    args: argparse.Namespace,
    dev: str,
    rank: int,
    world: int,
    flops: list[float],
    warm_steps: int = WARM_STEPS,
) -> dict[str, Any]:
    """One training run of ``data``'s steps; tok/s over the steps after ``warm_steps``, MFU on ``flops``
    (each step's FLOPs over all ranks) over the same steps, and tok/s over ``args.ratio_window`` steps
    (the ones the peer is timed on)."""
    torch.manual_seed(0)  # identical initial weights on every rank
    drafter = Eagle3Drafter(drafter_config(s, args.drafter))
    drafter.attach_embeddings(torch.randn(s["V"], s["H"]) * 0.02)
    head = torch.randn(s["VD"], s["H"]) * 0.02
    cfg = TrainConfig(
        ttt_length=args.ttt,
        epochs=1,  # (TrainConfig's default is the config's now: 8)
        batch_size=data.samples_per_step,
        lr=1e-4,
        compile=args.compile,
        pack_tokens=args.pack_tokens,
        rows_per_micro_batch=args.rows_per_micro_batch,
        show_progress=False,
        train_lm_head=args.train_lm_head,
        compile_cache_dir=args.compile_cache_dir,
    )
    times: list[float] = []
    records: list[dict[str, Any]] = []
    graphs = [compiled_graphs()]  # before the run, after its first step

    def on_step(_step: int, record: dict[str, Any]) -> None:
        times.append(time.perf_counter())  # the record's values were read back: the step has finished
        records.append(record)
        if _step == 1:
            graphs.append(compiled_graphs())
        if rank == 0 and (_step in (1, warm_steps) or _step % 10 == 0):
            log(f"  world {world} step {_step}: {times[-1] - start:.1f} s, loss {record['loss']:.4f}")

    start = time.perf_counter()
    result = train_drafter(drafter, data, head, cfg, dev, rank=rank, world=world, on_step=on_step)
    steps = len(records)
    warm = min(warm_steps, steps - 1)
    tokens = [r["real_tokens"] for r in records]
    window = min(args.ratio_window or steps, steps)
    since = times[warm - 1] if warm else start  # the timed steps start when the warm ones finished
    out = {
        "tok_per_s": sum(tokens[warm:]) / (times[-1] - since),
        "ratio_window_tok_per_s": rate(tokens, times, warm, window) if 0 < warm < window else None,
        "mfu": sum(flops[warm:steps]) / (times[-1] - since) / args.peak / world,
        "timed_steps": steps - warm,
        "first_steps_s": round(times[warm - 1] - start, 1) if warm else 0.0,
        "time_to_first_step_s": round(times[0] - start, 1),  # compilation (or the cache's load) included
        "compiled_graphs_first_step": graphs[1] - graphs[0],
        "recompiles_after_first_step": compiled_graphs() - graphs[1],
        "packing_efficiency": result.final_metrics["packing_efficiency"],
        "loss": [r["loss"] for r in records],
        "real_tokens": tokens,
    }
    del drafter, result
    gc.collect()
    if dev == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def peer_run(s: dict[str, int], data: FirstSteps, args: argparse.Namespace, dev: str) -> dict[str, Any]:
    """The speculators trainer's step (its compiled model, eager kl_div loss) on the same rows as
    draftloop's: ``data``'s steps, packed first-fit decreasing into rows of ``args.pack_tokens``."""
    from speculators.losses.utils import resolve_loss_config

    torch.manual_seed(0)
    model = peer_model(s).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    loss_cfg = resolve_loss_config("kl_div", "eager")  # its fused loss breaks on torch 2.11
    hidden_dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # no CPU autocast here
    times: list[float] = []
    reals: list[int] = []
    start = time.perf_counter()
    for share in data.rank_steps(0, 0, data.samples_per_step, 0, 0, 1):
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
    window = min(args.ratio_window, len(times))
    out = {
        "tok_per_s": rate(reals, times, warm, len(times)),
        "ratio_window_tok_per_s": rate(reals, times, warm, window) if 0 < warm < window else None,
        "timed_steps": len(times) - warm,
        "first_steps_s": round(times[warm - 1] - start, 1),
        "real_tokens": reals,
    }
    del model, opt
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def timed_runs(
    s: dict[str, int], base: ShardedSamples, args: argparse.Namespace, dev: str, rank: int, world: int
) -> dict[str, Any]:
    """``args.runs`` runs: the first of ``args.steps`` steps (its loss curve is compared), the others of
    ``args.repeat_steps`` steps (the spread of tokens/s); all from ``base``'s first steps."""
    runs = []
    for index in range(args.runs):
        data = FirstSteps(base, args.steps if index == 0 else args.repeat_steps, args.samples_per_step)
        run = draftloop_run(s, data, args, dev, rank, world, args.step_flops)
        log(f"draftloop run {index} world {world}: {run['tok_per_s']:.0f} tok/s mfu {run['mfu']:.3f}")
        runs.append(run)
    window = [r["ratio_window_tok_per_s"] for r in runs if r["ratio_window_tok_per_s"] is not None]
    return {
        "runs": runs,
        "tok_per_s": spread([r["tok_per_s"] for r in runs]),
        "ratio_window_tok_per_s": spread(window) if window else None,
        "packing_efficiency": runs[0]["packing_efficiency"],
        "mfu": round(statistics.median(r["mfu"] for r in runs), 3),
        "mfu_runs": [round(r["mfu"], 3) for r in runs],
        "mfu_within_bound": all(r["mfu"] <= 1 for r in runs),  # (> 1: the FLOP count or the peak is wrong)
        "time_to_first_step_s": [r["time_to_first_step_s"] for r in runs],
        "recompiles_after_first_step": [r["recompiles_after_first_step"] for r in runs],
    }


def long_row_table(
    s: dict[str, int], args: argparse.Namespace, dev: str, write: Any, table: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per row length: ``args.long_row_steps`` steps of ``args.long_row_samples`` samples of exactly that
    many tokens (one sample per row), tok/s over the steps after the first two (compilation, first
    allocations) and the peak memory; stops at the first length that runs out of memory. Each length's
    entry is appended to `table` (the result's own list) before `write()`, so a call cut short keeps them."""
    cfg = drafter_config(s, args.drafter)
    for length in args.long_rows:
        data = SyntheticHiddenStates(s, length, prompt_fraction=args.prompt_fraction, fixed_length=length)
        per_step = args.long_row_samples
        base = data.dataset(-(-args.long_row_steps * per_step // SAMPLES_PER_SHARD))
        steps = FirstSteps(base, args.long_row_steps, per_step)
        flops, _ = step_flops(cfg, steps, args.ttt, args.train_lm_head)
        row_args = argparse.Namespace(**{**vars(args), "pack_tokens": length})
        entry: dict[str, Any] = {"row_tokens": length, "samples_per_step": per_step}
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            run = draftloop_run(s, steps, row_args, dev, 0, 1, flops, warm_steps=2)
            entry |= {k: run[k] for k in ("tok_per_s", "mfu", "time_to_first_step_s", "timed_steps")}
            entry |= {"peak_gib": run.get("peak_gib"), "recompiles": run["recompiles_after_first_step"]}
            entry["mfu_within_bound"] = run["mfu"] <= 1  # (> 1: the FLOP count or the peak is wrong)
        except torch.cuda.OutOfMemoryError as error:
            entry |= {"oom": True, "error": str(error).splitlines()[0][:300]}
        log(f"long rows {length}: {entry}")
        table.append(entry)
        write()
        if entry.get("oom"):
            del data, base, steps
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
            break
    return table


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 16:
        raise argparse.ArgumentTypeError(f"--long-rows wants comma-separated lengths >= 16, got {text!r}")
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="the bf16 matmul peak MFU is counted on (default: measured here, at the start)",
    )
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
    parser.add_argument("--peer-steps", type=int, default=20)
    parser.add_argument(
        "--ratio-window",
        type=int,
        default=None,
        help="steps both trainers are compared on (after the warm ones; default: the shortest run's)",
    )
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.compile the loss (--no-compile: eager, e.g. to compare variants without a compile each)",
    )
    parser.add_argument("--drafter", default="eagle3", help="the drafter variant (eagle3, eagle3.1)")
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--rows-per-micro-batch", type=int, default=TrainConfig.rows_per_micro_batch)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument(
        "--prompt-fraction",
        type=float,
        default=0.0,
        help="share of each sample (its start) out of the loss, as a chat's prompt (default 0: all counted)",
    )
    parser.add_argument("--peer-only", action="store_true", help="only the speculators runs")
    parser.add_argument("--world-only", action="store_true", help="torchrun: only the N-GPU runs")
    parser.add_argument(
        "--long-rows",
        type=parse_lengths,
        default=None,
        help="only the long-row table: e.g. 4096,8192,16384,32768 (one sample per row of each length)",
    )
    parser.add_argument("--long-row-steps", type=int, default=5, help="steps per length (2 warm)")
    parser.add_argument("--long-row-samples", type=int, default=2, help="samples (rows) per step")
    parser.add_argument(
        "--train-lm-head",
        action=argparse.BooleanOptionalAction,
        default=TrainConfig.train_lm_head,
        help="draftloop trains its lm_head (default: the loop's; the runs recorded so far had it on)",
    )
    args = parser.parse_args()
    if not 0 <= args.prompt_fraction < 1:
        parser.error(f"--prompt-fraction must be in [0, 1), got {args.prompt_fraction}")
    if args.long_rows is not None and args.long_row_steps < 3:
        parser.error(f"--long-row-steps must be at least 3 (2 warm, 1 timed), got {args.long_row_steps}")

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
    sharing = other_gpu_processes() if dev == "cuda" else 0
    args.peak = args.peak_flops or matmul_peak(dev)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": s,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "peak", "peak_flops")}
        | {"cap": cap, "median": MEDIAN_TOKENS},
        "bf16_matmul_peak_flops": args.peak,
        "peak_measured": args.peak_flops is None,
        # > 0: other processes shared the GPU while its peak was measured (and while this one trained):
        # then neither MFU nor tok/s is a figure of this trainer alone.
        "other_gpu_processes": sharing,
    }

    def write() -> None:
        if rank == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))

    if args.long_rows is not None:
        if world > 1:
            parser.error("--long-rows runs on one GPU (no torchrun)")
        result["long_rows"] = []
        long_row_table(s, args, dev, write, result["long_rows"])
        write()
        log(json.dumps(result["long_rows"]))
        return

    # One dataset for every run (its shard count fixes the epoch order): each run trains its first steps.
    longest = max(args.steps, args.repeat_steps if args.runs > 1 else 0, args.peer_steps if args.peer else 0)
    base = SyntheticHiddenStates(s, cap, prompt_fraction=args.prompt_fraction).dataset(
        -(-longest * args.samples_per_step // SAMPLES_PER_SHARD)
    )
    shortest = min(
        [args.steps]
        + ([args.repeat_steps] if args.runs > 1 else [])
        + ([args.peer_steps] if args.peer else [])
    )
    args.ratio_window = min(args.ratio_window or shortest, shortest)
    cfg = drafter_config(s, args.drafter)
    args.step_flops, step_tokens = step_flops(
        cfg, FirstSteps(base, longest, args.samples_per_step), args.ttt, args.train_lm_head
    )
    result["useful_flops_per_real_token"] = sum(args.step_flops) / sum(step_tokens)
    result["ratio_window_steps"] = [min(WARM_STEPS, args.ratio_window - 1), args.ratio_window]
    if world > 1:  # all ranks, then rank 0 alone on its GPU: one compilation serves both
        result[f"world{world}"] = timed_runs(s, base, args, dev, rank, world)
        write()
        dist.destroy_process_group()
        if rank != 0 or args.world_only:
            return
    if not args.peer_only:
        result["world1"] = timed_runs(s, base, args, dev, 0, 1)
        write()
    if args.peer:
        try:
            data = FirstSteps(base, args.peer_steps, args.samples_per_step)
            peer = [peer_run(s, data, args, dev) for _ in range(args.runs)]
            for run in peer:
                log(f"speculators run: {run['tok_per_s']:.0f} tok/s")
            result["speculators"] = {"runs": peer, "tok_per_s": spread([r["tok_per_s"] for r in peer])}
            windows = [r["ratio_window_tok_per_s"] for r in peer if r["ratio_window_tok_per_s"] is not None]
            if windows:
                result["speculators"]["ratio_window_tok_per_s"] = spread(windows)
            mine = result.get("world1", {}).get("ratio_window_tok_per_s")
            if mine and windows:  # the same steps, so the same rows, on both sides
                result["training_ratio"] = round(
                    mine["median"] / result["speculators"]["ratio_window_tok_per_s"]["median"], 3
                )
        except Exception as error:  # report and keep draftloop's figures
            result["speculators_error"] = repr(error)[:600]
    write()
    log(json.dumps({k: v for k, v in result.items() if k != "shapes"})[:3000])


if __name__ == "__main__":
    main()
