"""A published drafter as a baseline in the registry: `draftloop diagnose --register`.

The diagnosed folder is logged as the same kind of MLflow model as a trained drafter (flavor
`draftloop_eagle3`, the folder under `drafter/`), and registered as a version of the target's registered
model, its `gate` tag `external baseline` (the source folder, verdict and figures on its logged model, as a
trained version's), so the leaderboard lists it beside trained versions and `evaluation.gate.beat` can name
it (by the alias given here, e.g. `baseline`). It never takes the `champion` alias.
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
    headline,
    leaderboard_markdown,
    model_tags,
    target_label,
    version_tags,
)
from draftloop.infra.registry.gate import EXTERNAL_GATE, CycleResults
from draftloop.infra.registry.models import log_drafter_model
from draftloop.infra.registry.runs import Tracker


@dataclass(frozen=True)
class ExternalVersion:
    name: str
    version: str
    alias: str | None
    model_id: str


def external_results(diagnosis: Diagnosis, k: int) -> CycleResults:
    """The diagnosis's engine figures and speedups as the results a trained version stores."""
    figures = diagnosis.engine or {}
    measured = {int(level): s for level, s in diagnosis.speedup.items() if s.get("speedup") is not None}
    return CycleResults(
        acceptance_rate=figures.get("acceptance_rate"),
        mean_acceptance_length=figures.get("mean_acceptance_length"),
        speedup={level: float(s["speedup"]) for level, s in measured.items()},
        speedup_status={level: str(s.get("status") or "ok") for level, s in measured.items()},
        recommended_k=k,
    )


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
        variant="unknown",  # a published folder's variant is not recorded by the diagnosis (yet)
    )
    run = client.create_run(
        tracker.experiment_id, run_name=f"baseline {folder.name}", tags={"draftloop.kind": "baseline"}
    )
    model, _command = log_drafter_model(
        tracker, run.info.run_id, folder, card, lambda uri: diagnosis.served_command or uri, k
    )
    results = external_results(diagnosis, k)
    facts = {"external": "true", "source": str(folder), "verdict": diagnosis.verdict}
    if diagnosis.cause is not None:
        facts["cause"] = diagnosis.cause.name
    description = (
        f"{headline(results, card.engine_label)} · {EXTERNAL_GATE}: {diagnosis.verdict} (source {folder})"
        "\n\n" + "\n".join(f"- {reason}" for reason in diagnosis.reasons)
    )
    version = client.create_model_version(
        name, source=model.artifact_location, run_id=run.info.run_id,
        tags=version_tags(card, results, EXTERNAL_GATE), description=description, model_id=model.model_id,
    )  # fmt: skip
    client.set_terminated(run.info.run_id)
    client.set_logged_model_tags(  # before the leaderboard: it reads the figures from here
        model.model_id,
        {
            **model_tags(results),
            **facts,
            MLFLOW_MODEL_VERSIONS: json.dumps([{"name": name, "version": str(version.version)}]),
        },
    )
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    client.update_registered_model(name, description=leaderboard_markdown(client, name))
    return ExternalVersion(name, str(version.version), alias, model.model_id)
