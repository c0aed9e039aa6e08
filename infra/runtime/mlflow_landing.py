"""The MLflow server `draftloop up` runs (`mlflow server --app-name draftloop`): MLflow's own app, whose
UI opens where the drafters are, the cycles' experiment in model-training mode.

Why a page script: MLflow 3.17's UI picks GenAI or model training per browser, from the `workflowType`
URL parameter, else the `mlflow.workflowType_v1` localStorage entry its sidebar switch writes, else
GenAI (the experiment's `mlflow.experimentKind` tag is read only where that switch is disabled; it is
on in 3.17). No server option sets that default, and every UI page is the one document at `/` (routes
follow `#`). So that document, MLflow's index.html, gets a few lines before MLflow's bundle: model
training unless this browser chose otherwise with the switch, and, on the bare root, the experiment's
runs as the first route. Everything else is MLflow's app, its security middleware included.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

# Set by `up` on the server's command line: the experiment the root opens on.
LANDING_EXPERIMENT_ENV = "DRAFTLOOP_MLFLOW_EXPERIMENT"
WORKFLOW_STORAGE_KEY = "mlflow.workflowType_v1"  # MLflow's useLocalStorage key: `${key}_v${version}`
MODEL_TRAINING_WORKFLOW = "machine_learning"
# MLflow's assistant opens itself over half the page on a browser's first visit unless this says it did.
ASSISTANT_OPENED_KEY = "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"
# The runs table's columns on a browser's first visit to the experiment (what the sidebar's Columns menu
# would save there): the cycle run's figures (infra/registry/cycle_run.py `cycle_columns`).
RUNS_TABLE_COLUMNS = (
    "metrics.`mean_acceptance_length`",
    "metrics.`acceptance_pct`",
    "metrics.`speedup_c1`",
    "tags.`gate`",
    "tags.`verdict`",
    "tags.`model_version`",
    "attributes.`Source`",
)


def _view_state_key(experiment_id: str) -> str:
    """Where MLflow 3.17 keeps one experiment page's view (columns, sort) in the browser."""
    return f'MLflowLocalStorage-1.1-ExperimentPage-["{experiment_id}"]-ReactComponentState'


def landing_script(experiment_id: str | None) -> str:
    """The lines run before MLflow's bundle: the workflow default, and the bare root's first route."""
    route = json.dumps(f"#/experiments/{experiment_id}/runs") if experiment_id else "null"
    defaults = {
        WORKFLOW_STORAGE_KEY: json.dumps(MODEL_TRAINING_WORKFLOW),
        ASSISTANT_OPENED_KEY: json.dumps(True),
    }
    if experiment_id:
        defaults[_view_state_key(experiment_id)] = json.dumps({"selectedColumns": list(RUNS_TABLE_COLUMNS)})
    return (
        "<script>(function(){"
        f"var defaults={json.dumps(defaults)};"
        "try{for(var key in defaults){"
        "if(!localStorage.getItem(key))localStorage.setItem(key,defaults[key]);}}"
        "catch(e){}"
        f"var route={route};"
        'if(route&&(location.hash===""||location.hash==="#"||location.hash==="#/"))location.replace(route);'
        "})();</script>"
    )


def landing_page(index_html: str, experiment_id: str | None) -> str:
    """MLflow's index.html with the landing script first in its head."""
    return index_html.replace("<head>", "<head>" + landing_script(experiment_id), 1)


@lru_cache(maxsize=1)
def _client() -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_BACKEND_STORE_URI"])


def _experiment_id() -> str | None:
    """The landing experiment's id once it exists (`up` creates it; a first cycle would too)."""
    name = os.environ.get(LANDING_EXPERIMENT_ENV)
    if not name or "MLFLOW_BACKEND_STORE_URI" not in os.environ:
        return None
    try:
        found = _client().get_experiment_by_name(name)
    except Exception:  # the landing must never keep the UI from loading
        return None
    return None if found is None else str(found.experiment_id)


def app() -> Any:
    """The ASGI app, a factory (uvicorn `--factory`, as MLflow runs a function it is given): the
    `mlflow server` process that only supervises never imports MLflow's server."""
    from flask import Response
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import app as mlflow_app

    index = Path(str(flask_app.static_folder)) / "index.html"
    mlflow_serve = flask_app.view_functions["serve"]  # MLflow's view of `/` (the UI's one document)

    def serve() -> Any:
        if not index.exists():
            return mlflow_serve()
        page = landing_page(index.read_text(encoding="utf-8"), _experiment_id())
        return Response(page, mimetype="text/html", headers={"Cache-Control": "no-cache"})

    flask_app.view_functions["serve"] = serve
    return mlflow_app
