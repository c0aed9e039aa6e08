"""The cycle's MLflow parent run as a person reads it, and the links between it and Prefect.

Where it came from (Source: the deployment or the `draftloop run` command and the git commit; the
Prefect flow run's URL as a tag and in the description), what it found (the verdict as the run's
description; AL, acceptance %, speedup @ c=1, gate and verdict as the runs table's columns, rounded),
and its stages' plots as its own artifacts (they are also in the stage runs). `CycleLinks` are the URLs
both tools print: the Prefect artifact and the flow's last log line take them from here.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE

from draftloop.infra.registry.runs import StageRun, Tracker, is_finite
from draftloop.infra.runtime.storage import Manifest, StorageOptions, read_shard

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFECT_FLOW_RUN_TAG = "prefect.flow_run_url"
# The plots a cycle run carries: the evaluation's (`plot-<name>.png` shards) and training's loss curve.
PLOT_SHARDS = {"evaluate": "plot-", "train": "training_curves.png", "train_online": "training_curves.png"}


def is_ui_url(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


@dataclass(frozen=True)
class CycleLinks:
    """Where a person opens one cycle: its MLflow run, model version, model and experiment (when
    tracking goes through an MLflow server; a file store has no UI), its Prefect flow run (when a
    Prefect server runs it; `draftloop run` alone uses a private API that ends with the run)."""

    mlflow_run: str | None = None
    mlflow_model_version: str | None = None
    mlflow_model: str | None = None
    mlflow_experiment: str | None = None
    prefect_flow_run: str | None = None

    def mlflow_rows(self) -> dict[str, str]:
        """The MLflow links by label, as the artifact and summary.json's `links` show them."""
        rows = {
            "MLflow run": self.mlflow_run,
            "MLflow model version": self.mlflow_model_version,
            "MLflow model": self.mlflow_model,
        }
        return {label: url for label, url in rows.items() if url}


def mlflow_ui_links(
    tracking_uri: str,
    experiment_id: str,
    run_id: str | None,
    model: str | None = None,
    version: str | None = None,
    prefect_flow_run: str | None = None,
) -> CycleLinks:
    """The MLflow UI's pages of a run and its registered version (MLflow 3's hash routes)."""
    if not is_ui_url(tracking_uri) or run_id is None:
        return CycleLinks(prefect_flow_run=prefect_flow_run)
    base = tracking_uri.rstrip("/")
    return CycleLinks(
        mlflow_run=f"{base}/#/experiments/{experiment_id}/runs/{run_id}",
        mlflow_model_version=f"{base}/#/models/{model}/versions/{version}" if model and version else None,
        mlflow_model=f"{base}/#/models/{model}" if model else None,
        mlflow_experiment=f"{base}/#/experiments/{experiment_id}/runs",
        prefect_flow_run=prefect_flow_run,
    )


def prefect_flow_run_url(flow_run_id: str) -> str | None:
    """The Prefect UI's page of a flow run, when a Prefect server (PREFECT_API_URL) runs it."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    if not PREFECT_API_URL.value():
        return None
    ui = PREFECT_UI_URL.value()
    return f"{str(ui).rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else None


def git_commit(folder: Path = REPO_ROOT) -> str | None:
    """The checkout's commit (None outside git): the code a cycle ran."""
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def source_tags(source_name: str, flow_run_url: str | None) -> dict[str, str]:
    """The run's Source column (MLflow shows `mlflow.source.name`) and its link back to Prefect."""
    tags = {MLFLOW_SOURCE_NAME: source_name, MLFLOW_SOURCE_TYPE: "JOB"}
    commit = git_commit()
    if commit:
        tags[MLFLOW_GIT_COMMIT] = commit
    if flow_run_url:
        tags[PREFECT_FLOW_RUN_TAG] = flow_run_url
    return tags


def running_description(config: str, last_stage: str, flow_run_url: str | None) -> str:
    """The description while the cycle runs (the verdict replaces it at the end)."""
    lines = [f"Running: cycle of `{config}` up to {last_stage}."]
    if flow_run_url:
        lines += ["", f"Prefect flow run: [{flow_run_url}]({flow_run_url})"]
    return "\n".join(lines)


@dataclass(frozen=True)
class CycleRecord:
    """What the finished cycle run shows (read from summary.json's shape)."""

    config: str
    status: str  # completed | failed
    last_stage: str
    whole_cycle: bool  # the pipeline's last stage ran (not an `until` run)
    verdict: str | None  # the registered version's one-line verdict, else the evaluation's
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    speedup: dict[str, float] = field(default_factory=dict)
    speedup_status: dict[str, str] = field(default_factory=dict)
    gate: str | None = None  # champion | rejected
    model_version: str | None = None  # "drafter-x v2"
    produced: tuple[tuple[str, str], ...] = ()  # (stage, dataset URI)
    links: CycleLinks = field(default_factory=CycleLinks)

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any], pipeline_last: str, links: CycleLinks) -> CycleRecord:
        registered = summary.get("registered_model") or {}
        stages: dict[str, Any] = dict(summary.get("stages") or {})
        last = list(stages)[-1] if stages else pipeline_last
        evaluation = summary.get("verdict")
        return cls(
            config=str(summary.get("config")),
            status=str(summary.get("status")),
            last_stage=last,
            whole_cycle=last == pipeline_last,
            verdict=registered.get("verdict") or (f"evaluation: {evaluation}" if evaluation else None),
            mean_acceptance_length=summary.get("mean_acceptance_length"),
            acceptance_rate=summary.get("acceptance_rate"),
            speedup={str(k): float(v) for k, v in (summary.get("speedup") or {}).items()},
            speedup_status={str(k): str(v) for k, v in (summary.get("speedup_status") or {}).items()},
            gate=registered.get("alias_status") if registered else None,
            model_version=f"{registered['name']} v{registered['version']}" if registered else None,
            produced=tuple((name, str(stage.get("uri"))) for name, stage in stages.items()),
            links=links,
        )

    def figures_line(self) -> str | None:
        """`AL 2.24 · acceptance 41.2 % · 0.66x @ c=1 (inconclusive)`: the figures, rounded."""
        parts = []
        if self.mean_acceptance_length is not None:
            parts.append(f"AL {self.mean_acceptance_length:.2f}")
        if self.acceptance_rate is not None:
            parts.append(f"acceptance {100 * self.acceptance_rate:.1f} %")
        if "1" in self.speedup:
            flag = self.speedup_status.get("1", "ok").split(":")[0]
            parts.append(f"{self.speedup['1']:.2f}x @ c=1" + (f" ({flag})" if flag != "ok" else ""))
        return " · ".join(parts) or None


def cycle_description(record: CycleRecord) -> str:
    """The run's description: the verdict first, then the figures, the version, the links; a partial
    or failed run says what it produced and where."""
    lines: list[str] = []
    if record.status != "completed":
        lines.append(f"**Failed** after {record.last_stage} (cycle of `{record.config}`).")
    elif not record.whole_cycle:
        lines.append(
            f"**Partial cycle** of `{record.config}`, up to {record.last_stage}: nothing registered."
        )
    elif record.verdict:
        lines.append(f"**{record.verdict}**")
    figures = record.figures_line()
    if figures:
        lines += ["", figures]
    if record.model_version:
        version = record.links.mlflow_model_version
        lines += [
            "",
            f"Model version: [{record.model_version}]({version})" if version else record.model_version,
        ]
    if record.produced and (not record.whole_cycle or record.status != "completed"):
        lines += ["", "Produced:"] + [f"- {stage}: `{uri}`" for stage, uri in record.produced]
    if record.links.prefect_flow_run:
        url = record.links.prefect_flow_run
        lines += ["", f"Prefect flow run: [{url}]({url})"]
    return "\n".join(lines)


def cycle_columns(record: CycleRecord) -> tuple[dict[str, float], dict[str, str]]:
    """The runs table's columns of a cycle run: rounded metrics, and the gate and verdict as tags."""
    metrics: dict[str, float] = {}
    if record.mean_acceptance_length is not None:
        metrics["mean_acceptance_length"] = round(record.mean_acceptance_length, 2)
    if record.acceptance_rate is not None:
        metrics["acceptance_rate"] = round(record.acceptance_rate, 3)
        metrics["acceptance_pct"] = round(100 * record.acceptance_rate, 1)
    for concurrency, value in record.speedup.items():
        metrics[f"speedup_c{concurrency}"] = round(value, 2)
    tags = {"verdict": _one_line(record)}
    if record.gate:
        tags["gate"] = record.gate
    return {key: value for key, value in metrics.items() if is_finite(value)}, tags


def _one_line(record: CycleRecord) -> str:
    if record.status != "completed":
        return f"failed after {record.last_stage}"
    if not record.whole_cycle:
        return f"partial: up to {record.last_stage}"
    return (record.verdict or "completed")[:250]


def stage_plots(manifests: Mapping[str, Manifest], options: StorageOptions | None) -> list[tuple[str, bytes]]:
    """The evaluation plots and the loss curve from the stages' datasets (a cache hit has them too)."""
    plots: list[tuple[str, bytes]] = []
    for stage, manifest in manifests.items():
        prefix = PLOT_SHARDS.get(stage)
        if prefix is None:
            continue
        for shard in manifest.shards:
            if shard.name.startswith(prefix) and shard.name.endswith(".png"):
                plots.append((shard.name.removeprefix("plot-"), read_shard(manifest, shard.name, options)))
    return plots


def publish_cycle_run(
    tracker: Tracker, run: StageRun, record: CycleRecord, plots: Sequence[tuple[str, bytes]]
) -> None:
    """The finished cycle run's description, columns and plots (under `plots/`)."""
    tracker.describe_cycle(cycle_description(record))
    metrics, tags = cycle_columns(record)
    run.log_metrics(metrics)
    run.set_tags(tags)
    if plots:
        with tempfile.TemporaryDirectory(prefix="draftloop-plots-") as scratch:
            for name, data in plots:
                (Path(scratch) / name).write_bytes(data)
            run.log_artifact(scratch, "plots")
