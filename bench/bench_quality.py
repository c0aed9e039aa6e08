"""Drafter quality against the speculators library (CPU, tiny-llama; issue 10 item 8).

One dataset, two trainers, one simulator:

1. data: the product's own synthesize and extract stages (tasks/synthesize.py, tasks/extract.py) on
   configs/tiny-llama.yaml: the zoo's tiny-llama answers `--samples` builtin prompts, its hidden states
   are extracted; the synthesize stage also keeps the held-out evaluation prompts (the last
   `data.eval_prompts` builtin prompts, never trained on).
2. draftloop: the train stage's worker body (infra/training/worker.py `train_worker`, Ray-free with one
   worker) with the config's training section (no held-out epoch selection: the last epoch is exported).
3. speculators 0.9.0: its own `Eagle3DraftModel` (built by bench/bench_gpu.py `peer_model`) with
   its own verifier-weight loading, sample shift (`shift_batch`), packing (`CollateFn`), TTT forward and
   kl_div loss, its optimizer builder (AdamW) and its default linear warm-up/decay schedule, driven by a
   plain loop (its `Trainer` needs CUDA). Every optimizer step trains the same samples as draftloop's
   step of the same number (the same seeded `ShardedSamples` order; checked on the tokens per step).
4. conversion: the peer's weights are renamed onto kernels/drafter.py's `Eagle3Drafter`; its TTT logits
   (draftloop's ttt_loss) must equal the peer's own (its forward) on a few samples, within float
   tolerance, before any acceptance is trusted.
5. both drafters through kernels/simulate.py `simulate_acceptance` on the held-out prompts (the engine's
   k, the evaluation's max_tokens). Steps 2-5 run once per seed (initial weights and sample order);
   quality_ratio_vs_speculators = draftloop's mean acceptance length / the peer's, each averaged over
   the seeds (the per-seed ratios are recorded too).

    .venv/bin/python bench/bench_quality.py --samples 256 --epochs 4 --seeds 0 1

Ablations (one draftloop training option changed at a time, speculators' side fixed): keep the data in a
workdir, and speculators' result per seed with it (every run writes it there; `--reuse-peer` reads it, so
only draftloop trains again); each `--draftloop-set` result goes to the out file's `quality_ablations`
list instead of `quality`:

    .venv/bin/python bench/bench_quality.py --workdir /tmp/quality --reuse-peer \
        --draftloop-set train_lm_head=false
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

REPO_ROOT = Path(__file__).resolve().parent.parent
SPECULATORS_DIR = REPO_ROOT / ".venvs" / "speculators"  # `make peer-libs`: speculators 0.9.0, --no-deps
PEER_LOSS = "kl_div"  # speculators' default loss for eagle3
PEER_STEP_DECAY = 0.8  # TTT step loss decay, as draftloop's TrainConfig.step_decay
PEER_ATTENTION = "sdpa"  # speculators' draft_attn_impl on CPU (its flex attention has no CPU backward)
PEER_ONLY_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# The TrainConfig fields train_peer reads (draftloop-only ones, e.g. train_lm_head, stay out of its cache key)
PEER_SETTINGS = (
    "ttt_length",
    "epochs",
    "batch_size",
    "grad_accum",
    "lr",
    "warmup_ratio",
    "weight_decay",
    "grad_clip",
    "seed",
    "max_length",
    "step_decay",
)
LOGITS_RTOL = 1e-4  # conversion check: max |logit difference| / max |logit|
CHECK_SAMPLES = 4

Sample = Mapping[str, Tensor]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------- data


def experiment_config(
    workdir: Path, samples: int, epochs: int, seed: int = 0, training: Mapping[str, Any] | None = None
) -> Any:
    """configs/tiny-llama.yaml with its target and storage in ``workdir``, these training settings and
    ``training``'s overrides of the training section (draftloop's side of an ablation)."""
    import yaml

    from draftloop.infra.runtime.config import ExperimentConfig

    raw = yaml.safe_load((REPO_ROOT / "configs" / "tiny-llama.yaml").read_text())
    raw["name"] = f"quality-{samples}"
    raw["target"]["path"] = str(workdir / "models" / "tiny-llama")
    raw["data"]["num_samples"] = samples
    # Every sample trains (both trainers see the same ones); the quality is measured on the held-out
    # evaluation prompts instead of the train stage's per-epoch held-out estimate.
    raw["training"].update({"epochs": epochs, "seed": seed, "held_out_samples": 0, **(training or {})})
    raw["storage"]["root"] = str(workdir / "runs")
    return ExperimentConfig.from_dict(raw, check_environment=False)


def synthesize_and_extract(config: Any) -> tuple[Any, Any]:
    """(conversations, hidden states): the product's synthesize and extract stages (cached in storage)."""
    from bench_scale import start_ray

    from draftloop.infra.runtime.ray_cluster import shutdown_ray
    from draftloop.tasks import extract, synthesize

    start_ray(config.ray.address)
    try:
        conversations = synthesize.run(config)
        rows = conversations.manifest.summary.get("rows")
        log(f"synthesize: {rows} rows (cache hit {conversations.cache_hit})")
        hidden = extract.run(config, conversations)
        log(f"extract: {hidden.manifest.summary.get('tokens')} tokens (cache hit {hidden.cache_hit})")
    finally:
        shutdown_ray()
    return conversations, hidden


def training_samples(config: Any, hidden: Any) -> Any:
    """The hidden-state shards as the train stage's worker streams them (same shards, window, seed):
    the same global sample order every epoch."""
    from draftloop.infra.runtime.storage import read_shard, storage_options
    from draftloop.kernels.data import ShardedSamples, ShardRef, split_held_out
    from draftloop.kernels.shards import iter_hidden_samples, shard_from_bytes

    options = storage_options(config)

    def load(name: str) -> list[Sample]:
        tensors, _ = shard_from_bytes(read_shard(hidden.manifest, name, options))
        return [{k: v.clone() for k, v in sample.items()} for sample in iter_hidden_samples(tensors)]

    shards = [
        ShardRef(info.name, info.rows, info.size)
        for info in hidden.manifest.shards
        if info.name.endswith(".safetensors")
    ]
    training, held = split_held_out(shards, 0, seed=0)
    if held.num_samples:
        raise RuntimeError("no sample may be held out here")
    section = config.training
    return ShardedSamples(
        training,
        load,
        window_shards=int(section.shuffle_window_shards),
        prefetch_shards=int(section.prefetch_shards),
    )


# ---------------------------------------------------------------------------------------------- draftloop


def train_draftloop(config: Any, hidden: Any, folder: Path) -> tuple[Path, dict[str, Any], Any]:
    """(exported drafter folder, its result.json, the TrainConfig): the train stage's worker body."""
    from draftloop.infra.training.worker import train_worker
    from draftloop.tasks.train import loop_config

    shutil.rmtree(folder, ignore_errors=True)  # a checkpoint left there would be resumed
    job = loop_config(config, hidden, folder)
    reports: list[dict[str, Any]] = []
    train_worker(job, rank=0, world=1, device="cpu", report=reports.append)
    final = folder / "final"
    result = json.loads((final / "result.json").read_text())
    return final / "drafter", result, job.train


# ---------------------------------------------------------------------------------------------- speculators


def import_speculators() -> None:
    if not (SPECULATORS_DIR / "speculators").is_dir():
        raise SystemExit(f"speculators not found in {SPECULATORS_DIR}: run `make peer-libs`")
    if str(SPECULATORS_DIR) not in sys.path:
        sys.path.append(str(SPECULATORS_DIR))  # after the venv's own packages: only what it lacks


def build_peer(
    target_dir: Path,
    aux_layer_ids: Sequence[int],
    seed: int,
    target_tensors: tuple[Tensor, Tensor, Tensor],
) -> Any:
    """speculators' Eagle3DraftModel shaped like draftloop's drafter for this target, with the
    target's embedding, lm_head (frozen, as speculators trains) and final norm loaded by its own loader."""
    from bench_gpu import peer_model

    embed, lm_head, final_norm = target_tensors
    target = json.loads((target_dir / "config.json").read_text())
    shape = {
        "H": int(target["hidden_size"]),
        "I": int(target["intermediate_size"]),
        "NH": int(target["num_attention_heads"]),
        "NKV": int(target["num_key_value_heads"]),
        "V": int(target["vocab_size"]),
        "VD": int(target["vocab_size"]),  # draft_vocab_size null: the whole vocabulary
        "L": int(target["num_hidden_layers"]),
    }
    head_dim = int(target.get("head_dim") or shape["H"] // shape["NH"])
    if head_dim != shape["H"] // shape["NH"]:
        raise SystemExit(f"peer_model has no head_dim: the target's {head_dim} != hidden / heads")
    torch.manual_seed(seed)
    model = peer_model(shape)
    # peer_model's layer config has rms_norm_eps 1e-5 (Llama-3's); give its norms the target's.
    eps = float(target["rms_norm_eps"])
    model.config.transformer_layer_config.rms_norm_eps = eps
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = eps
    # FlexAttention has no backward on CPU: speculators' own dense path (its draft_attn_impl "sdpa", "for
    # hardware that doesn't support flex attention"), set where its from_training_args sets it, and the
    # additive masks the model builds for that path, in float32 (its default bf16 assumes CUDA autocast).
    from speculators.models.attention import create_float_mask

    model.config.transformer_layer_config._attn_implementation = PEER_ATTENTION
    model._attn_impl = PEER_ATTENTION
    model._create_mask_fn = partial(create_float_mask, dtype=torch.float32)
    if model.layers[0].self_attn.config._attn_implementation != PEER_ATTENTION:
        raise SystemExit("the peer's decoder layer does not share its layer config")
    model.config.eagle_aux_hidden_state_layer_ids = list(aux_layer_ids)
    model.config.speculators_config.verifier.name_or_path = str(target_dir)
    model.load_verifier_weights()  # embed_tokens, lm_head, verifier_lm_head, verifier_norm
    loaded = {
        "embed_tokens": (model.embed_tokens.weight, embed),
        "lm_head": (model.lm_head.weight, lm_head),
        "verifier_lm_head": (model.verifier_lm_head.weight, lm_head),
        "verifier_norm": (model.verifier_norm.weight, final_norm),
    }
    wrong = [
        name for name, (theirs, target_tensor) in loaded.items() if not torch.equal(theirs, target_tensor)
    ]
    if wrong:
        raise SystemExit(f"speculators' load_verifier_weights did not load the target's {wrong}")
    return model


def peer_item(sample: Sample, final_norm: Tensor, max_length: int) -> dict[str, Tensor]:
    """One sample as speculators' dataset returns it (BaseDataset.__getitem__).

    Its verifier_last_hidden_states are the target's states before the final norm (the model applies
    ``verifier_norm``, loaded from the target); the extracted ones are after it: h = w * x / rms(x).
    h / w = x / rms(x) has the pre-norm state's direction and unit RMS, so verifier_norm(h / w) = h."""
    length = min(int(sample["input_ids"].shape[0]), max_length)
    return {
        "hidden_states": sample["aux_hidden"][:length].float(),
        "input_ids": sample["input_ids"][:length].long(),
        "verifier_last_hidden_states": sample["last_hidden"][:length].float() / final_norm,
        "loss_mask": sample["loss_mask"][:length].bool(),
        "lengths": torch.tensor([length], dtype=torch.long),
        "position_ids": torch.arange(length, dtype=torch.long),
    }


def peer_row(
    items: Sequence[dict[str, Tensor]], hidden_size: int, num_aux: int, with_targets: bool = True
) -> dict[str, Tensor]:
    """speculators' own packing: shift_batch per sample, then CollateFn into one row [1, tokens].
    ``with_targets``: with the verifier's last hidden states (the forward then computes its loss)."""
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import CollateFn

    tokens = sum(int(item["lengths"][0]) - 1 for item in items)  # shift_batch drops one per sample
    collate = CollateFn(tokens, hidden_size, num_aux, dtype=torch.float32, preprocess=shift_batch)
    row = collate(list(items))
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids")
    return {key: row[key] for key in (*keys, *(("verifier_last_hidden_states",) if with_targets else ()))}


def train_peer(model: Any, data: Any, cfg: Any, final_norm: Tensor) -> dict[str, Any]:
    """cfg.epochs over ``data`` in draftloop's step order: one packed row per optimizer step."""
    from speculators.losses.utils import resolve_loss_config
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    hidden_size, num_aux = int(model.hidden_size), len(model.config.eagle_aux_hidden_state_layer_ids)
    loss_config = resolve_loss_config(PEER_LOSS, "eager")  # the fused loss needs CUDA (Triton)
    settings = SimpleNamespace(optimizer="adamw", lr=cfg.lr, weight_decay=cfg.weight_decay)
    (optimizer,) = build_optimizers(model, settings)
    steps_per_epoch = -(-data.num_samples // cfg.samples_per_step)
    total_steps = steps_per_epoch * cfg.epochs
    # speculators' default schedule (scheduler_type "linear"), warm-up steps = int(total * ratio)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(total_steps * cfg.warmup_ratio), total_steps)
    max_length = cfg.max_length or 1 << 30
    model.train()
    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    for epoch in range(cfg.epochs):
        for share in data.rank_steps(epoch, cfg.seed, cfg.samples_per_step, 0, 0, 1):
            items = [peer_item(sample, final_norm, max_length) for sample in share.samples]
            _, loss, metrics = model(
                **peer_row(items, hidden_size, num_aux),
                ttt_steps=cfg.ttt_length,
                ttt_step_loss_decay=PEER_STEP_DECAY,
                loss_config=loss_config,
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            history.append(
                {
                    "loss": float(loss.detach()),
                    "real_tokens": sum(int(item["lengths"][0]) for item in items),
                    "full_acc_0": float(metrics["full_acc_0_sum"] / metrics["full_acc_0_total"].clamp_min(1)),
                }
            )
            if len(history) % 8 == 0:
                log(f"speculators step {len(history)}/{total_steps}: loss {history[-1]['loss']:.3f}")
    model.eval()
    return {"seconds": round(time.perf_counter() - started, 1), "history": history}


def peer_to_drafter(model: Any, drafter_config: Any, embed: Tensor) -> Any:
    """The peer's weights under kernels/drafter.py's names (layers.0.* -> midlayer.*; the embedding and
    the verifier's head and norm are the target's, not the drafter's)."""
    from draftloop.kernels.drafter import Eagle3Drafter

    drafter = Eagle3Drafter(drafter_config)
    weights = {
        ("midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name): tensor
        for name, tensor in model.state_dict().items()
        if name not in PEER_ONLY_TENSORS
    }
    # speculators keeps no vocabulary tables for a full draft vocabulary: draftloop's identity ones
    weights.update({name: drafter.state_dict()[name] for name in ("d2t", "t2d")})
    drafter.load_state_dict(weights, strict=True)
    return drafter.attach_embeddings(embed).eval()


def _lm_head_outputs(head: nn.Module, run: Callable[[], object]) -> list[Tensor]:
    """Every output of ``head`` while ``run`` runs (one per TTT step)."""
    captured: list[Tensor] = []
    handle = head.register_forward_hook(lambda _module, _inputs, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return captured


def conversion_check(
    model: Any, drafter: Any, samples: Sequence[Sample], cfg: Any, final_norm: Tensor, lm_head: Tensor
) -> dict[str, Any]:
    """Per sample and TTT step: the peer's own logits (its forward on its shifted row) against the
    converted drafter's (draftloop's ttt_loss on the unshifted sample; anchor t of both predicts the same
    token). Also the peer's targets against the target's own logits."""
    from draftloop.kernels.objective import ttt_loss
    from draftloop.kernels.packing import collate_samples

    hidden_size, num_aux = int(model.hidden_size), len(model.config.eagle_aux_hidden_state_layer_ids)
    max_length = cfg.max_length or 1 << 30
    worst_logit, worst_target, scale, agree, total = 0.0, 0.0, 0.0, 0, 0
    for sample in samples:
        item = peer_item(sample, final_norm, max_length)
        length = int(item["lengths"][0])
        row = peer_row([item], hidden_size, num_aux, with_targets=False)
        peer_steps = _lm_head_outputs(model.lm_head, partial(model, **row, ttt_steps=cfg.ttt_length))
        batch = collate_samples([{k: v[:length] for k, v in sample.items()}], "cpu")
        ours = _lm_head_outputs(
            drafter.lm_head, partial(ttt_loss, drafter, batch, lm_head, cfg.ttt_length, cfg.step_decay)
        )
        if len(peer_steps) != cfg.ttt_length or len(ours) != cfg.ttt_length:
            raise RuntimeError(
                f"captured {len(peer_steps)} / {len(ours)} TTT steps, expected {cfg.ttt_length}"
            )
        for theirs, mine in zip(peer_steps, ours, strict=True):
            a, b = theirs[0, : length - 1].float(), mine[0, : length - 1].float()
            worst_logit = max(worst_logit, float((a - b).abs().max()))
            scale = max(scale, float(a.abs().max()))
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += length - 1
        with torch.no_grad():
            peer_targets = model.verifier_lm_head(model.verifier_norm(item["verifier_last_hidden_states"]))
            own_targets = sample["last_hidden"][:length].float() @ lm_head.T
        worst_target = max(worst_target, float((peer_targets - own_targets).abs().max()))
    return {
        "samples": len(samples),
        "ttt_steps": cfg.ttt_length,
        "max_abs_logit_difference": worst_logit,
        "max_abs_logit": scale,
        "relative": worst_logit / max(scale, 1e-12),
        "argmax_agreement": agree / max(1, total),
        "max_abs_target_logit_difference": worst_target,
        "exact": worst_logit <= LOGITS_RTOL * max(scale, 1.0),
    }


# ---------------------------------------------------------------------------------------------- simulate


def simulate(
    target: Any, tokenizer: Any, drafter: Any, prompts: list[str], k: int, max_tokens: int
) -> dict[str, Any]:
    from draftloop.kernels.simulate import simulate_acceptance

    report = simulate_acceptance(
        target, tokenizer, drafter, prompts, k=k, max_new_tokens=max_tokens, device="cpu"
    )
    return {
        "mean_acceptance_length": report.mean_acceptance_length,
        "acceptance_rate": report.acceptance_rate,
        "per_position_acceptance": report.per_position_acceptance,
        "num_drafts": report.num_drafts,
        "num_output_tokens": report.num_output_tokens,
        "seconds": round(report.elapsed_s, 1),
    }


# ---------------------------------------------------------------------------------------------- main


def train_settings(config: Any, hidden: Any) -> Any:
    """The TrainConfig the train stage builds from ``config`` (what both trainers are given)."""
    from draftloop.tasks.train import loop_config

    return loop_config(config, hidden, Path("unused")).train


DRAFTLOOP_OPTIONS = ("train_lm_head", "adam_betas", "lr_schedule", "init_norm_from_target")


def draftloop_description(section: Any) -> dict[str, Any]:
    """draftloop's side: its training section's options that differ from speculators' way, and what they
    mean."""
    settings = {name: getattr(section, name) for name in DRAFTLOOP_OPTIONS}
    settings["adam_betas"] = list(settings["adam_betas"])
    head = "trained" if section.train_lm_head else "frozen"
    norm = "the target's" if section.init_norm_from_target else "ones"
    return {
        "settings": settings,
        "loss": "soft cross-entropy to the target's distribution, step decay 0.8, each TTT step's "
        "token-weighted mean over the optimizer step",
        "trains": f"fc, decoder layer, final norm (starts at {norm})"
        + (", lm_head (starts at the target's)" if section.train_lm_head else "")
        + f"; lm_head {head}",
        "optimizer": f"AdamW betas {tuple(section.adam_betas)}, linear warm-up then {section.lr_schedule} "
        "decay",
    }


def peer_cache_path(workdir: Path, hidden: Any, cfg: Any, simulation: Mapping[str, Any]) -> Path:
    """Where the peer's result for these data, training settings and simulation is kept in ``workdir``."""
    settings = {name: getattr(cfg, name) for name in PEER_SETTINGS}
    key = {
        "data": hidden.manifest.summary.get("tokens"),
        "shards": sorted(info.sha256 for info in hidden.manifest.shards),
        "training": settings,
        "simulation": dict(simulation),
        "peer": [PEER_LOSS, PEER_STEP_DECAY, PEER_ATTENTION],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return workdir / "peer-cache" / f"seed{cfg.seed}-{digest}.json"


def peer_side(
    config: Any,
    hidden: Any,
    drafter_config: Any,
    prompts: list[str],
    target: Any,
    tokenizer: Any,
    cfg: Any,
) -> dict[str, Any]:
    """speculators trained with ``cfg``, converted (checked), simulated: its AL and tokens per step."""
    from draftloop.kernels.files import load_target_head

    seed = int(cfg.seed)
    target_dir = Path(config.target.path)
    log(f"seed {seed}: speculators training (Eagle3DraftModel, plain loop, CPU)")
    embed, lm_head, final_norm = load_target_head(target_dir)
    if final_norm is None:
        raise SystemExit(f"{target_dir}: no final norm weight")
    aux_ids = list(hidden.manifest.summary["aux_layer_ids"])
    peer = build_peer(target_dir, aux_ids, seed, (embed, lm_head, final_norm))
    data = training_samples(config, hidden)
    peer_result = train_peer(peer, data, cfg, final_norm.float())
    log(f"seed {seed}: speculators {len(peer_result['history'])} steps in {peer_result['seconds']:.0f} s")

    converted = peer_to_drafter(peer, drafter_config, embed)
    steps = data.rank_steps(0, seed, CHECK_SAMPLES, 0, 0, 1)
    check_samples = next(steps).samples
    steps.close()  # stops its shard prefetcher
    check = conversion_check(peer, converted, check_samples, cfg, final_norm.float(), lm_head.float())
    log(f"seed {seed}: conversion check {json.dumps(check)}")
    if not check["exact"]:
        raise SystemExit(f"the converted drafter's logits differ from speculators' own: {check}")
    k, max_tokens = int(config.engine.num_speculative_tokens), int(config.evaluation.max_tokens)
    return {
        **simulate(target, tokenizer, converted, prompts, k, max_tokens),
        "train_seconds": peer_result["seconds"],
        "last_epoch_mean_loss": last_epoch_mean(peer_result["history"], cfg.epochs),
        "tokens_per_step": [step["real_tokens"] for step in peer_result["history"]],
        "conversion_check": check,
    }


def last_epoch_mean(history: list[dict[str, Any]], epochs: int) -> float:
    last = history[-(len(history) // epochs) :]
    return round(sum(step["loss"] for step in last) / len(last), 4)


def one_seed(
    config: Any,
    peer_config: Any,
    hidden: Any,
    workdir: Path,
    prompts: list[str],
    target: Any,
    tokenizer: Any,
    reuse_peer: bool,
) -> dict[str, Any]:
    """Both trainers with the seed of the configs (initial weights and sample order), both simulated:
    draftloop with ``config``'s training section, speculators with ``peer_config``'s (read from the
    workdir's cache when ``reuse_peer`` and cached)."""
    from draftloop.kernels.checkpoint import load_drafter
    from draftloop.kernels.files import load_target_head

    seed = int(config.training.seed)
    log(f"seed {seed}: draftloop training (train stage worker body, 1 worker, CPU)")
    started = time.perf_counter()
    drafter_dir, ours_result, cfg = train_draftloop(config, hidden, workdir / f"train-draftloop-{seed}")
    ours_seconds = time.perf_counter() - started
    log(f"seed {seed}: draftloop {len(ours_result['history'])} steps in {ours_seconds:.0f} s")
    ours = load_drafter(drafter_dir)
    ours.attach_embeddings(load_target_head(Path(config.target.path))[0])

    k, max_tokens = int(config.engine.num_speculative_tokens), int(config.evaluation.max_tokens)
    peer_cfg = train_settings(peer_config, hidden)
    cache = peer_cache_path(workdir, hidden, peer_cfg, {"k": k, "max_tokens": max_tokens, "prompts": prompts})
    if reuse_peer and cache.exists():
        peer = json.loads(cache.read_text())
        log(f"seed {seed}: speculators' result from {cache}")
    else:
        peer = peer_side(peer_config, hidden, ours.config, prompts, target, tokenizer, peer_cfg)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(peer, indent=1) + "\n")
    ours_tokens = [step["real_tokens"] for step in ours_result["history"]]
    if ours_tokens != peer["tokens_per_step"]:
        raise SystemExit(
            f"the trainers saw different steps: tokens per step {ours_tokens} vs {peer['tokens_per_step']}"
        )

    ours_sim = simulate(target, tokenizer, ours, prompts, k, max_tokens)
    lengths = [sim["mean_acceptance_length"] for sim in (ours_sim, peer)]
    log(f"seed {seed}: mean acceptance length draftloop {lengths[0]:.3f}, speculators {lengths[1]:.3f}")
    return {
        "seed": seed,
        "optimizer_steps": len(ours_tokens),
        "draftloop": {
            **ours_sim,
            "train_seconds": round(ours_seconds, 1),
            "last_epoch_mean_loss": last_epoch_mean(ours_result["history"], cfg.epochs),
        },
        "speculators": {k: v for k, v in peer.items() if k not in ("tokens_per_step", "conversion_check")},
        "ratio": round(lengths[0] / lengths[1], 3),
        "conversion_check": peer["conversion_check"],
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftloop.infra.runtime.storage import storage_options
    from draftloop.infra.synthesis.conversations import read_eval_prompts

    import_speculators()
    config = experiment_config(workdir, args.samples, args.epochs)
    conversations, hidden = synthesize_and_extract(config)
    target_dir = Path(config.target.path)
    prompts = [row["prompt"] for row in read_eval_prompts(conversations.manifest, storage_options(config))]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    runs = []
    for seed in args.seeds:
        ours = experiment_config(workdir, args.samples, args.epochs, seed, args.draftloop_set)
        peer = experiment_config(workdir, args.samples, args.epochs, seed)
        runs.append(one_seed(ours, peer, hidden, workdir, prompts, target, tokenizer, args.reuse_peer))

    def mean(side: str, key: str) -> float:
        return round(sum(float(r[side][key]) for r in runs) / len(runs), 4)

    section = config.training
    ours_section = experiment_config(workdir, args.samples, args.epochs, 0, args.draftloop_set).training
    aux_ids = list(hidden.manifest.summary["aux_layer_ids"])
    return {
        "machine": f"CPU, {os.cpu_count()} cores (shared)",
        "command": ".venv/bin/python bench/bench_quality.py " + " ".join(sys.argv[1:]),
        "target": f"tiny-llama (zoo, seed {config.target.seed}), aux layers {aux_ids} (layer_input)",
        "data": {
            "samples": hidden.manifest.summary["samples"],
            "tokens": hidden.manifest.summary["tokens"],
            "synthesis": "the target's own greedy answers (synthesize stage, in_process, "
            f"{config.synthesis.max_new_tokens} new tokens)",
            "eval_prompts": len(prompts),
        },
        "training": {
            "epochs": int(section.epochs),
            "optimizer_steps": runs[0]["optimizer_steps"],
            "samples_per_step": int(section.batch_size) * int(section.grad_accum),
            "ttt_length": int(section.ttt_length),
            "lr": float(section.lr),
            "warmup_ratio": float(section.warmup_ratio),
            "grad_clip": float(section.grad_clip),
            "weight_decay": float(section.weight_decay),
            "seeds": list(args.seeds),
            "same_samples_per_step": True,
        },
        "simulation": {
            "k": int(config.engine.num_speculative_tokens),
            "max_new_tokens": int(config.evaluation.max_tokens),
            "prompts": "the synthesize stage's held-out eval_prompts.jsonl",
        },
        "draftloop": {
            "mean_acceptance_length": mean("draftloop", "mean_acceptance_length"),
            "acceptance_rate": mean("draftloop", "acceptance_rate"),
            **draftloop_description(ours_section),
        },
        "speculators": {
            "version": "0.9.0",
            "mean_acceptance_length": mean("speculators", "mean_acceptance_length"),
            "acceptance_rate": mean("speculators", "acceptance_rate"),
            "loss": f"kl_div (eager), step decay {PEER_STEP_DECAY}, mean over the packed row's positions",
            "trains": "fc, decoder layer, final norm (starts at ones); lm_head frozen (the target's)",
            "optimizer": "its build_optimizers('adamw'): torch AdamW betas (0.9, 0.999); its default "
            "schedule: linear warm-up then linear decay",
            "attention": "its sdpa path (its flex attention has no backward on CPU)",
        },
        "ratio_per_seed": [r["ratio"] for r in runs],
        "runs": runs,
    }


def ablation_record(quality: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """One line of the ablation list: draftloop's settings and both sides' AL per seed."""
    runs = quality["runs"]
    ours = quality["draftloop"]["mean_acceptance_length"]
    peer = quality["speculators"]["mean_acceptance_length"]
    return {
        "variant": variant,
        "command": quality["command"],
        "draftloop_settings": quality["draftloop"]["settings"],
        "seeds": [r["seed"] for r in runs],
        "draftloop_al": [round(r["draftloop"]["mean_acceptance_length"], 4) for r in runs],
        "draftloop_last_epoch_loss": [r["draftloop"]["last_epoch_mean_loss"] for r in runs],
        "speculators_al": [round(r["speculators"]["mean_acceptance_length"], 4) for r in runs],
        "ratio_per_seed": quality["ratio_per_seed"],
        "ratio": round(ours / peer, 3),
    }


def parse_setting(text: str) -> tuple[str, Any]:
    """KEY=VALUE of the training section, VALUE read as YAML (false, 0.999, [0.9, 0.999])."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="one run of each trainer each")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results-scale.json")
    parser.add_argument("--workdir", type=Path, help="keep the target and datasets here (reused when rerun)")
    parser.add_argument(
        "--draftloop-set",
        type=parse_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an ablation: override this training-section setting on draftloop's side only (repeatable); "
        "the result goes to the out file's quality_ablations list, not to quality",
    )
    parser.add_argument(
        "--reuse-peer",
        action="store_true",
        help="take speculators' result from the workdir's cache when the same data, settings and seed "
        "were run there (every run writes it)",
    )
    args = parser.parse_args()
    overrides = dict(args.draftloop_set)
    args.draftloop_set = overrides
    for name, value in {
        "RAY_AUTH_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "DRAFTLOOP_RAY_LOG_TO_DRIVER": "0",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }.items():
        os.environ.setdefault(name, value)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="draftloop-quality-") as scratch:
        workdir = (args.workdir or Path(scratch)).resolve()
        os.environ["DRAFTLOOP_STATE_DIR"] = str(workdir / "state")
        quality = run(args, workdir)
    quality["seconds"] = round(time.perf_counter() - started, 1)
    ratio = quality["draftloop"]["mean_acceptance_length"] / quality["speculators"]["mean_acceptance_length"]
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if overrides:
        variant = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
        ablations = [a for a in previous.get("quality_ablations", []) if a["variant"] != variant]
        record = {**previous, "quality_ablations": [*ablations, ablation_record(quality, variant)]}
    else:
        record = {**previous, "quality": quality, "quality_ratio_vs_speculators": round(ratio, 3)}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"ratio": round(ratio, 3), "ratio_per_seed": quality["ratio_per_seed"]}))


if __name__ == "__main__":
    main()
