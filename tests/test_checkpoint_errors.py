"""Bad checkpoint input: one clear error naming the file and the reason (DrafterFormatError when a
folder is read, DrafterPairingError before serving), and exit code 2 from the CLI."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter_contract import SERVING, make_drafter, refusal, target_config
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.infra.engines.pairing import check_drafter_pairing
from draftloop.kernels.checkpoint import load_drafter
from draftloop.kernels.files import DrafterFormatError, load_target_head


@pytest.fixture
def target(zoo_target_dir: Callable[[str], Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(zoo_target_dir("tiny-llama"), tmp_path / "target"))


def other_target(target: Path, tmp_path: Path, **changes: int) -> Path:
    """A config-only copy of `target` with other sizes, to build a drafter for another target."""
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**target_config(target), **changes}))
    shutil.copy(target / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


def test_drafter_made_for_another_hidden_size_is_refused(target: Path, tmp_path: Path) -> None:
    hidden = int(target_config(target)["hidden_size"])
    drafter, _ = make_drafter(other_target(target, tmp_path, hidden_size=2 * hidden), tmp_path / "d")
    message = refusal(target, drafter)
    assert f"made for a target of hidden size {2 * hidden}; this target's hidden_size is {hidden}" in message


def test_drafter_made_for_another_vocabulary_is_refused(target: Path, tmp_path: Path) -> None:
    vocab = int(target_config(target)["vocab_size"])
    drafter, _ = make_drafter(other_target(target, tmp_path, vocab_size=vocab + 7), tmp_path / "d")
    message = refusal(target, drafter)
    assert f"made for a vocabulary of {vocab + 7} tokens; this target's vocab_size is {vocab}" in message


def test_target_without_weights_is_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    for file in target.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(DrafterFormatError, match=r"target: no \*\.safetensors weights files"):
        load_target_head(target)
    assert "target: no *.safetensors weights files" in refusal(target, drafter)
    # Only pickled weights: engines serve them, pairing accepts them; training needs safetensors.
    (target / "pytorch_model.bin").write_bytes(b"")
    check_drafter_pairing(target, drafter, SERVING)
    with pytest.raises(DrafterFormatError, match=r"target: no \*\.safetensors weights files"):
        load_target_head(target)


def test_target_whose_index_names_a_missing_file_is_refused(target: Path, tmp_path: Path) -> None:
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    expected = (
        "model-00002-of-00002.safetensors: weights file not found (listed in model.safetensors.index.json)"
    )
    with pytest.raises(DrafterFormatError) as info:
        load_target_head(target)
    assert expected in str(info.value)


def test_truncated_target_weights_are_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        DrafterFormatError, match=r"model\.safetensors: truncated: its header lists \d+ bytes"
    ):
        load_target_head(target)
    assert "model.safetensors: truncated" in refusal(target, drafter)
    weights.write_bytes(data[:5])
    with pytest.raises(DrafterFormatError, match=r"truncated or not a safetensors file \(5 bytes"):
        load_target_head(target)


def _rewrite_drafter_weights(drafter: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    weights = load_file(str(drafter / "model.safetensors"))
    change(weights)
    save_file(weights, str(drafter / "model.safetensors"))


def test_drafter_with_a_missing_tensor_is_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    _rewrite_drafter_weights(drafter, lambda w: w.pop("fc.weight"))
    with pytest.raises(DrafterFormatError, match=r"d/model\.safetensors: tensors missing \['fc\.weight'\]"):
        load_drafter(drafter)
    assert "tensors missing ['fc.weight']" in refusal(target, drafter)


def test_drafter_with_a_misshapen_tensor_is_refused(target: Path, tmp_path: Path) -> None:
    drafter, model = make_drafter(target, tmp_path / "d")
    shape = tuple(model.fc.weight.shape)

    def shrink(weights: dict[str, torch.Tensor]) -> None:
        weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()

    _rewrite_drafter_weights(drafter, shrink)
    expected = f"tensor fc.weight has shape {(shape[0], shape[1] - 1)}, config.json implies {shape}"
    with pytest.raises(DrafterFormatError, match=r"model\.safetensors: tensor fc\.weight has shape"):
        load_drafter(drafter)
    assert expected in refusal(target, drafter)


def test_drafter_with_non_finite_weights_is_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")

    def poison(weights: dict[str, torch.Tensor]) -> None:
        weights["fc.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])

    _rewrite_drafter_weights(drafter, poison)
    with pytest.raises(DrafterFormatError, match=r"tensor fc\.weight has 3 non-finite values \(nan/inf\)"):
        load_drafter(drafter)
    assert "fc.weight has 3 non-finite values" in refusal(target, drafter, SERVING)


def test_truncated_drafter_weights_are_refused(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(DrafterFormatError, match=r"d/model\.safetensors: truncated: its header lists"):
        load_drafter(drafter)


def test_cli_exits_2_with_one_line_on_a_bad_drafter(target: Path, tmp_path: Path) -> None:
    drafter, _ = make_drafter(target, tmp_path / "d")
    _rewrite_drafter_weights(drafter, lambda w: w.pop("fc.weight"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    result = CliRunner().invoke(
        app, ["simulate", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts)]
    )
    assert result.exit_code == 2, result.output
    assert "tensors missing ['fc.weight']" in result.output
    assert "Traceback" not in result.output
    # A truncated target: the same, naming the file.
    drafter, _ = make_drafter(target, tmp_path / "d2")
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = CliRunner().invoke(
        app, ["simulate", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts)]
    )
    assert result.exit_code == 2, result.output
    assert "model.safetensors: truncated: its header lists" in result.output


def test_a_cycle_failing_on_bad_checkpoint_input_is_a_user_error(target: Path, tmp_path: Path) -> None:
    """`draftloop run` exits 2 with the cause's message when a stage failed on bad checkpoint input."""
    from draftloop.commands.run import bad_input_behind
    from draftloop.infra.engines.pairing import DrafterPairingError, check_drafter_pairing
    from draftloop.tasks.cache import StageError

    drafter, _ = make_drafter(target, tmp_path / "d")
    _rewrite_drafter_weights(drafter, lambda w: w.pop("fc.weight"))
    stages: dict[str, Callable[[], object]] = {
        "train": lambda: load_drafter(drafter),
        "evaluate": lambda: check_drafter_pairing(target, drafter, SERVING),
    }
    for stage, check in stages.items():
        with pytest.raises(StageError) as wrapped:
            try:
                check()
            except (DrafterFormatError, DrafterPairingError) as error:
                raise StageError(stage, str(error)) from error  # as tasks/cycle.py wraps it
        cause = bad_input_behind(wrapped.value)
        assert cause is not None and "tensors missing ['fc.weight']" in str(cause)
    assert bad_input_behind(StageError("train", "worker died", None)) is None
