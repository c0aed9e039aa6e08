"""Refuse a drafter the engine cannot serve with a target, before any server starts.

The engine keeps the drafter's KV cache in the same block layout as the target's: an MLA target's
latent KV cache and a Llama-style drafter's per-head cache share no block size, and vLLM dies at start-up
with `No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`. So the drafter's
attention kind must be the one the target's family asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import EngineConfigError, read_json


class DrafterPairingError(EngineConfigError):
    """The drafter cannot run with this target in the engine (refused before any server starts)."""


def is_mla_config(config: Mapping[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): a kv_lora_rank in the (text) config."""
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and is_mla_config(text_config):
        return True
    return bool(config.get("kv_lora_rank"))


def check_drafter_pairing(target_dir: Path, drafter_dir: Path) -> None:
    """Raise DrafterPairingError when the drafter's attention kind is not the one the target needs."""
    target = read_json(Path(target_dir) / "config.json")
    drafter = read_json(Path(drafter_dir) / "config.json")
    target_mla = is_mla_config(target)
    drafter_mla = is_mla_config(drafter) or any(
        "deepseek" in str(a).lower() for a in drafter.get("architectures") or []
    )
    if target_mla and not drafter_mla:
        raise DrafterPairingError(
            f"{Path(drafter_dir) / 'config.json'}",
            f"a standard-attention EAGLE-3 drafter ({drafter.get('architectures')}) cannot serve the MLA "
            f"target {target.get('architectures')}: the engine's MLA KV cache and the drafter's share no "
            "block size (vLLM: 'No common block size ... CPU_MLA ... CPU_ATTN'). Train an MLA drafter "
            "(architectures Eagle3DeepseekV2ForCausalLM; drafter attention 'mla', which "
            "DrafterConfig.for_target picks for MLA targets).",
        )
    if drafter_mla and not target_mla:
        raise DrafterPairingError(
            f"{Path(drafter_dir) / 'config.json'}",
            f"an MLA drafter cannot serve the standard-attention target {target.get('architectures')}: "
            "train a Llama-style drafter (attention 'llama').",
        )
