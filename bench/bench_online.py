"""Online training on one GPU: the target's forward makes hidden states on one CUDA stream while the
drafter trains on another (issue "online training", item 7; kernels level: no Ray on the GPU machine).

Llama-3.1-8B-shaped target (random bf16 weights, ``bench_gpu.target_config``), sample lengths lognormal
(median 600, ``bench_realistic.SyntheticHiddenStates``: its lengths and token ids, not its hidden
states), each optimizer step's samples packed first-fit decreasing into rows of 4,096 tokens. The
target runs once per packed row with per-sample positions (transformers then masks attention per
sample); ``capture_aux_hidden_states`` keeps the three aux layers (2, 16, 29) and the last hidden state,
padded on the GPU to the row shape the compiled loss sees. Nothing goes through host memory: a row
collated by ``collate_rows`` (ids, masks, segments, positions) gets the captured states as its
``aux_hidden`` / ``last_hidden``, and ``TrainingRun.forward_backward`` trains on it (product defaults:
TTT 7, frozen lm_head, torch.compile on CUDA). After the warm-up steps, one untimed settle pass of all three
at the timed sizes (allocator pool settled), then three measurements on the same tokens, interleaved per run:

1. extraction alone: the producer over every step (stream A), states kept on the GPU;
2. training alone: the trainer over those pre-made states (stream B);
3. online: a producer thread makes step i+1 on stream A while the trainer trains step i on stream B,
   through a bounded queue of finished steps (an event per step; the producer waits on it before the
   hand-off, so at most ``queue_depth`` + 2 steps of states exist at once).

Real tokens/s count sample tokens only. ``online_ratio`` = online tok/s / (1 / (1/extraction +
1/training)), the two run back to back; above 1 only where they overlap, at most
min(extraction, training) / that serial bound. ``--tiny``: toy shapes (a CPU smoke test of this script).
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from draftloop.kernels.capture import capture_aux_hidden_states
from draftloop.kernels.drafter import Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.objective import sample_ttt_tokens
from draftloop.kernels.packing import collate_rows, pack_first_fit_decreasing
from draftloop.kernels.train import TrainConfig, TrainingRun
from draftloop.kernels.train_state import StepSums

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import matmul_peak, shapes, target_config
from bench_realistic import (
    SAMPLES_PER_SHARD,
    SyntheticHiddenStates,
    drafter_config,
    log,
    spread,
    useful_flops_per_token,
)


@dataclass
class StepPlan:
    """One optimizer step: its samples (host ids and masks only) in packed rows."""

    rows: list[list[Mapping[str, Tensor]]]
    real_tokens: int
    step_tokens: Tensor  # counted positions per TTT step over the step [ttt], on the host
    step_tokens_on_device: Tensor  # the same, copied once up front (a later copy would wait)


@dataclass
class StepStates:
    """A step's micro-batches (one packed row each) with their hidden states, on the device."""

    plan: StepPlan
    batches: list[dict[str, Tensor]]
    ready: torch.cuda.Event | None  # recorded on the producer's stream after the last row


def on_stream(stream: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def plan_steps(
    data: SyntheticHiddenStates, steps: int, cfg: TrainConfig, dev: torch.device
) -> list[StepPlan]:
    """``steps`` optimizer steps of the product's streamed order (``ShardedSamples``), packed."""
    shards = steps * cfg.samples_per_step // SAMPLES_PER_SHARD
    plans = []
    for share in data.dataset(shards).rank_steps(0, cfg.seed, cfg.samples_per_step, 0, 0, 1):
        samples = [
            {  # the producer computes the states: zero-width placeholders for collate_rows
                "input_ids": s["input_ids"],
                "loss_mask": s["loss_mask"],
                "aux_hidden": s["aux_hidden"][:, :0],
                "last_hidden": s["last_hidden"][:, :0],
            }
            for s in share.samples
        ]
        lengths = [int(s["input_ids"].shape[0]) for s in samples]
        rows = [[samples[i] for i in row] for row in pack_first_fit_decreasing(lengths, cfg.pack_tokens or 0)]
        counts = [sample_ttt_tokens(s, cfg.ttt_length, cfg.max_length) for s in samples]
        step_tokens = torch.tensor(counts, dtype=torch.float64).sum(0)
        plans.append(StepPlan(rows, sum(lengths), step_tokens, step_tokens.to(dev)))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return plans


@torch.no_grad()
def produce(
    target: Any,
    plan: StepPlan,
    layer_ids: LayerIds,
    fixed_shape: tuple[int | None, int | None],
    dev: torch.device,
    stream: torch.cuda.Stream | None,
    after: torch.cuda.Event | None = None,
) -> StepStates:
    """The target's forward over each packed row of ``plan`` on ``stream`` (once ``after`` has happened
    there, if given); states stay on the device."""
    batches = []
    with on_stream(stream):
        if stream is not None and after is not None:
            stream.wait_event(after)
        for row in plan.rows:
            batch = collate_rows([row], dev, None, *fixed_shape, packed=True)
            real = sum(int(s["input_ids"].shape[0]) for s in row)
            captured = capture_aux_hidden_states(
                target,
                batch["input_ids"][:, :real],
                layer_ids,
                position_ids=batch["position_ids"][:, :real],  # restart per sample: attention per sample
            )
            assert captured.last is not None
            pad = int(batch["input_ids"].shape[1]) - real  # to the row shape the compiled loss sees
            batch["aux_hidden"] = F.pad(captured.aux, (0, 0, 0, pad))
            batch["last_hidden"] = F.pad(captured.last, (0, 0, 0, pad))
            batches.append(batch)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
    return StepStates(plan, batches, ready)


def train_states(
    run: TrainingRun, states: StepStates, step: int, stream: torch.cuda.Stream | None
) -> dict[str, Any]:
    """One optimizer step on device-resident rows: ``TrainingRun.train_step`` with its host collation
    (``collate_rows`` from host samples) replaced by the producer's batches. Returns the step's record
    (reading it waits for this stream only)."""
    cfg = run.cfg
    with on_stream(stream):
        if stream is not None:
            assert states.ready is not None
            stream.wait_event(states.ready)
            for batch in states.batches:  # made on the producer's stream: freed only after this one ran
                for tensor in batch.values():
                    tensor.record_stream(stream)
        run.optimizer.zero_grad(set_to_none=True)
        sums = StepSums(cfg.ttt_length, run.device)
        for batch in states.batches:
            loss, terms = run.forward_backward(batch, states.plan.step_tokens_on_device)
            sums.add(loss, terms, batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)
        run.optimizer.step()
        run.scheduler.step()
        record = sums.record(states.plan.step_tokens)
        record.update(step=step, grad_norm=float(grad_norm))
    return record


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


class Bench:
    """The target, the training run and the two streams, shared by every measurement."""

    def __init__(self, s: dict[str, int], cfg: TrainConfig, dev: torch.device, total_steps: int) -> None:
        from transformers import LlamaForCausalLM

        self.dev = dev
        with torch.device(dev):
            target: Any = LlamaForCausalLM(target_config(s))  # (random weights: nothing to download)
            self.target = target.to(torch.bfloat16).eval()
        self.layer_ids = LayerIds.default_for_depth(s["L"])
        torch.manual_seed(0)
        drafter = Eagle3Drafter(drafter_config(s))
        drafter.attach_embeddings(self.target.get_input_embeddings().weight.cpu())
        self.run = TrainingRun.start(drafter, self.target.lm_head.weight, cfg, dev, 1, total_steps)
        cuda = dev.type == "cuda"
        self.producer_stream = torch.cuda.Stream(dev) if cuda else None
        self.trainer_stream = torch.cuda.Stream(dev) if cuda else None
        self.step = 0
        self.records: list[dict[str, Any]] = []
        sync(dev)

    def produce(self, plan: StepPlan, after: torch.cuda.Event | None = None) -> StepStates:
        return produce(
            self.target, plan, self.layer_ids, self.run.fixed_shape, self.dev, self.producer_stream, after
        )

    def train(self, states: StepStates, also_after: torch.cuda.Event | None = None) -> dict[str, Any]:
        self.step += 1
        if also_after is not None and self.trainer_stream is not None:
            self.trainer_stream.wait_event(also_after)
        record = train_states(self.run, states, self.step, self.trainer_stream)
        self.records.append({k: record[k] for k in ("step", "loss", "real_tokens", "computed_tokens")})
        return record

    def extraction(self, plans: list[StepPlan]) -> tuple[float, list[StepStates]]:
        """Seconds to make every step's states (kept, on the device), and the states."""
        sync(self.dev)
        start = time.perf_counter()
        made = [self.produce(plan) for plan in plans]
        sync(self.dev)
        return time.perf_counter() - start, made

    def training(self, made: list[StepStates]) -> float:
        sync(self.dev)
        start = time.perf_counter()
        for states in made:
            self.train(states)  # its record is read back: the step has finished
        sync(self.dev)
        return time.perf_counter() - start

    def alternating(self, plans: list[StepPlan]) -> float:
        """Online with the two streams taking turns on the GPU, the producer one step ahead: step i+1's
        forward (stream A) runs once step i-1 is trained, step i trains (stream B) once step i+1 is made.
        Both sides fill the GPU alone, so running them at once only makes them contend (the concurrent
        schedule's measured loss); in turns the GPU never waits, because each side's work is queued
        while the other's runs. Seconds for every step, fill and drain included."""
        sync(self.dev)
        start = time.perf_counter()
        ahead = self.produce(plans[0])
        trained: torch.cuda.Event | None = None
        for index in range(len(plans)):
            current = ahead
            if index + 1 < len(plans):
                ahead = self.produce(plans[index + 1], after=trained)
            self.train(current, also_after=ahead.ready if index + 1 < len(plans) else None)
            if self.trainer_stream is not None:
                trained = torch.cuda.Event()
                trained.record(self.trainer_stream)
            del current
        sync(self.dev)
        return time.perf_counter() - start

    def online(self, plans: list[StepPlan], queue_depth: int) -> dict[str, float]:
        """Producer thread (stream A) ahead of the trainer (stream B, this thread) by at most
        ``queue_depth`` finished steps; times the whole pipeline, fill and drain included."""
        handoff: queue.Queue[StepStates | BaseException | None] = queue.Queue(maxsize=queue_depth)
        stop = threading.Event()
        producer_blocked = [0.0]

        def put(item: StepStates | BaseException | None) -> bool:
            began = time.perf_counter()
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    producer_blocked[0] += time.perf_counter() - began
                    return True
                except queue.Full:
                    continue
            return False

        def producer() -> None:
            try:
                for plan in plans:
                    states = self.produce(plan)
                    if states.ready is not None:
                        states.ready.synchronize()  # hand over finished states: a wait is then visible
                    if not put(states):
                        return
                put(None)
            except BaseException as error:
                put(error)

        sync(self.dev)
        start = time.perf_counter()
        thread = threading.Thread(target=producer, name="online-producer", daemon=True)
        thread.start()
        waited, first_wait = 0.0, 0.0
        try:
            for index in range(len(plans)):
                began = time.perf_counter()
                item = handoff.get()
                wait = time.perf_counter() - began
                waited += wait
                if index == 0:
                    first_wait = wait
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    raise RuntimeError(f"the producer stopped after {index} of {len(plans)} steps")
                self.train(item)
                del item
            sync(self.dev)
            elapsed = time.perf_counter() - start
        finally:
            stop.set()
            thread.join()
        return {
            "seconds": elapsed,
            "trainer_waited_s": waited,
            "trainer_first_wait_s": first_wait,  # the pipeline's fill: one step made before any training
            "producer_blocked_s": producer_blocked[0],  # queue full: the trainer was the slower side
        }


def runs_table(values: list[float]) -> dict[str, Any]:
    return {"runs": [round(v, 1) for v in values], **spread(values)}


def target_flops_per_token(s: dict[str, int], plans: list[StepPlan]) -> float:
    """The target's matmul FLOPs per real token (forward, no lm_head), attention causal per sample."""
    q, kv = s["NH"] * s["HD"], s["NKV"] * s["HD"]
    layer = 2 * (s["H"] * (q + 2 * kv) + q * s["H"] + 3 * s["H"] * s["I"])
    lengths = [int(x["input_ids"].shape[0]) for plan in plans for row in plan.rows for x in row]
    attention = sum(2 * 2 * q * n * (n + 1) / 2 for n in lengths) / sum(lengths)
    return float(s["L"] * (layer + attention))


def cycle_plans(plans: list[StepPlan], count: int) -> Iterator[StepPlan]:
    for index in range(count):
        yield plans[index % len(plans)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="JSON file (written after every part)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each measurement (interleaved)")
    # Defaults: 20, 3 and 32 (a CPU smoke run with --tiny: 3, 2 and 16).
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed run")
    parser.add_argument("--warm-steps", type=int, default=None, help="untimed steps first (compilation)")
    parser.add_argument("--samples-per-step", type=int, default=None)
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--queue-depth", type=int, default=2, help="finished steps between the two")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA"
    )
    parser.add_argument("--train-lm-head", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--stop-after-s", type=float, default=1e9, help="start no new run after this")
    args = parser.parse_args()
    began = time.monotonic()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = shapes(args.tiny)
    cap = 256 if args.tiny else 4096
    for name, full, tiny in (("steps", 20, 3), ("warm_steps", 3, 2), ("samples_per_step", 32, 16)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.tiny:
        args.pack_tokens = min(args.pack_tokens, cap)
    if args.samples_per_step % SAMPLES_PER_SHARD:
        parser.error(f"--samples-per-step must be a multiple of {SAMPLES_PER_SHARD} (samples per shard)")
    defaults = TrainConfig()
    cfg = TrainConfig(
        ttt_length=args.ttt,
        epochs=1,
        batch_size=args.samples_per_step,
        lr=1e-4,
        compile=args.compile,
        pack_tokens=args.pack_tokens,
        show_progress=False,
        train_lm_head=defaults.train_lm_head if args.train_lm_head is None else args.train_lm_head,
    )
    data = SyntheticHiddenStates(s, cap)
    plans = plan_steps(data, args.warm_steps + args.steps, cfg, dev)
    warm, timed = plans[: args.warm_steps], plans[args.warm_steps :]
    real_tokens = sum(p.real_tokens for p in timed)
    rows = sum(len(p.rows) for p in timed)
    peak = matmul_peak(dev.type)
    timed_shards = args.steps * args.samples_per_step // SAMPLES_PER_SHARD
    drafter_flops = useful_flops_per_token(drafter_config(s), data, timed_shards, args.ttt, cfg.train_lm_head)
    target_flops = target_flops_per_token(s, timed)
    # Warm-up steps, two online warm-up steps, the settle pass, the timed runs (two trainings each).
    total_steps = (args.warm_steps + 2 + (args.runs + 1) * 2 * args.steps) * 2  # lr stays above zero
    bench = Bench(s, cfg, dev, total_steps)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": s,
        "settings": {k: v for k, v in vars(args).items() if k != "out"}
        | {
            "cap": cap,
            "compiled": bench.run.fixed_shape != (None, None),
            "train_lm_head": cfg.train_lm_head,
            "layer_ids": list(bench.layer_ids.ids),
            "target_attention": getattr(bench.target.config, "_attn_implementation", None),
        },
        "real_tokens_per_run": real_tokens,
        "rows_per_run": rows,
        "packing_efficiency": round(real_tokens / (rows * (bench.run.fixed_shape[1] or cap)), 4),
        "bf16_matmul_peak_flops": peak,
        "drafter_useful_flops_per_real_token": drafter_flops,
        "target_flops_per_real_token": target_flops,
    }

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    # Warm-up, untimed: the first training step compiles the loss (minutes at the 8B shape); then the
    # producer and the trainer once more, and two online steps (the streams' first use from a thread).
    start = time.perf_counter()
    for plan in warm:
        bench.train(bench.produce(plan))
        loss = bench.records[-1]["loss"]
        log(f"warm step {bench.step}: {time.perf_counter() - start:.1f} s, loss {loss:.4f}")
    bench.online(list(cycle_plans(warm, 2)), args.queue_depth)
    bench.alternating(list(cycle_plans(warm, 2)))
    result["warm_seconds"] = round(time.perf_counter() - start, 1)
    log(f"warm-up done: {result['warm_seconds']} s")
    # Settle pass, untimed: each measurement once at the timed sizes, so the first pass's allocations
    # (the kept states: gigabytes) land in the caching allocator's pool before any timed run; its
    # figures are kept apart to show how far a first pass differs.
    seconds, made = bench.extraction(timed)
    settle = {"extraction": real_tokens / seconds, "training": real_tokens / bench.training(made)}
    del made
    gc.collect()
    settle["online"] = real_tokens / bench.online(timed, args.queue_depth)["seconds"]
    settle["online_alternating"] = real_tokens / bench.alternating(timed)
    result["settle_pass_tok_per_s"] = {k: round(v, 1) for k, v in settle.items()}
    log(
        f"settle pass (untimed): extraction {settle['extraction']:.0f} tok/s, "
        f"training {settle['training']:.0f} tok/s, online {settle['online']:.0f} tok/s"
    )
    write()

    extraction, training, online, ratios = [], [], [], []
    alternating, alternating_ratios, alternating_idle = [], [], []
    idle, idle_after_fill, blocked = [], [], []
    for index in range(args.runs):
        if index >= 2 and time.monotonic() - began > args.stop_after_s:
            result["runs_skipped"] = f"after {index} runs: {time.monotonic() - began:.0f} s had passed"
            break
        seconds, made = bench.extraction(timed)
        extraction.append(real_tokens / seconds)
        training.append(real_tokens / bench.training(made))
        del made
        gc.collect()
        pipeline = bench.online(timed, args.queue_depth)
        online.append(real_tokens / pipeline["seconds"])
        serial = 1 / (1 / extraction[-1] + 1 / training[-1])
        ratios.append(online[-1] / serial)
        idle.append(pipeline["trainer_waited_s"] / pipeline["seconds"])
        idle_after_fill.append(
            (pipeline["trainer_waited_s"] - pipeline["trainer_first_wait_s"]) / pipeline["seconds"]
        )
        blocked.append(pipeline["producer_blocked_s"] / pipeline["seconds"])
        seconds = bench.alternating(timed)
        alternating.append(real_tokens / seconds)
        alternating_ratios.append(alternating[-1] / serial)
        # The trainer's GPU time is training alone's: the rest of the wall it did not train.
        alternating_idle.append(1 - real_tokens / training[-1] / seconds)
        log(
            f"run {index}: extraction {extraction[-1]:.0f} tok/s, training {training[-1]:.0f} tok/s, "
            f"online concurrent {online[-1]:.0f} tok/s (ratio {ratios[-1]:.3f}, trainer idle "
            f"{idle[-1]:.3f}), alternating {alternating[-1]:.0f} tok/s (ratio {alternating_ratios[-1]:.3f})"
        )
        median_e, median_t = statistics.median(extraction), statistics.median(training)
        median_o, median_a = statistics.median(online), statistics.median(alternating)
        serial_bound = 1 / (1 / median_e + 1 / median_t)
        result.update(
            online_extraction_tok_per_s=runs_table(extraction),
            online_training_tok_per_s=runs_table(training),
            serial_bound_tok_per_s=round(serial_bound, 1),
            overlap_upper_bound_ratio=round(min(median_e, median_t) / serial_bound, 3),
            # The schedule the product's one-GPU pipeline uses: the streams take turns.
            online_real_tok_per_s=runs_table(alternating),
            online_ratio=round(median_a / serial_bound, 3),
            online_ratio_runs=[round(r, 3) for r in alternating_ratios],
            online_ratio_spread_pct=round(
                100
                * (max(alternating_ratios) - min(alternating_ratios))
                / statistics.median(alternating_ratios),
                2,
            ),
            online_le_min_x1_02=all(
                o <= min(e, t) * 1.02
                for o, e, t in zip(online + alternating, extraction * 2, training * 2, strict=True)
            ),
            online_trainer_idle_fraction=round(statistics.median(alternating_idle), 4),
            online_trainer_idle_fraction_runs=[round(x, 4) for x in alternating_idle],
            online_mfu=round(median_a * (target_flops + drafter_flops) / peak, 3),
            # Both streams at once (a producer thread ahead through a queue): contention, for comparison.
            online_concurrent_real_tok_per_s=runs_table(online),
            online_concurrent_ratio=round(median_o / serial_bound, 3),
            online_concurrent_ratio_runs=[round(r, 3) for r in ratios],
            online_concurrent_trainer_idle_fraction=round(statistics.median(idle), 4),
            online_concurrent_trainer_idle_fraction_after_fill=round(statistics.median(idle_after_fill), 4),
            online_concurrent_producer_blocked_fraction=round(statistics.median(blocked), 4),
            extraction_mfu=round(median_e * target_flops / peak, 3),
            training_mfu=round(median_t * drafter_flops / peak, 3),
        )
        if dev.type == "cuda":
            result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        write()
    result["losses"] = [round(r["loss"], 4) for r in bench.records]
    result["seconds"] = round(time.monotonic() - began, 1)
    write()
    log(json.dumps({k: v for k, v in result.items() if k not in ("shapes", "losses")}))


if __name__ == "__main__":
    main()
