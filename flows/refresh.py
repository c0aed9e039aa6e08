"""The `refresh` flow: a served drafter checked against new traffic, retrained on it only when it drifted,
and promoted only when it measurably beats the champion.

1. New rows: the traffic location's rows no finished refresh took (infra/synthesis/traffic.py); none
   means nothing to do: no run, no model, the same champion.
2. Drift: the champion, simulated on the new rows' held-out prompts, against its own held-out figure,
   per category (infra/evaluation/drift.py). Below `retrain_drop` (and not `force`), the part is taken
   and the champion stays.
3. The challenger: the cycle up to evaluate over the new rows only (the part's prompts file: only they
   are synthesized and extracted), fine-tuned from the champion, in a `refresh-challenger` subflow whose
   MLflow run nests under the refresh's parent run.
4. Champion and challenger simulated on the same held-out prompts in this run (infra/registry/
   challenge.py); the challenger's cycle then runs on to register, where the gate reads that comparison:
   the alias moves only when the challenger wins beyond the interval, otherwise the version is
   registered as rejected with the reason.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run as current_flow_run
from pydantic import BaseModel, Field

from draftloop.flows.cycle import CycleNesting, cycle_flow
from draftloop.flows.form import ConfigPath, Overrides, RetrainDrop, ShippedConfig, TrafficLocation
from draftloop.flows.sweep import sweep_variant
from draftloop.infra.evaluation.drift import DEFAULT_RETRAIN_DROP, DriftPolicy, DriftReport, drift_report
from draftloop.infra.evaluation.simulator import PromptFigures, run_simulator, simulator_mode_for
from draftloop.infra.registry.challenge import Challenge, challenge
from draftloop.infra.registry.cycle_run import prefect_flow_run_url, source_tags
from draftloop.infra.registry.gate import current_champion
from draftloop.infra.registry.models import download_version_drafter
from draftloop.infra.registry.runs import StageRun, Tracker
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
from draftloop.infra.runtime.processes import state_dir
from draftloop.infra.runtime.storage import download_shards, read_manifest, storage_options
from draftloop.infra.synthesis.conversations import read_eval_prompts
from draftloop.infra.synthesis.traffic import TrafficLedger, TrafficPart, category_of, part_rows, read_traffic
from draftloop.infra.targets.resolve import ensure_target
from draftloop.tasks.summaries import TrainingSummary

DEFAULT_CONFIG = "configs/tiny-llama.yaml"


class RefreshSummary(BaseModel):
    """What a refresh found and decided (the Prefect artifact, the parent run's `refresh/refresh.json`)."""

    config: str
    traffic: str
    status: Literal["nothing_new", "champion_fits", "retrained"]
    reason: str
    rows_seen: int  # usable rows of the location, once per content
    new_rows: int
    part: str | None = None
    categories: dict[str, int] = Field(default_factory=dict)  # new rows per category
    champion_version: str | None = None
    drift: DriftReport | None = None
    challenge: Challenge | None = None
    challenger_run_folder: str | None = None  # the challenger cycle's summary.json is there
    registered_model: dict[str, Any] | None = None
    mlflow_run_id: str | None = None


# The challenger's cycle up to a stage, its MLflow run placed by a `CycleNesting`: a sweep variant's flow
# under its own name in Prefect.
refresh_challenger = sweep_variant.with_options(name="refresh-challenger")


def _simulate(config: ExperimentConfig, drafter: Path, prompts: list[str]) -> list[PromptFigures]:
    target = Path(ensure_target(config))  # a zoo target is built where it is missing
    figures = run_simulator(
        target, drafter, prompts, config.engine.num_speculative_tokens, config.evaluation.max_tokens,
        mode=simulator_mode_for(config.engine_settings(), target),
        trust_remote_code=config.target.trust_remote_code,
    )  # fmt: skip
    return figures.prompts


def _challenger_folder(config: ExperimentConfig, cycle: dict[str, Any], into: Path) -> Path:
    manifest = read_manifest(cycle["stages"]["train"]["uri"], storage_options(config))
    files = TrainingSummary.model_validate(manifest.summary).drafter_files
    return download_shards(manifest, into, files, storage_options(config))


def run_refresh(
    config_path: str, traffic: str, overrides: dict[str, Any], retrain_drop: float, force: bool
) -> RefreshSummary:
    logger = get_run_logger()
    config = ExperimentConfig.load(config_path, overrides)
    options = storage_options(config)
    rows = read_traffic(traffic, str(config.data.format), float(config.data.max_rejected_fraction), options)
    ledger = TrafficLedger(str(config.storage.root), config.name, options)
    new = ledger.new_rows(rows)
    if not new:
        reason = f"nothing new: all {len(rows)} rows of {traffic} were taken by earlier refreshes"
        logger.info("refresh of %s: %s", config.name, reason)
        return RefreshSummary(
            config=config.name, traffic=traffic, status="nothing_new", reason=reason, rows_seen=len(rows),
            new_rows=0,
        )  # fmt: skip
    tracker = Tracker.from_config(config)
    champion = current_champion(tracker.client, config.registered_model_name)
    if champion is None:
        raise ConfigError(  # a user error (exit 2): the refresh fine-tunes from the champion
            "registered model",
            f"{config.registered_model_name} has no champion to refresh: run a cycle that passes the gate "
            "(or register a published drafter) first",
        )
    # A quarter of the new rows at most are held out, so most of them train.
    held_out = max(1, min(int(config.data.eval_prompts), len(new) // 4))
    part = ledger.part_for(new, held_out)
    logger.info(
        "refresh of %s: %d new rows of %d in %s (%s); part %s, %d held out",
        config.name, len(new), len(rows), traffic,
        ", ".join(f"{name} {count}" for name, count in part.categories.items()), part.key, held_out,
    )  # fmt: skip
    flow_run_id = str(current_flow_run.id) if current_flow_run.id else part.key
    flow_run_url = prefect_flow_run_url(flow_run_id)
    parent = tracker.parent_run(
        "refresh",
        part.key,
        run_name=f"{config.name}-refresh-{part.key[:8]}",
        params={
            "refresh.config": config.name,
            "refresh.traffic": traffic,
            "refresh.new_rows": len(new),
            "refresh.held_out": held_out,
            "refresh.champion_version": champion.version,
            "refresh.retrain_drop": retrain_drop,
            "refresh.force": force,
        },
        tags={"prefect.flow_run_id": flow_run_id, **source_tags("refresh", flow_run_url)},
    )
    champion_dir = download_version_drafter(
        tracker, config.registered_model_name, champion.version,
        state_dir() / "refresh" / config.name / f"champion-v{champion.version}",
    )  # fmt: skip
    held_rows = part_rows(part, options)[-held_out:]
    held_prompts = [str(row["prompt"]) for row in held_rows]
    champion_figures = _simulate(config, champion_dir, held_prompts)
    drift = drift_report(
        champion.version,
        champion.mean_acceptance_length,
        champion_figures,
        [category_of(row) for row in held_rows],
        DriftPolicy(retrain_drop=retrain_drop, force=force),
    )
    logger.info("refresh drift: %s", drift.reason)
    summary = RefreshSummary(
        config=config.name, traffic=traffic, status="champion_fits", reason=drift.reason, rows_seen=len(rows),
        new_rows=len(new), part=part.key, categories=part.categories, champion_version=champion.version,
        drift=drift, mlflow_run_id=parent.run_id,
    )  # fmt: skip
    if drift.retrain:
        summary = _challenge_champion(
            config_path, config, overrides, part, champion_dir, champion.version, parent, summary,
            (held_prompts, champion_figures),
        )  # fmt: skip
    ledger.record_decision(part, json.loads(summary.model_dump_json()))
    _publish(parent, tracker, summary)
    return summary


def _challenge_champion(
    config_path: str,
    config: ExperimentConfig,
    overrides: dict[str, Any],
    part: TrafficPart,
    champion_dir: Path,
    champion_version: str,
    parent: StageRun,
    summary: RefreshSummary,
    measured: tuple[list[str], list[PromptFigures]],
) -> RefreshSummary:
    """Train the challenger on the part from the champion, measure both on the same held-out prompts,
    register the challenger through the gate with that measurement."""
    logger = get_run_logger()
    challenger_overrides = {
        **overrides,
        "data.prompts": part.prompts_uri,
        "data.num_samples": len(part.train),
        "data.eval_prompts": len(part.held_out),
        "training.drafter_init": str(champion_dir),
    }
    label = f"challenger {part.key[:8]}"
    cycle = refresh_challenger.with_options(flow_run_name=label)(
        config_path,
        challenger_overrides,
        "evaluate",
        CycleNesting(parent_run_id=parent.run_id, run_name=label, tags={"draftloop.refresh_key": part.key}),
    )
    synthesized = read_manifest(cycle["stages"]["synthesize"]["uri"], storage_options(config))
    prompts = [str(row["prompt"]) for row in read_eval_prompts(synthesized, storage_options(config))]
    held_prompts, champion_figures = measured
    if prompts != held_prompts:  # a held-out row the length policy refused: the cycle's own held-out set
        champion_figures = _simulate(config, champion_dir, prompts)
    with tempfile.TemporaryDirectory(prefix="draftloop-challenger-") as scratch:
        challenger_figures = _simulate(config, _challenger_folder(config, cycle, Path(scratch)), prompts)
    result = challenge(champion_version, champion_figures, challenger_figures)
    logger.info("refresh challenge: %s", result.reason)
    registered = refresh_challenger.with_options(flow_run_name=f"register {label}")(
        config_path,
        challenger_overrides,
        "register",
        CycleNesting(
            resume_run_id=cycle.get("mlflow_run_id"),
            challenge=result,
            origin=f"refresh {part.key[:8]}: fine-tuned from v{champion_version} on {part.rows} new rows "
            f"(MLflow run {parent.run_id})",
        ),
    ).get("registered_model")
    promoted = bool(registered and registered.get("champion"))
    reason = (
        f"{summary.reason}; challenger v{(registered or {}).get('version')} "
        + ("promoted: " if promoted else "rejected: ")
        + result.reason
    )
    return summary.model_copy(
        update={
            "status": "retrained",
            "reason": reason,
            "challenge": result,
            "challenger_run_folder": cycle.get("run_folder"),
            "registered_model": registered,
        }
    )


def _publish(parent: StageRun, tracker: Tracker, summary: RefreshSummary) -> None:
    """The parent run and a Prefect artifact say what the refresh found (drift) and decided."""
    markdown = f"# refresh of {summary.config}\n\n{summary.new_rows} new rows of {summary.traffic}.\n\n"
    metrics: dict[str, float] = {"new_rows": float(summary.new_rows)}
    if summary.drift is not None:
        markdown += summary.drift.markdown() + "\n"
        for row in [summary.drift.overall, *summary.drift.categories]:
            if row.mean_acceptance_length is not None:
                metrics[f"drift.{row.category}.mean_acceptance_length"] = row.mean_acceptance_length
        if summary.drift.drop is not None:
            metrics["drift.drop"] = summary.drift.drop
    if summary.challenge is not None:
        markdown += f"\nChampion against challenger: {summary.challenge.reason}\n"
        metrics.update(
            {
                "challenge.champion_length": summary.challenge.champion_length,
                "challenge.challenger_length": summary.challenge.challenger_length,
                "challenge.difference": summary.challenge.difference,
                "challenge.low": summary.challenge.low,
                "challenge.high": summary.challenge.high,
            }
        )
    markdown += f"\nDecision: {summary.reason}\n"
    parent.log_metrics(metrics)
    parent.set_tags({"draftloop.decision": summary.status, "mlflow.note.content": markdown[:5000]})
    with tempfile.TemporaryDirectory(prefix="draftloop-refresh-") as scratch:
        for name, text in (("drift.md", markdown), ("refresh.json", summary.model_dump_json(indent=2))):
            (Path(scratch) / name).write_text(text)
            parent.log_artifact(Path(scratch) / name, "refresh")
    create_markdown_artifact(markdown, key="draftloop-refresh")
    tracker.client.set_terminated(parent.run_id, status="FINISHED")


@cycle_flow("refresh")
def refresh(
    config: ShippedConfig = DEFAULT_CONFIG,
    config_path: ConfigPath = "",
    traffic: TrafficLocation = "",
    overrides: Overrides = {},  # noqa: B006 - a literal so the form shows it; never mutated
    retrain_drop: RetrainDrop = DEFAULT_RETRAIN_DROP,
    force: bool = False,
) -> dict[str, Any]:
    """Refresh a config's drafter on new traffic: report the champion's drift on the rows no refresh took
    yet, retrain from it past `retrain_drop`, and promote the challenger only if it wins beyond the interval.

    Args:
        config: A shipped experiment config (configs/).
        config_path: Another config file (YAML, absolute or from the repository); replaces config when set.
        traffic: A folder or S3 prefix of JSONL/parquet prompts (e.g. a serving log in OpenAI messages form).
        overrides: Config values by dotted key.
        retrain_drop: Retrain when the champion's mean acceptance length on the new traffic falls by more
            than this share of its own held-out figure.
        force: Retrain whatever the drift.
    """
    if not traffic:
        raise ValueError("traffic: name the folder or S3 prefix of new prompts")
    summary = run_refresh(config_path or config, traffic, dict(overrides), retrain_drop, force)
    if summary.status == "nothing_new":
        note = f"# refresh of {summary.config}\n\n{summary.reason}\n"
        create_markdown_artifact(note, key="draftloop-refresh")
    return json.loads(summary.model_dump_json())
