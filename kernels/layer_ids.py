"""Aux-layer ids for EAGLE-3 and the one internal convention draftloop stores them in.

Two conventions exist in the wild and differ by one (see DESIGN.md, "Layer ids"):

- ``layer_input`` (internal): id k = the hidden state entering decoder layer k, i.e. the index into
  Hugging Face ``output_hidden_states``. Valid 0..N-1.
- ``layer_output``: id k = the output of decoder layer k = ``layer_input`` k+1. Valid 0..N-2 (the
  output of the last layer is not a residual-stream state any engine captures).

Everything draftloop stores uses ``layer_input``; conversion happens only at export time, into the
convention the serving engine declares (infra/engines/).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, cast

Convention = Literal["layer_input", "layer_output"]

CONVENTIONS: tuple[Convention, ...] = ("layer_input", "layer_output")

# Offset added to an id to express it in layer_input convention.
_OFFSET_TO_INPUT: dict[Convention, int] = {"layer_input": 0, "layer_output": 1}


def normalize_convention(name: str) -> Convention:
    """``name`` checked as a convention (which engine reads which is the engine modules' knowledge)."""
    key = str(name).strip().lower()
    if key not in CONVENTIONS:
        raise ValueError(f"unknown layer-id convention {name!r}; expected one of {list(CONVENTIONS)}")
    return cast(Convention, key)


@dataclass(frozen=True)
class LayerIds:
    """Ids of the target's decoder layers whose hidden states the drafter fuses, with their convention."""

    ids: tuple[int, ...]
    convention: Convention = "layer_input"

    def __post_init__(self) -> None:
        # Accept lists at construction so callers can pass config values straight through.
        ids = tuple(int(i) for i in self.ids)
        for raw in self.ids:
            if isinstance(raw, bool) or int(raw) != raw:
                raise ValueError(f"layer ids must be integers, got {list(self.ids)!r}")
        if any(i < 0 for i in ids):
            raise ValueError(f"layer ids must be >= 0, got {list(ids)}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer ids must be distinct, got {list(ids)}")
        if not ids:
            raise ValueError("layer ids must not be empty")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "convention", normalize_convention(self.convention))

    @classmethod
    def parse(cls, ids: Iterable[int], convention: str = "layer_input") -> LayerIds:
        """Build from config values (a list and a convention name)."""
        return cls(tuple(ids), normalize_convention(convention))

    def to(self, convention: str) -> LayerIds:
        """The same layers expressed in ``convention``; ValueError when one has no id there."""
        target = normalize_convention(convention)
        if target == self.convention:
            return self
        shift = _OFFSET_TO_INPUT[self.convention] - _OFFSET_TO_INPUT[target]
        converted = tuple(i + shift for i in self.ids)
        if any(i < 0 for i in converted):
            raise ValueError(
                f"layer ids {list(self.ids)} ({self.convention}) include a state with no {target} id "
                f"(the embedding output, layer_input 0, is not the output of any layer)"
            )
        return LayerIds(converted, target)

    def valid_range(self, depth: int) -> tuple[int, int]:
        """Inclusive range of valid ids for a target with ``depth`` decoder layers, in this convention."""
        last = depth - 1 if self.convention == "layer_input" else depth - 2
        return 0, last

    def validate(self, depth: int) -> LayerIds:
        """Check the ids against a target of ``depth`` decoder layers; returns self."""
        low, high = self.valid_range(depth)
        bad = [i for i in self.ids if not low <= i <= high]
        if bad:
            raise ValueError(
                f"layer ids {list(self.ids)} ({self.convention}) out of range for a {depth}-layer target: "
                f"valid ids are {low}..{high}"
            )
        return self

    def as_input(self) -> tuple[int, ...]:
        """The ids in layer_input convention (= indices into HF output_hidden_states)."""
        return self.to("layer_input").ids

    def to_json(self) -> dict[str, object]:
        return {"ids": list(self.ids), "convention": self.convention}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> LayerIds:
        raw_ids = data["ids"]
        if not isinstance(raw_ids, list | tuple):
            raise ValueError(f"layer ids must be a list, got {raw_ids!r}")
        return cls.parse(raw_ids, str(data.get("convention", "layer_input")))

    @classmethod
    def default_for_depth(cls, depth: int, count: int = 3) -> LayerIds:
        """vLLM's defaults (2, N//2, N-3) when distinct and valid, else ``count`` evenly spread ids."""
        if depth < count:
            raise ValueError(f"a {depth}-layer target has fewer than {count} distinct layer ids")
        if count == 3:
            vllm_ids = (2, depth // 2, depth - 3)
            if (
                len(set(vllm_ids)) == 3
                and all(0 <= i < depth for i in vllm_ids)
                and vllm_ids == tuple(sorted(vllm_ids))
            ):
                return cls(vllm_ids, "layer_input")
        # Spread over 1..N-1 (skipping the raw embedding output) when there is room, else 0..N-1.
        low = 1 if depth - 1 >= count else 0
        high = depth - 1
        if count == 1:
            return cls((high,), "layer_input")
        spread = [low + round(k * (high - low) / (count - 1)) for k in range(count)]
        return cls(tuple(spread), "layer_input")

    def __len__(self) -> int:
        return len(self.ids)
