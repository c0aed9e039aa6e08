"""The cycle's MLflow experiment is a model-training experiment, so MLflow's UI opens on its runs."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from draftloop.infra.registry.runs import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, Tracker


def test_new_experiment_is_tagged_as_model_training(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"), "kind-new")
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_existing_untagged_experiment_gets_the_tag(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = MlflowClient(tracking_uri=uri).create_experiment("kind-old")
    Tracker(uri, str(tmp_path / "artifacts"), "kind-old")
    tags = MlflowClient(tracking_uri=uri).get_experiment(experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND


def test_an_experiment_kind_chosen_by_hand_is_kept(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment_id = MlflowClient(tracking_uri=uri).create_experiment(
        "kind-chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"}
    )
    Tracker(uri, str(tmp_path / "artifacts"), "kind-chosen")
    assert MlflowClient(tracking_uri=uri).get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == (
        "genai_development"
    )
