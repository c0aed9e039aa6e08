"""What a target can or cannot do, refused before the first stage (infra/targets/support.py, the engine's
class support read from its source in infra/engines/doctor.py): `config validate`, `run` and
`engine doctor` refuse in seconds with one line naming the model type, and create nothing."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_engine import require_vllm_env
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.commands.run import bad_input_behind, one_line
from draftloop.infra.engines.base import EngineConfigError
from draftloop.infra.engines.class_support import vllm_class_support
from draftloop.infra.engines.doctor import refusals
from draftloop.infra.targets.support import TargetRefusedError, check_target, target_model_config
from draftloop.kernels.families.base import UnknownFamilyError

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = REPO / "configs" / "tiny-llama.yaml"


def _listing(folder: Path) -> list[tuple[str, str]]:
    return sorted(
        (str(p.relative_to(folder)), "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
        for p in folder.rglob("*")
    )


def _hf_config(model_type: str, **fields: Any) -> dict[str, Any]:
    from transformers import AutoConfig

    config: dict[str, Any] = AutoConfig.for_model(model_type, **fields).to_dict()
    return config


def test_recipes_resolve_to_their_family_or_the_generic_path_without_being_built() -> None:
    families = {
        recipe: check_target(target_model_config("/nonexistent", recipe)).family
        for recipe in ("tiny-llama", "tiny-deepseek", "tiny-qwen3", "tiny-olmo2", "tiny-gemma3")
    }
    assert families == {
        "tiny-llama": "llama",
        "tiny-deepseek": "deepseek",
        "tiny-qwen3": "generic",
        "tiny-olmo2": "generic",
        "tiny-gemma3": "generic",
    }
    assert check_target(target_model_config("/nonexistent", "tiny-deepseek")).drafter_attention == "mla"


@pytest.mark.parametrize(
    ("model_type", "fields", "reason"),
    [
        ("minicpm3", {"architectures": ["MiniCPM3ForCausalLM"]}, "multi-head latent attention"),
        ("t5", {"architectures": ["T5ForConditionalGeneration"]}, "encoder-decoder"),
        ("bert", {"architectures": ["BertForMaskedLM"]}, "name no causal LM"),
        ("gptj", {"architectures": ["GPTJForCausalLM"]}, "its config has no intermediate_size"),
    ],
)
def test_an_unsupported_architecture_is_refused_naming_its_model_type(
    model_type: str, fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(TargetRefusedError) as refused:
        check_target(_hf_config(model_type, **fields))
    message = str(refused.value)
    assert f"model_type {model_type!r}" in message and reason in message
    assert "kernels/families/" in message and "\n" not in message


def test_a_model_without_the_ordinary_layout_is_refused_from_its_meta_model() -> None:
    """The generic path builds the model on the meta device: GPT-2 keeps its layers at transformer.h."""
    config = _hf_config("gpt2", architectures=["GPT2ForCausalLM"], n_layer=2, n_embd=64, n_head=4)
    config["intermediate_size"] = 256  # the drafter's field, so that the layout is what is checked
    with pytest.raises(TargetRefusedError, match=r"model_type 'gpt2' \(GPT2ForCausalLM\).*decoder layers"):
        check_target(config)


def _write_target(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _user_config(tmp_path: Path, target: Path, **engine: Any) -> Path:
    raw = yaml.safe_load(TINY_LLAMA.read_text())
    raw["target"].update({"path": str(target), "create": None})
    raw["engine"].update({"python": sys.executable, **engine})
    raw["storage"]["root"] = str(tmp_path / "runs")
    path = tmp_path / "user.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("command", ["validate", "run"])
def test_config_validate_and_run_refuse_the_target_in_seconds_and_create_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    target = _write_target(
        tmp_path / "minicpm3", _hf_config("minicpm3", architectures=["MiniCPM3ForCausalLM"])
    )
    config = _user_config(tmp_path, target)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DRAFTLOOP_STATE_DIR", raising=False)
    before = _listing(tmp_path)
    started = time.monotonic()
    args = ["config", "validate", str(config)] if command == "validate" else ["run", str(config)]
    result = CliRunner().invoke(app, args)
    elapsed = time.monotonic() - started
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("config error: target.path: no target family for model_type 'minicpm3'")
    assert "multi-head latent attention" in line and result.stdout == ""
    assert elapsed < 10, elapsed
    assert _listing(tmp_path) == before


# A vLLM source tree as the static reader sees it: classes with and without SupportsEagle3 (directly, through
# a base imported from another module, through the Transformers backend package).
_FAKE_VLLM = {
    "model_executor/models/registry.py": """
_TEXT_GENERATION_MODELS = {
    "NativeForCausalLM": ("native", "NativeForCausalLM"),
    "ChildForCausalLM": ("child", "ChildForCausalLM"),
    "PlainForCausalLM": ("plain", "PlainForCausalLM"),
    "Olmo2ForCausalLM": ("plain", "PlainForCausalLM"),
}
_TRANSFORMERS_SUPPORTED_MODELS = {"Olmo2ForCausalLM": ("transformers", "TransformersForCausalLM")}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS, **_TRANSFORMERS_SUPPORTED_MODELS}
""",
    "model_executor/models/interfaces.py": "class SupportsEagle3: ...\nclass SupportsPP: ...\n",
    "model_executor/models/native.py": (
        "from torch import nn\nfrom .interfaces import SupportsEagle3, SupportsPP\n\n"
        "class NativeForCausalLM(nn.Module, SupportsPP, SupportsEagle3): ...\n"
    ),
    "model_executor/models/child.py": (
        "from vllm.model_executor.models.native import NativeForCausalLM\n\n"
        "class ChildForCausalLM(NativeForCausalLM): ...\n"
    ),
    "model_executor/models/plain.py": (
        "from torch import nn\nfrom .interfaces import SupportsPP\n\n"
        "class PlainForCausalLM(nn.Module, SupportsPP): ...\n"
    ),
    "model_executor/models/transformers/__init__.py": (
        "from vllm.model_executor.models.transformers.base import Base\n\n"
        "class TransformersForCausalLM(Base): ...\n"
    ),
    "model_executor/models/transformers/base.py": (
        "from torch import nn\nfrom vllm.model_executor.models.interfaces import SupportsEagle3\n\n"
        "class Base(nn.Module, SupportsEagle3): ...\n"
    ),
}


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    root = tmp_path / "site" / "vllm"
    for name, text in _FAKE_VLLM.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_engines_eagle3_support_is_read_from_its_source(fake_vllm: Path) -> None:
    def support(architecture: str, enabler: bool = False) -> tuple[str, str | None, bool]:
        found = vllm_class_support(fake_vllm, [architecture], enabler)
        return found.support, found.engine_class, found.transformers_backend

    assert support("NativeForCausalLM") == ("native", "native.NativeForCausalLM", False)
    assert support("ChildForCausalLM") == ("native", "child.ChildForCausalLM", False)  # through its base
    assert support("PlainForCausalLM") == ("unsupported", "plain.PlainForCausalLM", False)
    assert support("PlainForCausalLM", enabler=True)[0] == "plugin:eagle3_enabler"
    # later tables win, as in vLLM's own merge: OLMo-2 goes to the Transformers backend
    assert support("Olmo2ForCausalLM") == ("native", "transformers.TransformersForCausalLM", True)
    assert support("NoSuchForCausalLM")[0] == "unknown"  # not refused: vLLM may still load it


def test_a_spurious_ast_system_error_is_parsed_again(
    fake_vllm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPython 3.11's "AST constructor recursion depth mismatch" (another thread parsing at the same time)
    once failed a flow run's config check: the engine's source is read once more, not refused."""
    import ast

    from draftloop.infra.engines import class_support

    real_parse, calls = ast.parse, []

    def flaky_parse(source: str, *args: Any, **kwargs: Any) -> ast.Module:
        calls.append(source)
        if len(calls) == 1:  # (the registry, the first source read)
            raise SystemError("AST constructor recursion depth mismatch (before=63, after=95)")
        return real_parse(source, *args, **kwargs)

    class_support.vllm_registry.cache_clear()
    class_support._parsed.cache_clear()
    monkeypatch.setattr(class_support.ast, "parse", flaky_parse)
    found = vllm_class_support(fake_vllm, ["NativeForCausalLM"], False)
    assert (found.support, found.engine_class) == ("native", "native.NativeForCausalLM")
    assert len(calls) >= 3  # the registry twice (the retry), then the class's module
    class_support.vllm_registry.cache_clear()
    class_support._parsed.cache_clear()


def test_the_installed_vllm_serves_the_zoo_families_with_eagle3() -> None:
    require_vllm_env()
    (site,) = (REPO / ".venvs" / "vllm" / "lib").glob("python3*/site-packages/vllm")
    found = {
        arch: vllm_class_support(site, [arch], False).support
        for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM")
    }
    assert found == {"Qwen3ForCausalLM": "native", "LlamaForCausalLM": "native"}
    olmo2 = vllm_class_support(site, ["Olmo2ForCausalLM"], False)
    assert (olmo2.support, olmo2.transformers_backend) == ("native", True)
    assert vllm_class_support(site, ["StableLmForCausalLM"], False).support == "unsupported"  # plugin's job


def _fake_engine_python(tmp_path: Path, vllm_dir: Path, plugin: bool, doctor: dict[str, Any]) -> Path:
    """An 'engine Python' that answers the source locator and the doctor probe like the real one."""
    script = tmp_path / "engine-python"
    located = json.dumps([str(vllm_dir), plugin])
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-m" ]; then echo \'DRAFTLOOP_DOCTOR {json.dumps(doctor)}\'; '
        f"else echo '{located}'; fi\n"
    )
    script.chmod(0o755)
    return script


def test_a_class_the_engine_serves_without_eagle3_is_refused_by_validate_and_doctor(
    tmp_path: Path, fake_vllm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DRAFTLOOP_PLUGIN_PATCHES", raising=False)
    qwen3 = _hf_config("qwen3", architectures=["PlainForCausalLM"], num_hidden_layers=6, hidden_size=64)
    target = _write_target(tmp_path / "target", qwen3)
    doctor_report = {"eagle3": {"support": "unsupported", "class": "PlainForCausalLM", "native": False}}
    python = _fake_engine_python(tmp_path, fake_vllm, plugin=False, doctor=doctor_report)
    config = _user_config(tmp_path, target, python=str(python))
    result = CliRunner().invoke(app, ["config", "validate", str(config)])
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "config error: target.path: model_type 'qwen3': engine vllm serves PlainForCausalLM"
    )
    assert "lacks SupportsEagle3" in line
    # with the plugin installed (its enabler on) the same target is accepted ...
    with_plugin = _fake_engine_python(tmp_path, fake_vllm, plugin=True, doctor=doctor_report)
    config = _user_config(tmp_path, target, python=str(with_plugin))
    assert CliRunner().invoke(app, ["config", "validate", str(config)]).exit_code == 0
    # ... and `engine doctor` exits 2 on a probe that reports the class unsupported
    doctor = CliRunner().invoke(app, ["engine", "doctor", "--target", str(target), "--python", str(python)])
    assert doctor.exit_code == 2, doctor.output
    assert "REFUSED: the engine serves the target's class PlainForCausalLM without EAGLE-3" in doctor.output
    assert "target family: generic decoder-only path (no module for model_type 'qwen3')" in doctor.output


def test_the_transformers_backend_refuses_layer_id_zero(tmp_path: Path, fake_vllm: Path) -> None:
    olmo2 = _hf_config("olmo2", architectures=["Olmo2ForCausalLM"], num_hidden_layers=6, hidden_size=64)
    target = _write_target(tmp_path / "olmo2", olmo2)
    python = _fake_engine_python(tmp_path, fake_vllm, plugin=True, doctor={})
    config = _user_config(tmp_path, target, python=str(python))
    assert CliRunner().invoke(app, ["config", "validate", str(config)]).exit_code == 0
    result = CliRunner().invoke(
        app, ["config", "validate", str(config), "--set", "extraction.aux_layer_ids=[0, 2, 4]"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("config error: extraction.aux_layer_ids: model_type 'olmo2' is served by")


def test_doctor_refusals_list_what_the_cycle_would_refuse() -> None:
    assert (
        refusals({"family": {"name": "llama", "engine_patches": []}, "eagle3": {"support": "native"}}) == []
    )
    found = refusals(
        {
            "target_refused": "no target family for model_type 'gptj'",
            "family": {"name": None, "model_type": "gptj"},
            "eagle3": {"support": "unsupported", "class": "GPTJForCausalLM", "detail": "no SupportsEagle3"},
            "pairing": {"ok": False, "reason": "hidden size 64 vs 128"},
        }
    )
    assert found == [
        "no target family for model_type 'gptj'",
        "the engine serves the target's class GPTJForCausalLM without EAGLE-3 (no SupportsEagle3)",
        "drafter refused: hidden size 64 vs 128",
    ]


def test_a_user_error_raised_inside_a_ray_actor_is_one_line() -> None:
    """Ray re-raises an actor's exception as a class that is both a RayTaskError and the original one,
    whose message is the whole remote traceback; the cycle shows the original's own line."""
    original = UnknownFamilyError("no target family for model_type 'x', and the generic path does not fit")

    class RayTaskErrorLike(UnknownFamilyError):  # what ray.exceptions.RayTaskError.as_instanceof_cause makes
        cause = original

        def __str__(self) -> str:
            return "ray::Extractor.run() (pid=1)\nTraceback (most recent call last):\n  ...\n" + str(original)

    try:
        try:
            raise RayTaskErrorLike()
        except UnknownFamilyError as remote:
            raise RuntimeError("extract: failed") from remote
    except RuntimeError as stage_error:
        found = bad_input_behind(stage_error)
    assert found is original and one_line(found) == str(original)
    assert bad_input_behind(RuntimeError("plain failure")) is None
    assert isinstance(bad_input_behind(EngineConfigError("engine.python", "missing")), EngineConfigError)
