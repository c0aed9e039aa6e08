"""The acceptance simulator: lossless greedy speculation, vLLM's counters, the layer-id guard, the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_kernels import (
    builtin_prompts,
    default_layer_ids,
    load_target,
    make_constant_drafter,
    make_constant_target,
    make_lookup_drafter,
    plain_greedy,
    reference_drafts,
    untrained_drafter,
)

from draftloop.kernels.capture import capture_aux_hidden_states
from draftloop.kernels.counters import SpecCounters
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.simulate import (
    LayerIdMismatchError,
    StepRecord,
    encode_prompt,
    simulate_acceptance,
    speculative_generate,
    teacher_forced_acceptance,
)

PROMPTS = builtin_prompts()[:3]


# ---------------------------------------------------------------------------------------------------------
# Lossless: output equals the target's plain greedy decode


@pytest.mark.parametrize(
    ("drafter_kind", "k"),
    [("untrained", 3), ("untrained", 5), ("lookup", 3)],
    ids=["untrained-3", "untrained-5", "lookup-3"],
)
@pytest.mark.parametrize("recipe", ["tiny-llama", "tiny-deepseek"])
def test_output_equals_plain_greedy(
    zoo_target_dir: Callable[[str], Path], recipe: str, k: int, drafter_kind: str
) -> None:
    target, tokenizer = load_target(zoo_target_dir(recipe))
    max_new_tokens = 16
    if drafter_kind == "untrained":
        drafter = untrained_drafter(target)
    else:
        # tiny-deepseek is no Markov chain: its lookup memorises the target's own continuations.
        produced = [
            encode_prompt(tokenizer, prompt) + plain_greedy(target, tokenizer, prompt, max_new_tokens)
            for prompt in (PROMPTS if recipe == "tiny-deepseek" else [])
        ]
        drafter = make_lookup_drafter(target, memorise=produced)
    if recipe == "tiny-deepseek":
        assert drafter.config.attention == "mla"
    report = simulate_acceptance(target, tokenizer, drafter, PROMPTS, k=k, max_new_tokens=max_new_tokens)
    for prompt, result in zip(PROMPTS, report.results, strict=True):
        assert result.output_token_ids == plain_greedy(target, tokenizer, prompt, max_new_tokens)
        assert result.finish_reason == "length"
        assert result.text == tokenizer.decode(result.output_token_ids, skip_special_tokens=True)
    # vLLM's counter identities: every draft has k tokens; one round yields accepted + 1 tokens, and
    # the first token comes from the prefill.
    assert report.num_draft_tokens == k * report.num_drafts
    assert sum(report.accepted_per_position) == report.num_accepted_tokens
    assert report.accepted_per_position == sorted(report.accepted_per_position, reverse=True)
    produced = sum(len(r.output_token_ids) for r in report.results)
    assert report.num_drafts + report.num_accepted_tokens >= produced - len(PROMPTS)
    if drafter_kind == "untrained":
        assert report.mean_acceptance_length < 1.5  # a random drafter barely ever agrees
    else:
        assert 0 < report.num_accepted_tokens < report.num_draft_tokens  # rejections after acceptances


def test_drafts_equal_a_from_scratch_proposer(zoo_target_dir: Callable[[str], Path]) -> None:
    """The cached K/V (target cache cropped after rejections; drafter K/V kept for verified positions,
    chain steps dropped) give the same drafts as recomputing vLLM's proposal from scratch each step."""
    target, tokenizer = load_target(zoo_target_dir("tiny-llama"))
    k = 3
    for drafter in (make_lookup_drafter(target), untrained_drafter(target, seed=1)):
        layer_ids = drafter.config.aux_layer_ids
        prompt_ids = encode_prompt(tokenizer, PROMPTS[1])
        steps: list[StepRecord] = []
        output, _, counters = speculative_generate(
            target,
            drafter,
            torch.tensor([prompt_ids]),
            k=k,
            max_new_tokens=16,
            capture_layer_ids=layer_ids,
            on_step=steps.append,
        )
        assert len(steps) == counters.num_drafts >= 1
        for step in steps:
            committed = prompt_ids + output[: step.position - len(prompt_ids) + 1]
            assert step.draft_token_ids == reference_drafts(target, drafter, committed, k, layer_ids)
            accepted = 0
            while accepted < k and step.draft_token_ids[accepted] == step.target_token_ids[accepted]:
                accepted += 1
            assert step.num_accepted == accepted


# ---------------------------------------------------------------------------------------------------------
# Metric definitions on rigged pairs


@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafter_that_always_agrees(zoo_target_dir: Callable[[str], Path], k: int) -> None:
    target, tokenizer, x_token, _ = make_constant_target(zoo_target_dir("tiny-llama"))
    drafter = make_constant_drafter(target, agree=True)
    max_new_tokens = 1 + 4 * (k + 1)  # prefill token + 4 full rounds: no truncation
    report = simulate_acceptance(target, tokenizer, drafter, PROMPTS[:2], k=k, max_new_tokens=max_new_tokens)
    assert all(r.output_token_ids == [x_token] * max_new_tokens for r in report.results)
    assert report.num_drafts == 2 * 4
    assert report.num_draft_tokens == report.num_accepted_tokens == 2 * 4 * k
    assert report.acceptance_rate == 1.0
    assert report.mean_acceptance_length == k + 1
    assert report.per_position_acceptance == [1.0] * k


def test_drafter_that_never_agrees(zoo_target_dir: Callable[[str], Path]) -> None:
    target, tokenizer, x_token, y_token = make_constant_target(zoo_target_dir("tiny-llama"))
    assert x_token != y_token
    drafter = make_constant_drafter(target, agree=False)
    report = simulate_acceptance(target, tokenizer, drafter, PROMPTS[:2], k=3, max_new_tokens=10)
    assert all(r.output_token_ids == [x_token] * 10 for r in report.results)
    assert report.num_drafts == 2 * 9  # one verified draft per token after the prefill's
    assert report.num_draft_tokens == 3 * 18
    assert report.num_accepted_tokens == 0
    assert report.acceptance_rate == 0.0
    assert report.mean_acceptance_length == 1.0
    assert report.per_position_acceptance == [0.0, 0.0, 0.0]


def test_last_round_truncated_by_max_tokens_counts_like_vllm(zoo_target_dir: Callable[[str], Path]) -> None:
    """vLLM counts a round's accepted drafts before the stop checks cut the output at max_tokens."""
    target, tokenizer, x_token, _ = make_constant_target(zoo_target_dir("tiny-llama"))
    drafter = make_constant_drafter(target, agree=True)
    # 1 (prefill) + 4 (round 1: 3 accepted + bonus) = 5, round 2 would give 9 but max is 6.
    report = simulate_acceptance(target, tokenizer, drafter, PROMPTS[:1], k=3, max_new_tokens=6)
    (result,) = report.results
    assert result.output_token_ids == [x_token] * 6 and result.finish_reason == "length"
    assert (report.num_drafts, report.num_draft_tokens, report.num_accepted_tokens) == (2, 6, 6)
    assert report.mean_acceptance_length == 4.0
    # A single output token: the request ends at the prefill, no draft is ever verified.
    single = simulate_acceptance(target, tokenizer, drafter, PROMPTS[:1], k=3, max_new_tokens=1)
    assert single.num_drafts == 0 and single.results[0].output_token_ids == [x_token]


def test_stops_at_eos_like_generate(zoo_target_dir: Callable[[str], Path]) -> None:
    target, tokenizer = load_target(zoo_target_dir("tiny-llama"))
    drafter = untrained_drafter(target)
    free_run = plain_greedy(target, tokenizer, PROMPTS[0], 16)
    eos = free_run[5]  # pretend the 6th generated token is the end of turn
    target.generation_config.eos_token_id = eos
    report = simulate_acceptance(target, tokenizer, drafter, PROMPTS[:1], k=3, max_new_tokens=16)
    (result,) = report.results
    assert result.output_token_ids == free_run[: free_run.index(eos) + 1]
    assert result.output_token_ids == plain_greedy(target, tokenizer, PROMPTS[0], 16)
    assert result.finish_reason == "stop"


def test_counters_match_vllm_formulas() -> None:
    counters = SpecCounters.empty(3)
    assert counters.acceptance_rate is None and counters.per_position_acceptance == []
    for accepted in (0, 3, 1, 2):
        counters = counters.observe(3, accepted)
    assert counters == SpecCounters(4, 12, 6, (3, 2, 1))
    assert counters.acceptance_rate == 6 / 12
    assert counters.mean_acceptance_length == 1 + 6 / 4
    assert counters.per_position_acceptance == [3 / 4, 2 / 4, 1 / 4]
    with pytest.raises(ValueError):
        counters.observe(3, 4)
    assert json.loads(json.dumps(counters.to_json()))["accepted_per_position"] == [3, 2, 1]
    # Cumulative readings difference back to what happened in between, of any per-position width.
    assert (counters + SpecCounters(1, 3, 1, (1.0,))) - counters == SpecCounters(1, 3, 1, (1, 0, 0))


def test_teacher_forced_estimate_on_rigged_pairs(zoo_target_dir: Callable[[str], Path]) -> None:
    target, tokenizer, x_token, _ = make_constant_target(zoo_target_dir("tiny-llama"))
    layer_ids = default_layer_ids(target)
    samples = []
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        sequence = torch.tensor(ids + [x_token] * 12)
        captured = capture_aux_hidden_states(target, sequence[None], layer_ids)
        assert captured.last is not None
        mask = (torch.arange(len(sequence)) >= len(ids)).to(torch.uint8)
        samples.append(
            {
                "input_ids": sequence,
                "loss_mask": mask,
                "aux_hidden": captured.aux[0],
                "last_hidden": captured.last[0],
            }
        )
    head = target.get_output_embeddings().weight
    agree = teacher_forced_acceptance(make_constant_drafter(target, agree=True), samples, head, k=3)
    # Starts whose next 3 tokens are all answer tokens: answer positions len(ids)-1 .. end-3, 10 each.
    assert agree.num_drafts == 3 * 10
    assert agree.acceptance_rate == 1.0 and agree.mean_acceptance_length == 4.0
    never = teacher_forced_acceptance(make_constant_drafter(target, agree=False), samples, head, k=3)
    assert never.acceptance_rate == 0.0 and never.mean_acceptance_length == 1.0


# ---------------------------------------------------------------------------------------------------------
# Layer-id guard


def test_refuses_layer_ids_the_drafter_was_not_trained_on(
    zoo_target_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    from draftloop.kernels.checkpoint import load_drafter, save_drafter

    target, tokenizer = load_target(zoo_target_dir("tiny-llama"))
    save_drafter(
        untrained_drafter(target, LayerIds((1, 3, 5))), tmp_path / "drafter", convention="layer_output"
    )
    drafter = load_drafter(tmp_path / "drafter")  # ids come back from the draftloop block, layer_input
    drafter.attach_embeddings(target.get_input_embeddings().weight)
    with pytest.raises(LayerIdMismatchError) as refused:
        simulate_acceptance(
            target, tokenizer, drafter, PROMPTS[:1], k=3, max_new_tokens=4, layer_ids=[2, 4, 5]
        )
    assert "[1, 3, 5]" in str(refused.value) and "[2, 4, 5]" in str(refused.value)
    with pytest.raises(LayerIdMismatchError, match="2 entries"):
        simulate_acceptance(
            target,
            tokenizer,
            drafter,
            PROMPTS[:1],
            k=3,
            max_new_tokens=4,
            layer_ids=[2, 4],
            allow_layer_mismatch=True,
        )
    forced = simulate_acceptance(
        target,
        tokenizer,
        drafter,
        PROMPTS[:1],
        k=3,
        max_new_tokens=4,
        layer_ids=[2, 4, 5],
        allow_layer_mismatch=True,
    )
    assert forced.layer_ids_forced and forced.capture_layer_ids == [2, 4, 5]
    assert forced.drafter_layer_ids == [1, 3, 5]
    same = simulate_acceptance(
        target, tokenizer, drafter, PROMPTS[:1], k=3, max_new_tokens=4, layer_ids=[1, 3, 5]
    )
    assert not same.layer_ids_forced


# ---------------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture(scope="module")
def cli_folders(
    zoo_target_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    from draftloop.kernels.checkpoint import save_drafter

    target_dir = zoo_target_dir("tiny-llama")
    target, _ = load_target(target_dir)
    root = tmp_path_factory.mktemp("sim-cli")
    save_drafter(untrained_drafter(target, LayerIds((1, 3, 5))), root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2]))
    )
    return {"target": target_dir, "drafter": root / "drafter", "prompts": prompts, "root": root}


def _run_cli(args: list[str]) -> Any:
    from typer.testing import CliRunner

    from draftloop.cli import app

    return CliRunner().invoke(app, args)


def test_cli_prints_json_report(cli_folders: dict[str, Path]) -> None:
    args = ["simulate", "--target", str(cli_folders["target"]), "--drafter", str(cli_folders["drafter"])]
    result = _run_cli(
        [*args, "--prompts", str(cli_folders["prompts"]), "-k", "2", "--max-new-tokens", "5", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["k"] == 2 and report["num_prompts"] == 2
    assert report["num_draft_tokens"] == 2 * report["num_drafts"]
    assert len(report["per_position_acceptance"]) == 2
    assert all(len(r["output_token_ids"]) == 5 for r in report["results"])

    plain = cli_folders["root"] / "prompts.txt"
    plain.write_text(PROMPTS[0] + "\n\n" + PROMPTS[1] + "\n")
    table = _run_cli([*args, "--prompts", str(plain), "--max-new-tokens", "3"])
    assert table.exit_code == 0, table.output
    assert "mean acceptance length" in table.output and "acceptance per draft position" in table.output


def test_cli_user_errors_exit_2(cli_folders: dict[str, Path]) -> None:
    args = ["simulate", "--target", str(cli_folders["target"]), "--drafter", str(cli_folders["drafter"])]
    bad = cli_folders["root"] / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    result = _run_cli([*args, "--prompts", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2" in result.output

    result = _run_cli([*args, "--prompts", str(cli_folders["root"] / "missing.jsonl")])
    assert result.exit_code == 2 and "missing.jsonl" in result.output

    prompts = ["--prompts", str(cli_folders["prompts"]), "--max-new-tokens", "3"]
    result = _run_cli([*args, *prompts, "--layer-ids", "2,4,5"])
    assert result.exit_code == 2
    assert "[1, 3, 5]" in result.output and "[2, 4, 5]" in result.output
    forced = _run_cli([*args, *prompts, "--layer-ids", "2,4,5", "--force-layer-ids", "--json"])
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout)["capture_layer_ids"] == [2, 4, 5]
