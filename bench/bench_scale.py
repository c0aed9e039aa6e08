"""Memory flat in data size (CPU, tiny-llama): peak RSS of the extract and train stages, and of the online
train stage, at N and 8N samples.

Each stage runs in its own driver process (the product's stage code: tasks.extract.STAGE, tasks.train.STAGE,
tasks.train_online.STAGE, with their Ray actors / Ray Train workers); a sampler reads /proc/<pid>/status
VmHWM of every process in the driver's tree (Ray's own processes included) every 0.1 s and keeps each
process's largest value; a stage's peak is the sum over its processes. Synthesis is not measured:
conversations are generated synthetically (varied lengths) and written as a synthesize-stage dataset.
`online` (extraction.mode online) has no extract stage: its producer actors compute the hidden states the
train workers ask for, through Ray's object store; its stream summary's object-store peak and spilled bytes
are reported beside the RSS.

    .venv/bin/python bench/bench_scale.py --samples 256 --factor 8 --out bench/results-scale.json
    .venv/bin/python bench/bench_scale.py --samples 256 --factor 8 --stages online   # online_* keys only
    .venv/bin/python bench/bench_scale.py --samples 256 --factor 8 --stages online \
        --max-bytes-in-flight 67108864                                               # online_capped_*
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
ROWS_PER_CONVERSATION_SHARD = 256
# Smaller than the default 64 so that even the small dataset has more shards than the training
# window (shuffle_window_shards + prefetch_shards): what stays in memory is then set by the config alone.
SAMPLES_PER_SHARD = 16
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "are",
    "from",
    "or",
    "have",
    "an",
    "not",
]
OFFLINE_STAGES = ("extract", "train")
STAGES = (*OFFLINE_STAGES, "online")


# ---------------------------------------------------------------------------------------------- sampling


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces: split after ')'
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _tree(root: int) -> list[int]:
    children = _children()
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler:
    """Largest VmHWM seen per process of a tree, and the largest instantaneous sum of VmRSS."""

    def __init__(self, root: int, interval_s: float = 0.1) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak_kib: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.max_rss_sum_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss_sum = 0
            for pid in _tree(self.root):
                hwm = _status_kib(pid, "VmHWM")
                rss_sum += _status_kib(pid, "VmRSS")
                if hwm > self.peak_kib.get(pid, 0):
                    self.peak_kib[pid] = hwm
                    if pid not in self.names:
                        try:
                            # Ray names its workers in their command line (ray::<actor>.<method>)
                            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                            self.names[pid] = b" ".join(args[:3]).decode(errors="replace")[-100:]
                        except OSError:
                            self.names[pid] = "?"
            self.max_rss_sum_kib = max(self.max_rss_sum_kib, rss_sum)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        top = sorted(self.peak_kib.items(), key=lambda item: -item[1])[:6]
        return {
            "peak_rss_mib": round(sum(self.peak_kib.values()) / 1024, 1),
            "max_concurrent_rss_mib": round(self.max_rss_sum_kib / 1024, 1),
            "processes": len(self.peak_kib),
            "largest": [
                {"name": self.names.get(pid, "?"), "peak_mib": round(kib / 1024, 1)} for pid, kib in top
            ],
        }


# ---------------------------------------------------------------------------------------------- one stage


def _config(
    workdir: Path, samples: int, mode: str = "offline", max_bytes_in_flight: int | None = None
) -> Any:
    import yaml

    from draftloop.infra.runtime.config import ExperimentConfig

    raw = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    raw["name"] = f"scale-{samples}" if mode == "offline" else f"scale-{mode}-{samples}"
    raw["target"]["path"] = str(workdir / "models" / "tiny-llama")
    raw["data"]["num_samples"] = samples
    raw["extraction"].update(
        {"samples_per_shard": SAMPLES_PER_SHARD, "mode": mode, "max_bytes_in_flight": max_bytes_in_flight}
    )
    raw["training"].update({"epochs": 1, "ttt_length": 3, "batch_size": 8})
    raw["storage"]["root"] = str(workdir / "runs")
    raw["tracking"].update(
        {"mlflow_uri": f"sqlite:///{workdir}/mlflow.db", "artifact_root": str(workdir / "mlartifacts")}
    )
    return ExperimentConfig.from_dict(raw, check_environment=False)


def _synthetic_conversations(config: Any, samples: int) -> Any:
    """A synthesize-stage outcome holding `samples` conversations of varied length (seeded)."""
    from draftloop.infra.runtime.storage import DatasetWriter, join
    from draftloop.infra.synthesis.conversations import CONVERSATIONS_SHARD_PREFIX, to_jsonl
    from draftloop.tasks.cache import StageOutcome

    rng = random.Random(0)
    rows = []
    for index in range(samples):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
        rows.append(
            {
                "id": f"s{index}",
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "reasoning": None,
            }
        )
    uri = join(str(config.storage.root), "synthetic", str(samples))
    writer = DatasetWriter(uri)
    for number, start in enumerate(range(0, samples, ROWS_PER_CONVERSATION_SHARD)):
        chunk = rows[start : start + ROWS_PER_CONVERSATION_SHARD]
        writer.write_shard(
            f"{CONVERSATIONS_SHARD_PREFIX}{number:05d}.jsonl", to_jsonl(chunk), rows=len(chunk)
        )
    manifest = writer.commit("synthesize", inputs={"synthetic": str(samples)})
    return StageOutcome("synthesize", f"synthetic-{samples}", uri, manifest, cache_hit=False, seconds=0.0)


def start_ray(address: str | None) -> None:
    """`ensure_ray`, tried three times: Ray gives its raylet a fixed 30 s to start, too short on a loaded
    machine."""
    from draftloop.infra.runtime.ray_cluster import ensure_ray, shutdown_ray

    for attempt in range(3):
        try:
            ensure_ray(address)
            return
        except Exception:
            shutdown_ray()
            if attempt == 2:
                raise


def run_stage(
    stage: str, workdir: Path, samples: int, max_bytes_in_flight: int | None = None
) -> dict[str, Any]:
    """Inside the measured driver process: run `stage` (extract runs on a cache hit when stage is train;
    online has no extract stage, its train stage takes the conversations)."""
    from draftloop.infra.runtime.ray_cluster import shutdown_ray
    from draftloop.tasks import extract, train, train_online
    from draftloop.tasks.stage import run_alone

    mode = "online" if stage == "online" else "offline"
    config = _config(workdir, samples, mode, max_bytes_in_flight)
    conversations = _synthetic_conversations(config, samples)
    start_ray(config.ray.address)
    started = time.perf_counter()
    if stage == "online":
        outcome = run_alone(train_online.STAGE, config, {"synthesize": conversations})
        assert not outcome.cache_hit
        seconds = time.perf_counter() - started
        shutdown_ray()
        return {"seconds": round(seconds, 1), "summary": outcome.manifest.summary}
    hidden = run_alone(extract.STAGE, config, {"synthesize": conversations})
    if stage == "extract":
        assert not hidden.cache_hit
        outcome = hidden
    else:
        assert hidden.cache_hit, "run the extract stage first"
        started = time.perf_counter()
        outcome = run_alone(train.STAGE, config, {"extract": hidden})
        assert not outcome.cache_hit
    seconds = time.perf_counter() - started
    shutdown_ray()
    return {"seconds": round(seconds, 1), "summary": outcome.manifest.summary}


# ---------------------------------------------------------------------------------------------- driver


def measure(
    stage: str, workdir: Path, samples: int, max_bytes_in_flight: int | None = None
) -> dict[str, Any]:
    env = {
        **os.environ,
        "DRAFTLOOP_STATE_DIR": str(workdir / "state"),
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "DRAFTLOOP_RAY_LOG_TO_DRIVER": "0",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    result_path = workdir / f"{stage}-{samples}.json"
    command = [
        sys.executable,
        __file__,
        "--stage",
        stage,
        "--samples",
        str(samples),
        "--workdir",
        str(workdir),
    ]
    command += ["--result", str(result_path)]
    if max_bytes_in_flight is not None:
        command += ["--max-bytes-in-flight", str(max_bytes_in_flight)]
    process = subprocess.Popen(command, env=env)
    with TreeSampler(process.pid) as sampler:
        code = process.wait()
    if code != 0:
        raise SystemExit(f"{stage} at {samples} samples failed (exit {code})")
    return {**sampler.summary(), **json.loads(result_path.read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--factor", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results-scale.json")
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=STAGES,
        default=list(OFFLINE_STAGES),
        help="stages to measure (train needs extract: it reads extract's cached shards); the record keeps "
        "the keys of the stages not run",
    )
    parser.add_argument(
        "--max-bytes-in-flight",
        type=int,
        help="online: extraction.max_bytes_in_flight (default: the config's null, 1/4 of the object "
        "store); when given, the record's keys are online_capped_* instead of online_*",
    )
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "train" in args.stages and "extract" not in args.stages:
        parser.error("--stages train needs extract (the train stage reads its cached shards)")
    if args.stage is not None:  # the measured driver process
        result = run_stage(args.stage, args.workdir, args.samples, args.max_bytes_in_flight)
        args.result.write_text(json.dumps(result))
        return

    from draftloop.infra.targets.zoo import create_tiny_model

    sizes = (args.samples, args.samples * args.factor)
    stages = [stage for stage in STAGES if stage in args.stages]  # extract before train
    with tempfile.TemporaryDirectory(prefix="draftloop-scale-") as scratch:
        workdir = Path(scratch)
        create_tiny_model("tiny-llama", workdir / "models" / "tiny-llama", seed=0)
        runs: dict[str, dict[str, Any]] = {}
        for samples in sizes:
            for stage in stages:
                runs[f"{stage}_{samples}"] = measure(stage, workdir, samples, args.max_bytes_in_flight)
                print(f"{stage} {samples}: {json.dumps(runs[f'{stage}_{samples}'])}", flush=True)
    small, large = sizes
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    common = {
        "machine": f"CPU, {os.cpu_count()} cores (shared)",
        "target": "tiny-llama (zoo, seed 0)",
        "samples": list(sizes),
        "samples_per_shard": SAMPLES_PER_SHARD,
        "training": "1 epoch, TTT 3, batch 8, 1 worker, shuffle window 8 shards, prefetch 2",
        "peak_rss": "sum over the driver's process tree (Ray's processes, actors, workers) of VmHWM",
    }
    offline = [stage for stage in stages if stage in OFFLINE_STAGES]
    if offline:
        record["memory"] = {
            **common,
            "runs": {key: run for key, run in runs.items() if key.split("_")[0] in offline},
        }
    # A capped run is recorded beside the default one, not over it.
    online = "online" if args.max_bytes_in_flight is None else "online_capped"
    if "online" in stages:
        streams = {samples: runs[f"online_{samples}"]["summary"]["stream"] for samples in sizes}
        record[f"{online}_memory"] = {
            **common,
            "stage": "tasks.train_online.STAGE, extraction.mode online, 1 in-process producer actor",
            # online, the worker asks the producers a byte-capped depth ahead instead of reading ahead
            "training": "1 epoch, TTT 3, batch 8, 1 worker, shuffle window 8 shards, asked ahead: the "
            "stream summary's asked_ahead_per_worker",
            "max_bytes_in_flight_setting": args.max_bytes_in_flight,
            "runs": {key: run for key, run in runs.items() if key.startswith("online_")},
        }
        for field in (
            "peak_object_store_bytes",
            "spilled_bytes",
            "object_store_bytes",
            "max_bytes_in_flight",
            "asked_ahead_per_worker",
        ):
            record[f"{online}_{field}"] = {str(samples): int(streams[samples][field]) for samples in sizes}
        record[f"{online}_peak_rss_mib"] = {
            str(samples): runs[f"online_{samples}"]["peak_rss_mib"] for samples in sizes
        }
    for stage in stages:
        name = online if stage == "online" else stage
        record[f"{name}_peak_rss_ratio_8x"] = round(
            runs[f"{stage}_{large}"]["peak_rss_mib"] / runs[f"{stage}_{small}"]["peak_rss_mib"], 3
        )
    for stage in stages:  # the largest instantaneous sum too (processes that coexisted)
        name = online if stage == "online" else stage
        record[f"{name}_max_concurrent_rss_ratio_8x"] = round(
            runs[f"{stage}_{large}"]["max_concurrent_rss_mib"]
            / runs[f"{stage}_{small}"]["max_concurrent_rss_mib"],
            3,
        )
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps(
            {
                key: value
                for key, value in record.items()
                if key.endswith("_8x") or (key.startswith("online_") and not key.endswith("_memory"))
            }
        )
    )


if __name__ == "__main__":
    main()
