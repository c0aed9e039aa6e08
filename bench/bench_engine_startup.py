"""vLLM (CPU) server start-up with a fresh cache folder per server vs the engine environment's shared one.

Each server is the baseline server of a target folder (the evaluate stage's first server), started and
stopped in turn; the figure is EngineServer's start-up time (process start to /v1/models answering).
Run on one machine in one invocation: `shared_over_fresh` = median shared (after its first start) /
median fresh; the absolute seconds depend on the machine's load.

    .venv/bin/python bench/bench_engine_startup.py --target .draftloop/models/tiny-llama --runs 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from draftloop.infra.engines.base import get_engine
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.runtime.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


def start_once(settings: object, target: Path, run_dir: Path) -> float:
    server = EngineServer(get_engine("vllm", settings), target, run_dir, name="baseline")  # type: ignore[arg-type]
    with server:
        assert server.startup_s is not None
        return float(server.startup_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    base = replace(
        EngineConfig().settings(trust_remote_code=False), python=str(REPO_ROOT / ".venvs/vllm/bin/python")
    )
    with tempfile.TemporaryDirectory(prefix="startup-") as scratch:
        root = Path(scratch)
        shared = root / "shared-cache"
        fresh, warm, first = [], [], None
        for index in range(args.runs):
            # Fresh: a cache folder of its own (what every server had before: inside its run folder).
            own = replace(base, env={"VLLM_CACHE_ROOT": str(root / f"fresh-{index}" / "vllm-cache")})
            fresh.append(start_once(own, args.target, root / f"fresh-{index}"))
            seconds = start_once(
                replace(base, env={"VLLM_CACHE_ROOT": str(shared)}), args.target, root / f"s{index}"
            )
            if first is None:
                first = seconds
                seconds = start_once(
                    replace(base, env={"VLLM_CACHE_ROOT": str(shared)}), args.target, root / "s-again"
                )
            warm.append(seconds)
            shutil.rmtree(root / f"fresh-{index}", ignore_errors=True)
    result = {
        "fresh_s": [round(s, 1) for s in fresh],
        "shared_first_s": round(first or 0.0, 1),
        "shared_s": [round(s, 1) for s in warm],
        "shared_over_fresh": round(statistics.median(warm) / statistics.median(fresh), 3),
    }
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
