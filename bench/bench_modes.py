"""Offline, online and hybrid extraction on one config, one after the other (CPU, tiny-llama): the cycle
up to train for each mode on the same synthesized conversations (synthesize runs once, then is a cache
hit), and what each stored and spent: hidden-state bytes under storage.root, the extract and train
stages' seconds, target forward passes, peak object-store bytes.

    .venv/bin/python bench/bench_modes.py --out bench/results-modes.json [--budget 70MB]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def hidden_bytes(root: Path) -> int:
    """Bytes of hidden-state shards under a storage root (extract datasets and the hybrid cache)."""
    return sum(
        path.stat().st_size
        for path in root.rglob("*.safetensors")
        if path.name != "model.safetensors"  # the drafter
    )


def run_mode(workdir: Path, mode: str, budget: str, until: str = "train") -> dict[str, Any]:
    root = workdir / "runs"
    sets = {"offline": [], "synthesize": [], "online": ["extraction.mode=online"]}.get(
        mode, ["extraction.mode=hybrid", f"extraction.storage_budget={budget}"]
    )
    before = hidden_bytes(root) if root.exists() else 0
    command = [sys.executable, "-m", "draftloop", "run", str(REPO_ROOT / "configs" / "tiny-llama.yaml")]
    for item in [
        f"storage.root={root}",
        f"tracking.mlflow_uri=sqlite:///{workdir}/mlflow.db",
        f"tracking.artifact_root={workdir}/mlartifacts",
        *sets,
    ]:
        command += ["--set", item]
    started = time.perf_counter()
    subprocess.run([*command, "--until", until], cwd=workdir, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    if until != "train":
        return {"wall_s": round(wall, 1)}
    cycles = (root / "tiny-llama" / "cycles").glob("*/summary.json")
    summary_path = max(cycles, key=lambda path: path.stat().st_mtime)
    summary = json.loads(summary_path.read_text())
    stages = summary["stages"]
    train_uri = Path(stages["train"]["uri"])
    train = json.loads((train_uri / "manifest.json").read_text())["summary"]
    stream = train.get("stream") or {}
    extracted = None
    if "extract" in stages:
        extracted = json.loads((Path(stages["extract"]["uri"]) / "manifest.json").read_text())["summary"][
            "samples"
        ]
    return {
        "wall_s": round(wall, 1),
        "extract_s": stages.get("extract", {}).get("seconds"),
        "train_s": stages["train"]["seconds"],
        "hidden_state_bytes_stored": hidden_bytes(root) - before,
        # offline: one forward pass per extracted sample
        "target_forward_passes": stream.get("target_forward_passes", extracted),
        "peak_object_store_bytes": stream.get("peak_object_store_bytes"),
        "spilled_bytes": stream.get("spilled_bytes"),
        "budget_for_zero_recompute": stream.get("budget_for_zero_recompute"),
        "held_out_acceptance_length": train["held_out_acceptance_length"],
        "trained_per_sample": train["trained_per_sample"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", default="70MB", help="hybrid's extraction.storage_budget")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="draftloop-modes-") as scratch:
        workdir = Path(scratch)
        result: dict[str, Any] = {"budget": args.budget}
        result["synthesize"] = run_mode(workdir, "synthesize", args.budget, until="synthesize")  # shared
        for mode in ("offline", "online", "hybrid"):
            result[mode] = run_mode(workdir, mode, args.budget)
            print(mode, json.dumps(result[mode]), flush=True)
        result["online_vs_offline_wall"] = round(result["online"]["wall_s"] / result["offline"]["wall_s"], 3)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
