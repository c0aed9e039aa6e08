"""The files of drafter and target folders: reading them, and refusing bad ones with the file named.

`DrafterFormatError` names the file and the reason (a truncated or missing weights file, an unreadable
JSON, a d2t that is not offsets) and which check failed, for the pairing report. `load_target_head`
reads the target tensors a drafter shares (embedding, lm_head, final norm) without loading the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

__all__ = [
    "DrafterFormatError",
    "check_safetensors_file",
    "check_target_weights",
    "load_target_head",
    "read_json",
    "vocab_mapping_problem",
]


class DrafterFormatError(ValueError):
    """A drafter or target folder that cannot be read; the message names the file and the reason.

    ``check`` names what failed (weights, tensors, d2t, final_norm, config) for the pairing report."""

    def __init__(self, message: str, check: str = "format") -> None:
        super().__init__(message)
        self.check = check

    def __reduce__(self) -> tuple[Any, ...]:  # keeps `check` across processes (Ray, Prefect)
        return (type(self), (str(self), self.check))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DrafterFormatError(f"{path}: not found") from exc
    except json.JSONDecodeError as exc:
        raise DrafterFormatError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise DrafterFormatError(f"{path}: expected a JSON object")
    return data


def vocab_mapping_problem(d2t: Tensor, t2d: Tensor | None, vocab_size: int) -> str | None:
    """Why ``d2t`` (offsets: draft id + d2t[draft id] = target id) and ``t2d`` (which target ids the draft
    vocabulary holds) do not describe one injective map into the target vocabulary; None when they do."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        return f"d2t has dtype {d2t.dtype}; expected integer offsets"
    if t2d is not None and tuple(t2d.shape) != (vocab_size,):
        return f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) (the target vocabulary)"
    offsets = d2t.reshape(-1).long()
    target_ids = torch.arange(offsets.numel()) + offsets
    inside = (target_ids >= 0) & (target_ids < vocab_size)
    marked = t2d.bool() if t2d is not None else None
    wrong = ~inside
    if marked is not None:
        wrong |= inside & ~marked[target_ids.clamp(0, vocab_size - 1)]
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        offset, target_id = int(offsets[i]), int(target_ids[i])
        message = f"d2t[{i}] = {offset} maps draft id {i} to target id {target_id} (draft id + offset), " + (
            f"outside the target vocabulary of {vocab_size}"
            if not bool(inside[i])
            else "which t2d does not mark"
        )
        if marked is not None and 0 <= offset < vocab_size and bool(marked[offset]):
            message += f"; t2d marks {offset} itself: d2t holds absolute target ids, not offsets"
        return message + " (d2t must hold offsets: draft id + d2t[draft id] = target id)"
    unique, counts = torch.unique(target_ids, return_counts=True)
    if unique.numel() < target_ids.numel():
        repeated = int(unique[counts > 1][0])
        both = (target_ids == repeated).nonzero().flatten()[:2].tolist()
        return f"d2t maps draft ids {both} to the same target id {repeated}"
    if marked is not None and int(marked.sum()) != target_ids.numel():
        return (
            f"t2d marks {int(marked.sum())} target ids but d2t maps {target_ids.numel()} draft ids: "
            "t2d is not the inverse of d2t"
        )
    return None


def check_safetensors_file(path: str | os.PathLike[str]) -> None:
    """Refuse a weights file that is missing, has no readable safetensors header, or holds fewer bytes
    than its header lists (a truncated copy or download)."""
    file = Path(path)
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if header_len < 0 or header_len > size - 8:
                raise DrafterFormatError(
                    f"{file}: truncated or not a safetensors file ({size} bytes, no complete header)",
                    check="weights",
                )
            header = json.loads(handle.read(header_len))
        end = max(
            (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
            default=0,
        )
    except FileNotFoundError:
        raise DrafterFormatError(f"{file}: weights file not found", check="weights") from None
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError):
        raise DrafterFormatError(
            f"{file}: not a safetensors file (unreadable header)", check="weights"
        ) from None
    held = size - 8 - header_len
    if end > held:
        raise DrafterFormatError(
            f"{file}: truncated: its header lists {end} bytes of tensor data, the file holds {held}",
            check="weights",
        )


def check_target_weights(target_dir: str | os.PathLike[str], *, allow_bin: bool = False) -> list[Path]:
    """The target's safetensors files, each checked complete; refuses a folder without weights, or whose
    index names a file that is not there. ``allow_bin``: a folder of pytorch_model*.bin files only is
    accepted as it is (engines serve it; only safetensors headers can be checked cheaply)."""
    folder = Path(target_dir)
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise DrafterFormatError(f"{index_path}: no weight_map", check="weights")
        files = [folder / name for name in sorted(set(map(str, weight_map.values())))]
        for file in files:
            if not file.exists():
                raise DrafterFormatError(
                    f"{file}: weights file not found (listed in {index_path.name})", check="weights"
                )
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files and allow_bin and any(folder.glob("pytorch_model*.bin")):
            return sorted(folder.glob("pytorch_model*.bin"))
        if not files:
            raise DrafterFormatError(f"{folder}: no *.safetensors weights files", check="weights")
    for file in files:
        check_safetensors_file(file)
    return files


def load_target_head(target_dir: str | os.PathLike[str]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(embed_tokens [V, H], lm_head [V, H], final norm weight [H] or None) of an HF target folder.

    Reads only those tensors from the safetensors files (never the whole model); tied embeddings
    (no lm_head tensor, or ``tie_word_embeddings``) return the embedding for both.
    """
    folder = Path(target_dir)
    config = read_json(folder / "config.json")
    files = check_target_weights(folder)
    index_path = folder / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index_path.exists():
        weight_map = dict(read_json(index_path).get("weight_map", {}))

    def find(candidates: tuple[str, ...]) -> Tensor | None:
        for name in candidates:
            if weight_map:
                if name in weight_map:
                    with safe_open(str(folder / weight_map[name]), framework="pt") as handle:
                        return handle.get_tensor(name)
                continue
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    if name in handle.keys():  # noqa: SIM118 (safe_open has no __contains__)
                        return handle.get_tensor(name)
        return None

    prefixes = ("model.", "model.language_model.", "language_model.model.", "")
    embed = find(tuple(f"{p}embed_tokens.weight" for p in prefixes))
    if embed is None:
        raise DrafterFormatError(f"{folder}: no embed_tokens.weight in its safetensors files")
    raw_text_config = config.get("text_config")
    text_config: dict[str, Any] = raw_text_config if isinstance(raw_text_config, dict) else {}
    tied = bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))
    lm_head = None if tied else find(("lm_head.weight", "language_model.lm_head.weight"))
    norm = find(tuple(f"{p}norm.weight" for p in prefixes))
    return embed, (lm_head if lm_head is not None else embed), norm
