"""MLflow tracking for one drafter cycle: a parent run, nested stage runs, the registry and its gate.

Everything goes through `MlflowClient` with explicit run ids (never the fluent API's thread-local
"active run"), because Prefect may call tasks from worker threads and a cycle must not depend on which
thread logged last.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set before mlflow is imported anywhere in this process: no telemetry from tests or the demo.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from draftloop.infra.config import ExperimentConfig, GateConfig

CHAMPION_ALIAS = "champion"
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


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------------------
# Runs


@dataclass
class StageRun:
    """A nested MLflow run for one stage; the handle tasks log through."""

    client: MlflowClient
    run_id: str
    stage: str

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [Param(key, str(value)[:_PARAM_VALUE_LIMIT]) for key, value in params.items()]
        for start in range(0, len(items), _LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, params=items[start : start + _LOG_BATCH_LIMIT])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        timestamp = _now_ms()
        items = [
            Metric(key, float(value), timestamp, step or 0)
            for key, value in metrics.items()
            if _finite(value)
        ]
        for start in range(0, len(items), _LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[start : start + _LOG_BATCH_LIMIT])

    def log_metric_history(self, rows: list[Mapping[str, float]], step_key: str = "step") -> None:
        """Per-step curves (training loss, per-position accuracy): one batch per chunk of metrics."""
        timestamp = _now_ms()
        items: list[Metric] = []
        for row in rows:
            step = int(row.get(step_key, 0))
            items.extend(
                Metric(key, float(value), timestamp, step)
                for key, value in row.items()
                if key != step_key and _finite(value)
            )
        for start in range(0, len(items), _LOG_BATCH_LIMIT):
            self.client.log_batch(self.run_id, metrics=items[start : start + _LOG_BATCH_LIMIT])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(local_path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        elif path.exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, dict(data), artifact_file)

    @property
    def artifact_uri(self) -> str:
        uri: str = self.client.get_run(self.run_id).info.artifact_uri
        return uri


def _now_ms() -> int:
    return int(time.time() * 1000)


class Tracker:
    """One parent run per cycle, one nested run per stage, all in the config's experiment."""

    def __init__(self, tracking_uri: str, artifact_root: str, experiment: str) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                self.experiment_id = self.client.create_experiment(
                    experiment,
                    artifact_location=experiment_artifact_location(self.tracking_uri, artifact_root),
                    tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND},
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
    def start_cycle(self, run_name: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> StageRun:
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={**tags, "draftloop.kind": "cycle"}
        )
        self.parent_run_id = run.info.run_id
        handle = StageRun(self.client, run.info.run_id, "cycle")
        handle.log_params(params)
        return handle

    def end_cycle(self, status: str = "FINISHED", error: str | None = None) -> None:
        if self.parent_run_id is None:
            return
        if error:
            self.client.set_tag(self.parent_run_id, "draftloop.error", error[:5000])
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


# ---------------------------------------------------------------------------------------------------------
# Results, gate and registry


@dataclass
class CycleResults:
    """The figures the gate and the model-version description are made of."""

    acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position_acceptance: list[float] = field(default_factory=list)
    speedup: dict[int, float] = field(default_factory=dict)  # per concurrency
    throughput: dict[int, float] = field(default_factory=dict)  # output tokens/s per concurrency
    simulator_acceptance_rate: float | None = None
    consistent: bool | None = None  # engine vs simulator within tolerance
    lossless: bool | None = None
    # Per concurrency: "ok", "inconclusive" (interval contains 1.0) or "measurement_error" (with why).
    speedup_status: dict[int, str] = field(default_factory=dict)
    recommended_k: int | None = None  # the k the evaluation recommends serving

    def to_dict(self) -> dict[str, Any]:
        return {
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "speedup": {str(k): v for k, v in self.speedup.items()},
            "throughput": {str(k): v for k, v in self.throughput.items()},
            "simulator_acceptance_rate": self.simulator_acceptance_rate,
            "consistent": self.consistent,
            "lossless": self.lossless,
            "speedup_status": {str(k): v for k, v in self.speedup_status.items()},
            "recommended_k": self.recommended_k,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CycleResults:
        return cls(
            acceptance_rate=data.get("acceptance_rate"),
            mean_acceptance_length=data.get("mean_acceptance_length"),
            per_position_acceptance=list(data.get("per_position_acceptance") or []),
            speedup={int(k): float(v) for k, v in (data.get("speedup") or {}).items()},
            throughput={int(k): float(v) for k, v in (data.get("throughput") or {}).items()},
            simulator_acceptance_rate=data.get("simulator_acceptance_rate"),
            consistent=data.get("consistent"),
            lossless=data.get("lossless"),
            speedup_status={int(k): str(v) for k, v in (data.get("speedup_status") or {}).items()},
            recommended_k=data.get("recommended_k"),
        )


@dataclass
class GateDecision:
    passed: bool
    reasons: list[str]  # why it failed (empty when passed)
    notes: list[str]  # checks that were skipped, with why

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reasons": self.reasons, "notes": self.notes}


def evaluate_gate(gate: GateConfig, results: CycleResults, champion_length: float | None) -> GateDecision:
    """Apply `evaluation.gate` to a cycle's results.

    `min_speedup` is checked at concurrency 1 (a single stream is where speculation must pay);
    null means "not gated" and the reason is kept, because tiny CPU targets are compute-bound.
    """
    reasons: list[str] = []
    notes: list[str] = []
    if gate.min_speedup is None:
        notes.append(
            "min_speedup not gated (evaluation.gate.min_speedup is null: a tiny target on a CPU is "
            "compute-bound, speculation cannot pay there)"
        )
    else:
        speedup = results.speedup.get(1)
        status = results.speedup_status.get(1, "ok")
        if speedup is None:
            reasons.append("no speedup measured at concurrency 1")
        elif not status.startswith("ok"):
            # Never promote on a flagged figure.
            reasons.append(f"speedup at concurrency 1 ({speedup:.3f}x) is flagged: {status}")
        elif speedup < gate.min_speedup:
            reasons.append(f"speedup at concurrency 1 is {speedup:.3f} < min_speedup {gate.min_speedup}")
    if gate.require_consistency:
        if results.lossless is False:
            reasons.append("greedy outputs of the speculative server differ from the baseline's")
        if results.consistent is None:
            reasons.append("engine/simulator consistency was not measured")
        elif not results.consistent:
            reasons.append(
                f"engine acceptance {results.acceptance_rate} disagrees with the simulator's "
                f"{results.simulator_acceptance_rate} (integration fault)"
            )
    length = results.mean_acceptance_length
    if gate.min_acceptance_length is not None:
        if length is None:
            reasons.append("no mean acceptance length measured")
        elif length < gate.min_acceptance_length:
            reasons.append(
                f"mean acceptance length {length:.3f} < min_acceptance_length {gate.min_acceptance_length}"
            )
    if gate.beat_champion:
        if champion_length is None:
            notes.append("no current champion to beat")
        elif length is None or length <= champion_length:
            reasons.append(
                f"mean acceptance length {length} does not beat the champion's {champion_length:.3f}"
            )
    return GateDecision(passed=not reasons, reasons=reasons, notes=notes)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def description_table(
    results: CycleResults, gate: GateDecision | None = None, serving_command: str | None = None
) -> str:
    """The model version's description: a small markdown table of the results, ending with the command
    that serves the drafter at the recommended k."""
    lines = [
        "| metric | value |",
        "|---|---|",
        f"| acceptance rate | {_fmt(results.acceptance_rate)} |",
        f"| mean acceptance length | {_fmt(results.mean_acceptance_length)} |",
        f"| simulator acceptance rate | {_fmt(results.simulator_acceptance_rate)} |",
        f"| engine/simulator consistent | {results.consistent} |",
    ]
    if results.per_position_acceptance:
        per_position = ", ".join(f"{value:.2f}" for value in results.per_position_acceptance)
        lines.append(f"| acceptance per position | {per_position} |")
    for concurrency in sorted(results.speedup):
        throughput = results.throughput.get(concurrency)
        lines.append(
            f"| speedup @ concurrency {concurrency} | {results.speedup[concurrency]:.3f}x"
            + (f" ({throughput:.1f} tok/s)" if throughput is not None else "")
            + (f" {status}" if (status := results.speedup_status.get(concurrency, "ok")) != "ok" else "")
            + " |"
        )
    if gate is not None:
        verdict = "passed" if gate.passed else "rejected: " + "; ".join(gate.reasons)
        lines.append(f"| gate | {verdict} |")
    if serving_command is not None:
        lines += ["", f"Serve it (recommended k = {results.recommended_k}):", "", f"    {serving_command}"]
    return "\n".join(lines) + "\n"


@dataclass
class Registration:
    name: str
    version: str
    champion: bool  # the `champion` alias now points at this version
    gate: GateDecision
    previous_champion: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "champion": self.champion,
            "alias_status": "champion" if self.champion else "rejected",
            "previous_champion": self.previous_champion,
            "gate": self.gate.to_dict(),
        }


def champion_acceptance_length(client: MlflowClient, name: str) -> tuple[str | None, float | None]:
    """(version, mean acceptance length) of the current champion, or (None, None)."""
    try:
        version = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    except MlflowException:
        return None, None
    value = version.tags.get("mean_acceptance_length")
    return str(version.version), (float(value) if value not in (None, "", "None") else None)


def register_drafter(
    tracker: Tracker,
    run: StageRun,
    name: str,
    gate_config: GateConfig,
    results: CycleResults,
    tags: Mapping[str, Any],
    artifact_dir: str = "drafter",
    serving_command: Callable[[str], str] | None = None,
) -> Registration:
    """Create a model version from `<run artifacts>/<artifact_dir>` and move `champion` if the gate passes.

    The drafter folder must already be logged under `artifact_dir` in `run`. A version that fails the
    gate is still registered (it is evidence), tagged `rejected` with the reasons. `serving_command(source)`:
    the command that serves the drafter from the version's source (the description's last line).
    """
    client = tracker.client
    try:
        client.get_registered_model(name)
    except MlflowException:
        with suppress(MlflowException):  # another cycle may have created it meanwhile
            client.create_registered_model(name, description="EAGLE-3 drafters trained by draftloop")
    previous_version, previous_length = champion_acceptance_length(client, name)
    decision = evaluate_gate(gate_config, results, previous_length)
    version_tags = {k: str(v) for k, v in tags.items()}
    version_tags["mean_acceptance_length"] = str(results.mean_acceptance_length)
    version_tags["acceptance_rate"] = str(results.acceptance_rate)
    source = f"{run.artifact_uri}/{artifact_dir}"
    version = client.create_model_version(
        name,
        source=source,
        run_id=run.run_id,
        tags=version_tags,
        description=description_table(
            results, decision, serving_command(source) if serving_command is not None else None
        ),
    )
    if decision.passed:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, version.version)
        client.set_model_version_tag(name, version.version, "gate", "passed")
    else:
        client.set_model_version_tag(name, version.version, "rejected", "; ".join(decision.reasons))
        client.set_model_version_tag(name, version.version, "gate", "rejected")
    if decision.notes:
        client.set_model_version_tag(name, version.version, "gate_notes", "; ".join(decision.notes))
    run.set_tags(
        {
            "registered_model": name,
            "model_version": version.version,
            "gate": "passed" if decision.passed else "rejected",
        }
    )
    return Registration(
        name=name,
        version=str(version.version),
        champion=decision.passed,
        gate=decision,
        previous_champion=previous_version,
    )
