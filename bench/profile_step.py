"""Where a training step's GPU time goes: the product's ``train_drafter`` on bench_realistic's rows, a few
steps under torch.profiler, its CUDA kernels summed by kind (matmuls, attention, inductor's fused kernels,
eager elementwise ops, the optimizer, copies), their share of the steps' wall time, and the idle time.

MFU below its goal is either kernels that are not matmuls (attention, fusions, the loss) or a GPU that
waits (launches, host syncs); this tells which, per kind and per kernel. Also prints torch.compile's
time per phase (``torch._dynamo.utils.compile_times``) for the run's first step.

    python3 bench/profile_step.py --steps 10 --profile-steps 3 [--out prof.json] [--trace trace.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from draftloop.kernels.drafter import Eagle3Drafter
from draftloop.kernels.train import TrainConfig, train_drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import shapes
from realistic_data import SAMPLES_PER_SHARD, FirstSteps, SyntheticHiddenStates, drafter_config

# A kernel's kind from its name (first match wins): the order puts the specific names first.
KINDS = (
    ("attention", ("flex", "attention", "fmha", "flash")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "mm_", "_mm", "splitk")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("copy", ("memcpy", "memset", "copy_", "cat")),
    ("inductor fused", ("triton_",)),
    ("eager elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "index", "scatter", "gather")),
)


# Inductor's fused casts of fp32 weights to bf16 (a weight cast per region call, unless cast once per batch).
WEIGHT_CAST = re.compile(r"^triton_poi_fused__to_copy(_t)?_\d+$")


def kind_of(name: str) -> str:
    if WEIGHT_CAST.match(name):
        return "weight cast"
    lowered = name.lower()
    for kind, marks in KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The union of ``intervals`` (µs): time the GPU ran at least one kernel."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3, help="the last steps, profiled")
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--compile-cache-dir", default=None)
    parser.add_argument("--top", type=int, default=25, help="kernels listed by time")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trace", type=Path, default=None, help="a Chrome trace of the profiled steps")
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = shapes(args.tiny)
    cap = 256 if args.tiny else 4096
    base = SyntheticHiddenStates(s, cap).dataset(-(-args.steps * args.samples_per_step // SAMPLES_PER_SHARD))
    data = FirstSteps(base, args.steps, args.samples_per_step)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(drafter_config(s))
    drafter.attach_embeddings(torch.randn(s["V"], s["H"]) * 0.02)
    head = torch.randn(s["VD"], s["H"]) * 0.02
    cfg = TrainConfig(
        epochs=1,
        batch_size=args.samples_per_step,
        lr=1e-4,
        pack_tokens=min(args.pack_tokens, cap),
        show_progress=False,
        compile_cache_dir=args.compile_cache_dir,
    )
    first = args.steps - args.profile_steps  # profiled: steps first+1 .. steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    marks: dict[str, float] = {"start": time.perf_counter()}
    tokens: list[int] = []

    def on_step(step: int, record: dict[str, Any]) -> None:
        if step == 1:
            marks["first_step_s"] = time.perf_counter() - marks["start"]
            from torch._dynamo.utils import compile_times

            print(compile_times(repr="str", aggregate=True), flush=True)
        if step == first:
            profiler.start()
            marks["profiled_from"] = time.perf_counter()
        if step > first:
            tokens.append(int(record["real_tokens"]))
        if step == args.steps:
            if dev == "cuda":
                torch.cuda.synchronize()
            marks["profiled_to"] = time.perf_counter()
            profiler.stop()

    train_drafter(drafter, data, head, cfg, dev, on_step=on_step)
    wall_us = (marks["profiled_to"] - marks["profiled_from"]) * 1e6
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals: list[tuple[float, float]] = []
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = event.time_range.elapsed_us()
        by_kind[kind_of(event.name)] += span
        by_name[event.name][0] += span
        by_name[event.name][1] += 1
        intervals.append((event.time_range.start, event.time_range.end))
    busy = busy_us(intervals)
    report = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "profiled_steps": args.profile_steps,
        "real_tokens": sum(tokens),
        "tok_per_s_profiled": sum(tokens) / (wall_us / 1e6),
        "first_step_s": round(marks["first_step_s"], 1),
        "wall_ms": round(wall_us / 1e3, 1),
        "gpu_busy_share": round(busy / wall_us, 4) if wall_us else None,
        "kinds_share_of_wall": {
            k: round(v / wall_us, 4) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])
        },
        "top_kernels": [
            {"name": name[:120], "ms": round(total / 1e3, 2), "calls": int(calls), "kind": kind_of(name)}
            for name, (total, calls) in sorted(by_name.items(), key=lambda x: -x[1][0])[: args.top]
        ],
    }
    print(json.dumps(report, indent=1), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    if args.trace is not None:
        profiler.export_chrome_trace(str(args.trace))


if __name__ == "__main__":
    main()
