"""Speculative-decoding counters: the one type both the simulator and every engine's metrics produce.

Definitions (as vLLM's `SpecDecodingStats` counts them, once per verified draft):
- num_drafts: verification steps that carried draft tokens;
- num_draft_tokens: tokens proposed over those steps;
- num_accepted_tokens: proposed tokens the target accepted;
- accepted_per_position[i]: drafts whose i-th proposed token (0-based) was accepted.

Derived: acceptance rate = accepted / proposed; mean acceptance length = 1 + accepted / drafts (tokens
gained per target forward, the bonus token included); per-position acceptance = accepted_per_position[i]
/ drafts. Engine counters are Prometheus floats, so every field is a float; the simulator's are whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

__all__ = ["SpecCounters"]


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative speculative-decoding counters (empty `accepted_per_position` when not reported)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: tuple[float, ...] = ()

    @classmethod
    def empty(cls, num_spec_tokens: int) -> SpecCounters:
        """No drafts yet, with one per-position slot for each of `num_spec_tokens` draft positions."""
        return cls(accepted_per_position=(0.0,) * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> SpecCounters:
        """These counters plus one verified draft of `num_draft_tokens` tokens, the first
        `num_accepted_tokens` of which were accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens")
        accepted = (1.0,) * num_accepted_tokens
        return self + SpecCounters(1.0, float(num_draft_tokens), float(num_accepted_tokens), accepted)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_position=tuple(
                a + b
                for a, b in zip_longest(self.accepted_per_position, other.accepted_per_position, fillvalue=0)
            ),
        )

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        """The counts between two cumulative readings (`after - before`)."""
        return SpecCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_position=tuple(
                a - b
                for a, b in zip_longest(self.accepted_per_position, before.accepted_per_position, fillvalue=0)
            ),
        )

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed draft tokens (None before any draft token)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens per target forward, bonus token included (None before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts > 0 else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts whose i-th token was accepted (empty before any draft)."""
        if self.num_drafts <= 0:
            return []
        return [count / self.num_drafts for count in self.accepted_per_position]

    def to_json(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }
