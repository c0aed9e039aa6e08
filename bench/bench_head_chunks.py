"""The loss head's cost by chunk size (kernels/counted.py CHUNK_TOKENS): the compiled chunk terms and target
table of kernels/objective.py against the head's matmuls alone, over the same positions, at the
Llama-3.1-8B shape (H 4096, Vd 32000), frozen head, bf16 autocast. On CPU a tiny shape, to check it runs.

    python bench/bench_head_chunks.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

from draftloop.kernels import objective

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, DRAFT_VOCAB, POSITIONS = (4096, 32000, 16384) if DEVICE == "cuda" else (64, 320, 4096)
CHUNK_SIZES = (256, 512, 1024, 2048, 4096)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_seconds(run: Callable[[], None], reps: int = 5) -> float:
    run()
    run()  # (compilation and the allocator's first blocks)
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main(out: str) -> None:
    torch.manual_seed(0)
    head = (torch.randn(DRAFT_VOCAB, HIDDEN, device=DEVICE) * 0.02).to(torch.bfloat16)
    last = torch.randn(POSITIONS, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    x_all = torch.randn(POSITIONS, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.rand(POSITIONS, device=DEVICE)
    terms = torch.compile(objective._HeadCrossEntropy.apply, dynamic=False)
    table_of = torch.compile(objective._target_table, dynamic=False)

    def matmuls_only(n: int) -> Callable[[], None]:
        """The head's matmuls of the loss: logits and dL/dx per chunk, the target's logits."""

        def run() -> None:
            for k in range(POSITIONS // n):
                logits = torch.nn.functional.linear(x_all[k * n : (k + 1) * n], head)
                logits.backward(torch.ones_like(logits))
            torch.matmul(last, head.t())

        return run

    def loss_head(n: int) -> Callable[[], None]:
        """The loss head as the training loss runs it: the target table by chunk, then the chunk terms."""

        def run() -> None:
            parts = [
                table_of(last, head, torch.arange(k * n, (k + 1) * n, device=DEVICE))
                for k in range(POSITIONS // n)
            ]
            table, table_lse, table_argmax = (torch.cat(part) for part in zip(*parts, strict=True))
            rows = torch.arange(n, device=DEVICE)
            total = x_all.new_zeros((), dtype=torch.float32)
            for k in range(POSITIONS // n):
                with torch.autocast(DEVICE, dtype=torch.bfloat16):
                    loss, _hits = terms(
                        x_all[k * n : (k + 1) * n],
                        head,
                        table,
                        table_lse,
                        table_argmax,
                        rows + k * n,
                        weight[k * n : (k + 1) * n],
                    )
                total = total + loss
            total.backward()

        return run

    result: dict[str, object] = {
        "device": DEVICE,
        "hidden": HIDDEN,
        "draft_vocab": DRAFT_VOCAB,
        "positions": POSITIONS,
    }
    for n in CHUNK_SIZES:
        matmuls, whole = median_seconds(matmuls_only(n)), median_seconds(loss_head(n))
        row = {"matmuls_ms": round(matmuls * 1e3, 2), "loss_head_ms": round(whole * 1e3, 2)}
        row["overhead_ms"] = round((whole - matmuls) * 1e3, 2)
        result[str(n)] = row
        print(n, row, flush=True)
    with open(out, "w") as file:
        json.dump(result, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
