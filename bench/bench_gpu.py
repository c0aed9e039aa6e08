"""draftloop's GPU benchmark: ratios measured in ONE invocation on one GPU (bench/RESULTS.md has the command).

1. extraction: tokens/s of extracting three aux layers + the final hidden state of a Llama-3.1-8B-shaped
   target (random bf16 weights, sequences of 2048) all the way into committed shards on local disk
   (infra.storage manifest, sha256) / tokens/s of the bare forward pass (no lm_head, no KV cache: the
   extraction's own settings). Goal >= 0.90.
2. training: draftloop's EAGLE-3 TTT step (ttt 7) tokens/s / the speculators library's trainer on the
   same drafter config and the same synthetic hidden states. Goal >= 1.3. Plus MFU against the measured
   bf16 matmul peak.
3. simulator: tokens/s of the acceptance simulator (greedy chain speculation) for k = 3 and 5.

Usage: python bench/bench_gpu.py [--tiny] [--out DIR] [--parts extraction,training,simulator]
       [--no-fsync-variant]
--tiny runs every part with toy shapes (a CPU smoke test of this script).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.extract import extract_hidden_states
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.objective import ttt_loss
from draftloop.kernels.shards import shard_chunks
from draftloop.kernels.train import TrainConfig, make_optimizer

RESULTS: dict[str, Any] = {}


def log(key: str, value: Any) -> None:
    RESULTS[key] = value
    print(json.dumps({key: value}), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls (device synchronised around each call)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shapes(tiny: bool) -> dict[str, int]:
    if tiny:
        return dict(H=128, I=256, NH=4, NKV=2, HD=32, V=1024, VD=512, L=6, SEQ=128, B=2)
    return dict(H=4096, I=14336, NH=32, NKV=8, HD=128, V=128256, VD=32000, L=32, SEQ=2048, B=4)


def target_config(s: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=s["H"],
        intermediate_size=s["I"],
        num_attention_heads=s["NH"],
        num_key_value_heads=s["NKV"],
        head_dim=s["HD"],
        vocab_size=s["V"],
        num_hidden_layers=s["L"],
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        torch_dtype="bfloat16",
    )


def matmul_peak(dev: str) -> float:
    n = 8192 if dev == "cuda" else 512
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = timed(lambda: a @ b, 3, 10)
    return 2 * n**3 / t


# ---------------------------------------------------------------------------------------------- extraction


def bench_extraction(s: dict[str, int], dev: str, workdir: Path, batches: int, fsync_variant: bool) -> Any:
    """Extraction into committed shards vs the bare forward, over ``batches`` batches (one shard each).

    A finite run pays once for its drain: after the last forward, the last shard is still copied,
    hashed and written while nothing else runs. A real extraction (thousands of shards) amortises it, a
    dozen batches do not; so next to the end-to-end ratio the bench reports the steady state (the
    marginal time per batch between a quarter run and a full run) and the fixed cost per run (drain).
    """
    from transformers import LlamaForCausalLM

    from draftloop.infra.runtime.storage import DatasetWriter, read_manifest

    with torch.device(dev):
        target = LlamaForCausalLM(target_config(s)).to(torch.bfloat16).eval()
    layer_ids = LayerIds.default_for_depth(s["L"])
    gen = torch.Generator().manual_seed(0)
    data = [
        [
            {
                "input_ids": torch.randint(0, s["V"], (s["SEQ"],), generator=gen),
                "loss_mask": torch.ones(s["SEQ"], dtype=torch.uint8),
            }
            for _ in range(s["B"])
        ]
        for _ in range(batches)
    ]
    device_batches = [torch.stack([x["input_ids"] for x in batch]).to(dev) for batch in data]
    tokens_per_batch = s["B"] * s["SEQ"]
    tokens = batches * tokens_per_batch

    def bare() -> None:
        with torch.no_grad():
            for ids in device_batches:
                target.model(input_ids=ids, use_cache=False)  # the extraction's own settings

    bare_s = timed(bare, 1, 3)
    log("extraction_batches", batches)
    log("extraction_bare_forward_tok_per_s", round(tokens / bare_s, 1))

    def pipeline(fsync: bool, drop: bool = False, count: int = batches) -> float:
        """One extraction pass over the first ``count`` batches into committed shards; ``drop``: the
        shards are laid out, then dropped (no hashing, no writing), which isolates the capture and the
        copies from the sink's cost."""
        out = workdir / f"hidden-{time.monotonic_ns()}"
        writer = DatasetWriter(str(out), fsync=fsync)

        def sink(name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
            rows = int(tensors["seq_offsets"].shape[0]) - 1
            chunks = shard_chunks(tensors, metadata)
            if drop:
                return
            writer.write_shard_chunks(name, chunks, rows)

        sync()
        start = time.perf_counter()
        extract_hidden_states(
            target,
            data[:count],
            layer_ids,
            sink,
            target_name="llama-8b-random",
            samples_per_shard=s["B"],  # writer threads and in-flight shards: the product's defaults
        )
        elapsed = time.perf_counter() - start
        if drop:
            return elapsed
        manifest = writer.commit("extract", inputs={}, summary={"tokens": count * tokens_per_batch})
        elapsed = time.perf_counter() - start
        assert len(manifest.shards) == count, manifest.shards
        assert read_manifest(str(out)).content_hash() == manifest.content_hash()
        shutil.rmtree(out, ignore_errors=True)
        return elapsed

    pipeline(False)  # warm-up (pinned-memory pool, writer threads)
    full_s = statistics.median([pipeline(False) for _ in range(3)])
    log("extraction_pipeline_tok_per_s", round(tokens / full_s, 1))
    log("extraction_ratio", round(bare_s / full_s, 3))
    if fsync_variant:
        fsync_s = statistics.median([pipeline(True) for _ in range(3)])
        log("extraction_pipeline_fsync_tok_per_s", round(tokens / fsync_s, 1))
        log("extraction_ratio_fsync", round(bare_s / fsync_s, 3))
    quarter = max(1, batches // 4)
    quarter_s = statistics.median([pipeline(False, count=quarter) for _ in range(3)])
    per_batch = (full_s - quarter_s) / (batches - quarter)  # marginal: fill and drain cancel
    log("extraction_ratio_steady", round(bare_s / batches / per_batch, 3))
    log("extraction_fixed_seconds_per_run", round(full_s - batches * per_batch, 3))  # fill + drain
    drop_s = statistics.median([pipeline(False, drop=True) for _ in range(3)])
    log("extraction_capture_only_ratio", round(bare_s / drop_s, 3))  # the sink's share: this vs the above
    log("extraction_bytes_per_token", (len(layer_ids.ids) + 1) * s["H"] * 2)
    return target


# ---------------------------------------------------------------------------------------------- training


def drafter_config(s: dict[str, int]) -> DrafterConfig:
    return DrafterConfig.for_target(
        target_config(s), LayerIds.default_for_depth(s["L"]), draft_vocab_size=s["VD"]
    )


def synthetic_batch(s: dict[str, int], dev: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    seq = s["SEQ"]
    return {
        "input_ids": torch.randint(0, s["V"], (1, seq), generator=gen).to(dev),
        "loss_mask": torch.ones(1, seq, dtype=torch.bool, device=dev),
        "aux_hidden": torch.randn(1, seq, 3 * s["H"], generator=gen).to(dev, torch.bfloat16),
        "last_hidden": torch.randn(1, seq, s["H"], generator=gen).to(dev, torch.bfloat16),
        "lengths": torch.tensor([seq], device=dev),
    }


def drafter_step_flops(cfg: DrafterConfig, seq: int, ttt: int) -> float:
    """Matmul FLOPs of one TTT training step (forward x3 for backward; frozen target head forward only)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size + h * cfg.draft_vocab_size
    per_token = 2 * layer * 3 * ttt  # fwd + bwd over the unrolled steps
    per_token += 2 * 3 * (cfg.num_aux_layers * cfg.target_hidden_size * h)  # fc once
    per_token += 2 * cfg.target_hidden_size * cfg.draft_vocab_size  # target head (no grad)
    attn = sum(2 * 2 * seq * q / 2 + 2 * 2 * j * q for j in range(ttt)) * 3  # causal scores + diagonal
    return float(seq * (per_token + attn))


def bench_training(s: dict[str, int], dev: str, reps: int, ttts: tuple[int, ...]) -> None:
    cfg = drafter_config(s)
    batch = synthetic_batch(s, dev)
    seq = s["SEQ"]
    peak = RESULTS.get("bf16_matmul_peak_flops", 0.0)
    for ttt in ttts:
        for compiled in (False, True):
            torch.manual_seed(0)
            drafter = Eagle3Drafter(cfg).to(dev)
            drafter.attach_embeddings(torch.randn(s["V"], s["H"], device=dev) * 0.02)
            head = torch.randn(s["VD"], s["H"], device=dev, dtype=torch.bfloat16) * 0.02
            opt = make_optimizer(drafter, TrainConfig(lr=1e-4))
            loss_fn = torch.compile(ttt_loss) if compiled else ttt_loss

            def step(
                drafter: Eagle3Drafter = drafter,
                opt: Any = opt,
                loss_fn: Any = loss_fn,
                head: Any = head,
                ttt: int = ttt,
            ) -> None:
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    loss, _ = loss_fn(drafter, batch, head, ttt, 0.8)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
                opt.step()

            key = f"draftloop_{'compiled' if compiled else 'eager'}_ttt{ttt}"
            try:
                t = timed(step, 3, reps)
                log(key + "_tok_per_s", round(seq / t, 1))
                if peak:
                    log(key + "_mfu", round(drafter_step_flops(cfg, seq, ttt) / t / peak, 3))
                if dev == "cuda":
                    log(key + "_peak_gib", round(torch.cuda.max_memory_allocated() / 2**30, 2))
            except Exception as error:  # report and go on: the other variants still count
                log(key + "_error", repr(error)[:400])
            del drafter, opt
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    bench_peer(s, dev, reps, ttts)


def peer_model(s: dict[str, int]) -> Any:
    """The speculators library's EAGLE-3 drafter (speculators 0.9.0) on the drafter shape `s`."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(
        hidden_size=s["H"],
        intermediate_size=s["I"],
        num_attention_heads=s["NH"],
        num_key_value_heads=s["NKV"],
        vocab_size=s["V"],
        num_hidden_layers=1,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    )
    spec = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=s["VD"],
        speculators_config=spec,
        eagle_aux_hidden_state_layer_ids=list(LayerIds.default_for_depth(s["L"]).ids),
    )
    return Eagle3DraftModel(cfg)


def bench_peer(s: dict[str, int], dev: str, reps: int, ttts: tuple[int, ...]) -> None:
    """The speculators library's EAGLE-3 step on the same drafter shape and synthetic states."""
    try:
        from speculators.losses.utils import resolve_loss_config

        peer_model(s)  # the library and its config classes import
    except ImportError as error:
        log("speculators_error", repr(error))
        return
    batch = synthetic_batch(s, dev)
    seq = s["SEQ"]
    for ttt in ttts:
        for stance in ("default", "force_eager"):  # compiled model (its default) and eager
            torch.compiler.set_stance(stance)
            torch.manual_seed(0)
            model = peer_model(s).to(dev)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            loss_cfg = resolve_loss_config("kl_div", "eager")  # its fused loss breaks on torch 2.11
            doc = torch.zeros(1, seq, dtype=torch.long, device=dev)

            def step(
                model: Any = model, opt: Any = opt, loss_cfg: Any = loss_cfg, doc: Any = doc, ttt: int = ttt
            ) -> None:
                with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                    _, loss, _ = model(
                        hidden_states=batch["aux_hidden"],
                        input_ids=batch["input_ids"],
                        document_ids=doc,
                        loss_mask=batch["loss_mask"],
                        verifier_last_hidden_states=batch["last_hidden"],
                        ttt_steps=ttt,
                        ttt_step_loss_decay=0.8,
                        loss_config=loss_cfg,
                    )
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()

            key = f"speculators_{'compiled' if stance == 'default' else 'eager'}_ttt{ttt}"
            try:
                log(key + "_tok_per_s", round(seq / timed(step, 3, reps), 1))
            except Exception as error:
                log(key + "_error", repr(error)[:400])
            del model, opt
            gc.collect()
            if dev == "cuda":
                torch.cuda.empty_cache()
    torch.compiler.set_stance("default")


# ---------------------------------------------------------------------------------------------- simulator


def bench_simulator(s: dict[str, int], dev: str, target: Any, new_tokens: int) -> None:
    from draftloop.kernels.simulate import speculative_generate

    if target is None:
        from transformers import LlamaForCausalLM

        with torch.device(dev):
            target = LlamaForCausalLM(target_config(s)).to(torch.bfloat16).eval()
    layer_ids = LayerIds.default_for_depth(s["L"])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(drafter_config(s)).to(dev, torch.bfloat16).eval()
    drafter.attach_embeddings(target.get_input_embeddings().weight)
    prompts = [torch.randint(0, s["V"], (1, 256), device=dev) for _ in range(4)]
    for k in (3, 5):
        speculative_generate(target, drafter, prompts[0], k=k, max_new_tokens=8, capture_layer_ids=layer_ids)
        sync()
        start = time.perf_counter()
        produced = 0
        for ids in prompts:
            out, _, _ = speculative_generate(
                target, drafter, ids, k=k, max_new_tokens=new_tokens, capture_layer_ids=layer_ids
            )
            produced += len(out)
        sync()
        log(f"simulator_k{k}_tok_per_s", round(produced / (time.perf_counter() - start), 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default="extraction,training,simulator")
    parser.add_argument("--no-fsync-variant", action="store_true", help="skip the fsync extraction pass")
    parser.add_argument("--ttt", default="7", help="comma-separated TTT lengths to time (e.g. 7,3)")
    parser.add_argument(
        "--extraction-batches", type=int, default=None, help="batches per extraction pass (default 48)"
    )
    args = parser.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = shapes(args.tiny)
    parts = set(args.parts.split(","))
    log("device", torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    log("torch", torch.__version__)
    log("shapes", s)
    log("bf16_matmul_peak_flops", matmul_peak(dev))
    workdir = Path(tempfile.mkdtemp(prefix="draftloop-bench-"))
    target = None
    try:
        if "training" in parts:
            ttts = tuple(int(t) for t in args.ttt.split(","))
            bench_training(s, dev, reps=2 if args.tiny else 10, ttts=ttts)
        if "extraction" in parts:
            target = bench_extraction(
                s,
                dev,
                workdir,
                batches=args.extraction_batches or (4 if args.tiny else 48),
                fsync_variant=not args.no_fsync_variant,
            )
        if "simulator" in parts:
            bench_simulator(s, dev, target, new_tokens=16 if args.tiny else 128)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for ttt in (7, 3):
        ours = max(
            (RESULTS.get(f"draftloop_{v}_ttt{ttt}_tok_per_s", 0.0) for v in ("eager", "compiled")),
            default=0.0,
        )
        peer = max(
            (RESULTS.get(f"speculators_{v}_ttt{ttt}_tok_per_s", 0.0) for v in ("eager", "compiled")),
            default=0.0,
        )
        if ours and peer:
            log(f"training_ratio_ttt{ttt}", round(ours / peer, 3))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(RESULTS, indent=2))
    print(json.dumps(RESULTS), flush=True)


if __name__ == "__main__":
    sys.exit(main())
