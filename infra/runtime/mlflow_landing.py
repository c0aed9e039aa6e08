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


def landing_script(experiment_id: str | None) -> str:
    """The lines run before MLflow's bundle: the workflow default, and the bare root's first route."""
    route = json.dumps(f"#/experiments/{experiment_id}/runs") if experiment_id else "null"
    return (
        "<script>(function(){"
        f"var key={json.dumps(WORKFLOW_STORAGE_KEY)};"
        f"try{{if(!localStorage.getItem(key))localStorage.setItem(key,{json.dumps(json.dumps(MODEL_TRAINING_WORKFLOW))});}}"
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
