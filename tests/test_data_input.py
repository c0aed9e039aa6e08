"""The prompt data users bring (infra/synthesis/prompts.py): three formats as JSONL or parquet, local or S3,
bad rows named by file, line and reason, set aside or fatal per `data.on_bad_row`, checked by
`config validate`."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from moto_s3 import moto_s3_server
from typer.testing import CliRunner

from draftloop.cli import app
from draftloop.commands.run import bad_input_behind
from draftloop.infra.runtime.config import ExperimentConfig
from draftloop.infra.runtime.storage import read_shard, storage_options, write_bytes_atomic
from draftloop.infra.synthesis.conversations import (
    REJECTED_SHARD,
    SynthesisResult,
    first_turns,
    read_conversations,
)
from draftloop.infra.synthesis.prompts import DataError, input_fingerprint, read_input
from draftloop.tasks import synthesize
from draftloop.tasks.cache import StageError, StageWork, cache_key, stage_uri
from draftloop.tasks.stage import StageRequest

TINY_LLAMA = Path(__file__).resolve().parent.parent / "configs" / "tiny-llama.yaml"

PROMPT_ROWS: list[dict[str, Any]] = [
    {"id": "p1", "prompt": "Say hi."},
    {"id": 2, "prompt": "Count to 3.", "category": "math"},
]
SHAREGPT_ROWS: list[dict[str, Any]] = [
    {
        "id": "s1",
        "conversations": [
            {"from": "system", "value": "Be terse."},
            {"from": "human", "value": "Name a color."},
            {"from": "gpt", "value": "Red."},
            {"from": "human", "value": "Another?"},
        ],
    },
    {"id": "s2", "conversations": [{"from": "human", "value": "Hello?"}]},
]
OPENAI_ROWS: list[dict[str, Any]] = [
    {
        "id": "o1",
        "messages": [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Greet me."},
        ],
    },
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    columns = list(dict.fromkeys(key for row in rows for key in row))  # a field absent from a row is null
    pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows]), path)
    return path


def _lines(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("writer", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_prompt_format(tmp_path: Path, writer: Any) -> None:
    # a parquet column has one type: string ids there; JSONL also takes integer ids
    rows = PROMPT_ROWS if writer is _jsonl else [{**row, "id": str(row["id"])} for row in PROMPT_ROWS]
    source = writer(tmp_path / f"p.{'jsonl' if writer is _jsonl else 'parquet'}", rows)
    data = read_input(str(source))
    assert data.rows == [
        {"id": "p1", "prompt": "Say hi."},
        {"id": "2", "prompt": "Count to 3.", "category": "math"},
    ]
    assert data.formats == {str(source): "prompt"} and data.rejected == []


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_sharegpt_format_keeps_system_and_turns(tmp_path: Path, suffix: str) -> None:
    writer = _jsonl if suffix == "jsonl" else _parquet
    source = writer(tmp_path / f"s.{suffix}", SHAREGPT_ROWS)
    data = read_input(str(source))
    assert data.formats == {str(source): "sharegpt"}
    first, second = data.rows
    assert first["prompt"] == "Name a color."
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "user"]
    assert first["messages"][0] == {"role": "system", "content": "Be terse."}
    assert second == {"id": "s2", "prompt": "Hello?"}  # one user turn: a plain prompt


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_openai_format_keeps_system_prompt(tmp_path: Path, suffix: str) -> None:
    rows = (
        OPENAI_ROWS if suffix == "jsonl" else [{"id": "o1", **OPENAI_ROWS[0]}, {"id": "o2", **OPENAI_ROWS[1]}]
    )
    writer = _jsonl if suffix == "jsonl" else _parquet
    source = writer(tmp_path / f"o.{suffix}", rows)
    data = read_input(str(source), data_format="openai")
    assert data.rows[0]["messages"][0] == {"role": "system", "content": "You are a pirate."}
    assert data.rows[0]["prompt"] == "Greet me."
    assert data.rows[1]["id"] == ("o-2" if suffix == "jsonl" else "o2")  # no id: file stem and line
    # the one-turn (in-process) answer keeps the system prompt in the conversation it writes
    assert first_turns(data.rows[0]) == data.rows[0]["messages"]
    result = SynthesisResult()
    result.add_answer(data.rows[0], "Ahoy!", None)
    assert [m["role"] for m in result.conversations[0]["messages"]] == ["system", "user", "assistant"]


def test_builtin_prompts() -> None:
    data = read_input("builtin")
    assert len(data.rows) >= 300 and data.rejected == [] and list(data.formats.values()) == ["prompt"]
    assert len({row["prompt"] for row in data.rows}) == len(data.rows)


def test_folder_of_mixed_formats_detected_per_file(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", PROMPT_ROWS)
    _parquet(folder / "b.parquet", SHAREGPT_ROWS)
    _jsonl(folder / "c.jsonl", OPENAI_ROWS)
    (folder / "notes.txt").write_text("ignored")
    data = read_input(str(folder))
    assert sorted(data.formats.values()) == ["openai", "prompt", "sharegpt"]
    assert len(data.rows) == 6 and data.summary()["input_rows"] == 6


def test_named_format_refuses_rows_of_another(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", PROMPT_ROWS)
    with pytest.raises(DataError) as raised:
        read_input(str(source), data_format="sharegpt", on_bad_row="fail")
    assert str(raised.value) == (
        f"{source}:line 1: 'conversations' is missing (sharegpt format: a list of turns)"
    )


def test_s3_jsonl_and_parquet(tmp_path: Path) -> None:
    with moto_s3_server(buckets=("data",)) as endpoint:
        options = storage_options(endpoint)
        write_bytes_atomic("s3://data/in/a.jsonl", _as_bytes(PROMPT_ROWS), options)
        _parquet(tmp_path / "b.parquet", OPENAI_ROWS[:1])
        write_bytes_atomic("s3://data/in/b.parquet", (tmp_path / "b.parquet").read_bytes(), options)
        single = read_input("s3://data/in/a.jsonl", options=options)
        assert [row["id"] for row in single.rows] == ["p1", "2"]
        both = read_input("s3://data/in", options=options)
        assert sorted(both.formats.values()) == ["openai", "prompt"] and len(both.rows) == 3
        # edited in place on S3: the fingerprint (from ETags, no data read) changes, so does the stage key
        before = input_fingerprint("s3://data/in", options)
        assert input_fingerprint("s3://data/in", options) == before
        write_bytes_atomic("s3://data/in/a.jsonl", _as_bytes(PROMPT_ROWS[:1]), options)
        assert input_fingerprint("s3://data/in", options) != before


def _as_bytes(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


GOOD = b'{"id": "ok1", "prompt": "fine"}'
BAD_ROWS = [
    (b'{"id": "x", "prompt": "trunc', "invalid JSON: Unterminated string starting at (column 23)"),
    (b'{"id": "x", "prompt": "caf\xe9"}', "invalid UTF-8 at column 27"),
    (b'["a", "list"]', "expected a JSON object, got list"),
    (b"42", "expected a JSON object, got int"),
    (b'{"id": "x"}', "missing 'prompt' (prompt format)"),
    (b'{"id": "x", "prompt": ""}', "'prompt' is empty (prompt format)"),
    (b'{"id": "x", "prompt": "   "}', "'prompt' is empty (prompt format)"),
    (b'{"id": "x", "prompt": null}', "'prompt' is null (prompt format)"),
    (b'{"id": "x", "prompt": 7}', "'prompt' must be a string, got int (prompt format)"),
    (b'{"id": null, "prompt": "p"}', "'id' must be a string or an integer"),
    (b'{"id": "", "prompt": "p"}', "'id' is empty"),
    (b'{"id": "ok1", "prompt": "again"}', "duplicate id 'ok1' (first at {source}:line 1)"),
    (
        b'{"id": "x", "messages": [{"role": "wizard", "content": "hi"}]}',
        "unknown role 'wizard' in turn 1 (known: assistant, developer, system, user)",
    ),
    (
        b'{"id": "x", "conversations": [{"from": "human"}]}',
        "missing 'value' in turn 1",
    ),
    (
        b'{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}',
        "conversation has no user turn",
    ),
    (b'{"id": "x", "messages": []}', "'messages' is empty or not a list (openai format: a list of turns)"),
    (b'{"id": "x", "messages": ["hi"]}', "turn 1 is not an object"),
    (b'{"id": "x", "prompt": "p", "category": 3}', "'category' must be a string when given"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_ROWS, ids=[r for _, r in BAD_ROWS])
def test_bad_row_fails_with_file_line_and_reason(tmp_path: Path, line: bytes, reason: str) -> None:
    # a file's format is detected from its first row: a conversation row stands alone in its file
    if b"messages" in line or b"conversations" in line:
        source, where = _lines(tmp_path / "in.jsonl", line), "line 1"
    else:
        source, where = _lines(tmp_path / "in.jsonl", GOOD, line), "line 2"
    with pytest.raises(DataError) as raised:
        read_input(str(source), on_bad_row="fail")
    assert str(raised.value) == f"{source}:{where}: {reason.format(source=source)}"


def test_mixed_corpus_keeps_every_valid_row(tmp_path: Path) -> None:
    good = [json.dumps({"id": f"g{i}", "prompt": f"question {i}"}).encode() for i in range(40)]
    bad = [line for line, _ in BAD_ROWS[:3]]
    source = _lines(
        tmp_path / "mixed.jsonl", *good[:10], bad[0], *good[10:25], b"", bad[1], *good[25:], bad[2]
    )
    data = read_input(str(source))  # 3 of 43 rejected: under the default fraction
    assert [row["id"] for row in data.rows] == [f"g{i}" for i in range(40)]
    assert [(r["where"], r["reason"].split(":")[0]) for r in data.rejected] == [
        ("line 11", "invalid JSON"),
        ("line 28", "invalid UTF-8 at column 27"),
        ("line 44", "expected a JSON object, got list"),
    ]
    assert data.summary() == {
        "input_rows": 43,
        "input_accepted": 40,
        "input_rejected": 3,
        "input_formats": ["prompt"],
    }
    with pytest.raises(DataError) as raised:
        read_input(str(source), max_rejected_fraction=0.05)
    assert str(raised.value) == (
        f"{source}: 3 of 43 rows rejected, more than data.max_rejected_fraction=0.05; first: "
        f"{source}:line 11: {BAD_ROWS[0][1]}"
    )


def test_no_usable_row_and_missing_file(tmp_path: Path) -> None:
    source = _lines(tmp_path / "bad.jsonl", b"not json")
    with pytest.raises(DataError, match=r"holds no usable rows \(1 rejected; first: .*line 1: invalid JSON"):
        read_input(str(source), max_rejected_fraction=1.0)
    with pytest.raises(DataError, match="line 1: row has no 'prompt', 'messages' or 'conversations' field"):
        read_input(str(_lines(tmp_path / "shapeless.jsonl", b'{"id": "x"}', GOOD)), on_bad_row="fail")
    with pytest.raises(DataError, match=r"absent\.jsonl: no such file"):
        read_input(str(tmp_path / "absent.jsonl"))


def test_a_data_error_behind_a_stage_failure_is_a_user_error() -> None:
    error = DataError("in.jsonl", "line 3", "invalid JSON")
    try:
        try:
            raise error
        except DataError as cause:
            raise StageError("synthesize", "failed") from cause
    except StageError as stage_error:
        assert bad_input_behind(stage_error) is error


def _validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *sets: str) -> tuple[int, str, str]:
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY_LLAMA, tmp_path / "cfg.yaml")
    args = ["config", "validate", "cfg.yaml", "--set", f"engine.python={sys.executable}"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.stdout, result.stderr


def test_config_validate_reads_the_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _lines(tmp_path / "in.jsonl", GOOD, b'{"id": "x", "prompt": "caf\xe9"}')
    code, out, err = _validate(tmp_path, monkeypatch, f"data.prompts={source}", "data.on_bad_row=fail")
    assert code == 2 and out == ""
    assert err == f"data error: {source}:line 2: invalid UTF-8 at column 27\n"
    assert "Traceback" not in err
    code, out, err = _validate(
        tmp_path, monkeypatch, f"data.prompts={source}", "data.max_rejected_fraction=0.5"
    )
    assert code == 0 and "prompts:" in out
    assert err.splitlines() == [
        "data: 1 rows (prompt), 1 rejected",
        f"  rejected {source}:line 2: invalid UTF-8 at column 27",
    ]


def test_run_with_bad_data_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _lines(tmp_path / "in.jsonl", GOOD, b'{"id": "x", "prompt": "trunc')
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY_LLAMA, tmp_path / "cfg.yaml")
    sets = [f"engine.python={sys.executable}", f"data.prompts={source}", "data.on_bad_row=fail"]
    result = CliRunner().invoke(app, ["run", "cfg.yaml", *(arg for item in sets for arg in ("--set", item))])
    assert result.exit_code == 2
    assert result.stderr == f"data error: {source}:line 2: {BAD_ROWS[0][1]}\n" and result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "in.jsonl"]  # no service started


def _stage_key(config: ExperimentConfig) -> str:
    """The synthesize stage's cache key, from its declaration."""
    stage = synthesize.STAGE
    return cache_key(stage.name, config, stage.sections, {}, stage.key_fields(config))[0]


def run_synthesize(config: ExperimentConfig) -> Any:
    """The synthesize stage's work itself (no cache, no MLflow run): its committed manifest."""
    stage = synthesize.STAGE
    key, inputs = cache_key(stage.name, config, stage.sections, {}, stage.key_fields(config))
    work = StageWork(stage.name, key, stage_uri(config, stage.name, key), inputs)
    return stage.produce(StageRequest(config, work, {}, SimpleNamespace(pids=None), None))  # type: ignore[arg-type]


def test_synthesize_manifest_counts_input_rows_and_keeps_rejects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zoo_target_dir: Any
) -> None:
    """Synthesis (target and generation faked: no model) records what the input held in its manifest, and
    the set-aside input rows in rejected.jsonl with file, line and reason."""
    good = [json.dumps({"id": f"g{i}", "prompt": f"question {i}"}).encode() for i in range(20)]
    source = _lines(tmp_path / "mixed.jsonl", *good[:5], b'{"id": "g0", "prompt": "dup"}', *good[5:])
    config = ExperimentConfig.load(
        TINY_LLAMA,
        {
            "engine.python": sys.executable,
            "storage.root": str(tmp_path / "runs"),
            "data.prompts": str(source),
            "data.eval_prompts": 4,
        },
        base_dir=tmp_path,
    )

    def answer_all(_config: Any, _target: str, prompts: list[dict[str, Any]], _pids: Any) -> SynthesisResult:
        time.sleep(0.5)  # loading the target: start-up, not generation
        result = SynthesisResult(seconds=0.25)
        for prompt in prompts:
            result.add_answer(prompt, f"answer to {prompt['id']}", None)
        return result

    target = str(zoo_target_dir("tiny-llama"))  # its tokenizer measures the prompts; nothing generates
    monkeypatch.setattr(synthesize, "ensure_target", lambda _config: target)
    monkeypatch.setattr(synthesize, "_generate_in_process", answer_all)
    manifest = run_synthesize(config)
    assert manifest.summary["input_rows"] == 21 and manifest.summary["input_rejected"] == 1
    assert manifest.summary["input_formats"] == ["prompt"] and manifest.summary["rows"] == 16
    # rates over the generation alone (16 rows in 0.25 s), the rest of the stage's time is start-up
    assert manifest.summary["rows_per_s"] == 64.0 and manifest.summary["generation_seconds"] == 0.25
    assert manifest.summary["startup_seconds"] >= 0.25
    assert [c["id"] for c in read_conversations(manifest)] == [f"g{i}" for i in range(16)]
    rejected = [json.loads(line) for line in read_shard(manifest, REJECTED_SHARD).decode().splitlines()]
    assert rejected == [
        {
            "id": "g0",
            "source": str(source),
            "where": "line 6",
            "reason": f"duplicate id 'g0' (first at {source}:line 1)",
            "kind": "duplicate id",
        }
    ]
    # every rejection counted by kind; 16 conversations of data.num_samples=256: a shortfall, warned
    assert manifest.summary["rejected_reasons"] == {"duplicate id": 1}
    assert manifest.summary["requested"] == 256 and manifest.summary["shortfall"] == 240
    (warning,) = manifest.summary["warnings"]
    assert warning == (
        "data.num_samples=256 but 16 training conversations were made (240 short): 16 training prompts were "
        "left of 21 rows (1 rejected on input, 0 by the length policy, 4 held out for evaluation)"
    )


def test_edited_prompts_change_the_synthesize_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(_as_bytes(PROMPT_ROWS))
    config = ExperimentConfig.load(
        TINY_LLAMA,
        {
            "data.prompts": str(prompts),
            "storage.root": str(tmp_path / "runs"),
            "target.path": str(tmp_path / "t"),
        },
        check_environment=False,
    )
    keys: list[str] = [_stage_key(config), _stage_key(config)]
    prompts.write_bytes(_as_bytes([*PROMPT_ROWS, {"id": "p3", "prompt": "One more."}]))
    keys.append(_stage_key(config))
    assert keys[0] == keys[1] != keys[2]  # same files: the cache hits; edited file: synthesized again
    # the bundled prompts are keyed by content, so every checkout shares them
    assert input_fingerprint("builtin") == input_fingerprint("builtin")

    # a target folder of the user's (no zoo recipe): weights replaced in place are a new key too
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"old weights")
    own_target = config.model_copy(update={"target": config.target.model_copy(update={"create": None})})
    keys += [_stage_key(own_target), _stage_key(own_target)]
    (target / "model.safetensors").write_bytes(b"new weights!")
    keys.append(_stage_key(own_target))
    assert keys[3] == keys[4] != keys[5] and keys[3] != keys[2]


# OpenAI-style turns under `conversations` (a common export), with a system turn and a bad row among them.
ROLE_CONTENT_ROWS: list[dict[str, Any]] = [
    {
        "id": f"rc{i}",
        "conversations": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ],
    }
    for i in range(30)
]


@pytest.mark.parametrize("data_format", ["auto", "sharegpt", "openai"])
def test_role_content_turns_under_conversations_are_read(tmp_path: Path, data_format: str) -> None:
    bad = {"id": "bad", "conversations": [{"role": "user"}]}
    source = _jsonl(tmp_path / "rc.jsonl", [*ROLE_CONTENT_ROWS, bad])
    data = read_input(str(source), data_format=data_format)
    assert [row["id"] for row in data.rows] == [f"rc{i}" for i in range(30)]  # every valid row kept
    assert data.rows[3]["prompt"] == "Question 3?"
    assert [m["role"] for m in data.rows[3]["messages"]] == ["system", "user", "assistant"]
    (rejected,) = data.rejected
    assert rejected["reason"] == "missing 'content' in turn 1" and rejected["kind"] == "missing content"
    # ShareGPT turns under `messages` too, and a role that neither shape knows is still refused
    mixed = _jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"id": "m1", "messages": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
            {"id": "m2", "conversations": [{"role": "wizard", "content": "hi"}]},
        ],
    )
    mixed_data = read_input(str(mixed), data_format=data_format, max_rejected_fraction=0.5)
    assert [row["prompt"] for row in mixed_data.rows] == ["Hi?"]
    assert mixed_data.rejected[0]["reason"].startswith("unknown role 'wizard' in turn 1 (known: assistant")


@pytest.mark.parametrize(
    ("row", "looks_like"),
    [
        ({"instruction": "Sum 2 and 2.", "input": "", "output": "4"}, "an Alpaca-style"),
        ({"question": "Why?", "answer": "Because."}, "a question-answer row"),
        ({"text": "Once upon a time"}, "a plain-text corpus row"),
        ({"dialog": [{"role": "user", "content": "hi"}]}, "its turns are under 'dialog'"),
    ],
)
def test_a_row_in_no_format_says_which_it_looks_like(
    tmp_path: Path, row: dict[str, Any], looks_like: str
) -> None:
    source = _jsonl(tmp_path / "other.jsonl", [row])
    with pytest.raises(DataError) as raised:
        read_input(str(source), on_bad_row="fail")
    message = str(raised.value)
    assert message.startswith(f"{source}:line 1: row has no 'prompt', 'messages' or 'conversations' field; ")
    assert f"it looks like {looks_like}" in message
    # in a prompt-format file, the same row's missing prompt says it too
    with pytest.raises(DataError, match=r"missing 'prompt' \(prompt format\); it looks like"):
        read_input(str(_jsonl(tmp_path / "p.jsonl", [PROMPT_ROWS[0], row])), on_bad_row="fail")
    shapeless = _jsonl(tmp_path / "shapeless.jsonl", [{"id": "x", "colour": "blue"}])
    with pytest.raises(DataError, match=r"field \(its fields: colour, id\)$"):
        read_input(str(shapeless), on_bad_row="fail")
