"""The team profile: the cycle against a Ray cluster, Prefect and MLflow on PostgreSQL, S3 storage.

Real servers on 127.0.0.1: moto (S3), PostgreSQL (one database for Prefect, one for MLflow),
`draftloop up --profile team`'s Prefect server and MLflow server (artifacts proxied to the S3 bucket),
and a Ray head started with `ray start`. The flow runs up to `train` against that Prefect API with
nothing but config overrides pointing at the rest; the test then reads back what each server holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_services import create_database, postgres_bin_dir, postgres_server, ray_head
from fixtures_flow import FlowEnv, drain_prefect_workers, small_config
from moto_s3 import moto_s3_server
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftloop.infra.runtime.services import TeamBackends

pytestmark = pytest.mark.slow

BUCKET = "draftloop-cluster"
STAGES_RUN = ["synthesize", "extract", "train"]


def _cluster_config(workdir: Path, target_dir: Path) -> Path:
    """The flow tests' small config, with storage/tracking/ray back at the shipped local defaults.

    So a run that ignored the cluster overrides would write under `workdir/.draftloop` (checked below).
    """
    shipped: dict[str, Any] = yaml.safe_load(
        (Path(__file__).parent.parent / "configs/tiny-llama.yaml").read_text()
    )
    config = small_config(workdir, target_dir)
    config["name"] = "cluster-test"
    for section in ("storage", "tracking", "ray"):
        config[section] = shipped[section]
    path = workdir / "cluster-test.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def team_services(root: Path, backends: TeamBackends) -> Iterator[tuple[str, str]]:
    """`draftloop up --profile team` without worker or deployments; yields (Prefect API, MLflow URL)."""
    from draftloop.infra.runtime.processes import is_alive
    from draftloop.infra.runtime.services import down, read_services, up

    try:
        services = up(root, team=backends, start_worker=False, deploy=False, gpus=1)
        yield f"{services['prefect-server'].url}/api", str(services["mlflow"].url)
    finally:
        recorded = read_services(root)
        down(root)
        assert not [service for service in recorded.values() if is_alive(service.pid)], recorded


def _postgres_rows(database_uri: str, query: str, *parameters: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(database_uri) as connection:
        return connection.execute(query, parameters).fetchall()


def _actor_classes(address: str) -> list[str]:
    """Class names of every actor the cluster's GCS has seen (live or dead), read by a fresh driver."""
    import ray
    import ray._private.state as ray_state

    ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        actors: dict[str, Any] = ray_state.actors()
        return [str(info.get("ActorClassName", "")) for info in actors.values()]
    finally:
        ray.shutdown()


@pytest.mark.skipif(postgres_bin_dir() is None, reason="PostgreSQL is not installed (.ci/run installs it)")
def test_team_profile_cycle_on_a_cluster_with_postgresql_and_s3(
    flow_env: FlowEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    config_path = _cluster_config(workdir, flow_env.workdir / "models" / "tiny-llama")

    monkeypatch.setenv("DRAFTLOOP_STATE_DIR", str(tmp_path / "state"))  # the services' PIDs and logs
    with moto_s3_server(buckets=(BUCKET,)) as s3_endpoint, postgres_server() as server_uri:
        prefect_db = create_database(server_uri, "prefect")
        mlflow_db = create_database(server_uri, "mlflow")
        backends = TeamBackends(prefect_db, mlflow_db, f"s3://{BUCKET}/mlartifacts", s3_endpoint)
        # An events worker left by an earlier test in this process would keep its old client: start fresh.
        drain_prefect_workers(timeout=10)
        with (
            team_services(tmp_path, backends) as (prefect_api, mlflow_uri),
            ray_head(tmp_path) as (ray_address, ray_env),
            temporary_settings(updates={PREFECT_API_URL: prefect_api}),
        ):
            try:
                summary = _run_cycle_and_check(
                    config_path, s3_endpoint, mlflow_uri, ray_address, ray_env, monkeypatch
                )
            finally:  # while the team's server still runs: later tests' flows get workers of their own
                drain_prefect_workers()
            # Prefect: the flow run, its stage task runs and the `gpus` limit live in PostgreSQL.
            flow_runs = _postgres_rows(
                prefect_db, "SELECT state_type FROM flow_run WHERE id = %s", summary["run_id"]
            )
            assert flow_runs == [("COMPLETED",)], flow_runs
            # Task runs reach the server as events, written asynchronously: wait for them a little.
            deadline = time.monotonic() + 60
            while True:
                task_runs = _postgres_rows(
                    prefect_db,
                    "SELECT name, state_type FROM task_run WHERE flow_run_id = %s",
                    summary["run_id"],
                )
                done = {name.split("-")[0] for name, state in task_runs if state == "COMPLETED"}
                if done >= set(STAGES_RUN) or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert {name.split("-")[0] for name, _ in task_runs} == set(STAGES_RUN), task_runs
            assert all(state == "COMPLETED" for _, state in task_runs), task_runs
            limits = _postgres_rows(prefect_db, 'SELECT name, "limit" FROM concurrency_limit_v2')
            assert limits == [("gpus", 1)], limits
            # MLflow: the cycle's parent run is a row of MLflow's own database.
            runs = _postgres_rows(
                mlflow_db, "SELECT status FROM runs WHERE run_uuid = %s", summary["mlflow_run_id"]
            )
            assert runs == [("FINISHED",)], runs

    # Nothing fell back to the shipped local defaults in the working folder.
    assert not (workdir / ".draftloop").exists(), sorted(str(p) for p in (workdir / ".draftloop").rglob("*"))


def _run_cycle_and_check(
    config_path: Path,
    s3_endpoint: str,
    mlflow_uri: str,
    ray_address: str,
    ray_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    """The cycle up to `train` on the cluster; checks what S3, MLflow and Ray hold; returns its summary."""
    for key, value in ray_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # the cluster keeps token auth on

    from draftloop.flows.train_and_eval import train_and_eval

    summary: dict[str, Any] = train_and_eval(
        until="train",
        config_path=str(config_path),
        num_samples=16,
        overrides={
            "storage.root": f"s3://{BUCKET}/runs",
            "storage.s3_endpoint_url": s3_endpoint,
            "tracking.mlflow_uri": mlflow_uri,
            "ray.address": ray_address,
            "training.epochs": 1,
        },
    )

    assert summary["status"] == "completed", summary
    assert list(summary["stages"]) == STAGES_RUN
    assert summary["cache_hits"] == []

    # Storage: every stage's committed manifest, the drafter checkpoint and the summary are in S3.
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    for stage in STAGES_RUN:
        uri = summary["stages"][stage]["uri"]
        assert uri.startswith(f"s3://{BUCKET}/runs/cluster-test/{stage}/"), uri
        assert fs.exists(f"{uri}/manifest.json"), uri
    drafter_uri = summary["stages"]["train"]["uri"]
    assert fs.size(f"{drafter_uri}/model.safetensors") > 0
    assert fs.exists(f"{drafter_uri}/config.json")
    assert summary["run_folder"].startswith(f"s3://{BUCKET}/runs/")
    assert fs.exists(f"{summary['run_folder']}/summary.json")

    # MLflow: the parent run, its nested stage runs and the training curve, through the server.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["training.epochs"] == "1"
    assert parent.data.params["ray.address"] == ray_address
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_stage = {run.data.tags["draftloop.stage"]: run for run in children}
    assert set(by_stage) == set(STAGES_RUN)
    assert all(run.info.status == "FINISHED" for run in children)
    losses = client.get_metric_history(by_stage["train"].info.run_id, "loss")
    assert losses and all(entry.value > 0 for entry in losses)
    # Artifacts went through the server into the bucket, not into a folder on this machine.
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:"), parent.info.artifact_uri
    artifact_objects = fs.find(f"{BUCKET}/mlartifacts")
    assert any(key.endswith("/config.json") for key in artifact_objects), artifact_objects
    assert any(key.endswith("/manifest.json") for key in artifact_objects), artifact_objects

    # Ray: the stages' actors ran on the cluster this test started.
    classes = _actor_classes(ray_address)
    assert "TargetGenerator" in classes, classes
    assert "HiddenStateExtractor" in classes, classes
    assert any("TrainWorker" in name or "Train" in name for name in classes), classes
    return summary
