"""LayerIds: the one internal convention and its conversions."""

from __future__ import annotations

import pytest

from draftloop.kernels.layer_ids import LayerIds, normalize_convention


def test_only_the_two_conventions_are_names() -> None:
    assert normalize_convention(" Layer_Output ") == "layer_output"
    assert LayerIds((1, 2, 3), "layer_output").convention == "layer_output"
    # Engine names are not conventions here: which engine reads which is the engine's declaration.
    for name in ("hf", "vllm", "sglang"):
        with pytest.raises(ValueError, match="unknown layer-id convention"):
            normalize_convention(name)


def test_conversion_shifts_by_one_and_round_trips() -> None:
    ids = LayerIds((2, 30, 58), "layer_input")
    out = ids.to("layer_output")
    assert out == LayerIds((1, 29, 57), "layer_output")
    assert out.to("layer_input") == ids
    assert ids.to("layer_input") is ids
    # SpecForge's DeepSeek-V3 default [1, 29, 57] (layer_output) is vLLM's [2, 30, 58].
    assert LayerIds.parse([1, 29, 57], "layer_output").as_input() == (2, 30, 58)


def test_embedding_state_has_no_layer_output_id() -> None:
    with pytest.raises(ValueError, match="no layer_output id"):
        LayerIds((0, 3, 5)).to("layer_output")


def test_validate_names_the_valid_range() -> None:
    LayerIds((0, 3, 5)).validate(6)
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.5"):
        LayerIds((1, 3, 6)).validate(6)
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.4"):
        LayerIds((1, 3, 5), "layer_output").validate(6)


def test_rejects_duplicates_and_negatives() -> None:
    with pytest.raises(ValueError, match="distinct"):
        LayerIds((1, 1, 2))
    with pytest.raises(ValueError, match=">= 0"):
        LayerIds((-1, 1, 2))


@pytest.mark.parametrize(
    ("depth", "expected"),
    [(32, (2, 16, 29)), (61, (2, 30, 58)), (8, (2, 4, 5)), (6, (1, 3, 5)), (4, (1, 2, 3)), (3, (0, 1, 2))],
)
def test_default_for_depth(depth: int, expected: tuple[int, ...]) -> None:
    ids = LayerIds.default_for_depth(depth)
    assert ids.ids == expected
    assert ids.convention == "layer_input"
    ids.validate(depth)
    assert len(set(ids.ids)) == 3


def test_default_for_depth_distinct_for_all_small_depths() -> None:
    for depth in range(3, 80):
        ids = LayerIds.default_for_depth(depth).validate(depth)
        assert len(set(ids.ids)) == 3 and list(ids.ids) == sorted(ids.ids)
    with pytest.raises(ValueError):
        LayerIds.default_for_depth(2)


def test_json_round_trip() -> None:
    ids = LayerIds((1, 3, 5), "layer_output")
    assert LayerIds.from_json(ids.to_json()) == ids
