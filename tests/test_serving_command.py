"""The serving command a registered drafter carries: runnable as printed, wherever the artifacts live."""

from __future__ import annotations

from pathlib import Path

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.tasks.register import serving_command

REPO_ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path) -> ExperimentConfig:
    return ExperimentConfig.load(
        REPO_ROOT / "configs" / "tiny-llama.yaml",
        {"target.path": str(tmp_path / "target"), "storage.root": str(tmp_path / "runs")},
        check_environment=False,
    )


def test_a_local_artifact_store_serves_the_folder_itself(tmp_path: Path) -> None:
    command = serving_command(_config(tmp_path), "file:///store/models/m-1/artifacts/drafter", 2)
    assert command.startswith(f"vllm serve {tmp_path / 'target'} --speculative-config ")
    assert '"model": "/store/models/m-1/artifacts/drafter"' in command and "mlflow" not in command


def test_a_remote_artifact_store_downloads_the_drafter_before_serving_it(tmp_path: Path) -> None:
    for source in (
        "s3://bucket/mlartifacts/1/models/m-1/artifacts/drafter",
        "mlflow-artifacts:/1/m-1/drafter",
    ):
        command = serving_command(_config(tmp_path), source, 4)
        download, serve = command.split(" && ")
        assert (
            download == f"mlflow artifacts download --artifact-uri {source} --dst-path ./tiny-llama-drafter"
        )
        # the engine gets the downloaded folder, never the URI it cannot open; k the evaluation's (4)
        assert '"model": "./tiny-llama-drafter/drafter"' in serve and source not in serve
        assert '"num_speculative_tokens": 4' in serve
