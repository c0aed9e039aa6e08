"""The drafter-variant seam: a variant is one module (tests/fake_variant.py) that is registered, built,
trained a step, saved and loaded back; one with no speculators form is refused there by name (the
published round trip is EAGLE 3.1's, tests/test_eagle31.py); names no registered variant computes, and
published fields several variants claim, are refused once, by the registry, naming them."""

from __future__ import annotations

import json
from pathlib import Path

import fake_variant
import pytest
import torch
from synthetic_training import LAYERS, TARGET, synthetic_samples, target_tensors

from draftloop.kernels.attention import Chain
from draftloop.kernels.checkpoint import load_drafter, save_drafter
from draftloop.kernels.data import InMemorySamples
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.files import DrafterFormatError
from draftloop.kernels.packing import collate_samples
from draftloop.kernels.speculators import export_speculators
from draftloop.kernels.train import TrainConfig, train_drafter
from draftloop.kernels.variants.base import (
    _VARIANTS,
    SPECULATORS_VARIANT_FIELDS,
    DrafterVariant,
    UnsupportedVariantError,
    get_variant,
    known_variants,
    register_variant,
    variant_for_published,
)


def variant_drafter(embed: torch.Tensor, **options: object) -> Eagle3Drafter:
    torch.manual_seed(2)
    config = DrafterConfig.for_target(TARGET, LAYERS, variant=fake_variant.NAME, variant_options=options)
    return Eagle3Drafter(config).attach_embeddings(embed)


def outputs(drafter: Eagle3Drafter, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the first pass and of one chain step."""
    positions = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    with torch.no_grad():
        hidden, kv = drafter(drafter.fuse(batch["aux_hidden"]), batch["input_ids"], positions)
        chained, _ = drafter(hidden, batch["input_ids"], positions + 1, Chain(past=[kv]))
    return drafter.logits(hidden), drafter.logits(chained)


def test_a_variant_module_is_registered_built_trained_saved_and_loaded(tmp_path: Path) -> None:
    assert get_variant(fake_variant.NAME) is fake_variant.VARIANT
    assert {"eagle3", fake_variant.NAME} <= {variant.name for variant in known_variants()}
    embed, lm_head = target_tensors()
    drafter = variant_drafter(embed)
    assert drafter.config.variant_options == {"norm_output": True}  # the variant's default
    weights = drafter.weights_state_dict()
    assert {"fuse_norm.weight", "output_norm.weight"} <= set(weights)
    # Its fusion and handed-on state are the variant's: unlike plain EAGLE-3 (same shared weights).
    plain = Eagle3Drafter(DrafterConfig.for_target(TARGET, LAYERS)).attach_embeddings(embed)
    plain.load_state_dict({k: v for k, v in weights.items() if k in plain.state_dict()}, strict=False)
    batch = collate_samples(synthetic_samples(2, seed=3))
    assert not torch.allclose(outputs(drafter, batch)[0], outputs(plain, batch)[0])

    before = {name: tensor.clone() for name, tensor in weights.items()}
    cfg = TrainConfig(ttt_length=2, epochs=1, batch_size=4, lr=3e-3, show_progress=False)
    result = train_drafter(drafter, InMemorySamples(synthetic_samples(4, seed=4)), lm_head, cfg)
    assert len(result.history) == 1  # one optimizer step
    after = drafter.weights_state_dict()
    for name in ("fuse_norm.weight", "output_norm.weight", "fc.weight"):
        assert not torch.equal(after[name], before[name]), name  # the variant's modules train too

    out = save_drafter(drafter, tmp_path / "native")
    block = json.loads((out / "config.json").read_text())["draftloop"]["drafter_config"]
    assert (block["variant"], block["variant_options"]) == (fake_variant.NAME, {"norm_output": True})
    loaded = load_drafter(out).attach_embeddings(embed)
    assert loaded.config == drafter.config and type(loaded.variant) is type(fake_variant.VARIANT)
    for name, tensor in after.items():
        assert torch.equal(loaded.weights_state_dict()[name], tensor), name
    for want, got in zip(outputs(drafter, batch), outputs(loaded, batch), strict=True):
        assert torch.equal(want, got)

    # No speculators form: the export is refused by the variant, naming it, before any file is written.
    with pytest.raises(UnsupportedVariantError, match=r"'fake_fc_norm' has no speculators form"):
        export_speculators(drafter, tmp_path / "spec", str(tmp_path / "target"))
    assert not (tmp_path / "spec" / "config.json").exists()


def test_variant_options_reach_the_layer() -> None:
    embed, _ = target_tensors()
    batch = collate_samples(synthetic_samples(2, seed=3))
    normed, raw = variant_drafter(embed), variant_drafter(embed, norm_output=False)
    assert raw.config.variant_options == {"norm_output": False}
    assert not torch.allclose(outputs(normed, batch)[0], outputs(raw, batch)[0])


def test_unknown_variants_and_fields_are_refused_by_the_registry(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedVariantError, match=r"unknown drafter variant 'medusa'.*kernels/variants"):
        DrafterConfig.for_target(TARGET, LAYERS, variant="medusa")
    with pytest.raises(UnsupportedVariantError, match=r"'eagle3' has no field\(s\) \['fc_norm'\]"):
        DrafterConfig.for_target(TARGET, LAYERS, variant_options={"fc_norm": True})
    # A saved drafter whose variant is not registered: refused, naming the file and the variant.
    embed, _ = target_tensors()
    out = save_drafter(variant_drafter(embed), tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    config["draftloop"]["drafter_config"]["variant"] = "medusa"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match=r"config\.json.*unknown drafter variant 'medusa'"):
        load_drafter(out)
    # A published speculators variant no registered variant computes: refused, naming its fields.
    plain = Eagle3Drafter(DrafterConfig.for_target(TARGET, LAYERS)).attach_embeddings(embed)
    spec = export_speculators(plain, tmp_path / "spec", str(tmp_path / "target"))
    published = json.loads((spec / "config.json").read_text())
    published.pop("draftloop")
    (spec / "config.json").write_text(
        json.dumps({**published, "norm_before_residual": True, "fc_norm": True})
    )
    with pytest.raises(DrafterFormatError, match=r"'norm_before_residual': True.*'fc_norm': True"):
        load_drafter(spec, convention="layer_input")


def test_published_fields_two_variants_claim_are_refused() -> None:
    # A second variant claiming what plain EAGLE-3 claims (every field off): neither may win by order.
    rival = DrafterVariant(name="zz_rival_eagle3")
    register_variant(rival)
    try:
        with pytest.raises(UnsupportedVariantError, match=r"claimed by several.*eagle3, zz_rival_eagle3"):
            variant_for_published(dict.fromkeys(SPECULATORS_VARIANT_FIELDS, False))
    finally:
        _VARIANTS.pop(rival.name)
    assert variant_for_published(dict.fromkeys(SPECULATORS_VARIANT_FIELDS, False))[0].name == "eagle3"
