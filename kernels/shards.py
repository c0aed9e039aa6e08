"""Hidden-state shards: samples packed along the token axis in one safetensors file (DESIGN.md).

Tensors: ``input_ids`` int64 [N], ``loss_mask`` uint8 [N], ``seq_offsets`` int64 [S+1],
``aux_hidden`` [N, 3*Ht], ``last_hidden`` [N, Ht]. Metadata: ``aux_layer_ids`` (json, layer_input),
``target``, ``last_hidden_state`` (what ``last_hidden`` is: ``after_final_norm``, so the target's logits
are ``lm_head(last_hidden)``, which training assumes), ``target_dtype`` (the dtype the target ran in).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .layer_ids import LayerIds

__all__ = [
    "LAST_HIDDEN_AFTER_FINAL_NORM",
    "LAST_HIDDEN_STATE_KEY",
    "SHARD_KEYS",
    "TARGET_DTYPE_KEY",
    "HiddenSample",
    "iter_hidden_samples",
    "pack_hidden_shard",
    "shard_from_bytes",
    "shard_layer_ids",
    "shard_metadata",
    "shard_metadata_from_bytes",
    "shard_to_bytes",
]

SHARD_KEYS = ("input_ids", "loss_mask", "seq_offsets", "aux_hidden", "last_hidden")
# One sample: input_ids [T], loss_mask [T], aux_hidden [T, 3*Ht], last_hidden [T, Ht].
HiddenSample = dict[str, Tensor]
# The last hidden state's semantics, recorded at extraction (capture.py hooks the final norm's output)
# and carried into the drafter's draftloop block, where export and pairing check it.
LAST_HIDDEN_STATE_KEY = "last_hidden_state"
LAST_HIDDEN_AFTER_FINAL_NORM = "after_final_norm"
# The dtype the target ran in when its hidden states were extracted (the drafter learnt those numerics).
TARGET_DTYPE_KEY = "target_dtype"


def pack_hidden_shard(samples: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate per-sample tensors along the token axis and record the offsets."""
    if not samples:
        raise ValueError("cannot pack an empty shard")
    lengths = []
    for index, sample in enumerate(samples):
        missing = [k for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden") if k not in sample]
        if missing:
            raise ValueError(f"sample {index} lacks {missing}")
        length = int(sample["input_ids"].shape[0])
        for key in ("loss_mask", "aux_hidden", "last_hidden"):
            if int(sample[key].shape[0]) != length:
                raise ValueError(f"sample {index}: {key} has {sample[key].shape[0]} rows, input_ids {length}")
        lengths.append(length)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return {
        "input_ids": torch.cat([s["input_ids"].reshape(-1).long().cpu() for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"].reshape(-1).to(torch.uint8).cpu() for s in samples]),
        "seq_offsets": offsets,
        "aux_hidden": torch.cat([s["aux_hidden"].detach().cpu() for s in samples]).contiguous(),
        "last_hidden": torch.cat([s["last_hidden"].detach().cpu() for s in samples]).contiguous(),
    }


def iter_hidden_samples(tensors: Mapping[str, Tensor]) -> Iterator[HiddenSample]:
    """Per-sample views of a packed shard, in order."""
    missing = [k for k in SHARD_KEYS if k not in tensors]
    if missing:
        raise ValueError(f"shard lacks tensors {missing}")
    offsets = tensors["seq_offsets"].tolist()
    for start, end in itertools.pairwise(offsets):
        yield {
            "input_ids": tensors["input_ids"][start:end],
            "loss_mask": tensors["loss_mask"][start:end],
            "aux_hidden": tensors["aux_hidden"][start:end],
            "last_hidden": tensors["last_hidden"][start:end],
        }


def shard_metadata(layer_ids: LayerIds, target: str, **extra: Any) -> dict[str, str]:
    """The safetensors metadata a shard carries (strings only)."""
    meta = {
        "aux_layer_ids": json.dumps(list(layer_ids.to("layer_input").ids)),
        "target": str(target),
        LAST_HIDDEN_STATE_KEY: LAST_HIDDEN_AFTER_FINAL_NORM,
    }
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()})
    return meta


def shard_to_bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=dict(metadata or {}))


def shard_from_bytes(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors, metadata) from a shard's bytes; ``aux_layer_ids`` stays a JSON string in metadata."""
    tensors = st_load(data)
    metadata = _read_metadata(data)
    return tensors, metadata


def shard_metadata_from_bytes(data: bytes) -> dict[str, str]:
    """A shard's metadata alone (its header), without building its tensors."""
    return _read_metadata(data)


def _read_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return dict(header.get("__metadata__", {}) or {})


def shard_layer_ids(metadata: Mapping[str, str]) -> LayerIds:
    """The aux layer ids (layer_input) a shard's metadata records."""
    if "aux_layer_ids" not in metadata:
        raise ValueError("shard metadata has no aux_layer_ids")
    return LayerIds(tuple(json.loads(metadata["aux_layer_ids"])), "layer_input")


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def shard_chunks(
    tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None
) -> list[memoryview]:
    """The safetensors file of ``tensors`` as a header plus zero-copy views of each tensor's memory.

    Same bytes as :func:`shard_to_bytes` would give for these tensors' layout, but without building one
    big ``bytes`` object: the writer streams the views straight from (pinned) host memory to the file and
    hashes them on the way, with the GIL released, so extraction overlaps writing with compute.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    views: list[memoryview] = []
    offset = 0
    for name in sorted(tensors):  # safetensors orders tensors by name
        tensor = tensors[name].detach()
        if tensor.device.type != "cpu":
            raise ValueError(f"shard tensor {name!r} is on {tensor.device}; copy it to the host first")
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        if nbytes:
            views.append(memoryview(cast(Any, tensor.reshape(-1).view(torch.uint8).numpy())))
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8-byte alignment
    return [memoryview(len(encoded).to_bytes(8, "little") + encoded), *views]
