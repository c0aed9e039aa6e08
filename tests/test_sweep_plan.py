"""A sweep's plan (grid, list, the checks before anything runs), its winner and its comparison (CPU, seconds).

The sweep itself, with a real engine, a kill and a re-run, is tests/test_sweep.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prefect.utilities.callables import parameter_schema

from draftloop.infra.registry.gate import CycleResults
from draftloop.infra.registry.sweep_report import (
    VariantResult,
    comparison_markdown,
    comparison_rows,
    winner,
    write_comparison_plot,
)
from draftloop.infra.runtime.config import ConfigError, GateConfig
from draftloop.infra.runtime.sweeps import parse_grid, plan_sweep, read_variant_list

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(REPO_ROOT / "configs" / "tiny-llama.yaml")


def test_the_grid_is_every_combination_then_the_list_without_repeats() -> None:
    grid = parse_grid(["training.lr=1e-3,3e-3", "training.ttt_length=5,7"])
    assert grid == {"training.lr": [0.001, 0.003], "training.ttt_length": [5, 7]}
    plan = plan_sweep(
        CONFIG,
        {"data.num_samples": 32},
        grid,
        [{"training.lr": 0.001, "training.ttt_length": 5}, {"training.lr": 0.01}],
    )
    assert [variant.label for variant in plan.variants] == [
        "training.lr=0.001,training.ttt_length=5",
        "training.lr=0.001,training.ttt_length=7",
        "training.lr=0.003,training.ttt_length=5",
        "training.lr=0.003,training.ttt_length=7",
        "training.lr=0.01",
    ]
    assert plan.swept_keys == ("training.lr", "training.ttt_length")
    base = plan.check()
    assert base.data.num_samples == 32
    assert plan.variant_config(plan.variants[3]).training.ttt_length == 7
    # The same sweep has the same key (a re-run finds its records); another base config another one.
    listed = [{"training.lr": 0.001, "training.ttt_length": 5}, {"training.lr": 0.01}]
    assert plan.key == plan_sweep(CONFIG, {"data.num_samples": 32}, grid, listed).key
    assert plan.key != plan_sweep(CONFIG, {"data.num_samples": 64}, grid, [{"training.lr": 0.01}]).key


def test_list_values_survive_the_grid_syntax() -> None:
    grid = parse_grid(["extraction.aux_layer_ids=[1,2,3],[0,2,4]"])
    assert grid == {"extraction.aux_layer_ids": [[1, 2, 3], [0, 2, 4]]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["training.lr"], "expected key=value1,value2"),
        (["training.lr=1e-3,1e-3"], "repeats a value"),
        (["training.lr=1e-3", "training.lr=2e-3"], "given twice"),
    ],
)
def test_a_bad_grid_is_refused_by_name(options: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        parse_grid(options)
    assert refused.value.field == "--grid"


def test_one_variant_is_not_a_sweep() -> None:
    with pytest.raises(ConfigError, match="at least two variants"):
        plan_sweep(CONFIG, {}, parse_grid(["training.lr=1e-3"]))


def test_a_variant_the_config_refuses_is_named_before_anything_runs() -> None:
    plan = plan_sweep(CONFIG, {}, parse_grid(["training.lr=1e-3,3e-3", "training.ttt_length=5,0"]))
    with pytest.raises(ConfigError) as refused:
        plan.check()
    assert refused.value.field == "training.ttt_length"
    assert "sweep variant training.lr=0.001,training.ttt_length=0" in refused.value.reason


def test_a_variant_list_names_the_file_and_line(tmp_path: Path) -> None:
    good = tmp_path / "variants.jsonl"
    good.write_text('{"training.lr": 0.001}\n\n{"training.lr": 0.002}\n')
    assert read_variant_list(good) == [{"training.lr": 0.001}, {"training.lr": 0.002}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"training.lr": 0.001}\n{"training.lr": \n')
    with pytest.raises(ConfigError) as refused:
        read_variant_list(bad)
    assert refused.value.field == f"{bad}:2"
    listed = tmp_path / "variants.yaml"
    listed.write_text("- {training.lr: 0.001}\n- training.ttt_length: 5\n")
    assert read_variant_list(listed) == [{"training.lr": 0.001}, {"training.ttt_length": 5}]
    listed.write_text("training.lr: 0.001\n")
    with pytest.raises(ConfigError, match="list of non-empty mappings"):
        read_variant_list(listed)


def test_the_cli_refuses_a_bad_variant_with_exit_2_and_creates_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftloop",
            "sweep",
            CONFIG,
            "--grid",
            "training.lr=1e-3,-1",
            "--set",
            f"storage.root={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "DRAFTLOOP_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    assert "training.lr" in result.stderr and "sweep variant training.lr=-1" in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def _variant(
    label: str, length: float | None, speedup: float, consistent: bool = True, status: str = "completed"
) -> VariantResult:
    results = CycleResults(
        acceptance_rate=None if length is None else (length - 1) / 3,
        mean_acceptance_length=length,
        speedup={1: speedup},
        speedup_status={1: "ok"},
        consistent=consistent,
        lossless=True,
        simulator_acceptance_rate=0.5,
    )
    return VariantResult(
        key=label,
        label=f"training.lr={label}",
        overrides={"training.lr": float(label)},
        status=status,
        verdict="ok" if consistent else "integration_fault",
        results=results.to_dict(),
    )


def test_the_winner_is_the_gates_measure_among_the_variants_whose_figures_hold() -> None:
    gate = GateConfig(min_acceptance_length=1.5, min_speedup=None, require_consistency=True)
    variants = [
        _variant("0.001", 2.1, 0.5),
        _variant("0.002", 2.6, 0.4, consistent=False),  # the highest AL, but an integration fault
        _variant("0.003", 2.4, 0.3),
        _variant("0.004", 1.2, 0.9),  # below min_acceptance_length: the gate refuses it at registration
        _variant("0.005", None, 0.0, status="failed"),
    ]
    best = winner(variants)
    assert best is not None and best.label == "training.lr=0.003"
    rows = comparison_rows(variants, gate, best)
    assert [row["winner"] for row in rows] == ["", "", "yes", "", ""]
    assert rows[0]["gate"] == rows[2]["gate"] == "passes"
    assert "disagrees with the simulator" in rows[1]["gate"]
    assert "< min_acceptance_length 1.5" in rows[3]["gate"]
    assert rows[4]["gate"].startswith("the variant's cycle failed")
    assert (
        rows[2]["AL"] == "2.40" and rows[2]["acceptance"] == "46.7 %" and rows[2]["speedup @ c=1"] == "0.30x"
    )
    markdown = comparison_markdown("sweep", variants, gate, best)
    assert "**Winner: training.lr=0.003**" in markdown and markdown.count("\n| ") == 6
    # Ties on AL go to the faster one; nothing eligible, no winner.
    tie = winner([_variant("0.1", 2.0, 0.5), _variant("0.2", 2.0, 0.7)])
    assert tie is not None and tie.label == "training.lr=0.2"
    # A weak but sound variant still wins (the gate then rejects it); an unsound one never does.
    weak = winner([_variant("0.1", 1.0, 0.5), _variant("0.2", 2.0, 0.7, consistent=False)])
    assert weak is not None and weak.label == "training.lr=0.1"
    assert winner([_variant("0.2", 2.0, 0.7, consistent=False)]) is None


def test_the_comparison_plot_is_a_png(tmp_path: Path) -> None:
    variants = [_variant("0.001", 2.1, 0.5), _variant("0.003", 2.4, 0.3)]
    path = write_comparison_plot(variants, tmp_path / "comparison.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_the_sweep_form_is_typed() -> None:
    from draftloop.flows.sweep import sweep

    fields = parameter_schema(sweep).model_dump_for_openapi()["properties"]
    assert set(fields) == {"config", "config_path", "grid", "variants", "overrides", "parallel"}
    assert fields["grid"]["type"] == "object" and fields["variants"]["type"] == "array"
    assert (fields["parallel"]["minimum"], fields["parallel"]["maximum"]) == (1, 16)
    assert sorted(fields["config"]["enum"]) == sorted(
        str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "configs").glob("*.yaml")
    )
    for name, field in fields.items():
        assert field.get("description") and field.get("title"), name


def test_deploy_reads_the_sweep_form_from_source() -> None:
    """`prefect deploy` builds the schema from the entrypoint's source: the same typed form."""
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    from draftloop.flows.sweep import sweep

    imported = parameter_schema(sweep).model_dump_for_openapi()["properties"]
    from_source = parameter_schema_from_entrypoint(
        str(REPO_ROOT / "flows" / "sweep.py") + ":sweep"
    ).model_dump_for_openapi()["properties"]
    assert from_source == imported
