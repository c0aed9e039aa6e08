"""Sample packing: first-fit decreasing rows, per-sample positions and masks, and packed training equal
to unpacked training (same samples per optimizer step) within float32 tolerance."""

from __future__ import annotations

import pytest
import torch
from synthetic_training import new_drafter, synthetic_samples, target_tensors
from torch import Tensor

from draftloop.kernels.data import InMemorySamples
from draftloop.kernels.objective import draft_target_head, ttt_loss, ttt_metrics, ttt_weights
from draftloop.kernels.packing import collate_rows, collate_samples, pack_first_fit_decreasing
from draftloop.kernels.train import TrainConfig, train_drafter


def test_first_fit_decreasing_fills_rows_within_budget() -> None:
    lengths = [7, 3, 5, 2, 9, 4, 1, 12]
    rows = pack_first_fit_decreasing(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows if len(row) > 1)
    assert [12] in [[lengths[i] for i in row] for row in rows]  # too long: a row of its own
    # FFD: 12 | 9+1 | 7+3 | 5+4 | 2 → 5 rows, the lower bound for 43 tokens of which 12 stand alone.
    assert [[lengths[i] for i in row] for row in rows] == [[12], [9, 1], [7, 3], [5, 4], [2]]


def test_packed_row_restarts_positions_and_keeps_samples_apart() -> None:
    samples = synthetic_samples(3, min_len=6, max_len=9)
    batch = collate_rows([samples, samples[:1]])
    sizes = [int(s["input_ids"].shape[0]) for s in samples]
    row = batch["segment_ids"][0].tolist()
    assert row[: sum(sizes)] == [seg for seg, n in enumerate(sizes) for _ in range(n)]
    assert batch["position_ids"][0, : sum(sizes)].tolist() == [p for n in sizes for p in range(n)]
    assert batch["segment_ids"][1, sizes[0] :].eq(-1).all() and batch["lengths"].tolist() == [
        sum(sizes),
        sizes[0],
    ]
    weights = ttt_weights(batch, 3)
    for step in range(3):  # per sample, as if alone: predicted token t+2+step inside the sample
        expected = sum(int(s["loss_mask"][2 + step :].sum()) for s in samples)
        assert int(weights[step, 0].sum()) == expected


def test_packed_loss_equals_separate_samples() -> None:
    """One packed row of four samples: every TTT step's loss and token count equal the token-weighted
    result of the samples one by one (any attention or shift across a boundary would change them)."""
    embed, lm_head = target_tensors()
    drafter = new_drafter(embed)
    head = draft_target_head(drafter, lm_head)
    samples = synthetic_samples(4, seed=3)
    positions: list[list[int]] = []  # what the drafter is given (RoPE alone would not tell)
    hook = drafter.register_forward_pre_hook(lambda _m, args: positions.append(args[2][0].tolist()))
    with torch.no_grad():
        loss_packed, packed_terms = ttt_loss(drafter, collate_rows([samples]), head, 4, 0.8)
        packed = ttt_metrics(packed_terms)
    hook.remove()
    restarting = [p for s in samples for p in range(len(s["input_ids"]))]
    assert positions == [[p + step for p in restarting] for step in range(4)]
    with torch.no_grad():
        alone = [ttt_metrics(ttt_loss(drafter, collate_samples([s]), head, 4, 0.8)[1]) for s in samples]
        loss_padded, padded_terms = ttt_loss(drafter, collate_samples(samples), head, 4, 0.8)
        padded = ttt_metrics(padded_terms)
    assert packed["tokens"] == padded["tokens"]
    for step in range(4):
        tokens = [m["tokens"][step] for m in alone]
        assert packed["tokens"][step] == sum(tokens)
        weighted = sum(m["loss"][step] * n for m, n in zip(alone, tokens, strict=True)) / sum(tokens)
        assert packed["loss"][step] == pytest.approx(weighted, rel=1e-5)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)


def test_packed_training_equals_unpacked_training() -> None:
    """Same samples in the same optimizer steps, packed into rows of 40 tokens or padded per sample:
    the same losses and weights, float32, within 1e-4 relative (summation order differs)."""
    embed, lm_head = target_tensors()
    samples = synthetic_samples(24, seed=5)
    base = {
        "ttt_length": 3,
        "epochs": 2,
        "batch_size": 4,
        "grad_accum": 2,
        "lr": 3e-3,
        "show_progress": False,
    }
    unpacked, packed = new_drafter(embed), new_drafter(embed)
    plain = train_drafter(unpacked, InMemorySamples(samples), lm_head, TrainConfig(**base))
    rows = train_drafter(packed, InMemorySamples(samples), lm_head, TrainConfig(**base, pack_tokens=40))
    assert [h["tokens"] for h in rows.history] == [h["tokens"] for h in plain.history]
    # Two packed rows a micro-batch (a step's last may hold one): the same step, summed differently.
    paired = new_drafter(embed)
    two = train_drafter(
        paired, InMemorySamples(samples), lm_head, TrainConfig(**base, pack_tokens=40, rows_per_micro_batch=2)
    )
    assert [h["loss"] for h in two.history] == pytest.approx([h["loss"] for h in rows.history], rel=1e-4)
    for name, tensor in packed.state_dict().items():
        torch.testing.assert_close(paired.state_dict()[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert [h["loss"] for h in rows.history] == pytest.approx([h["loss"] for h in plain.history], rel=1e-4)
    for name, tensor in unpacked.state_dict().items():
        torch.testing.assert_close(packed.state_dict()[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    # Padding waste is reported per epoch; packing wastes less than padding each sample to its batch.
    for epoch_rows, epoch_plain in zip(rows.epochs, plain.epochs, strict=True):
        assert (
            epoch_rows["real_tokens"]
            == epoch_plain["real_tokens"]
            == sum(len(s["input_ids"]) for s in samples)
        )
        assert epoch_rows["packing_efficiency"] > epoch_plain["packing_efficiency"]


def test_compiled_shapes_pad_a_steps_last_micro_batch_and_train_the_same_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two packed rows a micro-batch with the shapes a compiled loss gets (kernels/train.py `_batch_shape`,
    forced here on the CPU): every micro-batch, a step's last one too, has 2 rows of the padded length, one
    shape; the empty rows count nothing, so the losses and weights are the unpadded run's."""
    import draftloop.kernels.train as train_module

    embed, lm_head = target_tensors()
    samples = synthetic_samples(24, seed=5)
    cfg = TrainConfig(
        ttt_length=3, epochs=1, batch_size=4, grad_accum=2, show_progress=False, pack_tokens=40,
        rows_per_micro_batch=2, pad_multiple=8,
    )  # fmt: skip
    assert train_module._batch_shape(cfg, compiled=False) == (None, None)
    assert train_module._batch_shape(cfg, compiled=True) == (2, 40)
    eager, padded = new_drafter(embed), new_drafter(embed)
    want = train_drafter(eager, InMemorySamples(samples), lm_head, cfg)

    shapes: list[tuple[int, ...]] = []
    rows_given: list[int] = []
    real_collate = train_module.collate_rows

    def recording_collate(rows: list[list[dict[str, Tensor]]], **kwargs: object) -> dict[str, Tensor]:
        batch = real_collate(rows, **kwargs)  # type: ignore[arg-type]
        rows_given.append(len(rows))
        shapes.append(tuple(batch["input_ids"].shape))
        return batch

    compiled_shape = train_module._batch_shape  # the product's rule, as if compiled
    monkeypatch.setattr(train_module, "_batch_shape", lambda c, compiled: compiled_shape(c, True))
    monkeypatch.setattr(train_module, "collate_rows", recording_collate)
    got = train_drafter(padded, InMemorySamples(samples), lm_head, cfg)
    assert set(shapes) == {(2, 40)}, shapes
    assert 1 in rows_given, "some step's last micro-batch should hold one row"
    assert [h["loss"] for h in got.history] == pytest.approx([h["loss"] for h in want.history], rel=1e-5)
    for name, tensor in eager.state_dict().items():
        torch.testing.assert_close(padded.state_dict()[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
