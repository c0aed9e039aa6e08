"""TTT training: the unrolled loss against a per-anchor reference, learning, determinism, resume."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from draftloop.kernels.attention import Decode
from draftloop.kernels.capture import capture_aux_hidden_states
from draftloop.kernels.checkpoint import load_drafter, save_drafter
from draftloop.kernels.data import InMemorySamples
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.layer_ids import LayerIds
from draftloop.kernels.objective import draft_target_head, ttt_loss, ttt_metrics
from draftloop.kernels.packing import collate_samples
from draftloop.kernels.train import TrainConfig, make_optimizer, train_drafter
from draftloop.kernels.vocab import build_draft_vocab

LAYERS = LayerIds((1, 3, 5))
TARGET = LlamaConfig(
    hidden_size=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=64,
    initializer_range=0.2,  # peaky target distributions: something to learn
)


@pytest.fixture(scope="module")
def target_and_samples() -> tuple[Any, list[dict[str, torch.Tensor]]]:
    """A tiny random Llama and 16 of its own greedy continuations with captured hidden states."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TARGET).eval()
    prompts = torch.randint(0, 64, (16, 4))
    with torch.no_grad():
        tokens = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24, do_sample=False
        )
    captured = capture_aux_hidden_states(model, tokens, LAYERS)
    assert captured.last is not None
    length = tokens.shape[1]
    samples = []
    for row in range(tokens.shape[0]):
        keep = length - (row % 3) * 5  # different lengths, so batches are padded
        samples.append(
            {
                "input_ids": tokens[row, :keep],
                "loss_mask": (torch.arange(keep) >= 4).to(torch.uint8),  # only the "assistant" part
                "aux_hidden": captured.aux[row, :keep],
                "last_hidden": captured.last[row, :keep],
            }
        )
    return model, samples


def new_drafter(model: Any, seed: int = 1, draft_vocab: int | None = None) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(DrafterConfig.for_target(TARGET, LAYERS, draft_vocab_size=draft_vocab))
    drafter.attach_embeddings(model.model.embed_tokens.weight)
    return drafter


def reference_ttt_loss(
    drafter: Eagle3Drafter, sample: dict[str, torch.Tensor], head: torch.Tensor, ttt: int, decay: float
) -> tuple[torch.Tensor, list[int]]:
    """One anchor at a time, the way vLLM drafts: a full step-0 pass, then single-token chain steps
    attending to the step-0 keys up to the anchor and the chain's own earlier keys."""
    ids = sample["input_ids"]
    length = ids.shape[0]
    mask = sample["loss_mask"].bool()
    target = torch.softmax(sample["last_hidden"].float() @ head.float().t(), -1)
    padded = torch.cat([ids, torch.zeros(ttt + 2, dtype=ids.dtype)])
    positions = torch.arange(length)[None]
    hidden0, (k0, v0) = drafter(
        drafter.fuse(sample["aux_hidden"][None]), padded[None, 1 : length + 1], positions
    )
    sums = [torch.zeros(()) for _ in range(ttt)]
    counts = [0] * ttt
    for anchor in range(length):
        hidden = hidden0[:, anchor : anchor + 1]
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []
        for step in range(ttt):
            if step > 0:
                past = [(k0[:, :, : anchor + 1], v0[:, :, : anchor + 1]), *chain]
                token = padded[anchor + 1 + step].view(1, 1)
                hidden, kv = drafter(hidden, token, torch.tensor([[anchor + step]]), Decode(past=past))
                chain.append(kv)
            predicted = anchor + 2 + step
            if predicted < length and mask[predicted]:
                log_probs = F.log_softmax(drafter.logits(hidden)[0, 0].float(), -1)
                sums[step] = sums[step] - (target[anchor + 1 + step] * log_probs).sum()
                counts[step] += 1
    total = sum((decay**step) * sums[step] / max(1, counts[step]) for step in range(ttt))
    assert isinstance(total, torch.Tensor)
    return total, counts


def test_ttt_loss_matches_per_anchor_reference(target_and_samples) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    drafter = new_drafter(model)
    head = draft_target_head(drafter, model.lm_head.weight.detach())
    sample = samples[1]
    batch = collate_samples([sample])
    with torch.no_grad():
        loss, terms = ttt_loss(drafter, batch, head, ttt_length=4, decay=0.8)
        metrics = ttt_metrics(terms)
        want, counts = reference_ttt_loss(drafter, sample, head, 4, 0.8)
    assert metrics["tokens"] == counts
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-4)
    assert len(metrics["acc"]) == 4 and len(metrics["loss"]) == 4


def test_padded_batch_has_no_cross_sample_attention(target_and_samples) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    drafter = new_drafter(model)
    head = draft_target_head(drafter, model.lm_head.weight.detach())
    pair = [samples[0], samples[2]]  # 28 and 18 tokens
    with torch.no_grad():
        together = ttt_metrics(ttt_loss(drafter, collate_samples(pair), head, 3, 0.8)[1])
        alone = [ttt_metrics(ttt_loss(drafter, collate_samples([s]), head, 3, 0.8)[1]) for s in pair]
    for step in range(3):
        tokens = [m["tokens"][step] for m in alone]
        assert together["tokens"][step] == sum(tokens)
        weighted = sum(m["loss"][step] * n for m, n in zip(alone, tokens, strict=True)) / sum(tokens)
        assert together["loss"][step] == pytest.approx(weighted, rel=1e-5)


def test_loss_ignores_non_assistant_targets(target_and_samples) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    drafter = new_drafter(model)
    head = draft_target_head(drafter, model.lm_head.weight.detach())
    sample = dict(samples[0])
    masked = dict(sample, loss_mask=torch.zeros_like(sample["loss_mask"]))
    with torch.no_grad():
        loss, terms = ttt_loss(drafter, collate_samples([masked]), head, 3, 0.8)
        metrics = ttt_metrics(terms)
    assert metrics["tokens"] == [0, 0, 0] and float(loss) == 0.0


def test_training_learns_and_is_deterministic(target_and_samples, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    cfg = TrainConfig(ttt_length=3, epochs=4, batch_size=4, lr=3e-3, seed=0, show_progress=False)
    steps: list[int] = []
    epochs: list[dict[str, Any]] = []
    drafter = new_drafter(model)
    result = train_drafter(
        drafter,
        InMemorySamples(samples),
        model.lm_head.weight.detach(),
        cfg,
        on_step=lambda step, _m: steps.append(step),
        on_epoch=lambda _e, m: epochs.append(m),
    )
    assert steps == list(range(1, 4 * 4 + 1))
    assert len(epochs) == 4 and epochs[0]["real_tokens"] == sum(s["input_ids"].shape[0] for s in samples)
    assert 0.5 < epochs[0]["packing_efficiency"] < 1  # unpacked: rows padded to their batch's longest
    first, last = result.epochs[0], result.epochs[-1]
    assert last["loss"] < first["loss"] - 0.3
    assert len(last["acc"]) == 3
    assert min(last["acc"]) > max(first["acc"]) + 0.1
    # Warm-up then cosine decay to zero.
    lrs = [h["lr"] for h in result.history]
    assert max(lrs) == pytest.approx(3e-3) and lrs[-1] == pytest.approx(0.0, abs=1e-12)

    again = train_drafter(new_drafter(model), InMemorySamples(samples), model.lm_head.weight.detach(), cfg)
    assert [h["loss"] for h in again.history] == [h["loss"] for h in result.history]

    # Trained drafter: save -> load gives identical logits, and the layer ids are recorded.
    out = save_drafter(drafter, tmp_path / "d", metadata={"epochs": 4})
    block = json.loads((out / "config.json").read_text())["draftloop"]
    assert block["aux_layer_ids"] == [1, 3, 5] and block["metadata"] == {"epochs": 4}
    loaded = load_drafter(out)
    loaded.attach_embeddings(model.model.embed_tokens.weight)
    batch = collate_samples(samples[:2])
    with torch.no_grad():
        positions = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
        want = drafter.logits(drafter(drafter.fuse(batch["aux_hidden"]), batch["input_ids"], positions)[0])
        got = loaded.logits(loaded(loaded.fuse(batch["aux_hidden"]), batch["input_ids"], positions)[0])
    assert torch.equal(want, got)


def test_frozen_lm_head_betas_and_linear_schedule(target_and_samples) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    cfg = TrainConfig(
        ttt_length=2,
        epochs=2,
        batch_size=8,
        lr=3e-3,
        show_progress=False,
        train_lm_head=False,
        adam_betas=[0.9, 0.999],  # type: ignore[arg-type]  # as a JSON config hands it over
        lr_schedule="linear",
    )
    assert cfg.adam_betas == (0.9, 0.999)
    drafter = new_drafter(model)
    drafter.init_from_target_head(model.lm_head.weight.detach())
    before = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    result = train_drafter(drafter, InMemorySamples(samples), model.lm_head.weight.detach(), cfg)
    after = drafter.state_dict()
    assert torch.equal(after["lm_head.weight"], model.lm_head.weight.detach())  # frozen: the target's rows
    assert drafter.lm_head.weight.grad is None
    assert not torch.equal(after["fc.weight"], before["fc.weight"])
    assert not torch.equal(after["norm.weight"], before["norm.weight"])
    # 4 steps, warm-up 1, then linear decay to zero (cosine would give 0.75 and 0.25 of the lr).
    lrs = [h["lr"] for h in result.history]
    assert lrs == pytest.approx([3e-3, 2e-3, 1e-3, 0.0], abs=1e-12)
    optimizer = make_optimizer(drafter, cfg)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(drafter.lm_head.weight) not in trained and id(drafter.fc.weight) in trained
    unfrozen = make_optimizer(drafter, TrainConfig(train_lm_head=True, show_progress=False))
    assert id(drafter.lm_head.weight) in {id(p) for p in unfrozen.param_groups[0]["params"]}
    with pytest.raises(ValueError, match="lr_schedule"):
        TrainConfig(lr_schedule="step")


def test_training_section_options_reach_train_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """training.train_lm_head / adam_betas / lr_schedule in a config reach the workers' TrainConfig."""
    import yaml

    from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
    from draftloop.infra.runtime.storage import Manifest
    from draftloop.tasks import train as train_task

    raw = yaml.safe_load((Path(__file__).parent.parent / "configs" / "tiny-llama.yaml").read_text())
    raw["training"].update(
        train_lm_head=False, adam_betas=[0.8, 0.99], lr_schedule="linear", init_norm_from_target=False
    )
    config = ExperimentConfig.from_dict(raw, check_environment=False)
    monkeypatch.setattr(train_task, "drafter_record", lambda _config, _hidden: {})
    extracted = {"aux_layer_ids": [1, 3, 5]}
    manifest = Manifest(stage="extract", uri="x", shards=[], summary=extracted, created_at="")
    job = train_task.loop_config(config, SimpleNamespace(manifest=manifest), tmp_path)  # type: ignore[arg-type]
    cfg = job.train
    assert (cfg.train_lm_head, cfg.adam_betas, cfg.lr_schedule) == (False, (0.8, 0.99), "linear")
    assert job.init_norm_from_target is False
    assert job.aux_layer_ids == LayerIds((1, 3, 5), "layer_input")
    assert cfg.max_length == config.data.max_length and cfg.show_progress is False
    # Every setting the section and TrainConfig share arrives as the section says.
    shared = {f.name for f in dataclasses.fields(TrainConfig)} & set(type(config.training).model_fields)
    assert {"epochs", "lr", "ttt_length", "compile", "pack_tokens"} <= shared
    for name in shared:
        assert getattr(cfg, name) == getattr(config.training, name), name
    assert pickle.loads(pickle.dumps(job)) == job  # it travels to the Ray workers pickled
    assert job.rank_split == "shards"
    raw["training"]["rank_split"] = "tokens"
    tokens_job = train_task.loop_config(
        ExperimentConfig.from_dict(raw, check_environment=False),
        SimpleNamespace(manifest=manifest),  # type: ignore[arg-type]
        tmp_path,
    )
    assert tokens_job.rank_split == "tokens"
    raw["training"]["rank_split"] = "rows"
    with pytest.raises(ConfigError, match=r"training\.rank_split"):
        ExperimentConfig.from_dict(raw, check_environment=False)
    raw["training"]["rank_split"] = "shards"
    raw["training"]["lr_schedule"] = "step"
    with pytest.raises(ConfigError, match=r"training\.lr_schedule"):
        ExperimentConfig.from_dict(raw, check_environment=False)
    raw["training"].update(lr_schedule="cosine", adam_betas=[0.9, 1.0])
    with pytest.raises(ConfigError, match=r"training\.adam_betas"):
        ExperimentConfig.from_dict(raw, check_environment=False)


def test_worker_starts_the_final_norm_from_the_target_or_ones(target_and_samples, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from draftloop.infra.runtime.storage import Manifest
    from draftloop.infra.training.job import TrainingJob
    from draftloop.infra.training.sources import StoredHiddenStates
    from draftloop.infra.training.worker import _build_drafter

    model = copy.deepcopy(target_and_samples[0])
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)  # a trained target's norm is not ones
    model.save_pretrained(tmp_path / "target")
    job = TrainingJob(
        hidden=StoredHiddenStates(
            Manifest(stage="extract", uri=str(tmp_path / "hidden"), shards=[], created_at=""), {}
        ),
        target_path=str(tmp_path / "target"),
        aux_layer_ids=LAYERS,
        draft_vocab_size=None,
        drafter_init=None,
        init_norm_from_target=True,
        engine="vllm",
        drafter_metadata={},
        work_dir=tmp_path / "work",
        shuffle_window_shards=1,
        prefetch_shards=1,
        rank_split="shards",
        held_out_samples=0,
        acceptance_k=3,
        train=TrainConfig(seed=0, show_progress=False),
    )
    for from_target in (True, False):
        drafter, _ = _build_drafter(dataclasses.replace(job, init_norm_from_target=from_target), None, 0, 1)
        want = model.model.norm.weight.detach() if from_target else torch.ones(TARGET.hidden_size)
        assert torch.equal(drafter.norm.weight.detach(), want)
        assert torch.equal(drafter.lm_head.weight.detach(), model.lm_head.weight.detach())


@pytest.mark.parametrize("train_lm_head", [True, False])
def test_resume_continues_exactly(target_and_samples, train_lm_head: bool) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    cfg = TrainConfig(
        ttt_length=2,
        epochs=3,
        batch_size=4,
        lr=1e-3,
        grad_accum=2,
        seed=3,
        show_progress=False,
        train_lm_head=train_lm_head,
    )
    head = model.lm_head.weight.detach()
    after_first: dict[str, object] = {}
    drafter = new_drafter(model)

    def keep_first(state: dict[str, object]) -> None:
        if state["epoch"] == 1:
            after_first["state"] = state
            after_first["weights"] = {k: v.clone() for k, v in drafter.state_dict().items()}

    straight = train_drafter(drafter, InMemorySamples(samples), head, cfg, on_checkpoint=keep_first)
    assert straight.state["global_step"] == 6
    restarted = new_drafter(model, seed=99)
    restarted.load_state_dict(after_first["weights"])  # type: ignore[arg-type]
    resumed = train_drafter(restarted, InMemorySamples(samples), head, cfg, resume_state=after_first["state"])  # type: ignore[arg-type]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    assert resumed.state["global_step"] == 6
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(restarted.state_dict()[name], tensor), name


def test_draft_vocabulary_training(target_and_samples) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    d2t, t2d = build_draft_vocab([s["input_ids"] for s in samples], 64, 24)
    drafter = new_drafter(model, draft_vocab=24)
    drafter.set_vocab_mapping(d2t, t2d)
    head = draft_target_head(drafter, model.lm_head.weight.detach())
    assert torch.equal(head, model.lm_head.weight.detach()[t2d])
    cfg = TrainConfig(ttt_length=2, epochs=2, batch_size=8, lr=3e-3, show_progress=False)
    result = train_drafter(drafter, InMemorySamples(samples), model.lm_head.weight.detach(), cfg)
    assert result.epochs[-1]["loss"] < result.epochs[0]["loss"]


def test_collate_pads_to_fixed_shapes(target_and_samples) -> None:  # type: ignore[no-untyped-def]
    model, samples = target_and_samples
    drafter = new_drafter(model)
    head = draft_target_head(drafter, model.lm_head.weight.detach())
    plain = collate_samples(samples[:2])
    fixed = collate_samples(samples[:2], batch_size=4, pad_multiple=32)
    assert fixed["input_ids"].shape == (4, 32) and fixed["lengths"].tolist()[2:] == [0, 0]
    assert plain["input_ids"].shape == (2, 28)
    with torch.no_grad():
        loss_plain, terms_plain = ttt_loss(drafter, plain, head, 3, 0.8)
        loss_fixed, terms_fixed = ttt_loss(drafter, fixed, head, 3, 0.8)
        metrics_plain, metrics_fixed = ttt_metrics(terms_plain), ttt_metrics(terms_fixed)
    assert metrics_fixed["tokens"] == metrics_plain["tokens"]
    torch.testing.assert_close(loss_fixed, loss_plain)


def test_the_next_steps_first_micro_batch_is_collated_before_a_step_is_read(  # type: ignore[no-untyped-def]
    target_and_samples, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a step's kernels run, the loop reads the next step's share and collates its first micro-batch
    (kernels/train.py `TrainingRun.feed`): reading the step's figures waits for the GPU, which would
    otherwise idle through both. Each micro-batch is collated once, and the result is the same."""
    import draftloop.kernels.train as train_module

    model, samples = target_and_samples
    cfg = TrainConfig(ttt_length=2, epochs=2, batch_size=2, grad_accum=2, lr=1e-3, show_progress=False)
    events: list[str] = []
    real_collate, real_record = train_module.collate_rows, train_module.StepSums.record

    def collate(rows: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        events.append("collate")
        return real_collate(rows, *args, **kwargs)

    def record(self: Any, step_tokens: torch.Tensor) -> dict[str, Any]:
        events.append("read")
        return real_record(self, step_tokens)

    monkeypatch.setattr(train_module, "collate_rows", collate)
    monkeypatch.setattr(train_module.StepSums, "record", record)
    head = model.lm_head.weight.detach()
    result = train_drafter(new_drafter(model), InMemorySamples(samples), head, cfg)
    # 16 samples, 4 a step, 2 a micro-batch: 4 steps an epoch, 2 micro-batches a step. Each step's read
    # comes after the next step's first collate, except an epoch's last step (nothing follows it).
    epoch = ["collate", *(["collate", "collate", "read"] * 3), "collate", "read"]
    assert events == epoch * 2, events
    assert len(result.history) == 8
    monkeypatch.undo()
    again = train_drafter(new_drafter(model), InMemorySamples(samples), head, cfg)
    assert [h["loss"] for h in again.history] == [h["loss"] for h in result.history]
