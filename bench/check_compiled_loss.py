"""On CUDA: the TTT loss compiled by region (FlexAttention's log-sum-exp merged with the slotted chain)
equals the eager loss (listed chain, dense attention) and its gradients, on packed rows, in float32 and
under bf16 autocast; the regions compile no graph after the first batch, whatever its count of positions.
Exit 1 on a mismatch.

    python3 bench/check_compiled_loss.py
"""

from __future__ import annotations

import sys

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig

from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.objective import compiled_regions, draft_target_head, ttt_loss
from draftloop.kernels.packing import collate_rows

TARGET = LlamaConfig(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=2048,
)
TTT, ROW = 7, 1024


def samples(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(40, 300, (), generator=gen))
        out.append(
            {
                "input_ids": torch.randint(0, TARGET.vocab_size, (n,), generator=gen),
                "loss_mask": (torch.rand(n, generator=gen) < 0.7).to(torch.uint8),
                "aux_hidden": torch.randn(n, 3 * TARGET.hidden_size, generator=gen),
                "last_hidden": torch.randn(n, TARGET.hidden_size, generator=gen) * 3,
            }
        )
    return out


def loss_and_grads(drafter: Eagle3Drafter, batch: dict, head: torch.Tensor, regions: object, bf16: bool):  # type: ignore[type-arg]
    drafter.zero_grad(set_to_none=True)
    kwargs = {} if regions is None else {"regions": regions}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        loss, terms = ttt_loss(drafter, batch, head, TTT, 0.8, None, **kwargs)  # type: ignore[arg-type]
    loss.backward()
    return (
        loss.detach(),
        terms.detach(),
        {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
    )


def main() -> int:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.for_target(TARGET, LayerIds((1, 4, 7)))).to(dev)
    drafter.attach_embeddings(torch.randn(TARGET.vocab_size, TARGET.hidden_size, device=dev))
    drafter.train()
    head = draft_target_head(drafter, torch.randn(TARGET.vocab_size, TARGET.hidden_size, device=dev))
    regions = compiled_regions()
    worst: dict[str, float] = {}
    ok = True
    for bf16, tol in ((False, 2e-4), (True, 3e-2)):
        first_graphs = -1  # (autocast on or off: a graph set of its own)
        for seed, count in ((1, 4), (2, 6), (3, 3)):
            batch = collate_rows([samples(count, seed)], dev, None, None, ROW, packed=True, ttt_length=TTT)
            want = loss_and_grads(drafter, batch, head, None, bf16)
            got = loss_and_grads(drafter, batch, head, regions, bf16)
            rel = {
                "loss": float((got[0] - want[0]).abs() / want[0].abs()),
                "terms": float((got[1] - want[1]).abs().max()),
                "grads": max(
                    float((got[2][n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in want[2].items()
                ),
            }
            tag = f"{'bf16' if bf16 else 'fp32'} seed {seed}"
            print(tag, {k: f"{v:.2e}" for k, v in rel.items()}, "counts", batch["ttt_anchors"].shape[2])
            for k, v in rel.items():
                worst[f"{tag[:4]} {k}"] = max(worst.get(f"{tag[:4]} {k}", 0.0), v)
            ok &= all(v <= tol for v in rel.values())
            graphs = int(counters["stats"]["unique_graphs"])
            first_graphs = graphs if first_graphs < 0 else first_graphs
        print("graphs after the first batch", graphs - first_graphs, "(want 0)")
        ok &= graphs == first_graphs
    print("worst relative differences", worst)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
