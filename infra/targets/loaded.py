"""The Hugging Face target loaded in one process: what the synthesis and extraction actors host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoadedTarget:
    tokenizer: Any
    model: Any  # in eval mode, on `device`
    device: str
    dtype: torch.dtype


def load_target(target_path: str, dtype: str, device: str | None, trust_remote_code: bool) -> LoadedTarget:
    """Tokenizer and model of `target_path` in `dtype` on `device` (CUDA when there is one).

    `trust_remote_code` runs the folder's own code: only for a config's target.trust_remote_code."""
    # Imported here: transformers' auto classes take seconds to import, and the processes that only
    # name this module (the driver, a training worker reading stored shards) never load a target.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
    model: Any = AutoModelForCausalLM.from_pretrained(
        target_path, dtype=torch_dtype, trust_remote_code=trust_remote_code
    )
    return LoadedTarget(tokenizer, model.to(device).eval(), device, torch_dtype)


def resolve_auto_classes() -> None:
    """Import transformers' auto classes now, on this thread. transformers resolves its names lazily and
    that resolution is not thread-safe: two threads that first name AutoTokenizer at once (a sweep's
    variants evaluating side by side) can fail with "cannot import name 'AutoTokenizer'". Called before
    stage code runs in threads; a process that never loads a target never pays the import."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
