"""The TTT loss compiled by region (kernels/objective.py `compiled_regions`): the chain kept in fixed-size
slots (`SlottedChain`) attends exactly as the listed chain (`Chain`) does, for GQA and MLA drafters, packed
and unpacked rows; the loss and its gradients are the eager loss's; and compiled, the four regions are
four graphs for every TTT step, chunk and count of positions (no recompilation)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_drafter import inputs, make_drafter
from test_masked_loss import TTT, batches, drafter_for, loss_and_grads, multi_turn_samples
from torch._dynamo.utils import counters

from draftloop.kernels.attention import Chain, ChainSlots, KVPair, SlottedChain
from draftloop.kernels.objective import (
    EAGER_REGIONS,
    LossRegions,
    _chunk_terms,
    _first_pass,
    _slotted_chain_pass,
    compiled_regions,
    ttt_loss,
)
from draftloop.kernels.packing import collate_rows

# The slotted chain, uncompiled: what the compiled regions compute, step by step, on the CPU.
SLOTTED_EAGER = LossRegions(_first_pass, _slotted_chain_pass, _chunk_terms, ChainSlots.empty)


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("packed", [False, True])
def test_slotted_chain_attends_as_the_listed_chain_with_the_same_gradients(kind: str, packed: bool) -> None:
    drafter = make_drafter(kind).train()
    aux, ids, positions = inputs()
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, -1, -1]]) if packed else None

    def chain_outputs(slotted: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        drafter.zero_grad(set_to_none=True)
        hidden, past = drafter(drafter.fuse(aux), ids, positions)
        listed: list[KVPair] = []
        slots = ChainSlots.empty(past, 4)
        outputs = []
        for step in range(1, 5):
            if slotted:
                hidden, kv = drafter(hidden, ids, positions + step, SlottedChain(past, slots, segments))
                slots = slots.with_step(kv)
            else:
                hidden, kv = drafter(hidden, ids, positions + step, Chain([past], listed, segments))
                listed = [*listed, kv]
            outputs.append(hidden)
        sum(
            ((step + 1) * out.square().mean() for step, out in enumerate(outputs)), torch.zeros(())
        ).backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        return [out.detach() for out in outputs], grads

    want, want_grads = chain_outputs(slotted=False)
    got, got_grads = chain_outputs(slotted=True)
    for step, (out, ref) in enumerate(zip(got, want, strict=True), start=1):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    assert got_grads.keys() == want_grads.keys() and "midlayer.self_attn.o_proj.weight" in got_grads
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_slot_fills_in_step_order_and_empty_slots_are_never_seen() -> None:
    past = (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3))
    slots = ChainSlots.empty(past, 3)
    first = (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3))
    second = (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3))
    slots = slots.with_step(first).with_step(second)
    assert int(slots.filled) == 2 and slots.keys.shape == (1, 2, 3, 5, 4)
    assert torch.equal(slots.keys[:, :, 0], first[0]) and torch.equal(slots.values[:, :, 1], second[1])
    assert not slots.keys[:, :, 2].any()
    # Whatever an empty slot holds, the attention does not change: it is masked, not zero-weighted by luck.
    q = torch.randn(1, 2, 5, 4)
    own = (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3))
    clean = SlottedChain(past, slots).attend(q, *own, scale=0.5)
    junk = slots._replace(keys=slots.keys.index_fill(2, torch.tensor([2]), 9.0))
    torch.testing.assert_close(SlottedChain(past, junk).attend(q, *own, scale=0.5), clean, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_the_slotted_loss_equals_the_listed_loss_and_its_gradients(variant: str) -> None:
    drafter, head = drafter_for(variant)
    for name, batch in batches().items():
        want_loss, want_terms, want_grads = loss_and_grads(ttt_loss, drafter, batch, head)

        def slotted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
            return ttt_loss(*args, regions=SLOTTED_EAGER)  # type: ignore[arg-type]

        loss, terms, grads = loss_and_grads(slotted, drafter, batch, head)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=f"{name}: loss")
        assert terms[2].tolist() == want_terms[2].tolist(), f"{name}: tokens per step"
        torch.testing.assert_close(terms, want_terms, rtol=1e-5, atol=1e-5, msg=f"{name}: terms")
        assert grads.keys() == want_grads.keys()
        for param, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[param], rtol=1e-4, atol=1e-6, msg=f"{name}: {param}")


def test_weights_cast_once_per_batch_give_the_autocast_loss_and_its_gradients() -> None:
    """Under bf16 autocast, the decoder layer's and lm_head's weights cast once per batch: the same
    loss (autocast cast the same weights at every use), the gradients up to bf16 summation, on the
    fp32 parameters, which are left in place."""
    drafter, head = drafter_for("eagle3")
    seen: list[torch.dtype] = []
    hook = drafter.midlayer.mlp.gate_proj.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    casting = replace(EAGER_REGIONS, cast_shared_weights=True)
    try:
        for name, batch in batches().items():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want_loss, want_terms, want_grads = loss_and_grads(ttt_loss, drafter, batch, head)
                assert set(seen) == {torch.float32}, "autocast alone: the layer sees its fp32 weight"
                seen.clear()

                def casted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
                    return ttt_loss(*args, regions=casting)  # type: ignore[arg-type]

                loss, terms, grads = loss_and_grads(casted, drafter, batch, head)
            assert seen and set(seen) == {torch.bfloat16}, f"{name}: every step sees the bf16 copy"
            seen.clear()
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6, msg=f"{name}: loss")
            torch.testing.assert_close(terms, want_terms, rtol=1e-6, atol=1e-6, msg=f"{name}: terms")
            assert grads.keys() == want_grads.keys() and "lm_head.weight" in grads
            for param, grad in grads.items():
                assert grad.dtype == torch.float32, param
                scale = want_grads[param].abs().max().item()
                torch.testing.assert_close(grad, want_grads[param], rtol=0, atol=2e-2 * scale, msg=param)
    finally:
        hook.remove()
    weight = drafter.midlayer.mlp.gate_proj.weight
    assert isinstance(weight, torch.nn.Parameter) and weight.dtype == torch.float32


@pytest.mark.slow
def test_compiled_regions_build_four_graphs_for_every_step_chunk_and_count() -> None:
    """Compiled on the CPU (the chain's past attention dense there, FlexAttention on CUDA): batches of
    one row shape whose counted positions differ reuse the first batch's four graphs (first pass, chain
    pass, chunk terms, target table)."""
    torch._dynamo.reset()
    counters.clear()
    drafter, head = drafter_for("eagle3")
    regions = compiled_regions()
    shape_rows = [multi_turn_samples(count, seed=seed) for count, seed in ((2, 11), (10, 12), (20, 13))]
    per_chunk = set()
    for samples in shape_rows:
        batch = collate_rows([samples], "cpu", None, None, 1024, packed=True, ttt_length=TTT)
        per_chunk.add(int(batch["ttt_anchors"].shape[2]))
        want_loss, want_terms, want_grads = loss_and_grads(ttt_loss, drafter, batch, head)

        def compiled(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
            return ttt_loss(*args, regions=regions)  # type: ignore[arg-type]

        loss, terms, grads = loss_and_grads(compiled, drafter, batch, head)
        torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(terms, want_terms, rtol=1e-4, atol=1e-4)
        for param, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[param], rtol=1e-3, atol=1e-5, msg=param)
    assert len(per_chunk) > 1, "the batches should differ in their count of positions"
    assert counters["stats"]["unique_graphs"] == 4


@pytest.mark.slow
def test_compiled_regions_under_autocast_reuse_their_graphs_with_each_batchs_weight_copies() -> None:
    """Under bf16 autocast the compiled regions read the weights cast once per batch, new tensors every
    batch: the graphs' guards hold (four graphs for all batches), and the loss is the eager autocast
    loss's (which casts at every use)."""
    torch._dynamo.reset()
    counters.clear()
    drafter, head = drafter_for("eagle3")
    regions = compiled_regions()
    assert regions.cast_shared_weights

    def compiled(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        return ttt_loss(*args, regions=regions)  # type: ignore[arg-type]

    for count, seed in ((2, 11), (10, 12)):
        batch = collate_rows(
            [multi_turn_samples(count, seed=seed)], "cpu", None, None, 1024, packed=True, ttt_length=TTT
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want_loss, _, want_grads = loss_and_grads(ttt_loss, drafter, batch, head)
            loss, _, grads = loss_and_grads(compiled, drafter, batch, head)
        torch.testing.assert_close(loss, want_loss, rtol=2e-2, atol=1e-3)
        for param, grad in grads.items():
            assert grad.dtype == torch.float32, param
            rel = float((grad - want_grads[param]).norm() / want_grads[param].norm().clamp_min(1e-12))
            assert rel < 5e-2, f"{param}: relative difference {rel:.2e}"
    assert counters["stats"]["unique_graphs"] == 4
