"""A published drafter as a baseline in the registry: `draftloop diagnose --register`.

The diagnosed folder is logged as the same kind of MLflow model as a trained drafter (flavor
`draftloop_eagle3`, the folder under `drafter/`), and registered as a version of the target's registered
model tagged `external` (its source folder, verdict, figures), so the leaderboard lists it beside trained
versions and `evaluation.gate.beat` can name it (by the alias given here, e.g. `baseline`). It never
takes the `champion` alias.
"""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from draftloop.infra.evaluation.diagnose import Diagnosis
from draftloop.infra.registry.cards import (
    REGISTERED_MODEL_INTRO,
    DrafterCard,
    leaderboard_markdown,
    target_label,
)
from draftloop.infra.registry.models import log_drafter_model
from draftloop.infra.registry.runs import Tracker

EXTERNAL_TAG = "external"


@dataclass(frozen=True)
class ExternalVersion:
    name: str
    version: str
    alias: str | None
    model_id: str


def register_external(
    tracker: Tracker, name: str, diagnosis: Diagnosis, engine: str, k: int, alias: str | None
) -> ExternalVersion:
    """Log the diagnosed folder and register it under `name`, tagged external; `alias` points at it."""
    client = tracker.client
    with suppress(MlflowException):  # already there, or created meanwhile
        client.create_registered_model(name, description=REGISTERED_MODEL_INTRO)
    folder = Path(diagnosis.folder.path)
    served = next((f for f in diagnosis.readings if f.reading.engine_reads), None)
    card = DrafterCard(
        target=target_label(str(diagnosis.report.target) if diagnosis.report else ""),
        engine=engine,
        engine_version=(diagnosis.report.engine_version or "") if diagnosis.report else "",
        aux_layer_ids=list(served.reading.capture_ids) if served else None,
        layer_id_convention="layer_input",
        convention_exported=diagnosis.folder.format,
    )
    run = client.create_run(
        tracker.experiment_id, run_name=f"baseline {folder.name}", tags={"draftloop.kind": "baseline"}
    )
    model, _command = log_drafter_model(
        tracker, run.info.run_id, folder, card, lambda uri: diagnosis.served_command or uri, k
    )
    figures = diagnosis.engine or {}
    tags = {
        **card.tags(),
        EXTERNAL_TAG: "true",
        "source": str(folder),
        "gate": "external baseline",
        "verdict": diagnosis.verdict,
        "mean_acceptance_length": f"{figures.get('mean_acceptance_length') or 0:.3f}",
        "acceptance_rate": f"{figures.get('acceptance_rate') or 0:.3f}",
    }
    for level, speedup in diagnosis.speedup.items():
        if speedup.get("speedup") is not None:
            tags[f"speedup_c{level}"] = f"{speedup['speedup']:.3f}"
            tags[f"speedup_c{level}_status"] = str(speedup.get("status"))
    if diagnosis.cause is not None:
        tags["cause"] = diagnosis.cause.name
    description = (
        f"external baseline: {diagnosis.verdict}, AL {tags['mean_acceptance_length']} on {engine} "
        f"(source {folder})\n\n" + "\n".join(f"- {reason}" for reason in diagnosis.reasons)
    )
    version = client.create_model_version(
        name, source=model.artifact_location, run_id=run.info.run_id, tags=tags, description=description,
        model_id=model.model_id,
    )  # fmt: skip
    client.set_terminated(run.info.run_id)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    client.update_registered_model(name, description=leaderboard_markdown(client, name))
    client.set_logged_model_tags(
        model.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([{"name": name, "version": str(version.version)}])}
    )
    return ExternalVersion(name, str(version.version), alias, model.model_id)
