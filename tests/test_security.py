"""Security: manifests that escape their folder, secrets redacted, exposed engine servers need a key,
remote code off by default. The cycle-level secrets test (slow) plants secrets and greps everything written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from fixtures_engine import engine_settings
from fixtures_flow import FlowEnv, drain_prefect_workers, run_cycle_in_process

from draftloop.infra.engines.base import EngineConfigError, ServerSpec, is_loopback
from draftloop.infra.engines.server import EngineServer
from draftloop.infra.engines.vllm import VllmEngine
from draftloop.infra.evaluation.benchmark import _Client
from draftloop.infra.runtime import storage
from draftloop.infra.runtime.config import ConfigError, ExperimentConfig
from draftloop.infra.runtime.redaction import (
    REDACTED,
    install_log_redaction,
    redact,
    redact_text,
    redacted_copy,
    secret_values,
)

# ---------------------------------------------------------------------------------------------------
# Manifests


@pytest.mark.parametrize("shard", ["../x", "../../etc/passwd", "/etc/passwd", "a/../../b", "..", "..\\x"])
def test_a_manifest_whose_shard_escapes_the_dataset_is_refused(tmp_path: Path, shard: str) -> None:
    uri = str(tmp_path / "ds")
    writer = storage.DatasetWriter(uri)
    writer.write_shard("shard-00000.bin", b"abc", rows=1)
    writer.commit("unit")
    manifest_path = Path(uri) / storage.MANIFEST_NAME
    raw = json.loads(manifest_path.read_text())
    raw["shards"][0]["name"] = shard  # as a tampered (or foreign) manifest would list it
    manifest_path.write_text(json.dumps(raw))
    with pytest.raises(storage.UnsafeShardNameError) as refused:
        storage.read_manifest(uri)
    assert str(manifest_path) in str(refused.value)
    assert repr(shard) in str(refused.value)
    assert refused.value.shard == shard


# ---------------------------------------------------------------------------------------------------
# Redaction

AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    ("text", "secret", "kept"),
    [
        (
            "postgresql://draft:s3cr3t-pw@127.0.0.1:5432/mlflow",
            "s3cr3t-pw",
            "postgresql://draft:***@127.0.0.1",
        ),
        (f"aws_access_key_id={AWS_KEY_ID}", AWS_KEY_ID, "aws_access_key_id="),
        (f'{{"aws_secret_access_key": "{AWS_SECRET}"}}', AWS_SECRET, '"aws_secret_access_key": "***"'),
        ("HF_TOKEN=hf_abcdefghijklmnop python x.py", "hf_abcdefghijklmnop", "python x.py"),
        ("serve --api-key sk-live-123456 --port 1", "sk-live-123456", "--port 1"),
        ("Authorization: Bearer abcdef123456", "abcdef123456", "Authorization: Bearer ***"),
        ("engine.api_key: sk-live-123456", "sk-live-123456", "engine.api_key: ***"),
    ],
)
def test_secrets_in_text_are_redacted(text: str, secret: str, kept: str) -> None:
    redacted = redact_text(text)
    assert secret not in redacted
    assert kept in redacted


def test_ordinary_values_are_not_redacted() -> None:
    text = "max_tokens=32 num_speculative_tokens: 3 cache_key=abc123def tokens/s 1.03e+03 http://127.0.0.1:8000/api"
    assert redact_text(text) == text
    tree = {"evaluation": {"max_tokens": 64}, "engine": {"api_key": None, "kind": "vllm"}}
    assert redact(tree) == tree
    # A drafter's or tokenizer's config (uploaded as artifacts) keeps its token ids and special tokens.
    model_config = {"pad_token_id": 0, "eos_token": "</s>", "thinking_token_budget": 64, "vocab_size": 8}
    assert redact(model_config) == model_config
    assert redact_text(json.dumps(model_config)) == json.dumps(model_config)


def test_a_config_tree_is_redacted_by_key_and_its_secrets_are_found() -> None:
    tree = {
        "engine": {
            "api_key": "sk-live-123456",
            "env": {"HF_TOKEN": "hf_abcdefghijklmnop", "OMP_NUM_THREADS": "2"},
            "extra_args": ["--api-key", "sk-other-987654", "--max-num-seqs", "4"],
        },
        "tracking": {"mlflow_uri": "postgresql://draft:s3cr3t-pw@127.0.0.1/mlflow"},
    }
    shown = redact(tree)
    assert shown["engine"]["api_key"] == REDACTED
    assert shown["engine"]["env"] == {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "2"}
    assert shown["engine"]["extra_args"] == ["--api-key", REDACTED, "--max-num-seqs", "4"]
    assert shown["tracking"]["mlflow_uri"] == "postgresql://draft:***@127.0.0.1/mlflow"
    assert sorted(secret_values(tree)) == ["hf_abcdefghijklmnop", "sk-live-123456", "sk-other-987654"]


def test_secret_environment_values_are_redacted_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    assert (
        redact_text(f"failed with credentials {AWS_SECRET} at s3://b/k")
        == "failed with credentials *** at s3://b/k"
    )


def test_uploaded_text_files_are_redacted_copies(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    (folder / "server.log").write_text("--api-key sk-live-123456\nready\n")
    (folder / "weights.safetensors").write_bytes(b"\x00sk-live-123456")  # binary: uploaded as is
    with redacted_copy(folder) as upload:
        assert upload != folder
        assert (upload / "server.log").read_text() == "--api-key ***\nready\n"
        assert (upload / "weights.safetensors").read_bytes() == b"\x00sk-live-123456"
    assert "sk-live-123456" in (folder / "server.log").read_text()  # the original is untouched
    clean = tmp_path / "clean.log"
    clean.write_text("nothing secret\n")
    with redacted_copy(clean) as upload:
        assert upload == clean


def test_prefect_run_log_records_are_redacted() -> None:
    install_log_redaction()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("prefect.flow_runs")
    handler = Keep()
    logger.addHandler(handler)
    try:
        try:
            raise RuntimeError("cannot connect to postgresql://draft:s3cr3t-pw@db/mlflow")
        except RuntimeError:
            logger.error("stage failed: %s", "token=abcdef123456", exc_info=True)
    finally:
        logger.removeHandler(handler)
    (record,) = records
    formatted = logging.Formatter().format(record)
    assert "abcdef123456" not in formatted and "s3cr3t-pw" not in formatted
    assert "stage failed: token=***" in formatted and "postgresql://draft:***@db" in formatted


def test_prefect_parameters_are_stored_redacted() -> None:
    from draftloop.flows.train_and_eval import train_and_eval

    stored = train_and_eval.serialize_parameters(
        {"config": "c.yaml", "overrides": {"engine.api_key": "sk-live-123456", "training.lr": 0.001}}
    )
    assert stored == {"config": "c.yaml", "overrides": {"engine.api_key": REDACTED, "training.lr": 0.001}}


# ---------------------------------------------------------------------------------------------------
# Engine servers: loopback unless configured; beyond it only with an API key


def _raw_config(tmp_path: Path, engine: dict[str, Any]) -> dict[str, Any]:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 32})
    )
    return {"name": "sec", "target": {"path": str(target)}, "engine": engine}


def test_engine_binds_loopback_by_default(tmp_path: Path) -> None:
    config = ExperimentConfig.from_dict(_raw_config(tmp_path, {}), check_environment=False)
    assert config.engine.host == "127.0.0.1"
    argv = VllmEngine(config.engine_settings()).server_command(ServerSpec(tmp_path, 8000))
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--api-key" not in argv


def test_an_exposed_engine_without_an_api_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine.api_key") as refused:
        ExperimentConfig.from_dict(_raw_config(tmp_path, {"host": "0.0.0.0"}), check_environment=False)
    assert "0.0.0.0" in str(refused.value)
    # The server refuses too, whoever builds its settings.
    server = EngineServer(VllmEngine(engine_settings(host="0.0.0.0")), tmp_path, tmp_path / "run")
    with pytest.raises(EngineConfigError) as no_key:
        server.start()
    assert no_key.value.field == "engine.api_key"
    assert server.process is None


def test_an_exposed_engine_gets_its_key_and_clients_send_it(tmp_path: Path) -> None:
    raw = _raw_config(tmp_path, {"host": "0.0.0.0", "api_key": "sk-live-123456"})
    settings = ExperimentConfig.from_dict(raw, check_environment=False).engine_settings()
    engine = VllmEngine(settings)
    argv = engine.server_command(ServerSpec(tmp_path, 8000))
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert "sk-live-123456" not in " ".join(argv)  # argv is visible to every user through ps
    assert engine.server_env(tmp_path)["VLLM_API_KEY"] == "sk-live-123456"
    client = _Client(
        "http://127.0.0.1:8000", "target", engine, max_tokens=4, timeout_s=5.0, width=1,
        num_speculative_tokens=None,
    )  # fmt: skip
    assert client.http.headers["Authorization"] == "Bearer sk-live-123456"
    assert EngineServer(engine, tmp_path, tmp_path / "run", port=8000).base_url == "http://127.0.0.1:8000"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


# ---------------------------------------------------------------------------------------------------
# Remote code


def test_trust_remote_code_is_off_unless_the_config_trusts_the_target(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftloop.infra.extraction import extractor
    from draftloop.infra.synthesis import generator

    config = ExperimentConfig.from_dict(_raw_config(tmp_path, {}), check_environment=False)
    assert config.target.trust_remote_code is False
    with (
        # Both actors load the target through the one loader (infra/targets/loaded.py), which takes
        # these classes from transformers when it loads.
        mock.patch.object(AutoTokenizer, "from_pretrained") as tokenizer,
        mock.patch.object(AutoModelForCausalLM, "from_pretrained") as model,
    ):
        generator.TargetGenerator(config.target.path, device="cpu")
        extractor.HiddenStateExtractor(config.target.path, [0, 1, 2], "layer_input", device="cpu")
    assert [call.kwargs["trust_remote_code"] for call in tokenizer.call_args_list] == [False, False]
    assert [call.kwargs["trust_remote_code"] for call in model.call_args_list] == [False, False]


# ---------------------------------------------------------------------------------------------------
# The real path: a cycle (to synthesize) with secrets planted in its config, overrides and environment


def _files_holding(roots: list[Path], secrets: dict[str, str]) -> list[str]:
    """`path: secret name` for every file under `roots` whose bytes contain a planted secret."""
    found = []
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                found += [f"{path}: {name}" for name, value in secrets.items() if value.encode() in data]
    return found


@pytest.mark.slow
def test_planted_secrets_reach_no_mlflow_record_prefect_record_or_run_file(
    flow_env: FlowEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    unique = uuid.uuid4().hex[:12]
    secrets = {
        "engine.api_key": f"sk-planted-{unique}",
        "engine.env.HF_TOKEN": f"hf_planted{unique}",
        "AWS_SECRET_ACCESS_KEY": f"awsPlanted/{unique}+Secret",
        "override engine.env.DB_PASSWORD": f"pw-planted-{unique}",
    }
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets["AWS_SECRET_ACCESS_KEY"])
    raw = yaml.safe_load(flow_env.config_path.read_text())
    raw["engine"]["api_key"] = secrets["engine.api_key"]
    raw["engine"]["env"] = {
        "HF_TOKEN": secrets["engine.env.HF_TOKEN"],
        "AWS_SECRET_ACCESS_KEY": secrets["AWS_SECRET_ACCESS_KEY"],
    }
    config_path = tmp_path / "secrets.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    overrides = {
        "data.num_samples": 4,
        "data.eval_prompts": 2,
        "synthesis.max_new_tokens": 8,
        "engine.env.DB_PASSWORD": secrets["override engine.env.DB_PASSWORD"],
    }
    # The test can fail: every planted value is in what the run is given.
    given = config_path.read_text() + json.dumps(overrides)
    assert all(value in given for value in secrets.values())

    drain_prefect_workers(timeout=10)  # workers of this session's server, not one an earlier test left
    summary, _ = run_cycle_in_process(
        dataclasses.replace(flow_env, config_path=config_path), overrides, until="synthesize"
    )
    assert summary["status"] == "completed"

    # MLflow (its store and artifact root), the run folder and datasets, the state folder (logs, records).
    workdir = flow_env.workdir
    written = [workdir / "mlflow.db", workdir / "mlartifacts", workdir / "runs", workdir / "state"]
    written += list(workdir.glob("mlflow.db-*"))  # a journal not yet checkpointed
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    run = client.get_run(summary["mlflow_run_id"])
    assert all(root.exists() for root in written)
    run_folder = Path(summary["run_folder"])
    assert (run_folder / "config.json").is_file()  # the files the secrets would be in were written
    assert [path for path in (workdir / "mlartifacts").rglob("config.json") if run.info.run_id in str(path)]
    assert _files_holding(written, secrets) == []
    assert run.data.params["engine.api_key"] == REDACTED  # the secret was logged, redacted
    assert run.data.params["engine.env.HF_TOKEN"] == run.data.params["engine.env.DB_PASSWORD"] == REDACTED

    # Prefect: the flow run's parameters, state and every log line it sent, and the run's artifacts.
    drain_prefect_workers(timeout=60)
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(uuid.UUID(summary["run_id"]))
        logs = prefect.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
        artifacts = prefect.read_artifacts()
    assert flow_run.parameters["overrides"]["engine.env.DB_PASSWORD"] == REDACTED
    assert any("synthesize: started" in log.message for log in logs), [log.message for log in logs]
    recorded = [json.dumps(flow_run.parameters), str(flow_run.state.message if flow_run.state else "")]
    recorded += [log.message for log in logs] + [str(artifact.data) for artifact in artifacts]
    leaks = [name for name, value in secrets.items() if any(value in text for text in recorded)]
    assert leaks == []
