"""Llama-like decoders: pre-norm residual layers at `model.layers`, a final `model.norm`, grouped-query
attention with RoPE. Served natively by vLLM's and SGLang's EAGLE-3; the drafter is a Llama layer."""

from __future__ import annotations

from .base import TargetFamily, register_family

register_family(TargetFamily(name="llama", model_types=("llama", "mistral", "qwen2")))
