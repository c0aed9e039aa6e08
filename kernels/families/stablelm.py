"""StableLM: Llama-like for capture and the drafter, but vLLM's model class lacks EAGLE-3 aux-state
capture, which the plugin's `eagle3_enabler` patch adds."""

from __future__ import annotations

from .base import TargetFamily, register_family

register_family(TargetFamily(name="stablelm", model_types=("stablelm",), engine_patches=("eagle3_enabler",)))
