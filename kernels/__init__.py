"""GPU-side kernels of draftloop: the drafter (drafter.py, its attention modes attention.py, its variants
variants/), target families (families/), capture and extraction, vocabulary, shards, checkpoints
(checkpoint.py native, speculators.py, files.py, contract.py), training (data.py the training data,
objective.py the TTT loss, train.py the loop, train_state.py and distributed.py), simulation and the
speculative counters.

Imports only torch, transformers, safetensors and the stdlib, so it runs alone on a GPU box.
Import the submodules directly (``from draftloop.kernels.drafter import Eagle3Drafter``).
"""

from .layer_ids import LayerIds

__all__ = ["LayerIds"]
