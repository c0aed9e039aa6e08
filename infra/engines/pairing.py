"""Refuse a drafter the engine cannot serve with a target, before any server starts.

The engine keeps the drafter's KV cache in the same block layout as the target's: an MLA target's
latent KV cache and a Llama-style drafter's per-head cache share no block size, and vLLM dies at start-up
with `No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`. So the drafter's
attention must be the one the target's family asks for (`TargetFamily.drafter_attention`); a drafter's
own config.json is read the same way (an MLA drafter is a one-layer deepseek_v2 model).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftloop.infra.engines.base import EngineConfigError, read_json
from draftloop.kernels.families.base import TargetFamily, UnknownFamilyError, family_for_config


class DrafterPairingError(EngineConfigError):
    """The drafter cannot run with this target in the engine (refused before any server starts)."""


def family_or_none(config: Mapping[str, Any]) -> TargetFamily | None:
    """The family of a model config, or None when no registered family covers its model_type."""
    try:
        return family_for_config(config)
    except UnknownFamilyError:
        return None


def check_drafter_pairing(target_dir: Path, drafter_dir: Path) -> None:
    """Raise DrafterPairingError when the drafter's attention is not the one the target's family needs
    (nothing is refused when either model's family is unknown: there is nothing to compare)."""
    drafter_file = Path(drafter_dir) / "config.json"
    target = read_json(Path(target_dir) / "config.json")
    drafter = read_json(drafter_file)
    target_family, drafter_family = family_or_none(target), family_or_none(drafter)
    if target_family is None or drafter_family is None:
        return
    needed, given = target_family.drafter_attention, drafter_family.drafter_attention
    if needed == given:
        return
    reason = (
        f"a {given}-attention EAGLE-3 drafter ({drafter.get('architectures')}) cannot serve the "
        f"{target_family.name} target {target.get('architectures')}, whose drafters use {needed} attention: "
        "the engine keeps target and drafter KV caches in one block layout"
    )
    if needed == "mla":
        reason += (
            " and an MLA cache shares no block size with a per-head one (vLLM: 'No common block size ... "
            "CPU_MLA ... CPU_ATTN'). Train an MLA drafter (architectures Eagle3DeepseekV2ForCausalLM), "
            "which the drafter config builder picks for this family."
        )
    else:
        reason += f". Train a {needed}-attention drafter."
    raise DrafterPairingError(str(drafter_file), reason)
