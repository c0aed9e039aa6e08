"""All-reduce of one drafter's gradients (fp32, Llama-3.1-8B-shaped EAGLE-3 drafter) between the GPUs:
the communication cost of one data-parallel training step. Run under ``torchrun``."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

GRADIENT_ELEMENTS = 425_000_000  # fc 50M + layer 242M + lm_head 131M parameters, rounded


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    flat = torch.ones(GRADIENT_ELEMENTS, device="cuda")
    times = []
    for i in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(flat)
        torch.cuda.synchronize()
        if i >= 3:  # NCCL sets its channels up on the first calls
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    size = flat.numel() * 4
    if rank == 0:  # bus bandwidth as nccl-tests defines it for all-reduce: 2 (n - 1) / n x size / time
        bus = 2 * (world - 1) / world * size / seconds
        print(json.dumps({"bytes": size, "median_s": round(seconds, 4), "bus_gb_per_s": round(bus / 1e9, 1)}))
        sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
