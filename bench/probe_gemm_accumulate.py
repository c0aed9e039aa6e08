"""Whether accumulating a bf16 weight gradient into an fp32 buffer inside the GEMM (``addmm`` with an
fp32 output) is cheaper than the GEMM followed by a separate fp32 add: the question behind fusing the
TTT steps' weight-gradient sums into their matmuls. One 4096^3 bf16 GEMM per variant, the mean of 50
calls after one warm-up; CUDA only.

    python3 bench/probe_gemm_accumulate.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

SIZE, CALLS = 4096, 50


def mean_ms(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e3


def main() -> None:
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(SIZE, SIZE, device="cuda", dtype=torch.float32)
    variants: dict[str, Callable[[], object]] = {
        "mm": lambda: torch.mm(a.t(), b),
        "mm(out_dtype=fp32)": lambda: torch.mm(a.t(), b, out_dtype=torch.float32),
        "addmm(acc_fp32, out_dtype=fp32)": lambda: torch.addmm(acc, a.t(), b, out_dtype=torch.float32),
        "mm, then acc_fp32.add_": lambda: acc.add_(torch.mm(a.t(), b)),
    }
    for name, fn in variants.items():
        try:
            print(f"{name}: {mean_ms(fn):.3f} ms")
        except (RuntimeError, TypeError) as error:  # (a torch without the fp32-output kernel)
            print(f"{name}: not available ({type(error).__name__}: {str(error)[:160]})")


if __name__ == "__main__":
    main()
