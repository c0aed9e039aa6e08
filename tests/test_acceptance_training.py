"""End to end on CPU: a drafter trained on a zoo target's own greedy answers is accepted far more often
on held-out prompts, losslessly, and capturing the wrong layers (off by one) costs acceptance.

The trained drafters come from the session fixture `trained_pair` (tests/fixtures_kernels.py): the
target's greedy answers to the first built-in prompts, their hidden states, a few epochs of
kernels/train.py. The held-out prompts are the last built-in ones (never trained on).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fixtures_kernels import ANSWER_TOKENS, TrainedPair, plain_greedy, reference_drafts

from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.simulate import (
    LayerIdMismatchError,
    StepRecord,
    encode_prompt,
    speculative_generate,
    teacher_forced_acceptance,
)

pytestmark = pytest.mark.slow

RECIPES = ["tiny-llama", "tiny-deepseek"]


def shifted_by_one(layer_ids: LayerIds, depth: int) -> LayerIds:
    """The same ids one layer later when all stay valid (the SGLang misreading), else one earlier."""
    later = tuple(i + 1 for i in layer_ids.ids)
    if max(later) < depth:
        return LayerIds(later)
    return LayerIds(tuple(i - 1 for i in layer_ids.ids))


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_raises_acceptance_on_held_out_prompts(
    trained_pair: Callable[[str], TrainedPair], recipe: str
) -> None:
    pair = trained_pair(recipe)
    before = pair.simulate("untrained", pair.untrained)
    after = pair.simulate("trained", pair.drafter)
    print(
        f"\n{recipe}: data {pair.timings['data_s']:.1f} s, training {pair.timings['train_s']:.1f} s; "
        f"held-out mean acceptance length (k=3) {before.mean_acceptance_length:.3f} untrained -> "
        f"{after.mean_acceptance_length:.3f} trained; acceptance rate {after.acceptance_rate:.3f}, "
        f"per position {[round(r, 3) for r in after.per_position_acceptance]}, "
        f"{after.tokens_per_second:.1f} tokens/s"
    )
    assert before.mean_acceptance_length < 1.3
    assert after.mean_acceptance_length >= 2.0
    if recipe == "tiny-deepseek":
        assert pair.drafter.config.attention == "mla"

    # Lossless even with long accepted runs: the output is the target's plain greedy decode.
    for prompt, result in zip(pair.held_out_prompts, after.results, strict=True):
        assert result.output_token_ids == plain_greedy(pair.target, pair.tokenizer, prompt, ANSWER_TOKENS)

    # The cheap per-epoch estimate from stored hidden states tells the two drafters apart the same way.
    layer_ids = pair.drafter.config.aux_layer_ids
    held_out = pair.held_out_samples(layer_ids)
    head = pair.target.get_output_embeddings().weight
    estimate = teacher_forced_acceptance(pair.drafter, held_out, head, k=3)
    estimate_before = teacher_forced_acceptance(pair.untrained, held_out, head, k=3)
    print(
        f"{recipe}: teacher-forced mean acceptance length {estimate_before.mean_acceptance_length:.3f} "
        f"untrained -> {estimate.mean_acceptance_length:.3f} trained ({estimate.num_drafts:.0f} positions)"
    )
    assert estimate_before.mean_acceptance_length < 1.3
    assert estimate.mean_acceptance_length >= 2.0
    # Same drafter, same prompts: the estimate lands near the simulated figure (it averages over every
    # start position instead of over the rounds a decode actually runs).
    assert abs(estimate.mean_acceptance_length - after.mean_acceptance_length) < 0.75


@pytest.mark.parametrize("recipe", RECIPES)
def test_trained_drafter_proposes_like_a_from_scratch_proposer(
    trained_pair: Callable[[str], TrainedPair], recipe: str
) -> None:
    """With partial acceptance at every draft position, the simulator's cached K/V give the drafts a
    from-scratch recomputation of vLLM's proposal gives."""
    pair = trained_pair(recipe)
    layer_ids = pair.drafter.config.aux_layer_ids
    prompt_ids = encode_prompt(pair.tokenizer, pair.held_out_prompts[0])
    steps: list[StepRecord] = []
    output, _, counters = speculative_generate(
        pair.target,
        pair.drafter,
        torch.tensor([prompt_ids]),
        k=3,
        max_new_tokens=24,
        capture_layer_ids=layer_ids,
        on_step=steps.append,
    )
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    for step in steps:
        committed = prompt_ids + output[: step.position - len(prompt_ids) + 1]
        assert step.draft_token_ids == reference_drafts(pair.target, pair.drafter, committed, 3, layer_ids)


@pytest.mark.parametrize("recipe", RECIPES)
def test_layer_ids_off_by_one_lower_acceptance(
    trained_pair: Callable[[str], TrainedPair], recipe: str
) -> None:
    pair = trained_pair(recipe)
    trained_ids = pair.drafter.config.aux_layer_ids
    shifted = shifted_by_one(trained_ids, int(pair.target.config.num_hidden_layers))
    with pytest.raises(LayerIdMismatchError):
        pair.simulate("shifted-refused", pair.drafter, layer_ids=shifted)
    right = pair.simulate("trained", pair.drafter)
    wrong = pair.simulate("shifted", pair.drafter, layer_ids=shifted, allow_layer_mismatch=True)
    assert wrong.layer_ids_forced and wrong.capture_layer_ids == list(shifted.ids)

    # The same comparison over every position of the held-out answers (many more draft decisions).
    head = pair.target.get_output_embeddings().weight
    estimates = {}
    for label, ids in (("trained", trained_ids), ("shifted", shifted)):
        samples = pair.held_out_samples(ids)
        estimates[label] = teacher_forced_acceptance(pair.drafter, samples, head, k=3).mean_acceptance_length
    print(
        f"\n{recipe}: captured layers {list(trained_ids.ids)} (trained) vs {list(shifted.ids)} (off by one): "
        f"simulated mean acceptance length {right.mean_acceptance_length:.3f} vs "
        f"{wrong.mean_acceptance_length:.3f}, acceptance rate {right.acceptance_rate:.3f} vs "
        f"{wrong.acceptance_rate:.3f}; teacher-forced {estimates['trained']:.3f} vs "
        f"{estimates['shifted']:.3f}"
    )
    assert wrong.mean_acceptance_length < right.mean_acceptance_length
    assert estimates["shifted"] < estimates["trained"]
