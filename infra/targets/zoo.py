"""The model zoo: tiny random-weight targets built locally and deterministically (no hub access).

`create_tiny_model("tiny-llama", out_dir, seed)` writes an ordinary Hugging Face folder
(config.json, generation_config.json, model.safetensors, tokenizer files with a chat template) that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load offline and vLLM (CPU)
serves. The same recipe and seed give byte-identical files. The recipes themselves (one per target family:
Llama, DeepSeek-V3, and Qwen3, OLMo-2 and Gemma 3, which no family module covers) are in
infra/targets/recipes.py.

Random weights at the usual initializer scale give degenerate greedy output (one token repeated, or
the same text whatever the prompt). The recipes therefore reshape the initial weights so that the
target behaves like a noisy, context-dependent Markov chain over its vocabulary: the embedding
dominates the residual stream (the next token depends strongly on the current one), the decoder
layers add a smaller context-dependent term (outputs differ between prompts), and special tokens are
never predicted (continuations run to max_new_tokens). Such a target has structure a drafter can
learn in a few CPU minutes, which is what the demo and the tests need.

Measured when the scales were chosen (seed 0, 80 prompts x 48 greedy tokens): a trigram lookup
table built from 64 continuations predicts 77-78% of the next tokens of the 16 others and reaches a
mean acceptance length of about 2.6 at k=3, while 74-77 of the 80 continuations are distinct. With
layer_output_scale 1 nearly half the prompts gave the same text; at 3 the lookup fell to AL 2.2.
End to end with draftloop's own kernels (run on the H200 box; 256 synthesized answers of 96 tokens,
aux layers [1, 3, 5] / [1, 2, 3], TTT 7, 8 epochs, lr 3e-3), the simulated mean acceptance length at
k=3 on 16 held-out prompts was 3.3 for tiny-llama and 3.4 for tiny-deepseek (before its code rule,
below); 64 optimizer steps already gave 2.4-2.7.

Adjacent layers' hidden states of such a target are nearly identical (cosine 0.999: the embedding
dominates), so a drafter fed layers shifted by one barely notices, unlike in real LLMs where an
off-by-one layer id collapses acceptance. Both recipes therefore carry a per-layer marker in reserved
hidden dimensions (`_add_layer_markers`; adjacent-layer cosine 0.25-0.55). Measured with the test
suite's training recipe (tests/fixtures_kernels.py: 200 prompts x 48 tokens, TTT 3, 4 epochs; 8
held-out prompts, k=3), seed 0, as mean acceptance length / acceptance rate, trained layers vs the
same drafter fed layers shifted by one:
  tiny-llama, marker 20, [1, 3, 5] vs [0, 2, 4]: 2.84 / 0.61 vs 1.97 / 0.33 (no marker: 2.56 / 0.52 vs
  2.53 / 0.51; marker 16: 2.94 / 0.65 vs 2.35 / 0.45; marker 32: 2.42 / 0.47 vs 1.43 / 0.14).
  tiny-deepseek before its code rule, marker 28, [1, 2, 3] vs [0, 1, 2]: 2.50 / 0.50 vs 1.80 / 0.27
  (no marker: 2.61 / 0.54 vs 2.54 / 0.51; marker 20: 2.35 / 0.45 vs 2.00 / 0.33).

Decisive logits (tiny-deepseek). vLLM's CPU MLA backend serves tiny-deepseek in bf16 only (it packs
only bf16 weights), while a reference may run in float32. With random output weights the top two
logits are often within one bf16 step: on the cycle's 16 eval prompts x 64 greedy tokens, 11.9% of
steps had a float32 top-2 gap below 2 bf16 steps, and bf16 and float32 transformers gave the same text
for only 3 of 16 prompts (flips at gaps of 0.01-2 steps). Scaling the head or the embedding does not
help (the gap and the bf16 step scale together). tiny-deepseek therefore computes its next token with
a code rule (`_add_token_code_rule`): the token is a function of the current token and the tokens 5
and 9 back, copied by two layer-0 MLA heads, and the runner-up is always one code bit away. Measured
(seed 0, same prompts): no step below 2 bf16 steps (median gap 40 steps), bf16 = float32 on 16 of 16
prompts, 13 distinct continuations of 16, 25-30 distinct tokens per 64 (the rule cycles with periods
of ~15-30 tokens). Weights are also rounded to bf16-representable values, so both dtypes compute the
same function up to activation rounding. tiny-llama keeps its random head (vLLM serves it in float32).
Weights are saved in float32 either way.

This module imports only the stdlib at the top and torch/transformers/tokenizers inside functions,
so it also runs on a machine with just those installed (e.g. the GPU benchmark box).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .recipes import (
    _COMMON_FIELDS,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    RECIPES,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    Recipe,
    UnknownRecipeError,
    get_recipe,
)

__all__ = [
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "RECIPES",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "Recipe",
    "UnknownRecipeError",
    "build_tokenizer",
    "create_tiny_model",
    "ensure_model",
    "get_recipe",
    "zoo_marker",
]

# Training a tokenizer starts the library's thread pool; processes that fork afterwards (Ray, vLLM)
# would otherwise print a warning and disable it themselves.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Jinja chat template: one role marker token per message, <|end|> closes every message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# A thinking target's template (recipe tiny-llama-think): the answer opens with a <think> block, which
# the generation prompt opens; an assistant message's "reasoning" (when kept) is rendered inside it.
THINK_TOKENS = ["<think>", "</think>"]
THINKING_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n<think>\\n' + message['reasoning'] | default('', true) | trim + '</think>\\n'"
    " + message['content'] | trim + '<|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n<think>\\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _builtin_prompt_texts() -> list[str]:
    path = Path(__file__).resolve().parents[2] / "draftloop" / "data" / "prompts.jsonl"
    texts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.append(str(json.loads(line)["prompt"]))
    return texts


def _generated_corpus(prompt_texts: list[str], seed: int, num_lines: int = 3000) -> list[str]:
    """Extra seeded text (word salad from the prompts' words, numbers, code-like lines) so the BPE
    trainer has enough distinct pairs to reach the full vocabulary."""
    rng = random.Random(seed)
    words = sorted({w.strip(".,:;?!()").lower() for t in prompt_texts for w in t.split()} - {""})
    code_lines = [
        "def {a}({b}):\n    return {b} + {n}",
        "for {a} in range({n}):\n    print({a})",
        "if {a} > {n}:\n    {b} = {a} * 2",
        "let {a} = {n}; // {b}",
        "SELECT {a} FROM {b} WHERE id = {n};",
    ]
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.choice(words), rng.choice(words)
            lines.append(rng.choice(code_lines).format(a=a, b=b, n=rng.randint(0, 999)))
        elif kind == 2:
            nums = [str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(rng.randint(2, 6))]
            lines.append(" + ".join(nums) + " = ?")
        else:
            lines.append(rng.choice(prompt_texts))
    return lines


def build_tokenizer(seed: int, vocab_size: int = VOCAB_SIZE, thinking: bool = False) -> Any:
    """Train a byte-level BPE tokenizer on the built-in prompts plus seeded generated text and wrap
    it as a transformers fast tokenizer carrying the chat template and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    prompt_texts = _builtin_prompt_texts()
    corpus = prompt_texts + _generated_corpus(prompt_texts, seed)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + (THINK_TOKENS if thinking else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer reached {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, token
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[2:],
        chat_template=THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE,
        model_max_length=_COMMON_FIELDS["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    if thinking:
        # Not special, as in real thinking models: decoding with skip_special_tokens (servers' default)
        # keeps </think> in the text, where reasoning parsers look for it.
        wrapped.backend_tokenizer.add_tokens(
            [AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS]
        )
    return wrapped


# ---------------------------------------------------------------------------------------------
# Weights


def _reshape_weights(model: Any, recipe: Recipe, generator: Any) -> None:
    """Rescale the freshly initialised weights into a learnable, context-dependent regime."""
    import torch

    code_dims = _code_rule_dims(recipe) if recipe.code_rule_offsets else []
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.copy_(torch.randn(embed.shape, generator=generator) * recipe.embedding_std)
        lm_head = model.get_output_embeddings().weight
        lm_head.copy_(torch.randn(lm_head.shape, generator=generator) * recipe.lm_head_std)
        # Never predict special tokens: a zero row gives logit 0, while the greedy maximum over two
        # thousand random rows is positive with overwhelming probability.
        lm_head[: len(SPECIAL_TOKENS)] = 0.0
        if recipe.layer_output_scale != 1.0:
            for name, param in model.named_parameters():
                if not name.endswith(recipe.scaled_writers):
                    continue
                if recipe.writer_gain_offset:
                    param.add_(recipe.writer_gain_offset).mul_(recipe.layer_output_scale)
                    param.sub_(recipe.writer_gain_offset)
                else:
                    param.mul_(recipe.layer_output_scale)
        if recipe.layer_marker_scale:
            _add_layer_markers(model, recipe.layer_marker_scale, code_dims)
        if recipe.code_rule_offsets:
            _add_token_code_rule(model, recipe, generator)
        # Weights that bf16 represents exactly: a bf16 copy (vLLM's CPU MLA serves only that) computes
        # the same function as the float32 one up to activation rounding.
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))


# Decoder-layer parameters that write the residual stream (hidden size is their second-last dim).
_WRITER_SUFFIXES = ("o_proj.weight", "down_proj.weight", "down_proj")


def _marker_dims(hidden: int, depth: int) -> list[int]:
    """The last depth + 1 hidden dimensions: reserved dim k carries the marker of layer k's input."""
    return list(range(hidden - depth - 1, hidden))


def _add_layer_markers(model: Any, scale: float, code_dims: list[int]) -> None:
    """Make every layer's hidden state distinctive, as in real LLMs, without changing what is predicted.

    The embedding dominates these targets' residual stream, so adjacent layers' hidden states are
    nearly identical (cosine ~0.999) and a drafter fed the wrong layers barely notices. Real models'
    layers differ much more (an off-by-one layer id collapses acceptance). Here the last L+1 hidden
    dimensions are reserved: nothing reads them (attention and MLP inputs, the output head) and nothing
    writes them except one MLP unit per layer. The embedding puts `scale` in reserved dim 0, and layer
    k's unit moves it from reserved dim k to reserved dim k+1, so the output of layer k carries a marker
    of the same size in its own dimension. All of this is ordinary weights (vLLM serves it unchanged).
    The marker adds a known energy to every RMSNorm's denominator, so the norms' weights on the other
    dimensions are raised by the same factor and the real signal keeps its scale.
    `code_dims` (the code rule's dimensions, see _add_token_code_rule) are cut off the layers' random
    projections in the same way; the code rule then wires them itself.
    """
    import torch

    config = model.config
    hidden, depth = int(config.hidden_size), int(config.num_hidden_layers)
    reserved = _marker_dims(hidden, depth)
    protected = reserved + code_dims
    others = [d for d in range(hidden) if d not in reserved]
    # Every other dimension has rms ~1 (embedding_std 1, code bits +-1; the layers add little), so
    # the stream's rms with the marker is sqrt((|others| + scale^2) / hidden).
    stream_rms = ((len(others) + scale**2) / hidden) ** 0.5
    norm_gain = ((len(others) + scale**2) / len(others)) ** 0.5
    # The mover unit's input is the marker after the post-attention norm: x = scale / stream_rms; its
    # output silu(x) * x is rescaled so that exactly `scale` moves.
    unit_input = scale / stream_rms
    unit_output = unit_input * unit_input / (1.0 + math.exp(-unit_input))
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, reserved] = 0.0
        embed[:, reserved[0]] = scale
        model.get_output_embeddings().weight[:, protected] = 0.0
        model.model.norm.weight[others] *= norm_gain
        for index, layer in enumerate(model.model.layers):
            # Cut every projection of the layer off the protected dims: writers (attention output,
            # MLP/expert down projections: hidden is their second-last dim) do not write them,
            # readers (attention inputs, router, MLP/expert gate/up: hidden is their last dim) do
            # not read them. Norm weights are 1-D and handled below.
            for name, param in layer.named_parameters():
                if param.dim() < 2 or "layernorm" in name:
                    continue
                if name.endswith(_WRITER_SUFFIXES):
                    param[..., protected, :] = 0.0
                elif param.shape[-1] == hidden:
                    param[..., protected] = 0.0
            layer.input_layernorm.weight[others] *= norm_gain
            layer.post_attention_layernorm.weight[others] *= norm_gain
            # The mover is a unit of a dense MLP: the layer's own, or the MoE's always-on shared expert.
            mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
            unit = index  # intermediate unit `index` becomes this layer's mover
            source, target = reserved[index], reserved[index + 1]
            mlp.gate_proj.weight[unit, :] = 0.0
            mlp.up_proj.weight[unit, :] = 0.0
            mlp.gate_proj.weight[unit, source] = 1.0
            mlp.up_proj.weight[unit, source] = 1.0
            mlp.down_proj.weight[:, unit] = 0.0
            mlp.down_proj.weight[source, unit] = -scale / unit_output
            mlp.down_proj.weight[target, unit] = scale / unit_output


# Token codes: VOCAB_SIZE = 2**CODE_BITS, so every token has its own code.
CODE_BITS = 11
# Logit weight of one code bit: the greedy token scores CODE_BITS * weight (~27), the runner-up two
# weights less (one bit flipped), a gap of ~40 bf16 steps at that magnitude.
_CODE_BIT_LOGIT = 2.5
# Attention logit per rotary frequency of a copy head at its offset; the nearest other offset (one
# position away) scores about 1.1 times less, so the head attends to its offset with weight ~1 - 1e-6.
_COPY_HEAD_LOGIT = 13.0


def _code_rule_dims(recipe: Recipe) -> list[int]:
    """The hidden dimensions of the code rule, just below the layer markers: a constant 1 (the output
    head's bias), CODE_BITS for the current token's code, then CODE_BITS for each copied offset."""
    blocks = len(recipe.code_rule_offsets)
    top = recipe.hidden_size - recipe.num_hidden_layers - 1
    return list(range(top - 1 - blocks * CODE_BITS, top))


def _add_token_code_rule(model: Any, recipe: Recipe, generator: Any) -> None:
    """Make the next token a decisive function of a few earlier tokens, computed by ordinary weights.

    Random weights give logits whose top two are often within one bf16 step, so a bf16 engine and a
    float32 reference part ways at near-ties. Here every token gets a CODE_BITS-bit code (a seeded
    bijection; the five special tokens get codes with bit 0 clear) written as +-1 in reserved dims of
    its embedding. In layer 0, one MLA head per offset d > 0 in `code_rule_offsets` attends only to the
    token d positions back (its query and key are constant rotary vectors, so the score depends only on
    the relative position) and copies that token's code into its own reserved dims. The output head
    reads only these dims: target bit 0 is a constant 1 (a bias dim of the embedding), and the other
    bits are seeded, sign-flipped copies of `code_rule_bits[i]` bits of the code at offset i. The logit
    of token s is the agreement of its code with the target code times _CODE_BIT_LOGIT, so the greedy
    token is the unique one with the target code and the runner-up is one bit away: every step has the
    same wide margin. The output depends on the prompt through the copied offsets; the layers' random
    MLA and MoE keep computing the rest of the hidden state, which is what the drafter reads.
    """
    import torch

    config = model.config
    hidden, depth = int(config.hidden_size), int(config.num_hidden_layers)
    offsets, bits_from = recipe.code_rule_offsets, recipe.code_rule_bits
    if len(bits_from) != len(offsets) or sum(bits_from) != CODE_BITS - 1 or offsets[0] != 0:
        raise ValueError(
            f"recipe {recipe.name}: code_rule_offsets start at 0 and bits sum to {CODE_BITS - 1}"
        )
    if int(config.vocab_size) != 2**CODE_BITS or len(offsets) - 1 > int(config.num_attention_heads):
        raise ValueError(
            f"recipe {recipe.name}: the code rule needs {2**CODE_BITS} tokens and a head per offset"
        )
    if not recipe.layer_marker_scale:
        raise ValueError(f"recipe {recipe.name}: the code rule's copy heads read the layer-0 marker")
    bias_dim, *dims = _code_rule_dims(recipe)
    block = [dims[i * CODE_BITS : (i + 1) * CODE_BITS] for i in range(len(offsets))]
    marker_dims = _marker_dims(hidden, depth)
    real = [d for d in range(hidden) if d not in marker_dims and d not in dims and d != bias_dim]

    # Codes: specials take codes with bit 0 clear, the output head's constant bit 0 = 1 excludes them.
    shuffled = torch.randperm(2**CODE_BITS, generator=generator).tolist()
    even = [c for c in shuffled if c % 2 == 0]
    special_codes = even[: len(SPECIAL_TOKENS)]
    codes = torch.tensor(special_codes + [c for c in shuffled if c not in special_codes])
    code_bits = ((codes[:, None] >> torch.arange(CODE_BITS)) & 1).float() * 2.0 - 1.0  # [vocab, bits]

    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        # The same real-part norm for every token: layer 0's input rms is then the same everywhere, and
        # so are the copy heads' rotary query and key (read from the marker through that norm).
        real_part = embed[:, real]
        embed[:, real] = real_part / real_part.norm(dim=1, keepdim=True) * len(real) ** 0.5
        embed[:, dims] = 0.0
        embed[:, block[0]] = code_bits
        embed[:, bias_dim] = 1.0

        attention = model.model.layers[0].self_attn
        nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        v_dim, kv_rank = int(config.v_head_dim), int(config.kv_lora_rank)
        head_q, head_kv = nope + rope, nope + v_dim
        # Queries of layer 0: q_a reads only the layer-0 marker, so after q_a_layernorm it is the
        # constant sqrt(q_lora_rank) in its dim 0 and every head's query is a constant vector.
        q_a = attention.q_a_proj.weight
        q_a.zero_()
        q_a[0, marker_dims[0]] = 1.0
        q_unit = float(config.q_lora_rank) ** 0.5
        # Compressed kv: the current token's code only (its rms is then the same for every token);
        # rotary key: the constant (1, 0) in every frequency pair, from the marker.
        kv_a = attention.kv_a_proj_with_mqa.weight
        kv_a.zero_()
        for bit, dim in enumerate(block[0]):
            kv_a[bit, dim] = 1.0
        latent = (kv_rank / CODE_BITS) ** 0.5  # each code bit after kv_a_layernorm
        stream_rms = float(embed[0].pow(2).mean().sqrt())
        marker_in = (
            recipe.layer_marker_scale
            / stream_rms
            * float(model.model.layers[0].input_layernorm.weight[marker_dims[0]])
        )
        kv_a[kv_rank : kv_rank + rope : 2, marker_dims[0]] = 1.0 / marker_in  # key pairs (1, 0)
        pairs = rope // 2
        theta = float(config.rope_parameters["rope_theta"]) ** (
            -torch.arange(pairs, dtype=torch.float64) * 2 / rope
        )
        scaling = head_q**-0.5
        q_b, kv_b, o_proj = attention.q_b_proj.weight, attention.kv_b_proj.weight, attention.o_proj.weight
        for head, offset in enumerate(offsets[1:]):
            # Query pair f = e^{-i theta_f offset}: the score sum_f cos(theta_f (i - j - offset)) peaks
            # at key position j = i - offset.
            q_rows = slice(head * head_q, (head + 1) * head_q)
            q_b[q_rows] = 0.0
            amplitude = _COPY_HEAD_LOGIT / scaling / q_unit
            q_b[head * head_q + nope : (head + 1) * head_q : 2, 0] = (
                amplitude * torch.cos(theta * offset)
            ).float()
            q_b[head * head_q + nope + 1 : (head + 1) * head_q : 2, 0] = (
                -amplitude * torch.sin(theta * offset)
            ).float()
            kv_rows = slice(head * head_kv, (head + 1) * head_kv)
            kv_b[kv_rows] = 0.0  # no content score; the value is the code, bit by bit
            for bit in range(CODE_BITS):
                kv_b[head * head_kv + nope + bit, bit] = 1.0
            o_proj[:, head * v_dim : (head + 1) * v_dim] = 0.0
            for bit, dim in enumerate(block[head + 1]):
                o_proj[dim, head * v_dim + bit] = 1.0 / latent

        # Output head: the agreement of each token's code with the target code.
        lm_head = model.get_output_embeddings().weight
        lm_head.zero_()
        lm_head[:, bias_dim] = _CODE_BIT_LOGIT * code_bits[:, 0]
        sources = []
        for source_block, count in zip(block, bits_from, strict=True):
            picked = torch.randperm(CODE_BITS, generator=generator)[:count].tolist()
            sources += [source_block[bit] for bit in picked]
        order = torch.randperm(len(sources), generator=generator).tolist()
        signs = torch.randint(0, 2, (len(sources),), generator=generator) * 2 - 1
        for target_bit, source_index in enumerate(order, start=1):
            lm_head[:, sources[source_index]] = (
                _CODE_BIT_LOGIT * float(signs[target_bit - 1]) * code_bits[:, target_bit]
            )


# ---------------------------------------------------------------------------------------------
# Build


def create_tiny_model(recipe: str, out_dir: Path, seed: int = 0) -> Path:
    """Build the zoo model `recipe` into `out_dir` (replaced atomically if it exists) and return it."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = get_recipe(recipe)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer(seed, thinking=spec.thinking)
        config = spec.hf_config()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed + 1)
        _reshape_weights(model, spec, generator)
        model.generation_config = GenerationConfig(
            eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None
        )
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        _write_zoo_marker(tmp_dir, recipe, seed)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _write_zoo_marker(model_dir: Path, recipe: str, seed: int) -> None:
    """A small record of how the folder was made, so a rebuild can be skipped when it matches."""
    marker = {"recipe": recipe, "seed": seed}
    (model_dir / "draftloop_zoo.json").write_text(json.dumps(marker, sort_keys=True) + "\n")


def zoo_marker(model_dir: Path) -> dict[str, Any] | None:
    path = Path(model_dir) / "draftloop_zoo.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def ensure_model(path: Path, recipe: str | None, seed: int = 0) -> Path:
    """Return `path`, building it from `recipe` first when it is missing (or was built from another
    recipe/seed). Without a recipe the folder must already exist."""
    path = Path(path)
    if (path / "config.json").is_file():
        marker = zoo_marker(path)
        if recipe is None or marker is None or marker == {"recipe": recipe, "seed": seed}:
            return path
    if recipe is None:
        raise FileNotFoundError(f"model folder {path} does not exist and no zoo recipe was given")
    return create_tiny_model(recipe, path, seed)
