"""Session fixtures for the simulator tests: zoo targets, rigged target/drafter pairs, trained drafters.

Imported by tests/conftest.py. Everything expensive is built once per session and cached here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from draftloop.kernels.capture import conversation_samples

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTIN_PROMPTS = REPO_ROOT / "draftloop" / "data" / "prompts.jsonl"

# The acceptance-training recipe: small enough for ~1-2 CPU minutes per target, enough data that a
# drafter generalises to held-out prompts.
NUM_TRAIN_PROMPTS = 200
NUM_HELD_OUT_PROMPTS = 8
ANSWER_TOKENS = 48
TRAIN_EPOCHS = 4
TRAIN_LR = 3e-3
TRAIN_TTT_LENGTH = 3


def builtin_prompts() -> list[str]:
    rows = [json.loads(line) for line in BUILTIN_PROMPTS.read_text().splitlines() if line.strip()]
    return [str(row["prompt"]) for row in rows]


@pytest.fixture(scope="session")
def zoo_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """recipe -> folder of that zoo target (seed 0), built once per session."""
    from draftloop.infra.targets.zoo import create_tiny_model

    root = tmp_path_factory.mktemp("sim-zoo")
    built: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in built:
            built[recipe] = create_tiny_model(recipe, root / recipe, seed=0)
        return built[recipe]

    return get


def load_target(folder: Path) -> tuple[Any, Any]:
    """A fresh float32 copy of the target and its tokenizer (tests may modify the weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def default_layer_ids(target: Any) -> Any:
    """The aux layer ids the target's family picks for its depth."""
    from draftloop.kernels.families.base import family_for_config

    return family_for_config(target.config).default_aux_layer_ids(int(target.config.num_hidden_layers))


def untrained_drafter(target: Any, layer_ids: Any = None, seed: int = 0, **config_kwargs: Any) -> Any:
    """A randomly initialised drafter shaped for `target`, with its embedding attached."""
    from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter

    torch.manual_seed(seed)
    config = DrafterConfig.for_target(target.config, layer_ids or default_layer_ids(target), **config_kwargs)
    drafter = Eagle3Drafter(config).eval()
    drafter.attach_embeddings(target.get_input_embeddings().weight)
    return drafter


def plain_greedy(target: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation of the chat-templated prompt (Hugging Face generate)."""
    from draftloop.kernels.simulate import encode_prompt

    prompt_ids = torch.tensor([encode_prompt(tokenizer, prompt)])
    with torch.no_grad():
        out = target.generate(prompt_ids, do_sample=False, max_new_tokens=max_new_tokens)
    return list(out[0, prompt_ids.shape[1] :].tolist())


@torch.no_grad()
def reference_drafts(target: Any, drafter: Any, tokens: list[int], k: int, layer_ids: Any) -> list[int]:
    """vLLM's proposal recomputed from scratch (no caches): `tokens` = t_0..t_P, t_P the newest token.

    First pass over positions 0..P-1 (target hidden at q, token q+1), then k-1 chain steps."""
    from draftloop.kernels.attention import Decode
    from draftloop.kernels.capture import capture_aux_hidden_states

    length = len(tokens) - 1
    captured = capture_aux_hidden_states(target, torch.tensor([tokens[:-1]]), layer_ids, want_last=False)
    hidden, first_kv = drafter(
        drafter.fuse(captured.aux), torch.tensor([tokens[1:]]), torch.arange(length)[None]
    )
    hidden = hidden[:, -1:]
    draft = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))
    drafts = [int(draft)]
    past = [first_kv]
    for step in range(1, k):
        hidden, kv = drafter(hidden, draft, torch.tensor([[length - 1 + step]]), Decode(past=past))
        past.append(kv)
        draft = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))
        drafts.append(int(draft))
    return drafts


# ---------------------------------------------------------------------------------------------------------
# Rigged pairs: a target whose greedy output is one constant token, drafters that always / never agree


def _zero_layer_outputs(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
            param.zero_()


@torch.no_grad()
def make_constant_target(folder: Path) -> tuple[Any, Any, int, int]:
    """(target, tokenizer, X, Y): the target always predicts token X; Y is the token it ranks last.

    Decoder layers contribute nothing, every embedding gets a large positive dimension 0 and the final
    norm keeps only that dimension, so the logits are lm_head[:, 0] times a positive factor whatever the
    context."""
    target, tokenizer = load_target(folder)
    _zero_layer_outputs(target)
    target.get_input_embeddings().weight[:, 0] = 10.0
    norm = target.model.norm.weight
    norm.zero_()
    norm[0] = 1.0
    column = target.get_output_embeddings().weight[:, 0]
    return target, tokenizer, int(column.argmax()), int(column.argmin())


@torch.no_grad()
def make_constant_drafter(target: Any, agree: bool) -> Any:
    """A drafter for `make_constant_target` whose every draft is X (agree) or Y (never agrees).

    Its attention and MLP add nothing, fc copies dimension 0 of the first aux layer (always 10), so its
    hidden state is 10*e_0 at every step; norm and lm_head then rank like the target (or reversed)."""
    drafter = untrained_drafter(target)
    _zero_layer_outputs(drafter)
    drafter.fc.weight.zero_()
    drafter.fc.weight[0, 0] = 1.0
    drafter.norm.weight.zero_()
    drafter.norm.weight[0] = 1.0
    head = target.get_output_embeddings().weight
    drafter.lm_head.weight.copy_(head if agree else -head)
    return drafter


@torch.no_grad()
def make_lookup_drafter(target: Any, seed: int = 0, memorise: Sequence[Sequence[int]] = ()) -> Any:
    """A drafter that is often right about its first draft, built without training.

    tiny-llama is close to a Markov chain, t_{q+1} ~ f(t_q) with f(t) = argmax lm_head(norm(embed t)).
    The drafter at position q must guess t_{q+2} ~ f(f(t_q)); its fc copies the first aux layer (close to
    embed t_q) and its lm_head holds, for each token v, the sum of the normalised embeddings of the tokens
    t with f(f(t)) = v. A target that is no Markov chain (tiny-deepseek's next token also depends on
    tokens further back) gets t -> t' pairs two apart read from `memorise` (token sequences it produced)
    instead. Attention and MLP keep their random initialisation (so its K/V matter); the chain steps
    mostly repeat the first draft, so acceptance is partial."""
    drafter = untrained_drafter(target, seed=seed)
    embed = target.get_input_embeddings().weight
    normalised = embed / embed.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    markov_next = ((target.model.norm.weight * normalised) @ target.get_output_embeddings().weight.T).argmax(
        -1
    )
    two_ahead = markov_next[markov_next]
    for tokens in memorise:
        for token, after_next in zip(tokens, tokens[2:], strict=False):
            two_ahead[token] = after_next
    hidden = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, :hidden] = torch.eye(hidden)
    lookup = torch.zeros_like(drafter.lm_head.weight)
    lookup.index_add_(0, two_ahead, normalised)
    drafter.lm_head.weight.copy_(lookup)
    return drafter


# ---------------------------------------------------------------------------------------------------------
# Trained drafters (slow tests)


@dataclass
class TrainedPair:
    recipe: str
    target_dir: Path
    target: Any
    tokenizer: Any
    drafter: Any
    untrained: Any
    held_out_prompts: list[str]
    train_samples: list[dict[str, torch.Tensor]]
    timings: dict[str, float] = field(default_factory=dict)
    simulations: dict[str, Any] = field(default_factory=dict)  # reports cached across tests

    def simulate(self, key: str, drafter: Any, **kwargs: Any) -> Any:
        """simulate_acceptance on the held-out prompts (k=3, ANSWER_TOKENS), cached under `key`."""
        from draftloop.kernels.simulate import simulate_acceptance

        if key not in self.simulations:
            options = {"k": 3, "max_new_tokens": ANSWER_TOKENS, **kwargs}
            self.simulations[key] = simulate_acceptance(
                self.target, self.tokenizer, drafter, self.held_out_prompts, **options
            )
        return self.simulations[key]

    def held_out_samples(self, layer_ids: Any) -> list[dict[str, torch.Tensor]]:
        """Shard samples of the held-out prompts with their greedy answers (the trained drafter's
        simulated outputs, which equal the target's greedy decode), captured at `layer_ids`."""
        outputs = self.simulate("trained", self.drafter).results
        conversations = [(result.prompt_token_ids, result.output_token_ids) for result in outputs]
        return conversation_samples(self.target, conversations, layer_ids)


Conversation = tuple[list[int], list[int]]  # (chat-templated prompt ids, answer ids)


def greedy_answers(
    target: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, batch_size: int = 32
) -> list[Conversation]:
    """The target's own greedy answers to `prompts` (batched, left-padded generate)."""
    from draftloop.kernels.simulate import encode_prompt

    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    pad = int(tokenizer.pad_token_id or 0)
    conversations: list[Conversation] = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chunk])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
        with torch.no_grad():
            generated = target.generate(
                input_ids,
                attention_mask=attention,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
        conversations.extend(zip(chunk, generated[:, width:].tolist(), strict=True))
    return conversations


def greedy_samples(
    target: Any, tokenizer: Any, prompts: list[str], layer_ids: Any, max_new_tokens: int
) -> list[dict[str, torch.Tensor]]:
    """The target's own greedy answers to `prompts`, with the hidden states a shard would hold."""
    return conversation_samples(target, greedy_answers(target, tokenizer, prompts, max_new_tokens), layer_ids)


def trained_drafter(
    target: Any, layer_ids: Any, samples: list[dict[str, torch.Tensor]], **config: Any
) -> Any:
    """A drafter for `target` (DrafterConfig fields in `config`, e.g. variant="eagle3.1") trained on
    `samples` with the pairs' settings."""
    from draftloop.kernels.data import InMemorySamples
    from draftloop.kernels.train import TrainConfig, train_drafter

    drafter = untrained_drafter(target, layer_ids, **config)
    drafter.init_from_target_head(target.get_output_embeddings().weight, target.model.norm.weight)
    settings = TrainConfig(
        ttt_length=TRAIN_TTT_LENGTH, epochs=TRAIN_EPOCHS, batch_size=8, lr=TRAIN_LR, show_progress=False
    )
    train_drafter(drafter, InMemorySamples(samples), target.get_output_embeddings().weight, settings)
    return drafter.eval()


def train_pair(recipe: str, target_dir: Path) -> TrainedPair:
    timings: dict[str, float] = {}
    target, tokenizer = load_target(target_dir)
    prompts = builtin_prompts()
    train_prompts, held_out = prompts[:NUM_TRAIN_PROMPTS], prompts[-NUM_HELD_OUT_PROMPTS:]
    layer_ids = default_layer_ids(target)

    started = time.perf_counter()
    samples = greedy_samples(target, tokenizer, train_prompts, layer_ids, ANSWER_TOKENS)
    timings["data_s"] = time.perf_counter() - started

    untrained = untrained_drafter(target, layer_ids)
    started = time.perf_counter()
    drafter = trained_drafter(target, layer_ids, samples)
    timings["train_s"] = time.perf_counter() - started
    return TrainedPair(
        recipe=recipe,
        target_dir=target_dir,
        target=target,
        tokenizer=tokenizer,
        drafter=drafter,
        untrained=untrained,
        held_out_prompts=held_out,
        train_samples=samples,
        timings=timings,
    )


@pytest.fixture(scope="session")
def trained_pair(zoo_target_dir: Callable[[str], Path]) -> Callable[[str], TrainedPair]:
    """recipe -> target + drafter trained on the target's greedy answers to the built-in prompts."""
    built: dict[str, TrainedPair] = {}

    def get(recipe: str) -> TrainedPair:
        if recipe not in built:
            built[recipe] = train_pair(recipe, zoo_target_dir(recipe))
        return built[recipe]

    return get
