"""Engine-independent acceptance simulator for EAGLE-3 drafters.

Greedy chain speculative decoding with a Hugging Face target and an `Eagle3Drafter` in one process,
reproducing what vLLM v1 does so that its acceptance figures can be predicted (and checked) without an
engine:

- the proposer: `vllm/v1/spec_decode/llm_base_proposer.py` (`SpecDecodeBaseProposer.propose`), the
  EAGLE-3 drafter model `vllm/model_executor/models/llama_eagle3.py`;
- the greedy verification (rejection sampler with temperature 0): accept the longest prefix of drafts
  the target's argmax agrees with, plus one bonus token from the target;
- the counters: `vllm/v1/spec_decode/metrics.py` (`SpecDecodingStats.observe_draft`), observed by the
  scheduler's `update_from_output` once per scheduled draft, BEFORE the stop checks truncate the step's
  tokens (so accepted tokens past EOS or max_tokens still count, as in vLLM).

Also `teacher_forced_acceptance`: a cheap estimate from stored hidden-state shards (no generation), for
per-epoch validation during training.

This module imports only torch, transformers and draftloop.kernels (it must run alone on a GPU box).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from .attention import Chain, Decode, KVPair
from .capture import capture_aux_hidden_states
from .counters import SpecCounters
from .layer_ids import LayerIds

if TYPE_CHECKING:
    from .drafter import Eagle3Drafter

__all__ = [
    "LayerIdMismatchError",
    "PromptResult",
    "SimulationInputError",
    "SimulationReport",
    "StepRecord",
    "encode_prompt",
    "resolve_capture_layer_ids",
    "simulate_acceptance",
    "speculative_generate",
    "stop_token_ids",
    "teacher_forced_acceptance",
]

FinishReason = Literal["stop", "length"]


class SimulationInputError(ValueError):
    """A user input the simulator cannot run with (the message names it)."""


class LayerIdMismatchError(SimulationInputError):
    """The layer ids requested for capture are not the ones the drafter was trained on (or are invalid)."""


# ---------------------------------------------------------------------------------------------------------
# Report


@dataclass
class PromptResult:
    prompt: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_drafts: int
    num_accepted_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "num_drafts": self.num_drafts,
            "num_accepted_tokens": self.num_accepted_tokens,
        }


@dataclass
class SimulationReport:
    """What `simulate_acceptance` measured: vLLM-style counters over all prompts, and the outputs."""

    k: int
    max_new_tokens: int
    counters: SpecCounters
    results: list[PromptResult]
    elapsed_s: float
    capture_layer_ids: list[int]  # layer_input convention: the ids actually captured
    drafter_layer_ids: list[int]  # layer_input convention: the ids the drafter was trained on
    layer_ids_forced: bool = False

    @property
    def num_drafts(self) -> int:
        return int(self.counters.num_drafts)

    @property
    def num_draft_tokens(self) -> int:
        return int(self.counters.num_draft_tokens)

    @property
    def num_accepted_tokens(self) -> int:
        return int(self.counters.num_accepted_tokens)

    @property
    def accepted_per_position(self) -> list[int]:
        return [int(count) for count in self.counters.accepted_per_position]

    @property
    def acceptance_rate(self) -> float | None:
        return self.counters.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.counters.mean_acceptance_length

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.counters.per_position_acceptance

    @property
    def num_output_tokens(self) -> int:
        return sum(len(result.output_token_ids) for result in self.results)

    @property
    def tokens_per_second(self) -> float | None:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "max_new_tokens": self.max_new_tokens,
            **self.counters.to_json(),
            "num_prompts": len(self.results),
            "num_output_tokens": self.num_output_tokens,
            "elapsed_s": self.elapsed_s,
            "tokens_per_second": self.tokens_per_second,
            "capture_layer_ids": self.capture_layer_ids,
            "drafter_layer_ids": self.drafter_layer_ids,
            "layer_ids_forced": self.layer_ids_forced,
            "results": [result.to_json() for result in self.results],
        }


# ---------------------------------------------------------------------------------------------------------
# Layer-id guard


def resolve_capture_layer_ids(
    drafter: Eagle3Drafter,
    layer_ids: LayerIds | Sequence[int] | None,
    *,
    allow_layer_mismatch: bool = False,
    num_target_layers: int | None = None,
) -> LayerIds:
    """The ids to capture from the target (layer_input convention).

    None = the drafter's own. Ids other than the drafter's are refused unless `allow_layer_mismatch`
    (to measure what a convention slip costs); their number must match the drafter's fc either way.
    """
    trained = drafter.config.aux_layer_ids.to("layer_input")
    try:
        if layer_ids is None:
            requested = trained
        elif isinstance(layer_ids, LayerIds):
            requested = layer_ids.to("layer_input")
        else:
            requested = LayerIds(tuple(layer_ids), "layer_input")
        if num_target_layers is not None:
            requested.validate(num_target_layers)
    except ValueError as error:
        raise LayerIdMismatchError(f"capture layer ids: {error}") from None
    if len(requested) != len(trained):
        raise LayerIdMismatchError(
            f"capture layer ids {list(requested.ids)} have {len(requested)} entries but the drafter fuses "
            f"{len(trained)} target layers (trained on layer_input ids {list(trained.ids)})"
        )
    if requested.ids != trained.ids and not allow_layer_mismatch:
        raise LayerIdMismatchError(
            f"the drafter was trained on target layer ids {list(trained.ids)} (layer_input convention) "
            f"but capture was asked for {list(requested.ids)}; refusing to simulate with layers the drafter "
            "never saw (pass allow_layer_mismatch=True / --force-layer-ids to measure the effect anyway)"
        )
    return requested


# ---------------------------------------------------------------------------------------------------------
# The speculative step


@dataclass(frozen=True)
class StepRecord:
    """One verified draft, for tracing: the newest token's position P, the k drafts, the target's
    greedy choice after each of [t_P, d_1..d_k], and how many drafts were accepted."""

    position: int
    draft_token_ids: list[int]
    target_token_ids: list[int]
    num_accepted: int


def _greedy_draft(drafter: Eagle3Drafter, prenorm_hidden: Tensor) -> Tensor:
    """The drafter's greedy token, in TARGET ids: argmax over the draft vocabulary, mapped with d2t.

    (vLLM scatters the draft logits into a -inf target-vocabulary row and takes the argmax there; the
    same token unless two draft logits tie.)"""
    draft_ids = drafter.logits(prenorm_hidden).argmax(dim=-1)
    return drafter.to_target_ids(draft_ids)


def _is_stop(token: int, num_output_tokens: int, max_new_tokens: int, eos_token_ids: frozenset[int]) -> bool:
    """vLLM's `check_stop`: EOS / stop token first, then the length cap."""
    return token in eos_token_ids or num_output_tokens >= max_new_tokens


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    drafter: Eagle3Drafter,
    prompt_ids: Tensor,
    *,
    k: int,
    max_new_tokens: int,
    capture_layer_ids: LayerIds,
    eos_token_ids: Iterable[int] = (),
    on_step: Callable[[StepRecord], None] | None = None,
    follow: Sequence[int] | None = None,
) -> tuple[list[int], FinishReason, SpecCounters]:
    """Greedy chain speculative decoding of one prompt ([1, L] token ids); returns the output token ids
    (EOS included when hit), the finish reason and the counters of this prompt.

    `follow`: a recorded output (an engine's) to replay: its tokens stand for the target's greedy
    choices, so drafts are verified against that text and it ends where that output ended.

    Notation: position q of the sequence holds token t_q; the target's hidden state at q (aux layers
    fused by fc) predicts t_{q+1}. The drafter at position q sees (target hidden at q, token t_{q+1}) and
    predicts t_{q+2}: its input ids are the target's shifted left by one.
    """
    from transformers import DynamicCache

    if k < 1:
        raise ValueError(f"k (draft tokens per step) must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop_ids = frozenset(int(t) for t in eos_token_ids)
    if follow is not None:
        max_new_tokens = min(max_new_tokens, max(len(follow), 1))
    device = prompt_ids.device
    drafter_dtype = drafter.fc.weight.dtype
    counters = SpecCounters.empty(k)
    target_config: Any = getattr(target, "config", None)
    cache = DynamicCache(config=target_config)

    # Prefill: the target reads the prompt (positions 0..L-1) and its argmax gives the first token.
    logits, aux_hidden = _target_forward(target, prompt_ids, capture_layer_ids, cache)
    next_token = _followed(logits[:, -1:].argmax(dim=-1), follow, 0)  # [1, 1]
    output: list[int] = [int(next_token)]
    finished: FinishReason | None = None
    if _is_stop(output[-1], len(output), max_new_tokens, stop_ids):
        finished = "stop" if output[-1] in stop_ids else "length"

    # What the drafter has not seen yet: target hidden states at positions start.. and the tokens one
    # to the right of them (the last one is the target's newest token, not yet in the target's cache).
    pending_hidden = aux_hidden.to(drafter_dtype)  # [1, T, 3*Ht]
    pending_tokens = torch.cat([prompt_ids[:, 1:], next_token], dim=1)  # [1, T]
    pending_start = 0
    # The drafter's K/V for verified positions 0..start-1, all from passes over TARGET hidden states.
    drafter_kv: KVPair | None = None

    while finished is None:
        # ---- propose k drafts (vLLM: SpecDecodeBaseProposer.propose) --------------------------------
        # Step 0, the "first pass": positions start..P-1 with the target's fused hidden states. Its K/V
        # are kept for good: these positions are verified. Its last row predicts the token after the
        # newest one, t_{P+1}.
        positions = torch.arange(pending_start, pending_start + pending_tokens.shape[1], device=device)
        hidden, first_kv = drafter(
            drafter.fuse(pending_hidden),
            pending_tokens,
            positions.unsqueeze(0),
            Decode(past=[drafter_kv] if drafter_kv is not None else []),
        )
        drafter_kv = first_kv if drafter_kv is None else _cat_kv(drafter_kv, first_kv)
        hidden = hidden[:, -1:]  # prenorm hidden at position P-1
        draft = _greedy_draft(drafter, hidden)  # [1, 1], target id
        drafts = [draft]
        # Steps 1..k-1, the chain: one position further each step, fed the drafter's own prenorm hidden
        # state and its own last draft; the chain's K/V are only visible to later chain steps.
        chain_kv: list[KVPair] = [drafter_kv]
        position = positions[-1:]
        for _ in range(k - 1):
            position = position + 1
            hidden, step_kv = drafter(hidden, draft, position.unsqueeze(0), Decode(past=chain_kv))
            chain_kv.append(step_kv)
            draft = _greedy_draft(drafter, hidden)
            drafts.append(draft)
        draft_ids = torch.cat(drafts, dim=1)  # [1, k]

        # ---- verify: ONE target forward over [t_P, d_1..d_k] at positions P..P+k ----------------------
        verified_len = _cache_length(cache)  # = P, the newest token's position
        logits, aux_hidden = _target_forward(
            target, torch.cat([next_token, draft_ids], dim=1), capture_layer_ids, cache
        )
        # [1, k+1]: target's greedy token after each input (output positions len(output)..)
        target_choice = _followed(logits.argmax(dim=-1), follow, len(output))
        # d_i is accepted iff the target picks it after [.., t_P, d_1..d_{i-1}] and all before it were.
        agree = (target_choice[0, :k] == draft_ids[0]).to(torch.int64)
        num_accepted = int(agree.cumprod(dim=0).sum())
        bonus = target_choice[:, num_accepted : num_accepted + 1]  # the target's own next token
        # Counted before the stop checks truncate the step, as vLLM's scheduler does.
        counters = counters.observe(k, num_accepted)
        if on_step is not None:
            on_step(StepRecord(verified_len, draft_ids[0].tolist(), target_choice[0].tolist(), num_accepted))

        # Roll back the target's cache: keep t_P, d_1..d_accepted (positions P..P+accepted).
        _crop_cache(cache, verified_len + num_accepted + 1)
        for token in [*draft_ids[0, :num_accepted].tolist(), int(bonus)]:
            output.append(int(token))
            if _is_stop(output[-1], len(output), max_new_tokens, stop_ids):
                finished = "stop" if output[-1] in stop_ids else "length"
                break

        # The drafter's next first pass: target hidden at P..P+accepted, tokens shifted by one
        # (d_1..d_accepted, then the bonus token). Rejected drafts leave no trace in drafter_kv.
        pending_hidden = aux_hidden[:, : num_accepted + 1].to(drafter_dtype)
        pending_tokens = torch.cat([draft_ids[:, :num_accepted], bonus], dim=1)
        pending_start = verified_len
        next_token = bonus

    return output, finished, counters


def _followed(choice: Tensor, follow: Sequence[int] | None, start: int) -> Tensor:
    """`choice` ([1, T] greedy tokens for output positions start..start+T-1) with the positions `follow`
    records replaced by its tokens; past its end the target's own choices stand (vLLM counts a step's
    accepted drafts before its stop check truncates them)."""
    known = list(follow[start : start + choice.shape[1]]) if follow is not None else []
    if not known:
        return choice
    replaced = choice.clone()
    replaced[0, : len(known)] = torch.tensor(known, dtype=choice.dtype, device=choice.device)
    return replaced


def _target_forward(
    target: nn.Module, input_ids: Tensor, layer_ids: LayerIds, cache: Any
) -> tuple[Tensor, Tensor]:
    """One incremental target forward (extends `cache`): logits [1, T, V] and aux hidden [1, T, 3*Ht]."""
    captured = capture_aux_hidden_states(
        target, input_ids, layer_ids, want_last=False, want_logits=True, past_key_values=cache
    )
    assert captured.logits is not None
    return captured.logits, captured.aux


def _cat_kv(past: KVPair, new: KVPair) -> KVPair:
    return torch.cat([past[0], new[0]], dim=-2), torch.cat([past[1], new[1]], dim=-2)


def _cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def _crop_cache(cache: Any, keep: int) -> None:
    """Drop the target cache's entries past `keep` positions (negative crop = remove that many)."""
    excess = _cache_length(cache) - keep
    if excess > 0:
        cache.crop(-excess)


# ---------------------------------------------------------------------------------------------------------
# Public entry point


def encode_prompt(tokenizer: Any, prompt: str, *, apply_chat_template: bool = True) -> list[int]:
    """The prompt as the engine's chat endpoint sends it: rendered by the tokenizer's chat template
    (with the generation prompt), then tokenized without adding special tokens again."""
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise SimulationInputError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "pass apply_chat_template=False to send raw prompts"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def stop_token_ids(target: nn.Module, tokenizer: Any) -> frozenset[int]:
    """vLLM stops on the tokenizer's EOS plus every eos_token_id of the model's generation config."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(target, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))
    return frozenset(ids)


def simulate_acceptance(
    target: nn.Module,
    tokenizer: Any,
    drafter: Eagle3Drafter,
    prompts: Sequence[str],
    k: int = 3,
    max_new_tokens: int = 64,
    device: torch.device | str | None = None,
    *,
    layer_ids: LayerIds | Sequence[int] | None = None,
    allow_layer_mismatch: bool = False,
    apply_chat_template: bool = True,
    follow_token_ids: Sequence[Sequence[int]] | None = None,
) -> SimulationReport:
    """Run greedy chain speculation over `prompts` (one at a time) and report vLLM's acceptance metrics.

    `follow_token_ids`: per prompt, a recorded output to replay (see `speculative_generate`'s `follow`).

    `layer_ids`: the target layers to capture (layer_input convention); None = the ones the drafter was
    trained on. Others raise LayerIdMismatchError unless `allow_layer_mismatch`.
    The drafter must already have the target's embedding attached (`attach_embeddings`).
    """
    if not prompts:
        raise SimulationInputError("no prompts to simulate")
    num_layers = int(getattr(target.config, "num_hidden_layers", 0)) or None
    capture_ids = resolve_capture_layer_ids(
        drafter, layer_ids, allow_layer_mismatch=allow_layer_mismatch, num_target_layers=num_layers
    )
    run_device = torch.device(device) if device is not None else next(target.parameters()).device
    target.to(run_device).eval()
    drafter.to(run_device).eval()
    stop_ids = stop_token_ids(target, tokenizer)

    counters = SpecCounters.empty(k)
    results: list[PromptResult] = []
    elapsed = 0.0
    if follow_token_ids is not None and len(follow_token_ids) != len(prompts):
        raise SimulationInputError(f"{len(follow_token_ids)} outputs to follow for {len(prompts)} prompts")
    for index, prompt in enumerate(prompts):
        prompt_ids = encode_prompt(tokenizer, prompt, apply_chat_template=apply_chat_template)
        started = time.perf_counter()
        output, finish_reason, local = speculative_generate(
            target,
            drafter,
            torch.tensor([prompt_ids], device=run_device),
            k=k,
            max_new_tokens=max_new_tokens,
            capture_layer_ids=capture_ids,
            eos_token_ids=stop_ids,
            follow=follow_token_ids[index] if follow_token_ids is not None else None,
        )
        counters += local
        elapsed += time.perf_counter() - started
        results.append(
            PromptResult(
                prompt=prompt,
                prompt_token_ids=prompt_ids,
                output_token_ids=output,
                text=tokenizer.decode(output, skip_special_tokens=True),
                finish_reason=finish_reason,
                num_drafts=int(local.num_drafts),
                num_accepted_tokens=int(local.num_accepted_tokens),
            )
        )
    trained = drafter.config.aux_layer_ids.to("layer_input")
    return SimulationReport(
        k=k,
        max_new_tokens=max_new_tokens,
        counters=counters,
        results=results,
        elapsed_s=elapsed,
        capture_layer_ids=list(capture_ids.ids),
        drafter_layer_ids=list(trained.ids),
        layer_ids_forced=capture_ids.ids != trained.ids,
    )


# ---------------------------------------------------------------------------------------------------------
# Teacher-forced estimate (no generation)


def _target_logits(target_head: nn.Module | Tensor, last_hidden: Tensor) -> Tensor:
    if isinstance(target_head, Tensor):
        return torch.nn.functional.linear(last_hidden, target_head.to(last_hidden.dtype))
    return target_head(last_hidden)


@torch.inference_mode()
def teacher_forced_acceptance(
    drafter: Eagle3Drafter,
    samples: Iterable[Mapping[str, Tensor]],
    target_head: nn.Module | Tensor,
    k: int = 3,
    *,
    max_samples: int | None = None,
) -> SpecCounters:
    """Estimate acceptance from stored hidden states (shard samples: `input_ids`, `loss_mask`,
    `aux_hidden`, `last_hidden`), without running the target. Counted as if every eligible start
    position were one verified draft (num_drafts = eligible start positions).

    For every start position p whose next k tokens are assistant tokens, the drafter proposes a chain
    exactly as the engine would after verifying t_0..t_p with t_{p+1} as the bonus token: step 0 from
    the target's stored hidden states, steps 1..k-1 from its own hidden states and drafts (all start
    positions at once, each chain masked to see only the first pass up to p and itself). Draft i is
    accepted when it and all before it equal the target's argmax a_{p+i} = argmax lm_head(last_hidden
    at p+i). Exact for data that is the target's own greedy output (then t_{p+i} = a_{p+i-1}, so the
    stored hidden states are the ones the target would compute); an estimate otherwise. Averaged over
    positions rather than over rounds, so it weighs long and short acceptance runs slightly differently
    from a real decode.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    estimate = SpecCounters.empty(k)
    weight = drafter.fc.weight
    device, dtype = weight.device, weight.dtype
    for index, sample in enumerate(samples):
        if max_samples is not None and index >= max_samples:
            break
        input_ids = sample["input_ids"].to(device=device, dtype=torch.long)
        loss_mask = sample["loss_mask"].to(device=device).bool()
        length = int(input_ids.shape[0])
        num_rows = length - 1  # first-pass rows: position q pairs hidden(q) with token q+1
        if num_rows < k:
            continue
        aux_hidden = sample["aux_hidden"].to(device=device, dtype=dtype)
        last_hidden = sample["last_hidden"].to(device=device)
        target_choice = _target_logits(target_head, last_hidden).argmax(dim=-1)  # a_q, [length]

        positions = torch.arange(num_rows, device=device)
        hidden, first_kv = drafter(drafter.fuse(aux_hidden[None, :-1]), input_ids[None, 1:], positions[None])
        drafts = [_greedy_draft(drafter, hidden)[0]]  # draft 1 of the chain started at p: [num_rows]
        # Chain steps for all starts at once: each row sees the first pass up to its start (like the
        # engine's drafter after verifying up to there) and, on the diagonal, the K/V of its own earlier
        # chain steps (and its own key).
        chain_kv: list[KVPair] = []
        for step in range(1, k):
            hidden, step_kv = drafter(
                hidden,
                drafts[-1][None],
                (positions + step)[None],
                Chain(past=[first_kv], earlier=list(chain_kv)),
            )
            chain_kv.append(step_kv)
            drafts.append(_greedy_draft(drafter, hidden)[0])

        # Start p is eligible when a_{p+1}..a_{p+k} exist and t_{p+1}..t_{p+k} are assistant tokens.
        starts = torch.arange(length - k, device=device)
        eligible = torch.stack([loss_mask[starts + i] for i in range(1, k + 1)]).all(dim=0)
        if not bool(eligible.any()):
            continue
        agree = torch.stack([drafts[i - 1][starts] == target_choice[starts + i] for i in range(1, k + 1)])
        accepted_prefix = agree.to(torch.int64).cumprod(dim=0)[:, eligible]  # [k, eligible starts]
        num_starts = int(eligible.sum())
        estimate += SpecCounters(
            num_drafts=float(num_starts),
            num_draft_tokens=float(k * num_starts),
            num_accepted_tokens=float(accepted_prefix.sum()),
            accepted_per_position=tuple(float(count) for count in accepted_prefix.sum(dim=1).tolist()),
        )
    return estimate
