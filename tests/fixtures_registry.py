"""What the registry tests register: a minimal drafter folder and the card of a tiny vLLM drafter."""

from __future__ import annotations

import json
from pathlib import Path

from draftloop.infra.registry.cards import DrafterCard


def fake_drafter(folder: Path) -> Path:
    """A drafter folder with the files registration uploads (no real weights)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def drafter_card(target: str, data_hash: str) -> DrafterCard:
    """The card of a drafter for `target` trained on layers [1, 3, 5], exported for vLLM 0.32.0."""
    return DrafterCard(
        target=target,
        engine="vllm",
        engine_version="0.32.0",
        aux_layer_ids=[1, 3, 5],
        layer_id_convention="layer_input",
        convention_exported="vllm",
        hashes={"data_hash": data_hash},
    )
