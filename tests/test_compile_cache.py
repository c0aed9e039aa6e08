"""The compiled loss kept between processes (kernels/compile_cache.py): what one process compiled, a
process on a "fresh machine" (an empty inductor cache folder) loads, and its compilation hits the cache.

The product compiles the TTT loss on CUDA only; the mechanism is torch's and device-independent, so a
small function compiled by inductor on CPU shows it here (the GPU timings: bench/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftloop.kernels.compile_cache import cache_file, load_compiled

REPO_ROOT = Path(__file__).resolve().parent.parent

PROCESS = """
import json, sys, torch
from torch._dynamo.utils import counters
from draftloop.kernels.compile_cache import cache_file, load_compiled, save_compiled
path = cache_file(sys.argv[1], torch.device("cpu"))
loaded = load_compiled(path)
step = torch.compile(lambda x, w: torch.nn.functional.gelu(x @ w).sum(), dynamic=False)
step(torch.randn(8, 16), torch.randn(16, 16))  # (forward only: one graph shows it)
print(json.dumps({"loaded": loaded, "saved": save_compiled(path), **counters["inductor"]}))
"""


def _process(store: Path, inductor_cache: Path) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROCESS, str(store)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_a_fresh_process_on_a_fresh_machine_reuses_what_another_compiled(tmp_path: Path) -> None:
    store = tmp_path / "compile-cache"
    first = _process(store, tmp_path / "machine-1")
    assert not first["loaded"] and first.get("fxgraph_cache_miss", 0) > 0 and first["saved"] > 0
    second = _process(store, tmp_path / "machine-2")  # nothing in its own inductor cache
    assert second["loaded"] and second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"]
    assert second.get("fxgraph_cache_miss", 0) == 0


def test_an_unreadable_cache_file_compiles_from_scratch(tmp_path: Path) -> None:
    import torch

    path = cache_file(tmp_path, torch.device("cpu"))
    assert not load_compiled(path)  # none yet
    path.write_bytes(b"not torch's artifacts")
    assert not load_compiled(path)  # torch refuses it (a checksum): the loss compiles anew, no error
