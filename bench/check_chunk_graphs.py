"""On CUDA, at the Llama-3.1-8B drafter's shape: the compiled chunk terms (kernels/objective.py, the loss
head of one chunk, forward and backward) build one graph for every count of positions, small and large;
and their time per call at a few counts. Exit 1 when a count compiled a second graph.

    python3 bench/check_chunk_graphs.py                 # the product's region
    python3 bench/check_chunk_graphs.py --inductor plain  # inductor's defaults (the A/B of 2026-12-07)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from draftloop.kernels.drafter import Eagle3Drafter
from draftloop.kernels.objective import CHUNK_TERMS_INDUCTOR, _chunk_terms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import shapes
from realistic_data import drafter_config

COUNTS = [4096, 1024, 640, 3008, 8192, 12288, 128]  # the first compiles; the rest must reuse it
INDUCTOR = {
    "product": CHUNK_TERMS_INDUCTOR,
    "plain": {},
    "non-strict": {"triton.mix_order_reduction_non_strict_mode": True},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inductor", choices=sorted(INDUCTOR), default="product")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(drafter_config(shapes(False))).to(dev)
    drafter.lm_head.weight.requires_grad_(False)  # the default: a frozen head
    flat, table_rows, vocab = 16384, 12288, drafter.config.draft_vocab_size
    hidden = torch.randn(flat, drafter.config.hidden_size, device=dev, requires_grad=True)
    weights = torch.rand(flat, device=dev)
    table = torch.randn(table_rows, vocab, device=dev).to(torch.bfloat16)
    table_lse, table_argmax = torch.logsumexp(table.float(), -1), table.argmax(-1)
    options: Any = INDUCTOR[args.inductor] or None
    terms = torch.compile(_chunk_terms, dynamic=False, options=options)

    def call(count: int) -> None:
        anchors = torch.randint(0, flat, (count,), device=dev)
        rows = torch.randint(0, table_rows, (count,), device=dev)
        for tensor in (table, table_lse, table_argmax, anchors, rows):
            torch._dynamo.mark_dynamic(tensor, 0)  # as kernels/objective.py marks them
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _hits = terms(drafter, hidden, weights, anchors, rows, table, table_lse, table_argmax)
        loss.backward()

    graphs = []
    for count in COUNTS:
        before, started = counters["stats"]["unique_graphs"], time.perf_counter()
        call(count)
        torch.cuda.synchronize()
        graphs.append(counters["stats"]["unique_graphs"] - before)
        seconds = time.perf_counter() - started
        print(f"{args.inductor}: {count} positions, {graphs[-1]} new graphs, {seconds:.1f} s")
    for count in (1024, 4096, 8192):
        for _ in range(3):
            call(count)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call(count)
        end.record()
        torch.cuda.synchronize()
        print(f"{args.inductor}: {count} positions, {start.elapsed_time(end) / 20:.3f} ms a call (fwd + bwd)")
    later = sum(graphs[1:])
    print(f"{args.inductor}: graphs after the first count: {later}")
    return 1 if later else 0


if __name__ == "__main__":
    sys.exit(main())
