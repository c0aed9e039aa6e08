"""The TTT loss computes logits, target probabilities and cross-entropy at counted positions only
(kernels/counted.py): its loss, its gradient w.r.t. every drafter parameter and its per-step metrics
equal those of the loss computed at every position (a reference written here), on packed and unpacked
batches, with the index built by collate_rows or by the loss itself, in one chunk or several."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from synthetic_training import LAYERS, TARGET, synthetic_samples, target_tensors
from torch import Tensor

from draftloop.kernels.attention import Chain, KVPair, Packed
from draftloop.kernels.counted import counted_index
from draftloop.kernels.drafter import FIRST_PASS, DrafterConfig, Eagle3Drafter
from draftloop.kernels.objective import draft_target_head, ttt_loss, ttt_weights
from draftloop.kernels.packing import collate_rows, collate_samples

TTT, DECAY = 4, 0.8


def full_positions_loss(
    drafter: Eagle3Drafter, batch: Mapping[str, Tensor], head: Tensor, ttt: int, decay: float
) -> tuple[Tensor, Tensor]:
    """The loss as it was: the drafter's logits and the target's softmax at every position of every
    row, the weights (loss mask x TTT eligibility) applied afterwards."""
    ids = batch["input_ids"]
    length = ids.shape[1]
    segments = batch.get("segment_ids")
    positions = batch["position_ids"] if segments is not None else torch.arange(length)[None].expand_as(ids)
    weights = ttt_weights(batch, ttt).float()
    target_logits = batch["last_hidden"] @ head.t()
    probs = F.pad(torch.softmax(target_logits, -1), (0, 0, 0, ttt + 1))
    argmax = F.pad(target_logits.argmax(-1), (0, ttt + 1), value=-1)
    ids_padded = F.pad(ids, (0, ttt + 1))
    hidden = drafter.fuse(batch["aux_hidden"])
    step0: KVPair | None = None
    chain: list[KVPair] = []
    total = torch.zeros(())
    losses, accs, counts = [], [], []
    for step in range(ttt):
        step_ids = ids_padded[:, 1 + step : 1 + step + length]
        if step0 is None:
            hidden, step0 = drafter(
                hidden, step_ids, positions, FIRST_PASS if segments is None else Packed(segments)
            )
        else:
            hidden, kv = drafter(hidden, step_ids, positions + step, Chain([step0], chain, segments))
            chain = [*chain, kv]
        logits = drafter.logits(hidden).float()
        per_token = -(probs[:, 1 + step : 1 + step + length] * torch.log_softmax(logits, -1)).sum(-1)
        weight = weights[step]
        tokens = weight.sum()
        loss_sum = (per_token * weight).sum()
        total = total + decay**step * loss_sum / tokens.clamp_min(1)
        hits = ((logits.argmax(-1) == argmax[:, 1 + step : 1 + step + length]).float() * weight).sum()
        losses.append(loss_sum.detach() / tokens.clamp_min(1))
        accs.append(hits / tokens.clamp_min(1))
        counts.append(tokens)
    return total, torch.stack([torch.stack(losses), torch.stack(accs), torch.stack(counts)])


def multi_turn_samples(count: int, seed: int) -> list[dict[str, Tensor]]:
    """Synthetic samples whose loss mask has holes (several assistant turns), so counted positions are
    scattered: the compact index must find every one and nothing else."""
    samples = synthetic_samples(count, seed=seed, min_len=6, max_len=40)
    gen = torch.Generator().manual_seed(seed + 100)
    for sample in samples:
        n = int(sample["input_ids"].shape[0])
        sample["loss_mask"] = (torch.rand(n, generator=gen) < 0.6).to(torch.uint8)
    return samples


def drafter_for(variant: str) -> tuple[Eagle3Drafter, Tensor]:
    embed, lm_head = target_tensors()
    torch.manual_seed(1)
    options = {"norm_output": True, "fc_norm": True} if variant == "eagle3.1" else None
    config = DrafterConfig.for_target(TARGET, LAYERS, variant=variant, variant_options=options)
    drafter = Eagle3Drafter(config)
    drafter.attach_embeddings(embed)
    drafter.train()
    return drafter, draft_target_head(drafter, lm_head)


def loss_and_grads(loss_fn, drafter, batch, head):  # type: ignore[no-untyped-def]
    drafter.zero_grad(set_to_none=True)
    loss, terms = loss_fn(drafter, batch, head, TTT, DECAY)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
    return loss.detach(), terms.detach(), grads


def batches() -> dict[str, dict[str, Tensor]]:
    samples = multi_turn_samples(7, seed=5)
    rows = [samples[0:3], samples[3:5], samples[5:7]]
    small_chunks = collate_rows(rows)
    index = counted_index(ttt_weights(small_chunks, TTT), chunk_tokens=16, max_chunks=64)
    small_chunks |= {"ttt_anchors": index.anchors, "ttt_target_rows": index.target_rows}
    # A long row's case: more chunks of chunk_tokens than the cap, so the chunks grow instead.
    capped = collate_rows(rows)
    index = counted_index(ttt_weights(capped, TTT), chunk_tokens=16, max_chunks=3)
    assert index.anchors.shape[1] == 3 and index.anchors.shape[2] > 16
    capped |= {"ttt_anchors": index.anchors, "ttt_target_rows": index.target_rows}
    return {
        "packed, index from collate": collate_rows(rows, ttt_length=TTT),
        "packed, index in the loss": collate_rows(rows),
        "packed, chunks of 16": small_chunks,
        "packed, 3 chunks at most": capped,
        "unpacked, right-padded": collate_samples(samples[:4]),
        "unpacked, fixed shape": collate_rows(
            [[s] for s in samples[:3]], "cpu", None, 4, 64, packed=False, ttt_length=TTT
        ),
    }


# EAGLE 3.1 (its own logits input: norm_output) on one kind of batch: the head seam is all it changes.
@pytest.mark.parametrize(
    ("variant", "kinds"), [("eagle3", None), ("eagle3.1", ["packed, index from collate"])]
)
def test_counted_positions_loss_equals_full_positions_loss(variant: str, kinds: list[str] | None) -> None:
    drafter, head = drafter_for(variant)
    for name, batch in batches().items():
        if kinds is not None and name not in kinds:
            continue
        want_loss, want_terms, want_grads = loss_and_grads(full_positions_loss, drafter, batch, head)
        loss, terms, grads = loss_and_grads(ttt_loss, drafter, batch, head)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
        assert terms[2].tolist() == want_terms[2].tolist(), f"{name}: tokens per step"
        assert terms[2].min() > 0, f"{name}: every step counts some positions"
        torch.testing.assert_close(terms[1], want_terms[1], rtol=0, atol=1e-6, msg=f"{name}: acc")
        torch.testing.assert_close(
            terms[0], want_terms[0], rtol=1e-5, atol=1e-6, msg=f"{name}: loss per step"
        )
        assert grads.keys() == want_grads.keys() and "lm_head.weight" in grads
        for param, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[param], rtol=1e-4, atol=1e-6, msg=f"{name}: {param}")


def test_index_holds_each_counted_position_once_and_padding_is_never_counted() -> None:
    batch = collate_rows([multi_turn_samples(4, seed=2), multi_turn_samples(2, seed=3)])
    weights = ttt_weights(batch, TTT)
    flat = weights.shape[1] * weights.shape[2]
    index = counted_index(weights, chunk_tokens=24, max_chunks=64)
    assert index.anchors.shape[1] == -(-flat // 24) and index.anchors.shape[2] % 64 == 0
    for step in range(TTT):
        anchors = index.anchors[step].flatten()
        real = anchors[anchors != flat - 1]
        assert sorted(real.tolist()) == weights[step].flatten().nonzero().squeeze(1).tolist()
        # Step j's target row is step 0's anchor t + j (the same target token t + 1 + j).
        rows = index.target_rows[step].flatten()[anchors != flat - 1]
        assert (index.anchors[0].flatten()[rows] == real + step).all()
    assert not weights.flatten(1)[:, flat - 1].any()


def test_chunks_per_step_stop_growing_at_the_cap_so_long_rows_compile_one_graph_size() -> None:
    # Rows up to MAX_CHUNKS * CHUNK_TOKENS keep chunks of <= CHUNK_TOKENS; longer rows the same chunk count.
    for length, chunks in [(2048, 1), (4096, 1), (8192, 2), (16384, 4), (32768, 4)]:
        counted = torch.zeros(TTT, 1, length, dtype=torch.bool)
        counted[:, 0, : length - 16] = True
        index = counted_index(counted)
        assert index.anchors.shape[:2] == (TTT, chunks), length
        assert chunks * index.anchors.shape[2] >= length - 16, length  # every counted position held
