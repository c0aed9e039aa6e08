"""Online training: hidden states streamed from producer actors through Ray's object store, none stored.

One small case (tiny-llama, 26 conversations, shards of 4) trained four ways on the same samples and
order: offline from stored shards, online, online with its producer SIGKILLed mid-epoch, and hybrid
under a storage budget smaller than the data. Online must give the offline losses and weights; every
fault must leave each sample trained exactly once per epoch (the counted histogram) and the same
weights; hybrid stores at most its budget and reads those shards back in later epochs. Through Ray
Train: a run whose trainer is SIGKILLed mid-epoch resumes on two trainers; and two Ray nodes with their
own object stores, producers on one, the trainer on the other. (tests/test_faults.py kills the driver,
a producer and a trainer of real `draftloop run` processes.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import yaml
from fixtures_flow import REPO_ROOT
from safetensors.torch import load_file
from test_extract_actors import _conversations, _synthesized

from draftloop.infra.extraction.extractor import HiddenStateExtractor
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import PidRecord
from draftloop.infra.runtime.ray_cluster import ensure_ray
from draftloop.infra.runtime.storage import DatasetWriter, Manifest, read_manifest
from draftloop.infra.training.job import TrainingJob
from draftloop.infra.training.stream import commit_cache, hidden_state_stream
from draftloop.infra.training.worker import train_worker

pytestmark = pytest.mark.slow  # Ray actors that load the target; a few CPU minutes together

SAMPLES = 26
SHARD = 4
EPOCHS = 2
FLOAT_TOLERANCE = 1e-5  # fp32 on CPU; the producers run the extract stage's very batches


@dataclass
class Case:
    config: ExperimentConfig
    conversations: Manifest
    root: Path
    pids: PidRecord


def _config(target: Path, root: Path, workers: int = 1, **extraction: Any) -> ExperimentConfig:
    raw = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    raw["target"]["path"] = str(target)
    raw["storage"]["root"] = str(root / "runs")
    raw["data"]["max_length"] = 96
    raw["extraction"].update({"samples_per_shard": SHARD, **extraction})
    raw["training"].update(
        {
            "epochs": EPOCHS,
            "batch_size": 4,
            "ttt_length": 2,
            "shuffle_window_shards": 2,
            "held_out_samples": 2,
            "draft_vocab_size": 48,  # counted from the data: the producers' token-only path
            "checkpoint_every_steps": 1,
            "num_workers": workers,
        }
    )
    return ExperimentConfig.from_dict(raw, check_environment=False)


@pytest.fixture(scope="module")
def case(zoo_target_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp("online")
    ensure_ray(num_cpus=2)
    rows = _conversations(SAMPLES, 9)
    for index in range(0, SAMPLES, 5):  # uneven lengths: rows pack differently
        rows[index]["messages"][1]["content"] += " and more" * (index % 7)
    conversations = _synthesized(str(root / "synth"), rows)
    return Case(
        _config(zoo_target_dir("tiny-llama"), root), conversations, root, PidRecord(root / "pids.json")
    )


def _train(case: Case, hidden: Any, work: str, config: ExperimentConfig | None = None) -> dict[str, Any]:
    config = config or case.config
    job = TrainingJob.from_config(config, hidden, case.root / work, {})
    train_worker(job, rank=0, world=1, device="cpu", report=lambda _metrics: None)
    final = case.root / work / "final"
    result = json.loads((final / "result.json").read_text())
    result["weights"] = load_file(str(final / "drafter" / "model.safetensors"))
    return result


@pytest.fixture(scope="module")
def offline(case: Case) -> dict[str, Any]:
    """The extract stage's way: one actor's shards stored, then trained from storage."""
    section = case.config.extraction
    extractor = HiddenStateExtractor(
        case.config.target.path, case.config.aux_layer_ids_internal().ids, "layer_input"
    )
    from draftloop.infra.synthesis.conversations import read_conversations

    uri = str(case.root / "hidden")
    result = extractor.extract(
        read_conversations(case.conversations), uri, {}, "hidden-a00", int(section.samples_per_shard), 96
    )
    writer = DatasetWriter(uri)
    for info in result.shards:
        writer.adopt_shard(info)
    ids = list(case.config.aux_layer_ids_internal().ids)
    manifest = writer.commit("extract", summary={"aux_layer_ids": ids})
    return _train(case, read_manifest(manifest.uri), "offline")


def _online(
    case: Case, work: str, config: ExperimentConfig | None = None, during: Any = None
) -> dict[str, Any]:
    """Train `case` online; `during(stream, work_dir)` runs on a thread while it trains (a fault)."""
    config = config or case.config
    cache = str(case.root / "cache" / work) if config.extraction.mode == "hybrid" else None
    with hidden_state_stream(config, case.conversations, cache, case.pids) as stream:
        fault = threading.Thread(target=during, args=(stream, case.root / work)) if during else None
        with stream.watch:
            if fault is not None:
                fault.start()
            result = _train(case, stream.hidden, work, config)
            if fault is not None:
                fault.join()
        report = stream.report(commit_cache(stream, {}))
    result["report"] = report
    return result


def _trained_once(result: dict[str, Any]) -> None:
    training = SAMPLES - result["held_out_samples"]
    assert [epoch["trained_per_sample"] for epoch in result["epochs"]] == [{"1": training}] * EPOCHS


def _same_training(ours: dict[str, Any], theirs: dict[str, Any], tolerance: float = FLOAT_TOLERANCE) -> None:
    assert len(ours["history"]) == len(theirs["history"]) == EPOCHS * 6  # 24 training samples, 4 a step
    for a, b in zip(ours["history"], theirs["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=tolerance, abs=tolerance)
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, tensor in ours["weights"].items():
        torch.testing.assert_close(tensor, theirs["weights"][name], rtol=tolerance, atol=tolerance)


@pytest.fixture(scope="module")
def online(case: Case) -> dict[str, Any]:
    return _online(case, "online")


def test_online_training_equals_offline_and_stores_nothing(
    case: Case, offline: dict[str, Any], online: dict[str, Any]
) -> None:
    _same_training(online, offline)
    _trained_once(online)
    _trained_once(offline)
    report = online["report"]
    assert report.shards == 7 and report.samples == SAMPLES and report.skipped == 0
    # Every epoch streams every shard again, the held-out samples' shard once more at the start;
    # counting the draft vocabulary takes no forward pass.
    produced = sum(p.samples for p in report.producers)
    assert EPOCHS * SAMPLES < produced <= EPOCHS * SAMPLES + SHARD
    assert report.watch.spilled_bytes == 0
    assert 0 < report.watch.peak_used_bytes <= report.max_bytes_in_flight
    assert online["stream"]["bytes_received"] > 0
    assert not list((case.root / "runs").rglob("*.safetensors"))  # nothing stored


def test_a_killed_producer_is_restarted_and_nothing_is_trained_twice(
    case: Case, online: dict[str, Any]
) -> None:
    killed: list[int] = []
    restarted: list[int] = []

    def kill_producer(stream: Any, work: Path) -> None:
        deadline = time.monotonic() + 120
        while not list(work.glob("step-*")) and time.monotonic() < deadline:  # mid-epoch 0
            time.sleep(0.05)
        pid = int(ray.get(stream.hidden.producers[0].pid.remote()))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        restarted.append(int(ray.get(stream.hidden.producers[0].pid.remote())))  # Ray's restart

    result = _online(case, "producer-killed", during=kill_producer)
    assert killed and restarted and restarted != killed
    _trained_once(result)
    _same_training(result, online, tolerance=0.0)  # a shard is a pure function of its plan


def test_hybrid_stores_at_most_its_budget_and_reads_it_back(case: Case, online: dict[str, Any]) -> None:
    budget = online["report"].bytes_all_shards * 3 // 7  # about 3 of the 7 shards
    config = _config(Path(case.config.target.path), case.root, mode="hybrid", storage_budget=budget)
    result = _online(case, "hybrid", config=config)
    report = result["report"]
    stored = int(report.cache_manifest.summary["bytes"])
    cached = report.cache_manifest.summary["shards"]
    assert 0 < stored <= budget and 0 < cached < 7
    assert result["stream"]["bytes_read_from_cache"] > 0
    # The cached shards were computed once, the others every epoch.
    produced = sum(p.samples for p in report.producers)
    assert produced <= EPOCHS * SAMPLES + SHARD - (EPOCHS - 1) * cached * 2
    _trained_once(result)
    _same_training(result, online, tolerance=0.0)


# --------------------------------------------------------------------- through Ray Train (the stage's way)


def _kill_a_trainer(stream: Any, work: Path) -> None:
    """SIGKILL the training worker once its first checkpoint is written (mid-epoch 0)."""
    deadline = time.monotonic() + 180
    while not list(work.glob("step-*/COMPLETE")) and time.monotonic() < deadline:
        time.sleep(0.01)
    from fault_harness import ray_train_workers

    for pid in ray_train_workers(os.getpid()):  # this test process's own, not another run's
        os.kill(pid, signal.SIGKILL)


def _fit_online(case: Case, work: str, workers: int, during: Any = None) -> dict[str, Any]:
    from draftloop.infra.training.fit import fit

    config = _config(Path(case.config.target.path), case.root, workers)
    with hidden_state_stream(config, case.conversations, None, case.pids) as stream:
        job = TrainingJob.from_config(config, stream.hidden, case.root / work, {})
        fault = threading.Thread(target=during, args=(stream, case.root / work)) if during else None
        if fault is not None:
            fault.start()
        try:
            final = fit(config, job, work, case.pids)
        finally:
            if fault is not None:
                fault.join()
    result = json.loads((final / "result.json").read_text())
    result["weights"] = load_file(str(final / "drafter" / "model.safetensors"))
    return result


def test_resume_mid_epoch_on_two_trainers(
    case: Case, online: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from draftloop.infra.training import fit

    monkeypatch.setattr(fit, "WORKER_RESTARTS", 0)  # the killed run stays dead
    with pytest.raises(Exception):  # noqa: B017 (Ray Train's error for a dead worker group)
        _fit_online(case, "one-then-two", workers=1, during=_kill_a_trainer)
    monkeypatch.undo()
    result = _fit_online(case, "one-then-two", workers=2)
    assert result["workers"] == 2
    assert result["resumed_from_epoch"] == 0 and result["resumed_at_sample"] > 0, result["resumed_at_sample"]
    _trained_once(result)
    # Two workers sum the step's gradient in another order: float rounding apart, the same training.
    _same_training(result, online, tolerance=1e-4)


def test_two_node_cluster_producers_on_one_node_trainer_on_the_other(
    zoo_target_dir: Any, tmp_path: Path
) -> None:
    """Two `ray` nodes with their own object stores, in a subprocess (its own Ray, stopped by PID)."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled"}
    script = Path(__file__).parent / "online_two_nodes.py"
    process = subprocess.Popen(
        [sys.executable, str(script), str(zoo_target_dir("tiny-llama")), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever the cluster left
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-4000:]
    found = json.loads((tmp_path / "found.json").read_text())
    assert len(found["nodes"]) == 2 and set(found["producer_nodes"]) == {found["head"]}
    stream = found["stream"]
    assert stream["bytes_received"] > 0
    assert stream["bytes_from_other_nodes"] == stream["bytes_received"]  # every shard crossed
    training = SAMPLES - found["held_out_samples"]
    assert found["trained_per_sample"] == [{"1": training}] * EPOCHS


def test_a_stream_that_would_spill_is_refused_by_name() -> None:
    from draftloop.infra.training.stream import StreamRefused, depth_for

    assert depth_for(cap=100, capacity=1000, largest=10, workers=2) == 4  # 2 x (4 + 1) x 10 = 100
    assert depth_for(cap=10, capacity=1000, largest=10, workers=2) == 1  # never less than one ahead
    with pytest.raises(StreamRefused, match=r"extraction\.samples_per_shard"):
        depth_for(cap=10**9, capacity=300, largest=100, workers=2)  # 2 x 2 x 100 > 300: it would spill
