"""The train-and-eval flow: stage caching, MLflow records, the online cycle (the real flow, tiny target).

A SIGKILL mid-training and its resume to the same drafter: tests/test_faults.py (the kill chain).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures_flow import FlowEnv, run_cycle_in_process

pytestmark = pytest.mark.slow


def _manifest(uri: str) -> Any:
    from draftloop.infra.runtime.storage import read_manifest

    return read_manifest(uri)


def test_second_run_hits_every_stage_cache(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float]
) -> None:
    first, first_seconds = first_cycle
    assert first["status"] == "completed"
    assert first["cache_hits"] == []
    assert first["stages"], "no stage ran"

    second, second_seconds = run_cycle_in_process(flow_env)
    assert second["status"] == "completed"
    assert sorted(second["cache_hits"]) == sorted(first["stages"])
    for stage, timing in first["stages"].items():
        assert second["stages"][stage]["uri"] == timing["uri"]
    assert second_seconds < 0.1 * first_seconds, (first_seconds, second_seconds)

    # summary.json was written in the run folder, and MLflow tags each nested run with its cache status.
    written = json.loads(Path(second["run_folder"], "summary.json").read_text())
    assert written["cache_hits"] == second["cache_hits"]
    from mlflow.tracking import MlflowClient

    config = yaml_config(flow_env)
    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    assert experiment is not None
    children = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{second['mlflow_run_id']}'",
    )
    assert {run.data.tags["draftloop.stage"] for run in children} == set(first["stages"])
    assert all(run.data.tags["draftloop.cache_hit"] == "true" for run in children)
    parent = client.get_run(second["mlflow_run_id"])
    assert parent.data.params["training.epochs"] == "2"
    assert parent.info.status == "FINISHED"


def yaml_config(env: FlowEnv, overrides: dict[str, Any] | None = None) -> Any:
    from draftloop.infra.runtime.config import ExperimentConfig

    return ExperimentConfig.load(env.config_path, overrides or {})


def test_full_cycle_records_results_registry_and_artifacts(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float]
) -> None:
    """The uncached cycle on tiny-llama with the real vLLM (CPU): summary.json, MLflow runs, registry."""
    summary, _ = first_cycle
    written = json.loads(Path(summary["run_folder"], "summary.json").read_text())
    assert written["status"] == "completed"
    assert 0.0 <= written["acceptance_rate"] <= 1.0
    assert written["mean_acceptance_length"] >= 1.0
    assert len(written["per_position_acceptance"]) == 3  # engine.num_speculative_tokens
    assert sorted(written["speedup"]) == ["1", "4"]
    assert all(value > 0 for value in written["speedup"].values())
    assert written["consistent"] is not None
    from draftloop.infra.runtime.storage import read_shard

    report = json.loads(read_shard(_manifest(summary["stages"]["evaluate"]["uri"]), "eval_report.json"))
    assert report["drafter_variant"] == "eagle3.1 (fc_norm, norm_output)"  # the session config's layer
    served = json.loads((Path(report["drafter"]) / "config.json").read_text())
    assert (served["fc_norm"], served["norm_output"]) == (True, True)
    registered = written["registered_model"]
    assert registered["name"] == "drafter-flow-test"
    assert registered["alias_status"] in {"champion", "rejected"}
    assert registered["champion"] == registered["gate"]["passed"]

    from mlflow.tracking import MlflowClient

    config = yaml_config(flow_env)
    client = MlflowClient(tracking_uri=config.tracking.mlflow_uri, registry_uri=config.tracking.mlflow_uri)
    version = client.get_model_version(registered["name"], registered["version"])
    assert "| mean acceptance length |" in (version.description or "")
    # A row readable at a glance: six short tags; the card's facts on the logged model.
    assert set(version.tags) == {"engine", "AL", "speedup_c1", "gate", "target", "variant"}, version.tags
    assert version.tags["engine"] == "vllm" and version.tags["variant"] == "eagle3.1"
    model_tags = client.get_logged_model(registered["model_id"]).tags
    assert model_tags["layer_id_convention"] == "layer_input"
    assert json.loads(model_tags["aux_layer_ids"]) == [1, 3, 5]
    if registered["champion"]:
        assert (
            str(client.get_model_version_by_alias(registered["name"], "champion").version)
            == registered["version"]
        )
    else:
        assert model_tags["gate_reasons"]  # the reason is recorded
    experiment = client.get_experiment_by_name(config.tracking.experiment)
    assert experiment is not None
    stages = {
        run.data.tags["draftloop.stage"]: run
        for run in client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'",
        )
    }
    assert set(stages) == {"synthesize", "extract", "train", "evaluate", "register"}
    assert stages["synthesize"].data.metrics["rows_per_s"] > 0
    assert stages["extract"].data.metrics["tokens_per_s"] > 0
    train_id = stages["train"].info.run_id
    assert len(client.get_metric_history(train_id, "loss")) == 6  # 2 epochs x 3 steps
    assert len(client.get_metric_history(train_id, "acc_2")) == 6  # per-position accuracy per step
    assert {item.path for item in client.list_artifacts(train_id, "plots")} == {"plots/training_curves.png"}
    # The drafter is stored once: the registered version's MLflow model (MLmodel + drafter/), not train's run.
    assert not client.list_artifacts(train_id, "drafter")
    model_files = {item.path for item in client.list_logged_model_artifacts(registered["model_id"])}
    assert {"MLmodel", "drafter"} <= model_files
    assert (version.description or "").splitlines()[0] == registered["verdict"]
    cycle_metrics = client.get_run(summary["mlflow_run_id"]).data.metrics  # the runs list's columns
    assert cycle_metrics["gate_passed"] == float(registered["champion"]) and "speedup_c1" in cycle_metrics
    evaluate_metrics = stages["evaluate"].data.metrics
    for key in (
        "speedup.c1",
        "speculative.c4.output_tokens_per_s",
        "baseline.c1.ttft_s.p50",
        "engine.acceptance_rate",
    ):
        assert key in evaluate_metrics, key
    evaluate_id = stages["evaluate"].info.run_id
    assert len(client.list_artifacts(evaluate_id, "plots")) >= 2
    logs = {Path(item.path).name for item in client.list_artifacts(evaluate_id, "engine_logs")}
    assert {"server-baseline.log", "server-speculative.log"} <= logs


def test_online_cycle_streams_hidden_states_and_stores_none(
    flow_env: FlowEnv, first_cycle: tuple[dict[str, Any], float]
) -> None:
    """`extraction.mode: online` on two Ray Train workers (gloo DDP): no extract stage, the train stage
    streams from producers to both; served and judged like the offline drafter (the same samples in the
    same order, gradients averaged over the workers: the same acceptance)."""
    first, _ = first_cycle
    # One concurrency level, no repeats: the figure compared here is the prompt pass's acceptance.
    light_evaluation = {
        "evaluation.concurrency": [1],
        "evaluation.repeats": 1,
        "evaluation.warmup_rounds": 0,
        "evaluation.min_output_tokens": 0,
        "evaluation.min_seconds": 0,
    }
    root = Path(yaml_config(flow_env).storage.root) / "flow-test"
    extracted_before = sorted((root / "extract").iterdir())
    online = {"extraction.mode": "online", "training.num_workers": 2}
    summary, _ = run_cycle_in_process(flow_env, {**online, **light_evaluation})
    stages = summary["stages"]
    assert list(stages) == ["synthesize", "train", "evaluate", "register"]
    assert stages["synthesize"]["cache_hit"]
    train = _manifest(stages["train"]["uri"]).summary
    stream = train["stream"]
    assert stream["mode"] == "online" and stream["hidden_state_bytes_stored"] == 0
    assert (
        stream["spilled_bytes"] == 0
        and 0 < stream["peak_object_store_bytes"] <= stream["max_bytes_in_flight"]
    )
    training = stream["samples"] - train["held_out_samples"]
    assert train["trained_per_sample"] == [{"1": training}] * train["epochs"]
    assert train["workers"] == 2
    from draftloop.infra.runtime.storage import read_shard

    history = json.loads(read_shard(_manifest(stages["train"]["uri"]), "training_history.json"))["history"]
    # Steps do not depend on the worker count: 8 samples per step over both workers, 3 steps per epoch.
    assert len(history) == 2 * 3 and history[-1]["loss"] < history[0]["loss"]
    # No hidden state stored: no new extract dataset, and beside them only drafters.
    assert sorted((root / "extract").iterdir()) == extracted_before
    stored = {path.name for path in root.rglob("*.safetensors") if (root / "extract") not in path.parents}
    assert stored == {"model.safetensors"}
    written = json.loads(Path(summary["run_folder"], "summary.json").read_text())
    assert written["status"] == "completed" and written["consistent"] is True
    assert abs(written["mean_acceptance_length"] - first["mean_acceptance_length"]) <= 0.05
