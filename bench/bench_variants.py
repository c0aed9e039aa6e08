"""EAGLE 3.1 against EAGLE-3 on the same data (CPU, tiny-llama; issue 25 item 4).

One dataset, one training recipe, two drafter variants, several seeds, one simulator:

1. data: the zoo's tiny-llama (seed 0) answers the first `--train-prompts` built-in prompts greedily
   (`--answer-tokens` new tokens, chat template applied, as the synthesize stage renders them); the
   answers' aux and final hidden states are captured (kernels/capture.py) into shard-shaped samples.
   Every run below trains on exactly these samples.
2. training: per seed, a drafter of each variant (`eagle3`, `eagle3.1` with the published layer's
   defaults: fc_norm and norm_output on) built by `DrafterConfig.for_target`, lm_head and final norm
   started from the target's, trained by kernels/train.py `train_drafter` over `InMemorySamples` with
   one TrainConfig (same epochs, steps, TTT length, lr, batch). The seed sets the initial weights and
   the sample order, the same for both variants.
3. simulation (kernels/simulate.py `simulate_acceptance`, greedy, k=`--k`): the short held-out prompts
   (the last `--held-out` built-in prompts, never trained on) and the long-context set
   (infra/synthesis/long_context.py, `--long-prompts` prompts of each `--long-lengths` length in target
   tokens), `--new-tokens` new tokens each.

eagle31_al_ratio = EAGLE 3.1 mean acceptance length / EAGLE-3's, per seed, for short and long prompts
separately (long: all lengths together, and per length), with the median and spread over seeds. The
record goes to `--out` under `eagle31_al_ratio_cpu_tiny_llama` (other keys kept):

    .venv/bin/python bench/bench_variants.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_KEY = "eagle31_al_ratio_cpu_tiny_llama"
VARIANTS = ("eagle3", "eagle3.1")

Sample = dict[str, torch.Tensor]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def builtin_prompts() -> list[str]:
    from draftloop.infra.synthesis.prompts import builtin_prompts_path

    lines = builtin_prompts_path().read_text(encoding="utf-8").splitlines()
    return [str(json.loads(line)["prompt"]) for line in lines if line.strip()]


@torch.no_grad()
def greedy_conversations(
    target: Any, tokenizer: Any, prompts: Sequence[str], new_tokens: int, batch_size: int = 32
) -> list[tuple[list[int], list[int]]]:
    """(chat-templated prompt ids, the target's greedy answer ids) per prompt, in left-padded batches."""
    from draftloop.kernels.simulate import encode_prompt

    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    pad = int(tokenizer.pad_token_id or 0)
    conversations: list[tuple[list[int], list[int]]] = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chunk])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
        out = target.generate(
            input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad
        )
        conversations.extend(zip(chunk, out[:, width:].tolist(), strict=True))
    return conversations


def train(target: Any, layer_ids: Any, samples: list[Sample], variant: str, seed: int, args: Any) -> Any:
    """A drafter of `variant` trained on `samples` (initial weights and sample order from `seed`)."""
    from draftloop.kernels.data import InMemorySamples
    from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
    from draftloop.kernels.train import TrainConfig, train_drafter

    torch.manual_seed(seed)
    drafter = Eagle3Drafter(DrafterConfig.for_target(target.config, layer_ids, variant=variant))
    drafter.attach_embeddings(target.get_input_embeddings().weight)
    lm_head = target.get_output_embeddings().weight
    drafter.init_from_target_head(lm_head, target.model.norm.weight)
    settings = TrainConfig(
        ttt_length=args.ttt,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=seed,
        show_progress=False,
    )
    result = train_drafter(drafter, InMemorySamples(samples), lm_head, settings)
    return drafter.eval(), len(result.history)


def acceptance(report: Any) -> dict[str, Any]:
    """The simulator's figures, with per prompt (drafts, accepted tokens) and how many of the target's
    outputs differ (a tiny target's answers may barely depend on a long document)."""
    return {
        "mean_acceptance_length": round(float(report.mean_acceptance_length), 4),
        "acceptance_rate": round(float(report.acceptance_rate), 4),
        "drafts": report.num_drafts,
        "per_prompt_drafts_accepted": [[r.num_drafts, r.num_accepted_tokens] for r in report.results],
        "distinct_outputs": len({tuple(r.output_token_ids) for r in report.results}),
    }


def spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "per_seed": [round(v, 4) for v in values],
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftloop.infra.synthesis.long_context import category_for, long_context_prompts, source_fingerprint
    from draftloop.infra.targets.zoo import create_tiny_model
    from draftloop.kernels.capture import conversation_samples
    from draftloop.kernels.families.base import family_for_config
    from draftloop.kernels.simulate import simulate_acceptance

    torch.set_num_threads(args.threads)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    folder = create_tiny_model("tiny-llama", workdir / "tiny-llama", seed=0)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    layer_ids = family_for_config(target.config).default_aux_layer_ids(int(target.config.num_hidden_layers))
    prompts = builtin_prompts()
    train_prompts, held_out = prompts[: args.train_prompts], prompts[-args.held_out :]
    samples = conversation_samples(
        target, greedy_conversations(target, tokenizer, train_prompts, args.answer_tokens), layer_ids
    )
    long_set = long_context_prompts(tokenizer, args.long_lengths, args.long_prompts)
    timings["data_s"] = round(time.perf_counter() - started, 1)
    log(f"data: {len(samples)} samples, {sum(len(s['input_ids']) for s in samples)} tokens; "
        f"long prompts {[p.tokens for p in long_set]} tokens ({timings['data_s']} s)")  # fmt: skip

    simulate = {"k": args.k, "max_new_tokens": args.new_tokens}
    per_seed: list[dict[str, Any]] = []
    for seed in args.seeds:
        record: dict[str, Any] = {"seed": seed}
        for variant in VARIANTS:
            began = time.perf_counter()
            drafter, steps = train(target, layer_ids, samples, variant, seed, args)
            trained = time.perf_counter() - began
            short = simulate_acceptance(target, tokenizer, drafter, held_out, **simulate)
            long = simulate_acceptance(target, tokenizer, drafter, [p.prompt for p in long_set], **simulate)
            by_length = {}
            for length in args.long_lengths:
                members = [i for i, p in enumerate(long_set) if p.category == category_for(length)]
                drafts = sum(long.results[i].num_drafts for i in members)
                accepted = sum(long.results[i].num_accepted_tokens for i in members)
                by_length[str(length)] = round(1 + accepted / drafts, 4) if drafts else None
            record[variant] = {
                "optimizer_steps": steps,
                "train_s": round(trained, 1),
                "simulate_s": round(time.perf_counter() - began - trained, 1),
                "short": acceptance(short),
                "long": {**acceptance(long), "mean_acceptance_length_by_length": by_length},
            }
            log(f"seed {seed} {variant}: {steps} steps in {trained:.0f} s; short AL "
                f"{record[variant]['short']['mean_acceptance_length']}, long AL "
                f"{record[variant]['long']['mean_acceptance_length']} {by_length}")  # fmt: skip
        per_seed.append(record)

    def ratios(kind: str, length: str | None = None) -> list[float]:
        def al(record: dict[str, Any], variant: str) -> float:
            figures = record[variant][kind]
            return float(
                figures["mean_acceptance_length_by_length"][length]
                if length
                else figures["mean_acceptance_length"]
            )

        return [al(r, "eagle3.1") / al(r, "eagle3") for r in per_seed]

    def mean_al(kind: str, variant: str) -> float:
        return statistics.fmean(r[variant][kind]["mean_acceptance_length"] for r in per_seed)

    return {
        "machine": "CPU, 2 cores (shared)",
        "target": f"tiny-llama (zoo, seed 0), aux layers {list(layer_ids.ids)} (layer_input)",
        "data": {
            "train_prompts": len(samples),
            "answer_tokens": args.answer_tokens,
            "tokens": sum(len(s["input_ids"]) for s in samples),
            "synthesis": "the target's own greedy answers to the first built-in prompts (chat template)",
        },
        "training": {
            "epochs": args.epochs,
            "ttt_length": args.ttt,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "init": "lm_head and final norm from the target's",
            "seeds": list(args.seeds),
            "variants": {"eagle3": "plain", "eagle3.1": "fc_norm, norm_output (the published defaults)"},
        },
        "simulation": {
            "k": args.k,
            "max_new_tokens": args.new_tokens,
            "short_prompts": f"the last {len(held_out)} built-in prompts (never trained on)",
            "long_prompts": {
                "lengths": list(args.long_lengths),
                "per_length": args.long_prompts,
                "tokens": [p.tokens for p in long_set],
                "tasks": [p.task for p in long_set],
                "source": "infra/synthesis/long_context.py",
                "text_fingerprint": source_fingerprint(),
            },
        },
        "per_seed": per_seed,
        "eagle31_al_ratio_short": spread(ratios("short")),
        "eagle31_al_ratio_long": spread(ratios("long")),
        "eagle31_al_ratio_long_by_length": {
            str(n): spread(ratios("long", str(n))) for n in args.long_lengths
        },
        "mean_al": {kind: {v: round(mean_al(kind, v), 4) for v in VARIANTS} for kind in ("short", "long")},
        "timings": timings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-prompts", type=int, default=200)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--long-prompts", type=int, default=2, help="long-context prompts of each length")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where the target is built (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results-scale.json")
    parser.add_argument("--no-write", action="store_true", help="print the record, leave --out as it is")
    args = parser.parse_args()
    if len(args.seeds) < 1:
        parser.error("--seeds: at least one seed")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="draftloop-variants-") as scratch:
        record = run(args, (args.workdir or Path(scratch)).resolve())
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["command"] = ".venv/bin/python bench/bench_variants.py " + " ".join(sys.argv[1:])
    summary = {key: record[key] for key in ("eagle31_al_ratio_short", "eagle31_al_ratio_long", "mean_al")}
    print(json.dumps(summary, indent=1))
    if not args.no_write:
        previous = json.loads(args.out.read_text()) if args.out.exists() else {}
        args.out.write_text(json.dumps({**previous, RESULT_KEY: record}, indent=2) + "\n")


if __name__ == "__main__":
    main()
