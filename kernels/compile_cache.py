"""The compiled TTT loss kept between processes: torch's portable cache artifacts, one file.

torch.compile's own caches (inductor's FX-graph cache, AOTAutograd's) live in a per-machine temp folder,
so a fresh machine, a container or a Ray Train worker on another node compiles the loss again: minutes
of idle GPU before the first step at the Llama-3.1-8B shape (bench/RESULTS.md). What one process
compiled, `torch.compiler.save_cache_artifacts()` packs into bytes; `load_cache_artifacts()` installs
them in another process's caches before it compiles, and its compilation becomes cache hits. The file
is named by torch version and device, the two things the artifacts are only valid for.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch


def cache_file(folder: str | Path, device: torch.device) -> Path:
    """The artifacts file for this torch build on this kind of device, under ``folder``."""
    name = f"torch-{torch.__version__}-{device.type}"
    if device.type == "cuda":
        name += "-" + torch.cuda.get_device_name(device).replace(" ", "_").replace("/", "_")
    return Path(folder) / f"{name}.bin"


def load_compiled(path: Path) -> bool:
    """Install the artifacts at ``path`` into this process's compile caches; False when there are none
    (or they cannot be read: then the loss compiles from scratch, as without a cache)."""
    if not path.is_file():
        return False
    try:
        return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
    except Exception as error:  # a file of another torch build, or truncated: compile anew
        warnings.warn(f"compile cache {path} not loaded ({error}); compiling from scratch", stacklevel=2)
        return False


def save_compiled(path: Path) -> int:
    """Write what this process compiled (and loaded) to ``path`` atomically; the bytes written (0: none)."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return 0
    data, _ = artifacts
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    partial.replace(path)  # readers see the old file or the new one, never half of one
    return len(data)
