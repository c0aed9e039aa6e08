"""On CUDA: the training loop's micro-batches copied to the GPU on a side stream ahead of their turn
(kernels/train.py `_copied_ahead`) hold exactly what collating each one on the compute stream holds, while
the compute stream is kept busy (so a missing wait between the streams, or memory reused too early, would
show as different values). Exit 1 on a mismatch.

    python3 bench/check_copied_ahead.py
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from draftloop.kernels.packing import collate_rows
from draftloop.kernels.train import _copied_ahead


def sample(length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 32000, (length,), generator=gen),
        "loss_mask": torch.rand(length, generator=gen) > 0.3,
        "aux_hidden": torch.randn(length, 3 * 1024, generator=gen).to(torch.bfloat16),
        "last_hidden": torch.randn(length, 1024, generator=gen).to(torch.bfloat16),
    }


def main() -> None:
    device = torch.device("cuda")
    micro_batches = [[[sample(700 + 97 * i, 2 * i), sample(300 + 31 * i, 2 * i + 1)]] for i in range(12)]
    collate = partial(collate_rows, device=device, pad_multiple=512, ttt_length=7)
    want = [{k: v.cpu() for k, v in collate(rows).items()} for rows in micro_batches]
    busy = torch.randn(8192, 8192, device=device)
    ok = True
    for rounds in range(3):
        for index, batch in enumerate(_copied_ahead(micro_batches, collate, device)):
            for _ in range(4):  # compute-stream work queued before the batch is read
                busy = torch.tanh(busy @ busy * 1e-4)
            got = {
                k: (v.float() * 1).to(v.dtype).cpu() for k, v in batch.items()
            }  # read on the compute stream
            for name, tensor in want[index].items():
                if not torch.equal(got[name], tensor):
                    print(f"round {rounds} micro-batch {index}: {name} differs")
                    ok = False
            del batch, got
    torch.cuda.synchronize()
    print("copied ahead = collated in place:", "OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
