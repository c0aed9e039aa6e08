"""The zoo's recipes: how each tiny target is shaped (its transformers config, its weight reshaping knobs).

Each recipe is built from transformers' own config class of its architecture (`AutoConfig.for_model`),
never a Llama under another name, so a recipe's target is what a user of that family would bring.
infra/targets/zoo.py builds them (module docstring there: why the weights are reshaped). Stdlib only at
import time, like zoo.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_TOKEN, EOS_TOKEN = "<|pad|>", "<|end|>"
PAD_TOKEN_ID, EOS_TOKEN_ID = 0, 1


@dataclass(frozen=True)
class Recipe:
    """How to build one tiny target: its HF config (without weights) and its weight reshaping."""

    name: str
    model_type: str
    config_fields: dict[str, Any]
    # Standard deviation of the token embedding (the default init would be initializer_range, 0.02):
    # a large embedding keeps the current token dominant in the residual stream (see module doc).
    embedding_std: float
    # Multiplier on every decoder-layer output projection: the context-dependent share of the stream.
    layer_output_scale: float
    # Standard deviation of the untied output head: sets how peaked the next-token distribution is.
    lm_head_std: float
    # Size of the per-layer marker in reserved hidden dimensions (0: none); see _add_layer_markers.
    layer_marker_scale: float = 0.0
    # Decisive next-token rule (see _add_token_code_rule): the relative positions (0 = the current
    # token, d > 0 = d tokens back) whose token codes decide the next token, and how many of its code
    # bits each supplies. Empty: the output head is the random one.
    code_rule_offsets: tuple[int, ...] = ()
    code_rule_bits: tuple[int, ...] = ()
    # A thinking target: <think> and </think> are special tokens and the chat template opens a thinking
    # block (THINKING_CHAT_TEMPLATE), so a server's reasoning parser (deepseek_r1) splits its answers.
    thinking: bool = False
    # Parameters (name suffixes) that `layer_output_scale` multiplies: what sets the size of a layer's
    # writes to the residual stream. Pre-norm decoders: the output projections. Post-norm ones (OLMo-2
    # normalizes each sublayer's output before adding it) the norms after them, since a norm undoes any
    # scale of the projection before it.
    scaled_writers: tuple[str, ...] = ("o_proj.weight", "down_proj.weight", "down_proj")
    # Gemma's norms scale by (1 + weight), their weights starting at 0: the gain `layer_output_scale` then
    # sets is 1 + weight, so weight becomes (1 + weight) * scale - 1 (0: plain gains, multiplied).
    writer_gain_offset: float = 0.0

    def hf_config(self) -> Any:
        """The transformers config this recipe builds (cheap: no weights are created)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.config_fields)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config_fields["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config_fields["hidden_size"])


_COMMON_FIELDS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    # room for the long-context evaluation set (8k-token prompts and their answers); default RoPE does not
    # depend on it, so the weights and every shorter computation are the same as at 2048
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "use_cache": True,
}

_TINY_LLAMA = Recipe(
    name="tiny-llama",
    model_type="llama",
    config_fields={
        **_COMMON_FIELDS,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    embedding_std=1.0,
    layer_output_scale=2.0,
    lm_head_std=0.5,
    layer_marker_scale=20.0,
)

# The Llama-shaped decoder sizes every dense recipe shares (6 layers, hidden 256, grouped-query heads).
_DENSE_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

RECIPES: dict[str, Recipe] = {
    "tiny-llama": _TINY_LLAMA,
    # Qwen3 (transformers' Qwen3Config / Qwen3ForCausalLM): a pre-norm decoder with per-head RMSNorm on
    # queries and keys. No family module covers it: it runs through the generic decoder-only path, and
    # vLLM serves it with EAGLE-3 natively. Its norms sit where Llama's do, so it carries layer markers.
    "tiny-qwen3": Recipe(
        name="tiny-qwen3",
        model_type="qwen3",
        config_fields={**_COMMON_FIELDS, **_DENSE_SHAPE, "architectures": ["Qwen3ForCausalLM"]},
        embedding_std=1.0,
        layer_output_scale=2.0,
        lm_head_std=0.5,
        layer_marker_scale=20.0,
    ),
    # OLMo-2 (Olmo2Config / Olmo2ForCausalLM): post-norm sublayers (each output is RMS-normalized before it
    # joins the stream) and RMSNorm over the whole query and key projections. Generic path too; vLLM
    # serves it through its Transformers backend, which has EAGLE-3. The marker scheme needs pre-norm
    # layers (its mover unit's output would be normalized), so this recipe has none; the post-norm gains
    # set the layers' share instead (scaled_writers).
    "tiny-olmo2": Recipe(
        name="tiny-olmo2",
        model_type="olmo2",
        config_fields={**_COMMON_FIELDS, **_DENSE_SHAPE, "architectures": ["Olmo2ForCausalLM"]},
        embedding_std=1.0,
        # Measured (seed 0, 40 built-in prompts x 32 greedy tokens; a trigram table from 32 continuations
        # predicting the other 8): gains 0.03 / 0.08 / 0.3 / 1 give a next-token lookup accuracy of
        # 0.71 / 0.55 / 0.16 / 0.13 (tiny-llama: 0.77), all 8 of 8 continuations distinct.
        layer_output_scale=0.03,
        lm_head_std=0.5,
        scaled_writers=("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
    ),
    # Gemma 3 (Gemma3TextConfig / Gemma3ForCausalLM): an embedding scaled by sqrt(hidden), pre- and post-norms
    # around both sublayers with (1 + weight) gains, GELU-tanh MLPs, per-head query/key norms, sliding-window
    # layers (4096: longer than any context but the 8k long-context prompts). vLLM 0.32 has no
    # SupportsEagle3 on its Gemma 3 class: draftloop's plugin (eagle3_enabler) adds it. An untied head, as
    # the other recipes.
    "tiny-gemma3": Recipe(
        name="tiny-gemma3",
        model_type="gemma3_text",
        config_fields={
            **_COMMON_FIELDS,
            **_DENSE_SHAPE,
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 4096,
            "query_pre_attn_scalar": 64,
            # one RoPE per attention kind (transformers' Gemma 3 layout), the same for both here
            "rope_parameters": {
                kind: {"rope_type": "default", "rope_theta": 10000.0}
                for kind in ("sliding_attention", "full_attention")
            },
        },
        embedding_std=1.0,
        # Measured as tiny-olmo2's: post-norm gains 0.1 / 0.3 / 0.5 / 1 give lookup accuracies 0.95 / 0.90 /
        # 0.80 / 0.52 with 2 / 6 / 7 / 8 of 8 continuations distinct (0.1: the same text whatever the prompt).
        layer_output_scale=0.5,
        lm_head_std=0.5,
        scaled_writers=("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
        writer_gain_offset=1.0,
    ),
    # tiny-llama as a thinking model: same weights recipe, a chat template with a thinking block.
    "tiny-llama-think": replace(_TINY_LLAMA, name="tiny-llama-think", thinking=True),
    # DeepSeek-V3 shape (the Kimi-K2 / K2.5 family): MLA attention and a sigmoid-routed MoE.
    # vLLM's CPU MLA backend needs kv_lora_rank + qk_rope_head_dim = 576, and "noaux_tc" routing
    # so that it has a parameter for the router's e_score_correction_bias.
    "tiny-deepseek": Recipe(
        name="tiny-deepseek",
        model_type="deepseek_v3",
        config_fields={
            **_COMMON_FIELDS,
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 4,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 128,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "num_nextn_predict_layers": 0,
            "rope_interleave": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        embedding_std=1.0,
        layer_output_scale=2.0,
        lm_head_std=0.5,
        layer_marker_scale=28.0,
        code_rule_offsets=(0, 5, 9),
        code_rule_bits=(4, 3, 3),
    ),
}


class UnknownRecipeError(ValueError):
    """The recipe name is not in RECIPES."""


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownRecipeError(
            f"unknown zoo recipe {name!r}; known: {', '.join(sorted(RECIPES))}"
        ) from None
