"""MLflow tracking for one drafter cycle: a parent run, nested stage runs, the registry and its gate.

Everything goes through `MlflowClient` with explicit run ids (never the fluent API's thread-local
"active run"), because Prefect may call tasks from worker threads and a cycle must not depend on which
thread logged last.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set before mlflow is imported anywhere in this process: no telemetry from tests or the demo.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow.entities import LoggedModel, LoggedModelOutput, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.models.model import MLMODEL_FILE_NAME
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS, MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from draftloop.infra.runtime.config import ExperimentConfig, GateConfig
from draftloop.infra.runtime.redaction import redact, redact_text, redacted_copy

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
        items = [Param(key, str(value)[:_PARAM_VALUE_LIMIT]) for key, value in redact(dict(params)).items()]
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

    def record_registration(self, registration: Mapping[str, Any]) -> None:
        """The cycle run's registry columns (MLflow has no documented per-experiment default columns, so
        the runs list shows these next to `mean_acceptance_length`, `acceptance_rate`, `speedup_c1`):
        metric `gate_passed` (1/0), tags `gate` (champion/rejected) and `model_version`."""
        if self.parent_run_id is None:
            return
        passed = bool(registration.get("champion"))
        self.client.log_batch(
            self.parent_run_id,
            metrics=[Metric("gate_passed", 1.0 if passed else 0.0, _now_ms(), 0)],
            tags=[
                RunTag("gate", str(registration.get("alias_status"))),
                RunTag("model_version", f"{registration.get('name')} v{registration.get('version')}"),
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


def evaluate_gate(
    gate: GateConfig,
    results: CycleResults,
    champion_length: float | None,
    champion_version: str | None = None,
) -> GateDecision:
    """Apply `evaluation.gate` to a cycle's results.

    `min_speedup` is checked at concurrency 1 (a single stream is where speculation must pay);
    null means "not gated" and the reason is kept, because tiny CPU targets are compute-bound.
    The champion is beaten at the registry's resolution (3 decimals, what its tags hold).
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
            reasons.append(f"speedup at concurrency 1 ({speedup:.2f}x) is flagged: {status}")
        elif speedup < gate.min_speedup:
            reasons.append(f"speedup at concurrency 1 is {speedup:.2f}x < min_speedup {gate.min_speedup}x")
    if gate.require_consistency:
        if results.lossless is False:
            reasons.append("greedy outputs of the speculative server differ from the baseline's")
        if results.consistent is None:
            reasons.append("engine/simulator consistency was not measured")
        elif not results.consistent:
            reasons.append(
                f"engine acceptance {format_figure(results.acceptance_rate)} disagrees with the simulator's "
                f"{format_figure(results.simulator_acceptance_rate)} (integration fault)"
            )
    length = results.mean_acceptance_length
    if gate.min_acceptance_length is not None:
        if length is None:
            reasons.append("no mean acceptance length measured")
        elif length < gate.min_acceptance_length:
            reasons.append(
                f"mean acceptance length {length:.2f} < min_acceptance_length {gate.min_acceptance_length}"
            )
    if gate.beat_champion:
        champion = f"champion v{champion_version}" if champion_version else "the champion"
        if champion_length is None:
            notes.append("no current champion to beat")
        elif length is None:
            reasons.append(f"no mean acceptance length to compare with {champion}'s {champion_length:.2f}")
        elif round(length, 3) <= champion_length:
            reasons.append(
                f"mean acceptance length {length:.2f} does not beat {champion}'s {champion_length:.2f}"
            )
    return GateDecision(passed=not reasons, reasons=reasons, notes=notes)


def format_figure(value: Any, digits: int = 3, unit: str = "") -> str:
    """A figure for people: `n/a` when missing, a float to `digits` decimals, anything else as is."""
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


# How the registry names an engine kind for people (the kind itself stays the `engine` tag).
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
# The MLmodel flavor of a drafter logged by draftloop: an engine-native EAGLE-3 folder, not a Python model.
DRAFTER_FLAVOR = "draftloop_eagle3"
DRAFTER_DATA_DIR = "drafter"  # the drafter's own folder inside the logged model, next to MLmodel
SHORT_HASH = 12  # characters of a content hash shown in tags


def engine_label(kind: str, version: str | None) -> str:
    """`vLLM 0.32.0`; the bare name when the version is unknown."""
    name = ENGINE_NAMES.get(kind, kind)
    return name if not version or version == "unknown" else f"{name} {version}"


def target_label(target: str) -> str:
    """The target as people name it: a hub id as is, a local folder by its name (no absolute paths)."""
    path = Path(target)
    return path.name if path.is_absolute() or path.exists() else target


@dataclass
class DrafterCard:
    """What the registry and the drafter's MLmodel say about it: where it serves and what it came from."""

    target: str  # a folder name or a hub id (target_label), never an absolute local path
    engine: str  # engine kind: vllm, sglang
    engine_version: str
    aux_layer_ids: list[int] | None
    layer_id_convention: str  # how `aux_layer_ids` are counted (DESIGN.md, "Layer ids")
    convention_exported: str  # the engine whose convention the exported config follows
    hashes: Mapping[str, str] = field(default_factory=dict)  # {"data_hash": sha256, ...}

    @property
    def engine_label(self) -> str:
        return engine_label(self.engine, self.engine_version)

    def tags(self) -> dict[str, str]:
        return {
            "target": self.target,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "aux_layer_ids": json.dumps(self.aux_layer_ids),
            "layer_id_convention": self.layer_id_convention,
            "convention_exported": self.convention_exported,
            **{key: value[:SHORT_HASH] for key, value in self.hashes.items()},
        }


def result_tags(results: CycleResults) -> dict[str, str]:
    """The figures a version carries as tags, rounded; the leaderboard is rebuilt from them."""
    tags = {
        "mean_acceptance_length": format_figure(results.mean_acceptance_length),
        "acceptance_rate": format_figure(results.acceptance_rate),
    }
    for concurrency, speedup in sorted(results.speedup.items()):
        tags[f"speedup_c{concurrency}"] = format_figure(speedup)
        status = results.speedup_status.get(concurrency, "ok")
        if status != "ok":
            tags[f"speedup_c{concurrency}_status"] = status.split(":")[0]
    if results.recommended_k is not None:
        tags["num_speculative_tokens"] = str(results.recommended_k)
    return tags


def _tag_float(tags: Mapping[str, str], key: str) -> float | None:
    try:
        return float(tags[key])
    except (KeyError, ValueError):
        return None


@dataclass
class ChampionFigures:
    """The current champion as its tags tell it (what a challenger is compared with)."""

    version: str
    mean_acceptance_length: float | None
    speedup_c1: float | None


def current_champion(client: MlflowClient, name: str) -> ChampionFigures | None:
    try:
        version = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    except MlflowException:
        return None
    return ChampionFigures(
        version=str(version.version),
        mean_acceptance_length=_tag_float(version.tags, "mean_acceptance_length"),
        speedup_c1=_tag_float(version.tags, "speedup_c1"),
    )


def _speedup_phrase(results: CycleResults, concurrency: int = 1) -> str:
    speedup = results.speedup.get(concurrency)
    if speedup is None:
        return f"speedup n/a @ c={concurrency}"
    status = results.speedup_status.get(concurrency, "ok")
    flag = "" if status == "ok" else f" ({status.split(':')[0]})"
    return f"speedup {speedup:.2f}x{flag} @ c={concurrency}"


def _comparison(results: CycleResults, passed: bool, champion: ChampionFigures | None) -> str:
    """How the version stands against the champion it was gated against, from its own viewpoint."""
    if champion is None:
        return "first champion" if passed else "no champion yet"
    length, theirs = results.mean_acceptance_length, champion.mean_acceptance_length
    if length is None or theirs is None:
        text = f"champion v{champion.version} has AL {format_figure(theirs, 2)}"
    elif passed and length > theirs:
        text = f"beats v{champion.version} by {length - theirs:+.2f} AL"
    elif passed:  # a gate without beat_champion
        text = f"replaces v{champion.version} at {length - theirs:+.2f} AL"
    elif theirs >= length:
        text = f"v{champion.version} leads by {theirs - length:.2f} AL"
    else:
        text = f"{length - theirs:+.2f} AL over v{champion.version}, which stays champion"
    speedup = results.speedup.get(1)
    if speedup is not None and champion.speedup_c1 is not None:
        text += f", speedup {speedup - champion.speedup_c1:+.2f}x vs v{champion.version}"
    return text


def verdict_line(
    results: CycleResults, decision: GateDecision, engine: str, champion: ChampionFigures | None
) -> str:
    """The description's first line, what the registry's versions list shows:
    `champion: AL 2.24, speedup 1.90x @ c=1 on vLLM 0.32.0 — beats v1 by +0.31 AL, speedup +0.20x vs v1`.
    A rejected version names the gate's reasons in its head."""
    head = "champion" if decision.passed else f"rejected ({'; '.join(decision.reasons)})"
    figures = f"AL {format_figure(results.mean_acceptance_length, 2)}, {_speedup_phrase(results)} on {engine}"
    return f"{head}: {figures} — {_comparison(results, decision.passed, champion)}"


def description_table(
    results: CycleResults,
    gate: GateDecision | None = None,
    serving_command: str | None = None,
    context_rows: Sequence[tuple[str, str]] = (),
) -> str:
    """A markdown table of the results with units (after `context_rows`: engine, target, comparison),
    ending with the command that serves the drafter at the recommended k."""
    consistent = {True: "yes", False: "no (integration fault)", None: "not measured"}[results.consistent]
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in context_rows]
    lines += [
        f"| mean acceptance length | {format_figure(results.mean_acceptance_length)} tokens/step |",
        f"| acceptance rate | {_percent(results.acceptance_rate)} |",
        f"| simulator acceptance rate | {_percent(results.simulator_acceptance_rate)} |",
        f"| engine/simulator consistent | {consistent} |",
    ]
    if results.per_position_acceptance:
        per_position = ", ".join(f"{100 * value:.0f} %" for value in results.per_position_acceptance)
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
        if gate.notes:
            lines.append(f"| gate notes | {'; '.join(gate.notes)} |")
    if serving_command is not None:
        lines += ["", f"Serve it (recommended k = {results.recommended_k}):", "", f"    {serving_command}"]
    return "\n".join(lines) + "\n"


def version_description(
    results: CycleResults,
    decision: GateDecision,
    card: DrafterCard,
    champion: ChampionFigures | None,
    serving_command: str,
) -> str:
    """The model version's description: the one-line verdict, the table, the serving command."""
    rows = [("engine", card.engine_label), ("target", card.target)]
    if champion is not None and champion.mean_acceptance_length is not None:
        rows.append((f"champion at registration (v{champion.version})", _champion_figures(champion)))
    table = description_table(results, decision, serving_command, context_rows=rows)
    return verdict_line(results, decision, card.engine_label, champion) + "\n\n" + table


def _champion_figures(champion: ChampionFigures) -> str:
    mean_al = format_figure(champion.mean_acceptance_length)
    speedup = format_figure(champion.speedup_c1, 3, "x")
    return f"AL {mean_al} tokens/step, speedup {speedup} @ concurrency 1"


# ---------------------------------------------------------------------------------------------------------
# The drafter as an MLflow model


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
    )
    client.log_model_artifacts(model.model_id, str(drafter_folder), DRAFTER_DATA_DIR)
    with tempfile.TemporaryDirectory(prefix="draftloop-mlmodel-") as scratch:
        mlmodel.save(str(Path(scratch) / MLMODEL_FILE_NAME))
        client.log_model_artifacts(model.model_id, scratch)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    return client.finalize_logged_model(model.model_id, "READY"), command


# ---------------------------------------------------------------------------------------------------------
# The registered model: versions, gate, leaderboard


@dataclass
class Registration:
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


REGISTERED_MODEL_INTRO = "EAGLE-3 drafters trained by draftloop."
_LEADERBOARD_ROWS = 50  # newest versions shown; the rest stay in the versions list


def _speedup_cell(tags: Mapping[str, str], concurrency: int) -> str:
    value = _tag_float(tags, f"speedup_c{concurrency}")
    if value is None:
        return "-"
    flag = tags.get(f"speedup_c{concurrency}_status")
    return f"{value:.2f}x" + (f" ({flag})" if flag else "")


def leaderboard_markdown(client: MlflowClient, name: str) -> str:
    """The registered model's description: its versions newest first (gate, AL, acceptance rate, speedup
    per concurrency, engine), rebuilt from the versions' tags."""
    escaped = name.replace("'", "\\'")
    versions = sorted(
        client.search_model_versions(f"name = '{escaped}'"), key=lambda v: int(v.version), reverse=True
    )
    concurrencies = sorted(
        {
            int(key[len("speedup_c") :])
            for v in versions
            for key in v.tags
            if re.fullmatch(r"speedup_c\d+", key)
        }
    )
    # By the alias itself: search results do not carry aliases.
    holder = current_champion(client, name)
    champion = next((v for v in versions if holder is not None and str(v.version) == holder.version), None)
    if champion is None:
        head = "No champion yet."
    else:
        tags = champion.tags
        head = (
            f"Champion: v{champion.version}, "
            f"AL {format_figure(_tag_float(tags, 'mean_acceptance_length'), 2)}, "
            f"speedup {_speedup_cell(tags, 1)} @ c=1 on "
            f"{engine_label(tags.get('engine', '?'), tags.get('engine_version'))}."
        )
    header = ["version", "gate", "AL (tokens/step)", "acceptance rate"]
    header += [f"speedup @ c={c}" for c in concurrencies] + ["engine", "target"]
    lines = [
        f"{REGISTERED_MODEL_INTRO} {head}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for version in versions[:_LEADERBOARD_ROWS]:
        tags = version.tags
        if version is champion:
            gate = "champion"
        elif tags.get("gate") == "passed":
            gate = "passed (former champion)"
        else:
            gate = tags.get("gate", "-")
        cells = [
            f"v{version.version}",
            gate,
            format_figure(_tag_float(tags, "mean_acceptance_length"), 2),
            _percent(_tag_float(tags, "acceptance_rate")),
            *(_speedup_cell(tags, c) for c in concurrencies),
            engine_label(tags.get("engine", "-"), tags.get("engine_version")),
            tags.get("target", "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(versions) > _LEADERBOARD_ROWS:
        lines += ["", f"{len(versions) - _LEADERBOARD_ROWS} older versions are in the versions list."]
    lines += ["", "Rebuilt at every registration from the versions' tags."]
    return "\n".join(lines) + "\n"


def register_drafter(
    tracker: Tracker,
    run: StageRun,
    name: str,
    gate_config: GateConfig,
    results: CycleResults,
    card: DrafterCard,
    drafter_folder: Path,
    serving_command: Callable[[str], str],
) -> Registration:
    """Log `drafter_folder` as an MLflow model, create a version from it, move `champion` past the gate.

    The model is an output of the cycle's parent run (the register stage's own run when there is none),
    so the runs list shows it. A version that fails the gate is still registered (it is evidence), tagged
    `rejected` with the reasons. `serving_command(drafter_uri)`: the command serving the drafter from
    where the model stores it (in the MLmodel and at the end of the description).
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
            Metric(key, float(value), _now_ms(), 0, model_id=model.model_id)
            for key, value in figures.items()
            if value is not None and _finite(value)
        ],
    )
    version_tags = {
        **card.tags(),
        **result_tags(results),
        "gate": "passed" if decision.passed else "rejected",
    }
    if not decision.passed:
        version_tags["rejected"] = "; ".join(decision.reasons)
    if decision.notes:
        version_tags["gate_notes"] = "; ".join(decision.notes)
    description = version_description(results, decision, card, champion, command)
    version = client.create_model_version(
        name,
        source=model.artifact_location,
        run_id=model_run_id,
        tags=version_tags,
        description=description,
        model_id=model.model_id,
    )
    # The logged model's page lists its registered versions from this tag (what mlflow.register_model sets).
    client.set_logged_model_tags(
        model.model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([{"name": name, "version": str(version.version)}])}
    )
    if decision.passed:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, version.version)
    client.update_registered_model(name, description=leaderboard_markdown(client, name))
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
        previous_champion=champion.version if champion else None,
        verdict=description.splitlines()[0],
        model_id=model.model_id,
    )
