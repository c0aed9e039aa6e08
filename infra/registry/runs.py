"""MLflow runs of one drafter cycle: one parent run per cycle, one nested run per stage, their handle.

Everything goes through `MlflowClient` with explicit run ids (never the fluent API's thread-local
"active run"), because Prefect may call tasks from worker threads and a cycle must not depend on which
thread logged last.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME, MLFLOW_RUN_NOTE

from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.redaction import redact, redact_text, redacted_copy
from draftloop.infra.runtime.services import served_tracking_uri

# The experiment-type tag MLflow 3's UI reads: without it the UI may infer "GenAI" and open on an empty
# traces view; "custom_model_development" opens on the runs table (MLflow has no Python constant for it).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# MLflow caps a param value at 6000 characters; long lists (extra_args) are truncated, not refused.
_PARAM_VALUE_LIMIT = 6000
_LOG_BATCH_LIMIT = 900  # MLflow accepts at most 1000 entities per log_batch call


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative `sqlite:///rel/path.db` absolute and create its folder (sqlite will not)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = uri[len(prefix) :]
        if not path.startswith("/"):
            path = str(Path(path).resolve())
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return prefix + path
    return uri


def resolve_artifact_root(root: str) -> str:
    """A URI for the experiment's artifact location: local folders become absolute `file://` URIs."""
    if "://" in root:
        return root
    path = Path(root).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def experiment_artifact_location(tracking_uri: str, artifact_root: str) -> str | None:
    """Where a new experiment keeps its artifacts; None lets the tracking server choose.

    A remote server (http/https) with a local `artifact_root` uses its own artifact store
    (`--artifacts-destination`, e.g. S3): a folder on the client is not reachable from the server.
    """
    if tracking_uri.startswith(("http://", "https://")) and "://" not in artifact_root:
        return None
    return resolve_artifact_root(artifact_root)


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"training.lr": "0.003", ...}, the shape MLflow params take."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            text = json.dumps(value) if isinstance(value, list | tuple) else str(value)
            flat[name] = text[:_PARAM_VALUE_LIMIT]
    return flat


def is_finite(value: float) -> bool:
    """A number MLflow can store as a metric (no NaN, no infinity, no None)."""
    return isinstance(value, int | float) and math.isfinite(value)


def now_ms() -> int:
    """A metric's timestamp: milliseconds since the epoch."""
    return int(time.time() * 1000)


@dataclass(frozen=True)
class StageRun:
    """A nested MLflow run for one stage; the handle tasks log through."""

    client: MlflowClient
    run_id: str
    stage: str

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [Param(key, str(value)[:_PARAM_VALUE_LIMIT]) for key, value in redact(dict(params)).items()]
        for start in range(0, len(items), _LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, params=items[start : start + _LOG_BATCH_LIMIT])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        timestamp = now_ms()
        items = [
            Metric(key, float(value), timestamp, step or 0)
            for key, value in metrics.items()
            if is_finite(value)
        ]
        for start in range(0, len(items), _LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[start : start + _LOG_BATCH_LIMIT])

    def log_metric_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        """Per-step curves (training loss, per-position accuracy): one batch per chunk of metrics."""
        timestamp = now_ms()
        items: list[Metric] = []
        for row in rows:
            step = int(row.get(step_key, 0))
            items.extend(
                Metric(key, float(value), timestamp, step)
                for key, value in row.items()
                if key != step_key and is_finite(value)
            )
        for start in range(0, len(items), _LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[start : start + _LOG_BATCH_LIMIT])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in redact(dict(tags)).items()])

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        with redacted_copy(Path(local_path)) as path:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path)
            elif path.exists():
                self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, redact_text(text), artifact_file)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, redact(dict(data)), artifact_file)

    @property
    def artifact_uri(self) -> str:
        uri: str = self.client.get_run(self.run_id).info.artifact_uri
        return uri


class Tracker:
    """One parent run per cycle, one nested run per stage, all in the config's experiment."""

    def __init__(self, tracking_uri: str, artifact_root: str, experiment: str) -> None:
        store = resolve_tracking_uri(tracking_uri)
        served = served_tracking_uri(store)
        # While `draftloop up`'s MLflow server serves this SQLite file, everything goes through it, so
        # runs and versions have UI links; the experiment keeps the artifact folder the file store would
        # give it (the server is on this machine).
        self.tracking_uri = served or store
        location = (
            resolve_artifact_root(artifact_root)
            if served
            else experiment_artifact_location(store, artifact_root)
        )
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
                )
            except MlflowException:  # created concurrently by another process
                found = self.client.get_experiment_by_name(experiment)
                assert found is not None
                self.experiment_id = found.experiment_id
        else:
            self.experiment_id = found.experiment_id
            if EXPERIMENT_KIND_TAG not in found.tags:  # created before the tag, or by hand
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        self.parent_run_id: str | None = None

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> Tracker:
        return cls(config.tracking.mlflow_uri, config.tracking.artifact_root, config.tracking.experiment)

    # -- parent run ---------------------------------------------------------------------------------------
    def start_cycle(
        self,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
        parent_run_id: str | None = None,
        resume_run_id: str | None = None,
    ) -> StageRun:
        """The cycle's run: a new one (nested under `parent_run_id`, a sweep's run, when given), or
        `resume_run_id` running again (a sweep's winner registered in its own variant's run)."""
        if resume_run_id is not None:
            self.client.update_run(resume_run_id, status="RUNNING")
            run_id = resume_run_id
            self.client.log_batch(run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])
        else:
            nested = {MLFLOW_PARENT_RUN_ID: parent_run_id} if parent_run_id else {}
            run = self.client.create_run(
                self.experiment_id, run_name=run_name, tags={**tags, **nested, "draftloop.kind": "cycle"}
            )
            run_id = run.info.run_id
        self.parent_run_id = run_id
        handle = StageRun(self.client, run_id, "cycle")
        if resume_run_id is None:
            handle.log_params(params)
        return handle

    def parent_run(
        self, kind: str, key: str, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]
    ) -> StageRun:
        """The parent run of a sweep or a refresh (`kind`): the one an earlier run of the same plan
        started (tags `draftloop.kind` and `draftloop.<kind>_key`), running again, or a new one. The
        cycle runs they start nest under it."""
        key_tag = f"draftloop.{kind}_key"
        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{key_tag}` = '{key}' and tags.`draftloop.kind` = '{kind}'",
            max_results=1,
        )
        if found:
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                self.experiment_id, run_name=run_name, tags={**tags, key_tag: key, "draftloop.kind": kind}
            )
            run_id = run.info.run_id
        handle = StageRun(self.client, run_id, kind)
        if not found:
            handle.log_params(params)
        return handle

    def describe_cycle(self, text: str) -> None:
        """The cycle run's description (MLflow's run page shows `mlflow.note.content` as markdown)."""
        if self.parent_run_id is not None:
            self.client.set_tag(self.parent_run_id, MLFLOW_RUN_NOTE, redact_text(text)[:5000])

    def record_registration(self, model: str, version: str, champion: bool) -> None:
        """The cycle run's registry columns (MLflow has no documented per-experiment default columns, so
        the runs list shows these next to `mean_acceptance_length`, `acceptance_rate`, `speedup_c1`):
        metric `gate_passed` (1/0), tags `gate` (champion/rejected) and `model_version`."""
        if self.parent_run_id is None:
            return
        self.client.log_batch(
            self.parent_run_id,
            metrics=[Metric("gate_passed", 1.0 if champion else 0.0, now_ms(), 0)],
            tags=[
                RunTag("gate", "champion" if champion else "rejected"),
                RunTag("model_version", f"{model} v{version}"),
            ],
        )

    def end_cycle(self, status: str = "FINISHED", error: str | None = None) -> None:
        if self.parent_run_id is None:
            return
        if error:
            self.client.set_tag(self.parent_run_id, "draftloop.error", redact_text(error)[:5000])
        self.client.set_terminated(self.parent_run_id, status=status)

    # -- nested stage runs --------------------------------------------------------------------------------
    @contextmanager
    def stage(self, stage: str, tags: Mapping[str, str] | None = None) -> Iterator[StageRun]:
        """A nested run for `stage`; a failure is recorded (status, tags, `error.txt`) and re-raised."""
        run_tags = {MLFLOW_RUN_NAME: stage, "draftloop.stage": stage, **(tags or {})}
        if self.parent_run_id is not None:
            run_tags[MLFLOW_PARENT_RUN_ID] = self.parent_run_id
        run = self.client.create_run(self.experiment_id, tags=run_tags)
        handle = StageRun(self.client, run.info.run_id, stage)
        try:
            yield handle
        except BaseException as error:
            excerpt = error_excerpt(error)
            try:
                handle.set_tags({"draftloop.status": "failed", "draftloop.error": str(error)[:5000]})
                handle.log_text(excerpt, "error.txt")
                if self.parent_run_id is not None:
                    self.client.set_tag(self.parent_run_id, "draftloop.failed_stage", stage)
                status = "KILLED" if isinstance(error, KeyboardInterrupt | SystemExit) else "FAILED"
                self.client.set_terminated(handle.run_id, status=status)
            except Exception:  # tracking must never hide the stage's own error
                pass
            raise
        else:
            handle.set_tags({"draftloop.status": "finished"})
            self.client.set_terminated(handle.run_id, status="FINISHED")


def error_excerpt(error: BaseException, log_tail: str | None = None, limit: int = 4000) -> str:
    """The traceback plus the tail of whatever log the error carries (engine logs, worker output)."""
    text = "".join(traceback.format_exception(error))
    tail = log_tail if log_tail is not None else getattr(error, "log_excerpt", None)
    if tail:
        text += "\n--- log excerpt ---\n" + str(tail)[-limit:]
    return text[-(2 * limit) :]
