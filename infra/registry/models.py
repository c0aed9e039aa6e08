"""The drafter as an MLflow logged model and its registered versions: log it, make a version, move `champion`.

A version that fails the gate is still registered (it is evidence), its `gate` tag `rejected` and the
reasons in its description and on its logged model; only a passing one gets the `champion` alias. The
version carries six short tags; the rest (the card, the results whole) is the logged model's. The prose of
the version and of the leaderboard is cards.py's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow.artifacts
from mlflow.entities import LoggedModel, LoggedModelOutput, Metric
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.models.model import MLMODEL_FILE_NAME
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from draftloop.infra.registry.cards import (
    REGISTERED_MODEL_INTRO,
    SHORT_HASH,
    DrafterCard,
    leaderboard_markdown,
    model_tags,
    version_description,
    version_tags,
)
from draftloop.infra.registry.challenge import Challenge
from draftloop.infra.registry.gate import (
    CHAMPION_ALIAS,
    CycleResults,
    GateDecision,
    current_champion,
    evaluate_gate,
    version_figures,
)
from draftloop.infra.registry.runs import StageRun, Tracker, is_finite, now_ms
from draftloop.infra.runtime.config import GateConfig

# The MLmodel flavor of a drafter logged by draftloop: an engine-native EAGLE-3 folder, not a Python model.
DRAFTER_FLAVOR = "draftloop_eagle3"
DRAFTER_DATA_DIR = "drafter"  # the drafter's own folder inside the logged model, next to MLmodel


def log_drafter_model(
    tracker: Tracker,
    run_id: str,
    drafter_folder: Path,
    card: DrafterCard,
    serving_command: Callable[[str], str],
    num_speculative_tokens: int | None,
) -> tuple[LoggedModel, str]:
    """Log the drafter once, as an MLflow model of flavor `draftloop_eagle3` output by `run_id`.

    The model holds the engine-native folder under `drafter/` and an `MLmodel` saying how to serve it
    (engine, engine version, the exact command, layer ids and their convention, target). No pyfunc:
    the drafter runs inside an engine, not in Python. Returns (the logged model, its serving command).
    """
    client = tracker.client
    model = client.create_logged_model(
        tracker.experiment_id,
        name="drafter",
        source_run_id=run_id,
        tags=card.tags(),
        model_type="eagle3-drafter",
    )
    command = serving_command(f"{model.artifact_location}/{DRAFTER_DATA_DIR}")
    mlmodel = Model(
        artifact_path=model.artifact_location,
        run_id=run_id,
        model_uuid=model.model_id,
        model_id=model.model_id,
        metadata={key: value[:SHORT_HASH] for key, value in card.hashes.items()},
    )
    mlmodel.add_flavor(
        DRAFTER_FLAVOR,
        data=DRAFTER_DATA_DIR,
        format="eagle3",
        engine=card.engine,
        engine_version=card.engine_version,
        serve_command=command,
        num_speculative_tokens=num_speculative_tokens,
        aux_layer_ids=card.aux_layer_ids,
        layer_id_convention=card.layer_id_convention,
        convention_exported=card.convention_exported,
        target=card.target,
        drafter_variant=card.variant,
    )
    client.log_model_artifacts(model.model_id, str(drafter_folder), DRAFTER_DATA_DIR)
    with tempfile.TemporaryDirectory(prefix="draftloop-mlmodel-") as scratch:
        mlmodel.save(str(Path(scratch) / MLMODEL_FILE_NAME))
        client.log_model_artifacts(model.model_id, scratch)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    return client.finalize_logged_model(model.model_id, "READY"), command


@dataclass(frozen=True)
class Registration:
    """A registered version and what the gate decided for it (the register manifest's summary)."""

    name: str
    version: str
    champion: bool  # the `champion` alias now points at this version
    gate: GateDecision
    previous_champion: str | None
    verdict: str  # the description's first line
    model_id: str  # the logged model the version was created from

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "champion": self.champion,
            "alias_status": "champion" if self.champion else "rejected",
            "previous_champion": self.previous_champion,
            "gate": self.gate.to_dict(),
            "verdict": self.verdict,
            "model_id": self.model_id,
        }


def download_version_drafter(tracker: Tracker, name: str, version: str, into: Path) -> Path:
    """The drafter folder of registered version `version` of `name`, downloaded under `into` once (a
    complete earlier download is reused: a version's files never change)."""
    folder = into / DRAFTER_DATA_DIR
    if (folder / "config.json").is_file():
        return folder
    source = tracker.client.get_model_version(name, version).source
    partial = into.with_name(into.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mlflow.artifacts.download_artifacts(
        artifact_uri=f"{source.rstrip('/')}/{DRAFTER_DATA_DIR}", dst_path=str(partial),
        tracking_uri=tracker.tracking_uri,
    )  # fmt: skip
    shutil.rmtree(into, ignore_errors=True)
    partial.rename(into)
    return folder


def register_drafter(
    tracker: Tracker,
    run: StageRun,
    name: str,
    gate_config: GateConfig,
    results: CycleResults,
    card: DrafterCard,
    drafter_folder: Path,
    serving_command: Callable[[str], str],
    challenge: Challenge | None = None,
) -> Registration:
    """Log `drafter_folder` as an MLflow model, create a version from it, move `champion` past the gate.

    The model is an output of the cycle's parent run (the register stage's own run when there is none),
    so the runs list shows it. A version that fails the gate is still registered (it is evidence), tagged
    `rejected` with the reasons. `serving_command(drafter_uri)`: the command serving the drafter from
    where the model stores it (in the MLmodel and at the end of the description). `challenge`: a
    refresh's champion-against-challenger measurement, which the gate reads instead of the records.
    """
    client = tracker.client
    try:
        client.get_registered_model(name)
    except MlflowException:
        with suppress(MlflowException):  # another cycle may have created it meanwhile
            client.create_registered_model(name, description=REGISTERED_MODEL_INTRO)
    champion = current_champion(client, name)
    decision = evaluate_gate(
        gate_config,
        results,
        champion.mean_acceptance_length if champion else None,
        champion.version if champion else None,
        baseline=version_figures(client, name, gate_config.beat) if gate_config.beat else None,
        challenge=challenge,
    )
    model_run_id = tracker.parent_run_id or run.run_id
    model, command = log_drafter_model(
        tracker, model_run_id, drafter_folder, card, serving_command, results.recommended_k
    )
    # The figures on the model as well (the experiment's Models tab shows them), logged through its run.
    figures = {
        "mean_acceptance_length": results.mean_acceptance_length,
        "acceptance_rate": results.acceptance_rate,
        **{f"speedup_c{concurrency}": value for concurrency, value in results.speedup.items()},
    }
    client.log_batch(
        model_run_id,
        metrics=[
            Metric(key, float(value), now_ms(), 0, model_id=model.model_id)
            for key, value in figures.items()
            if value is not None and is_finite(value)
        ],
    )
    gate = "passed" if decision.passed else "rejected"
    description = version_description(results, decision, card, champion, command)
    version = client.create_model_version(
        name,
        source=model.artifact_location,
        run_id=model_run_id,
        tags=version_tags(card, results, gate),
        description=description,
        model_id=model.model_id,
    )
    # The logged model keeps the results and the gate's reasons (what gate.read_version reads back); its
    # page lists its registered versions from MLFLOW_MODEL_VERSIONS (what mlflow.register_model sets).
    client.set_logged_model_tags(
        model.model_id,
        {
            **model_tags(results, decision),
            MLFLOW_MODEL_VERSIONS: json.dumps([{"name": name, "version": str(version.version)}]),
        },
    )
    if decision.passed:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, version.version)
    client.update_registered_model(name, description=leaderboard_markdown(client, name))
    run.set_tags(
        {
            "registered_model": name,
            "model_version": version.version,
            "gate": gate,
        }
    )
    return Registration(
        name=name,
        version=str(version.version),
        champion=decision.passed,
        gate=decision,
        previous_champion=champion.version if champion else None,
        verdict=description.splitlines()[0],
        model_id=model.model_id,
    )
