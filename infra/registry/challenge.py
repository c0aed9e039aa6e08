"""Champion against challenger, measured in the same run on the same held-out prompts.

Both drafters are simulated on the new traffic's held-out prompts (one target, one numeric mode, the
evaluation's k and max_tokens), so the difference is the drafters' alone. The challenger wins only
beyond the interval: the lower end of a paired bootstrap interval (prompts resampled, both drafters'
figures on the same resample) of its mean acceptance length minus the champion's must be above 0.
Otherwise the gate refuses it with this reason and the alias stays.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import BaseModel

from draftloop.infra.evaluation.simulator import PromptFigures

RESAMPLES = 2000
CONFIDENCE = 0.95


def _length(figures: Sequence[PromptFigures], picks: Sequence[int]) -> float:
    drafts = sum(figures[i].num_drafts for i in picks)
    accepted = sum(figures[i].num_accepted_tokens for i in picks)
    return 1.0 + accepted / drafts if drafts else 1.0


class Challenge(BaseModel):
    """The comparison the gate reads: lengths, their difference and its interval, who won and why."""

    champion_version: str
    prompts: int
    champion_length: float
    challenger_length: float
    difference: float
    low: float
    high: float
    won: bool
    reason: str


def challenge(
    champion_version: str,
    champion: Sequence[PromptFigures],
    challenger: Sequence[PromptFigures],
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> Challenge:
    """Compare per-prompt figures of the two drafters on the same prompts (same order)."""
    if len(champion) != len(challenger) or not champion:
        raise ValueError(f"{len(challenger)} challenger figures for {len(champion)} champion figures")
    everything = range(len(champion))
    ours, theirs = _length(challenger, everything), _length(champion, everything)
    rng = random.Random(seed)
    differences = []
    for _ in range(resamples):
        picks = [rng.randrange(len(champion)) for _ in everything]
        differences.append(_length(challenger, picks) - _length(champion, picks))
    differences.sort()
    tail = (1.0 - CONFIDENCE) / 2
    low = differences[int(tail * (resamples - 1))]
    high = differences[int((1.0 - tail) * (resamples - 1))]
    difference = ours - theirs
    stated = (
        f"challenger mean acceptance length {ours:.3f} vs champion v{champion_version}'s {theirs:.3f} on "
        f"the same {len(champion)} new held-out prompts: {difference:+.3f}, "
        f"{CONFIDENCE:.0%} interval [{low:+.3f}, {high:+.3f}]"
    )
    won = low > 0
    verdict = " (beyond the interval)" if won else ": not beyond the interval (its low end is not > 0)"
    reason = stated + verdict
    return Challenge(
        champion_version=champion_version,
        prompts=len(champion),
        champion_length=theirs,
        challenger_length=ours,
        difference=difference,
        low=low,
        high=high,
        won=won,
        reason=reason,
    )
