"""Where engine and reference first part, for a fault no known cause explains.

Three places to look, most telling first:

1. the outputs: a speculative server whose greedy text leaves the baseline's accepts drafts it should
   have rejected — the prompt, the output position and the two tokens;
2. the target's numerics: replaying the engine's text, the simulator's target prefers another token —
   the prompt, the position, the engine's token and the simulator's;
3. the acceptance itself: the first draft position whose acceptance differs beyond the tolerance
   (per prompt where the engine reports counters per request, else over all prompts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from draftloop.infra.evaluation.benchmark import ServerRun, TokenLogprobs


@dataclass(frozen=True)
class Divergence:
    where: str  # outputs | target_numerics | acceptance
    prompt: int | None  # None: over all prompts
    # Output token position (outputs, target_numerics), draft position (acceptance), None: a whole prompt.
    position: int | None
    engine: str  # the engine's token, or its acceptance at that position
    reference: str  # the baseline's / simulator's token, or the simulator's acceptance

    def describe(self) -> str:
        prompt = "over all prompts" if self.prompt is None else f"prompt {self.prompt}"
        if self.where == "outputs":
            return (
                f"{prompt}, output position {self.position}: the speculative server wrote {self.engine!r} "
                f"where the baseline wrote {self.reference!r} (drafts accepted that the target rejects)"
            )
        if self.where == "target_numerics":
            return (
                f"{prompt}, output position {self.position}: the engine's target chose token {self.engine}, "
                f"the simulator's target token {self.reference} (the two targets compute differently)"
            )
        at = "all draft positions" if self.position is None else f"draft position {self.position}"
        return (
            f"{prompt}, {at}: the engine accepts {self.engine} of the drafted tokens, the simulator "
            f"{self.reference}"
        )


def _first_token_difference(base: TokenLogprobs, spec: TokenLogprobs) -> tuple[int, str, str] | None:
    for position, ((base_token, _), (spec_token, _)) in enumerate(zip(base, spec, strict=False)):
        if base_token != spec_token:
            return position, spec_token, base_token
    return None


def _rates(accepted: Sequence[float], drafts: float) -> list[float]:
    return [count / drafts for count in accepted] if drafts else []


def _first_position_apart(
    engine: Sequence[float], simulator: Sequence[float | None], tolerance: float
) -> int | None:
    for position, (ours, theirs) in enumerate(zip(engine, simulator, strict=False)):
        if theirs is not None and abs(ours - theirs) > tolerance:
            return position
    return None


def first_divergence(
    baseline: ServerRun,
    speculative: ServerRun,
    mismatched_prompts: Sequence[int],
    simulator: Mapping[str, Any] | None,
    engine_counters: Mapping[str, Any] | None,
    tolerance: float,
) -> Divergence | None:
    """The first place engine and reference part (see the module's docstring), or None."""
    for prompt in mismatched_prompts:
        if prompt < len(baseline.output_logprobs) and prompt < len(speculative.output_logprobs):
            found = _first_token_difference(
                baseline.output_logprobs[prompt], speculative.output_logprobs[prompt]
            )
            if found is not None:
                return Divergence("outputs", prompt, *found)
    prompts = list((simulator or {}).get("prompts") or [])
    for index, figures in enumerate(prompts):
        split = figures.get("divergence")
        if split:
            return Divergence(
                "target_numerics", index, int(split["position"]), str(split["engine_token"]),
                str(split["simulator_token"]),
            )  # fmt: skip
    # Per prompt: the engine's per-request counters against the simulator's, where both exist.
    per_request = speculative.output_counters
    if per_request and len(per_request) == len(prompts):
        for index, (counters, figures) in enumerate(zip(per_request, prompts, strict=True)):
            if not counters or not figures.get("num_draft_tokens") or not counters.get("num_draft_tokens"):
                continue
            theirs = float(figures["num_accepted_tokens"]) / float(figures["num_draft_tokens"])
            ours = float(counters["num_accepted_tokens"]) / float(counters["num_draft_tokens"])
            if abs(ours - theirs) > tolerance:
                return Divergence("acceptance", index, None, f"{ours:.3f}", f"{theirs:.3f}")
    if engine_counters and simulator:
        engine = _rates(
            engine_counters.get("accepted_per_position") or [], float(engine_counters["num_drafts"] or 0)
        )
        position = _first_position_apart(engine, simulator.get("per_position") or [], tolerance)
        if position is not None:
            return Divergence(
                "acceptance", None, position, f"{engine[position]:.3f}",
                f"{float(simulator['per_position'][position]):.3f}",
            )  # fmt: skip
    return None
