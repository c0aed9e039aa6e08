"""Target families: discovered from kernels/families/, one registry, and a fake family added by one
test module (tests/fake_family.py) that capture, the drafter config and the default ids all follow."""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path

import pytest
import torch
from fake_family import TOYQWEN, tiny_toyqwen

import draftloop.kernels.families as families_package
from draftloop.kernels.capture import capture_aux_hidden_states
from draftloop.kernels.drafter import DrafterConfig, Eagle3Drafter
from draftloop.kernels.families.base import (
    GENERIC,
    FamilyRegistrationError,
    TargetFamily,
    UnknownFamilyError,
    family_for_config,
    generic_refusal,
    get_family,
    known_families,
    register_family,
)
from draftloop.kernels.layer_ids import LayerIds

PLUGIN_DIR = Path(__file__).resolve().parent.parent / "infra" / "engines" / "vllm_plugin_pkg"


def test_every_family_module_is_discovered() -> None:
    modules = {m.name for m in pkgutil.iter_modules(families_package.__path__)} - {"base"}
    names = {family.name for family in known_families()}
    assert {"llama", "deepseek", "stablelm", "toyqwen"} <= names
    # Each module of the package registered what it declares (module name = family name here).
    assert modules <= names


def test_fake_family_capture_follows_the_family() -> None:
    model = tiny_toyqwen()
    assert family_for_config(model.config) is TOYQWEN
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    layer_ids = LayerIds((0, 3, 5))
    result = capture_aux_hidden_states(model, ids, layer_ids, want_logits=True)
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True)
    for slot, layer in enumerate(layer_ids.ids):
        assert torch.equal(result.aux[..., slot * 32 : (slot + 1) * 32], reference.hidden_states[layer])
    assert result.last is not None and torch.equal(result.last, reference.hidden_states[-1])
    assert result.logits is not None
    torch.testing.assert_close(result.logits, reference.logits)


def test_fake_family_drafter_config_and_default_ids() -> None:
    model = tiny_toyqwen()
    family = family_for_config(model.config.to_dict())  # a config mapping works as well as the object
    default = family.default_aux_layer_ids(model.config.num_hidden_layers)
    assert default == LayerIds((0, 3, 5))  # the family's own choice, not the Llama default (1, 3, 5)
    assert get_family("llama").default_aux_layer_ids(6) == LayerIds((1, 3, 5))
    config = DrafterConfig.for_target(model.config, default)
    assert config.attention == TOYQWEN.drafter_attention == "llama"
    assert (config.num_key_value_heads, config.head_dim, config.hidden_size) == (2, 8, 32)
    drafter = Eagle3Drafter(config).attach_embeddings(model.get_input_embeddings().weight)
    captured = capture_aux_hidden_states(model, torch.tensor([[1, 2, 3]]), default, want_last=False)
    hidden, _ = drafter(drafter.fuse(captured.aux), torch.tensor([[2, 3, 4]]), torch.arange(3)[None])
    assert drafter.logits(hidden).shape == (1, 3, 64)


def test_duplicate_registration_is_an_error() -> None:
    before = [family.name for family in known_families()]
    with pytest.raises(FamilyRegistrationError, match="'toyqwen' is registered twice"):
        register_family(TargetFamily(name="toyqwen", model_types=("toyqwen2",)))
    with pytest.raises(FamilyRegistrationError, match=r"'llama' \(family 'llama'\)"):
        register_family(TargetFamily(name="llama-again", model_types=("llama",)))
    assert [family.name for family in known_families()] == before
    with pytest.raises(UnknownFamilyError):
        family_for_config({"model_type": "toyqwen2"})  # a refused family leaves nothing behind


def test_unknown_model_type_names_it_and_the_known_families() -> None:
    with pytest.raises(UnknownFamilyError) as unknown:
        family_for_config({"model_type": "gpt_neox", "hidden_size": 8})
    message = str(unknown.value)
    assert "'gpt_neox'" in message
    for family in known_families():
        assert family.name in message
    with pytest.raises(UnknownFamilyError, match="'gpt_neox'"):
        DrafterConfig.for_target(
            {"model_type": "gpt_neox", "hidden_size": 8, "num_hidden_layers": 4}, LayerIds((1, 2, 3))
        )
    with pytest.raises(UnknownFamilyError, match="unknown target family 'qwen9'"):
        get_family("qwen9")


def test_wrapped_language_model_uses_its_text_config_family() -> None:
    """Kimi-K2.5 wraps a DeepSeek-V3 decoder: the family (MLA) comes from text_config's model_type."""
    wrapped = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", "hidden_size": 8}}
    deepseek = family_for_config(wrapped)
    assert deepseek.name == "deepseek" and deepseek.drafter_attention == "mla"


def test_engine_patches_name_real_plugin_patches() -> None:
    sys.path.insert(0, str(PLUGIN_DIR))
    try:
        from draftloop_vllm_plugin import PATCH_NAMES
    finally:
        sys.path.remove(str(PLUGIN_DIR))
    for family in known_families():
        assert set(family.engine_patches) <= set(PATCH_NAMES), family.name


def _tiny(model_type: str) -> torch.nn.Module:
    """A random 4-layer model of transformers' own class for `model_type` (no family module covers it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=1,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2"])
def test_a_decoder_without_a_family_module_takes_the_generic_path(model_type: str) -> None:
    """Qwen3 (per-head query/key norms) and OLMo-2 (post-norm sublayers): capture, the drafter config and
    the structure check all work from the ordinary layout, with the Llama-like defaults."""
    model = _tiny(model_type)
    assert model_type not in {t for family in known_families() for t in family.model_types}
    assert family_for_config(model.config) is GENERIC
    assert family_for_config(model.config.to_dict()) is GENERIC
    GENERIC.check_structure(model)
    ids = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    layer_ids = LayerIds((1, 2, 3))
    result = capture_aux_hidden_states(model, ids, layer_ids, want_logits=True)
    with torch.no_grad():
        reference = model(input_ids=ids, output_hidden_states=True)
    for slot, layer in enumerate(layer_ids.ids):
        assert torch.equal(result.aux[..., slot * 32 : (slot + 1) * 32], reference.hidden_states[layer])
    assert result.last is not None and torch.equal(result.last, reference.hidden_states[-1])
    assert result.logits is not None
    torch.testing.assert_close(result.logits, reference.logits)
    config = DrafterConfig.for_target(model.config, GENERIC.default_aux_layer_ids(4))
    assert (config.attention, config.num_key_value_heads, config.head_dim) == ("llama", 2, 8)
    assert get_family("generic") is GENERIC


def test_the_structure_check_names_what_the_generic_path_cannot_find() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64))
    with pytest.raises(ValueError, match="cannot find the decoder layers of GPT2LMHeadModel"):
        GENERIC.check_structure(gpt2)
    model = _tiny("qwen3")
    del model.model.layers[3]
    with pytest.raises(ValueError, match="has 3 decoder layers, its config says 4"):
        GENERIC.check_structure(model)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"model_type": "minicpm3", "kv_lora_rank": 256}, "multi-head latent attention"),
        ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
        ({"model_type": "llava_next", "text_config": {"model_type": "vicuna", "hidden_size": 8}}, "wrapped"),
        ({"model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 2}, "no num_attention_heads"),
    ],
)
def test_the_generic_path_refuses_what_it_does_not_assume(config: dict[str, object], reason: str) -> None:
    assert generic_refusal(config) is not None and reason in str(generic_refusal(config))
    with pytest.raises(UnknownFamilyError, match=reason):
        family_for_config(config)
