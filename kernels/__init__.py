"""GPU-side kernels of draftloop: drafter, checkpoints, target families, capture, vocabulary, shards,
training, simulation and the speculative counters.

Imports only torch, transformers, safetensors and the stdlib, so it runs alone on a GPU box.
Import the submodules directly (``from draftloop.kernels.drafter import Eagle3Drafter``).
"""

from .layer_ids import LayerIds

__all__ = ["LayerIds"]
