"""`draftloop up`: the printed run command, the team profile's options, the light MLflow server and the
`gpus` concurrency limit that a stage holds while it runs."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.flows.cycle import TrainAndEvalParams
from draftloop.flows.pipeline import CYCLE
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.processes import is_alive
from draftloop.infra.runtime.services import GPU_LIMIT, Service, with_driver
from draftloop.infra.runtime.storage import DatasetWriter, Manifest
from draftloop.tasks.cache import StageOutcome
from draftloop.tasks.cycle import CycleContext
from draftloop.tasks.stage import Stage, StageRequest, execute

TEAM_VARIABLES = (
    "DRAFTLOOP_PREFECT_DATABASE_URL",
    "DRAFTLOOP_MLFLOW_DATABASE_URL",
    "DRAFTLOOP_MLFLOW_ARTIFACTS",
)


def gpu_config(**sections: dict[str, Any]) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"name": "gpu-test", "target": {"path": "/unused"}, **sections})


def test_each_stage_asks_for_the_whole_gpus_of_its_ray_requests() -> None:
    config = gpu_config(
        training={"num_workers": 2, "num_gpus_per_worker": 1},
        extraction={"num_actors": 3, "num_gpus_per_actor": 0.5},
        synthesis={"num_gpus": 1},
        engine={"num_gpus": 4},
    )
    counts = {stage.name: stage.gpu_slots(config) for stage in CYCLE.stages}
    assert counts == {"synthesize": 1, "extract": 2, "train": 2, "evaluate": 4, "register": 0}
    engine_data = gpu_config(
        synthesis={"backend": "engine"}, extraction={"backend": "engine"}, engine={"num_gpus": 2}
    )
    slots = {stage.name: stage.gpu_slots(engine_data) for stage in CYCLE.stages}
    assert slots["synthesize"] == slots["extract"] == 2
    assert CYCLE.stage("train").gpu_slots(gpu_config()) == 0  # a CPU config takes no slot


def test_database_urls_get_each_servers_driver() -> None:
    assert (
        with_driver("postgresql://u:p@db:5432/prefect", "asyncpg")
        == "postgresql+asyncpg://u:p@db:5432/prefect"
    )
    assert with_driver("postgres+psycopg2://db/mlflow", "psycopg") == "postgresql+psycopg://db/mlflow"
    with pytest.raises(ValueError, match="not a PostgreSQL URL"):
        with_driver("sqlite:///x.db", "asyncpg")


def _fake_up(seen: dict[str, Any]) -> Any:
    def start(root: Path, **options: Any) -> dict[str, Service]:
        seen.update(options)
        return {
            "prefect-server": Service("prefect-server", 11, "http://127.0.0.1:4200", "s.log"),
            "mlflow": Service("mlflow", 12, "http://127.0.0.1:5000", "m.log"),
        }

    return start


def _fake_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The experiment's pages without a server (the slow test below creates them through one)."""
    from draftloop.commands.services import ExperimentPages

    def pages(mlflow_url: str, team: object) -> ExperimentPages:
        return ExperimentPages("draftloop", f"{mlflow_url}/#/experiments/7/runs", f"{mlflow_url}/#/models/m")

    monkeypatch.setattr("draftloop.commands.services.experiment_pages", pages)


def _printed_run_command(output: str) -> list[str]:
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("env PREFECT_API_URL=")]
    assert len(lines) == 1, output
    return shlex.split(lines[0])


def test_up_prints_a_copy_paste_command_for_a_small_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("draftloop.commands.services.start_services", _fake_up(seen))
    _fake_pages(monkeypatch)
    result = CliRunner().invoke(app, ["up", "--gpus", "2", "--no-worker"])
    assert result.exit_code == 0, result.output
    # The pages people open: the experiment's runs and the registered model, not MLflow's root.
    assert (
        "MLflow runs of experiment 'draftloop': http://127.0.0.1:5000/#/experiments/7/runs" in result.output
    )
    assert "http://127.0.0.1:5000/#/models/m" in result.output
    assert seen["experiment"] == "draftloop"
    assert seen["team"] is None and seen["gpus"] == 2 and seen["start_worker"] is False
    words = _printed_run_command(result.output)
    assert words[:2] == ["env", "PREFECT_API_URL=http://127.0.0.1:4200/api"]
    assert Path(words[2]).is_absolute() and Path(words[2]).name == "prefect" and Path(words[2]).exists()
    assert words[3:6] == ["deployment", "run", "train-and-eval/train-and-eval"]
    params = json.loads(words[words.index("--params") + 1])
    assert params["num_samples"] <= 32 and params["epochs"] <= 2
    TrainAndEvalParams(**params)  # every key is a field of the form
    assert f"`{GPU_LIMIT}`: 2 slots" in result.output


def test_team_profile_takes_its_backends_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("draftloop.commands.services.start_services", _fake_up(seen))
    monkeypatch.setenv("DRAFTLOOP_PREFECT_DATABASE_URL", "postgresql://team:s3cret@db:5432/prefect")
    monkeypatch.setenv("DRAFTLOOP_MLFLOW_DATABASE_URL", "postgresql://team:s3cret@db:5432/mlflow")
    monkeypatch.setenv("DRAFTLOOP_MLFLOW_ARTIFACTS", "s3://team-bucket/mlartifacts")
    _fake_pages(monkeypatch)
    result = CliRunner().invoke(app, ["up", "--profile", "team", "--gpus", "0"])
    assert result.exit_code == 0, result.output
    team = seen["team"]
    assert team.prefect_database_url.endswith("@db:5432/prefect")
    assert team.mlflow_database_url.endswith("@db:5432/mlflow")
    assert team.mlflow_artifacts == "s3://team-bucket/mlartifacts"
    assert "s3cret" not in result.output  # the database password is never printed
    params = json.loads((words := _printed_run_command(result.output))[words.index("--params") + 1])
    # The worker's runs track into the team's MLflow, not the shipped config's local SQLite file.
    assert params["overrides"] == {"tracking.mlflow_uri": "http://127.0.0.1:5000"}
    TrainAndEvalParams(**params)


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        ({}, "--prefect-database-url (or DRAFTLOOP_PREFECT_DATABASE_URL) is required"),
        (
            {
                "DRAFTLOOP_PREFECT_DATABASE_URL": "mysql://db/prefect",
                "DRAFTLOOP_MLFLOW_DATABASE_URL": "postgresql://db/m",
            },
            "--prefect-database-url (or DRAFTLOOP_PREFECT_DATABASE_URL): not a PostgreSQL URL",
        ),
        (
            {
                "DRAFTLOOP_PREFECT_DATABASE_URL": "postgresql://db/p",
                "DRAFTLOOP_MLFLOW_DATABASE_URL": "postgresql://db/m",
            },
            "--mlflow-artifacts (or DRAFTLOOP_MLFLOW_ARTIFACTS) is required",
        ),
    ],
)
def test_team_profile_without_its_backends_is_a_user_error(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], named: str
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("draftloop.commands.services.start_services", _fake_up(seen))
    for variable in TEAM_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(app, ["up", "--profile", "team"], terminal_width=200)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.replace("│", " ").split())  # rich's error box, unwrapped
    assert named in message, result.output
    assert not seen  # nothing was started


def _process_tree(leader: int) -> list[tuple[int, str, int]]:
    """(pid, command line, RSS in KiB) of every live process in `leader`'s process group."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != leader or fields[0] == "Z":
                continue
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (proc / "status").read_text()
        except (OSError, IndexError):
            continue
        rss_kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        found.append((int(proc.name), command, rss_kib))
    return found


class _StageRun:
    """What a stage run asks of its MLflow run, kept in memory."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        pass

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        pass


class _Tracker:
    @contextmanager
    def stage(self, stage: str) -> Iterator[_StageRun]:
        yield _StageRun()


class _NoFigures(BaseModel):
    pass


def _gpu_stage(work: Callable[[], object], on_outcome: Callable[[], object] = lambda: None) -> Stage:
    """A stage declared with the train stage's GPUs: `work()` runs where a real stage does its work;
    `on_outcome()` runs inside the stage, on a cache hit too."""

    def produce(request: StageRequest) -> Manifest:
        work()
        writer = DatasetWriter(request.work.uri)
        return writer.commit("gpu-stage", inputs=request.work.inputs, summary={})

    return Stage(
        name="gpu-stage",
        produce=produce,
        summary=_NoFigures,
        sections=("training",),
        gpus=CYCLE.stage("train").gpus,
        on_outcome=lambda ctx, outcome: on_outcome(),
    )


def _gpu_context(tmp_path: Path) -> CycleContext:
    config = gpu_config(
        training={"num_workers": 2, "num_gpus_per_worker": 1}, storage={"root": str(tmp_path / "store")}
    )
    return CycleContext(config, "run-1", _Tracker(), str(tmp_path / "run"))  # type: ignore[arg-type]


def test_a_stage_that_runs_holds_its_gpus_and_a_cache_hit_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []

    @contextmanager
    def recording_hold(count: int) -> Iterator[None]:
        events.append(f"take {count}")
        yield
        events.append(f"release {count}")

    monkeypatch.setattr("draftloop.tasks.stage.hold_gpus", recording_hold)
    context = _gpu_context(tmp_path)
    stage = _gpu_stage(lambda: events.append("work"), lambda: events.append("outcome"))
    first: StageOutcome = execute(stage, context)
    second: StageOutcome = execute(stage, context)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert events == ["take 2", "work", "outcome", "release 2", "outcome"]


def _active_slots(api: str) -> int:
    slots: int = httpx.get(f"{api}/v2/concurrency_limits/{GPU_LIMIT}", timeout=30).json()["active_slots"]
    return slots


@pytest.mark.slow
def test_up_starts_a_light_mlflow_and_the_gpu_limit_a_stage_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.concurrency.services import ConcurrencySlotAcquisitionWithLeaseService
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from draftloop.infra.runtime.services import down, read_services, up

    monkeypatch.setenv("DRAFTLOOP_STATE_DIR", str(tmp_path / "state"))
    started = time.monotonic()
    try:
        services = up(
            tmp_path,
            mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db",
            artifact_root=str(tmp_path / "mlartifacts"),
            start_worker=False,
            deploy=False,
            gpus=2,
        )
        assert set(services) == {"prefect-server", "mlflow"}
        print(f"up: {time.monotonic() - started:.1f} s")

        # The MLflow server answers its REST API, with one worker and no job runner or Huey consumers.
        mlflow = services["mlflow"]
        created = httpx.post(
            f"{mlflow.url}/api/2.0/mlflow/experiments/create", json={"name": "up-test"}, timeout=30
        )
        assert created.status_code == 200, created.text
        found = httpx.get(
            f"{mlflow.url}/api/2.0/mlflow/experiments/get-by-name",
            params={"experiment_name": "up-test"},
            timeout=30,
        )
        assert found.json()["experiment"]["experiment_id"] == created.json()["experiment_id"]
        # A tracker of the SQLite file the server serves logs through the server (UI links), and the
        # root page opens the UI in model-training mode on the experiment (infra/runtime/mlflow_landing.py).
        from draftloop.infra.registry.runs import Tracker

        tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "mlartifacts"), "draftloop")
        assert tracker.tracking_uri == mlflow.url
        root = httpx.get(f"{mlflow.url}/", timeout=30).text
        assert '"mlflow.workflowType_v1"' in root and '"\\"machine_learning\\""' in root
        assert f"#/experiments/{tracker.experiment_id}/runs" in root
        tree = _process_tree(mlflow.pid)
        commands = [command for _, command, _ in tree]
        assert not any("huey" in command for command in commands), commands
        assert len(tree) <= 2, commands  # the server and its one uvicorn worker
        rss_mib = sum(rss for _, _, rss in tree) / 1024
        print(f"MLflow server tree: {len(tree)} processes, RSS {rss_mib:.0f} MiB")
        assert rss_mib < 1200  # with the job runner on: ~2000 MiB

        # `up` created the `gpus` limit; a stage that asks for 2 GPUs holds both slots while it runs.
        api = f"{services['prefect-server'].url}/api"
        limit = httpx.get(f"{api}/v2/concurrency_limits/{GPU_LIMIT}", timeout=30).json()
        assert (limit["limit"], limit["active_slots"]) == (2, 0)
        context = _gpu_context(tmp_path)
        held: list[int] = []
        stage = _gpu_stage(lambda: None, lambda: held.append(_active_slots(api)))

        with temporary_settings(updates={PREFECT_API_URL: api}):
            execute(stage, context)
            after = _active_slots(api)
            execute(stage, context)  # a cache hit: its outcome comes from storage
        assert held == [2, 0]  # held while running; a cache hit waits for no GPU
        assert after == 0  # released when the stage ended
        print(f"up + checks: {time.monotonic() - started:.1f} s")
    finally:
        ConcurrencySlotAcquisitionWithLeaseService.drain_all(timeout=10, at_exit=False)
        recorded = read_services(tmp_path)
        stopped = down(tmp_path)
        for service in recorded.values():
            assert not is_alive(service.pid), service
    assert set(stopped) == {"prefect-server", "mlflow"}
