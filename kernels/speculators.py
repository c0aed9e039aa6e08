"""Export to the speculators library's format (``speculators_model_type: eagle3``), which vLLM also loads.

Reading such folders back is kernels/checkpoint.py's `load_drafter` (published drafters).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from .checkpoint import DTYPE_NAMES, FORMAT_VERSION, layer_config
from .drafter import Eagle3Drafter
from .files import read_json

__all__ = ["export_speculators"]


def export_speculators(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike[str],
    verifier_path: str,
    speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
) -> Path:
    """Write the speculators-library format (``speculators_model_type: eagle3``), which vLLM also loads.

    Llama attention only (speculators' eagle3 has no MLA layer). The ids are written in layer_input
    convention (speculators generates its training data through vLLM, which reads them so).
    """
    cfg = drafter.config
    if cfg.attention != "llama":
        raise ValueError("the speculators eagle3 format has no MLA drafter; export the native folder")
    if cfg.target_hidden_size != cfg.hidden_size:
        raise ValueError("speculators eagle3 needs target_hidden_size == hidden_size")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if verifier_architectures is None:
        verifier_config = Path(verifier_path) / "config.json"
        verifier_architectures = (
            list(read_json(verifier_config).get("architectures") or []) if verifier_config.exists() else []
        )
    transformer_layer: dict[str, Any] = {
        **layer_config(cfg),
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
    }
    ids = list(cfg.aux_layer_ids.to("layer_input").ids)
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "speculators_version": "0.9.0",
        "transformer_layer_config": transformer_layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        # The variant's layer (plain EAGLE-3 keeps the raw hidden state as the residual, vLLM's default);
        # speculators' config reader in vLLM defaults norm_before_residual to True, so all are explicit.
        **drafter.variant.speculators_fields(cfg),
        "embed_requires_grad": False,
        "torch_dtype": DTYPE_NAMES.get(drafter.fc.weight.dtype, "float32"),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_path), "architectures": verifier_architectures},
        },
        "draftloop": {
            "format_version": FORMAT_VERSION,
            "aux_layer_ids": list(cfg.aux_layer_ids.ids),
            "aux_layer_ids_convention": "layer_input",
            "convention_exported": "layer_input",
            "engine": "speculators",
        },
    }
    tensors: dict[str, Tensor] = {}
    for name, tensor in drafter.weights_state_dict().items():
        if name in ("d2t", "t2d") and cfg.draft_vocab_size == cfg.vocab_size:
            continue  # speculators has no vocabulary tables for a full draft vocabulary
        native = "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name
        tensors[native] = tensor.cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
