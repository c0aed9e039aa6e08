"""What a person reads in MLflow's registry: the one-line verdict, the leaderboard, the MLmodel, six tags.

A champion, then a weaker challenger, registered against a real SQLite MLflow (no engine, no flow).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import mlflow
import yaml
from fixtures_registry import drafter_card, fake_drafter

from draftloop.infra.registry.cards import MAX_VERSION_TAGS, target_label, verdict_line
from draftloop.infra.registry.figures import as_number, format_figure, format_percent, format_significant
from draftloop.infra.registry.gate import (
    CHAMPION_ALIAS,
    RESULTS_TAG,
    ChampionFigures,
    CycleResults,
    GateDecision,
    version_figures,
)
from draftloop.infra.registry.models import DRAFTER_FLAVOR, register_drafter
from draftloop.infra.registry.runs import Tracker
from draftloop.infra.runtime.config import GateConfig

GATE = GateConfig(min_speedup=None, min_acceptance_length=1.5, require_consistency=True, beat_champion=True)
SHA = "9f2c4e1ab3d5" + "0" * 52  # a 64-character content hash


def _results(length: float, speedup_c1: float) -> CycleResults:
    rate = (length - 1) / 3
    return CycleResults(
        acceptance_rate=rate,
        mean_acceptance_length=length,
        per_position_acceptance=[0.61, 0.4, 0.2],
        speedup={1: speedup_c1, 4: speedup_c1 * 0.8},
        throughput={1: 41.25, 4: 120.5},
        simulator_acceptance_rate=rate,
        consistent=True,
        speedup_status={1: "ok", 4: "inconclusive: [0.9, 1.4]"},
        recommended_k=2,
    )


def test_rejected_version_says_why_and_how_it_compares_in_one_line(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"), "registry-view")
    tracker.start_cycle("cycle", {}, {})
    target = tmp_path / "models" / "tiny-llama"
    target.mkdir(parents=True)
    card = drafter_card(target_label(str(target)), SHA)
    name = "drafter-view"

    def register(results: CycleResults, tag: str) -> dict[str, object]:
        with tracker.stage("register") as run:
            registration = register_drafter(
                tracker,
                run,
                name,
                GATE,  # type: ignore[arg-type]
                results,
                card,
                fake_drafter(tmp_path / tag),
                serving_command=lambda drafter: (
                    f"vllm serve {target} --drafter {drafter.removeprefix('file://')}"
                ),
            )
        return registration.to_dict()

    champion = register(_results(2.24, 1.9), "first")
    challenger = register(_results(1.8, 1.2), "second")
    client = tracker.client
    assert champion["alias_status"] == "champion" and challenger["alias_status"] == "rejected"
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == champion["version"]

    rejected = client.get_model_version(name, str(challenger["version"]))
    print("\n--- rejected version's description ---\n" + rejected.description)
    first_line = rejected.description.splitlines()[0]
    assert first_line == challenger["verdict"]
    # Figures first (the list cuts the description off), then the gate, then both versions' figures.
    assert first_line == (
        "AL 1.80 · 1.20x @ c=1 · vLLM 0.32.0 · rejected: mean acceptance length 1.80 does not beat "
        "champion v1's 2.24 · vs champion v1: AL 1.80 vs 2.24, 1.20x vs 1.90x @ c=1"
    )
    assert rejected.description.splitlines()[1] == ""  # the verdict stands alone as the list's excerpt
    assert (
        "| speedup @ concurrency 4 | 0.960x (120.5 tok/s) inconclusive: [0.9, 1.4] |" in rejected.description
    )
    assert "| acceptance rate | 26.7 % |" in rejected.description
    assert (
        "| engine vs simulator acceptance (same prompts and mix) | 26.7 % vs 26.7 % |" in rejected.description
    )
    assert "| champion at registration (v1) |" in rejected.description
    # What the version's tags no longer carry is in its description.
    assert (
        "| drafter | eagle3, aux layers [1, 3, 5] (layer_input), exported for vllm |" in rejected.description
    )
    assert f"| content hashes | data_hash {SHA[:12]} |" in rejected.description
    accepted = client.get_model_version(name, str(champion["version"])).description.splitlines()[0]
    assert accepted == "AL 2.24 · 1.90x @ c=1 · vLLM 0.32.0 · champion (the first)"

    # The registered model's own description: a leaderboard of both versions, newest first.
    leaderboard = client.get_registered_model(name).description
    print("\n--- registered model's description ---\n" + leaderboard)
    assert leaderboard.splitlines()[0].endswith("Champion: v1, AL 2.24, speedup 1.90x @ c=1 on vLLM 0.32.0.")
    rows = [line for line in leaderboard.splitlines() if re.match(r"\| v\d", line)]
    same = "vLLM 0.32.0 | tiny-llama | eagle3 |"
    assert rows == [
        f"| v2 | rejected | 1.80 | 26.7 % | 1.20x | 0.96x (inconclusive) | {same}",
        f"| v1 | champion | 2.24 | 41.3 % | 1.90x | 1.52x (inconclusive) | {same}",
    ]

    # The version's source is a logged MLflow model whose MLmodel says how to serve the drafter.
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=rejected.source, dst_path=str(tmp_path / "dl"), tracking_uri=tracker.tracking_uri
        )
    )
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"][DRAFTER_FLAVOR]
    assert flavor["serve_command"].startswith(f"vllm serve {target} --drafter /")
    assert flavor["serve_command"].endswith("/drafter") and (local / "drafter" / "config.json").exists()
    assert flavor["serve_command"] in rejected.description  # the description ends with the same command
    assert (flavor["engine"], flavor["engine_version"], flavor["aux_layer_ids"]) == (
        "vllm",
        "0.32.0",
        [1, 3, 5],
    )
    assert (flavor["layer_id_convention"], flavor["target"], flavor["num_speculative_tokens"]) == (
        "layer_input",
        "tiny-llama",
        2,
    )
    assert flavor["drafter_variant"] == "eagle3"
    # Logged once, as an output of the cycle's run (the runs list's Models column).
    run = client.get_run(str(tracker.parent_run_id))
    assert len(run.outputs.model_outputs) == 2  # one per registration above, each in the same cycle run
    assert len(client.list_artifacts(str(tracker.parent_run_id))) == 0  # no second copy as a run artifact
    figures = {
        metric.key: metric.value for metric in client.get_logged_model(str(champion["model_id"])).metrics
    }
    assert figures["mean_acceptance_length"] == 2.24 and figures["speedup_c1"] == 1.9

    # A row readable at a glance: six short tags, rounded, no absolute local paths.
    tags = rejected.tags
    assert len(tags) <= MAX_VERSION_TAGS
    assert tags == {
        "engine": "vllm",
        "AL": "1.80",
        "speedup_c1": "1.20x",
        "gate": "rejected",
        "target": "tiny-llama",
        "variant": "eagle3",
    }
    assert all(len(key) + len(value) <= 24 for key, value in tags.items()), tags
    # The rest is the logged model's: the card's facts, the gate's reasons, the results whole.
    logged = client.get_logged_model(str(challenger["model_id"])).tags
    assert logged["data_hash"] == SHA[:12] and logged["aux_layer_ids"] == "[1, 3, 5]"
    assert logged["engine_version"] == "0.32.0" and logged["layer_id_convention"] == "layer_input"
    assert "does not beat champion v1" in logged["gate_reasons"]
    assert CycleResults.from_dict(json.loads(logged[RESULTS_TAG])) == _results(1.8, 1.2)
    assert not [key for key, value in logged.items() if str(tmp_path) in value], logged
    # ... where the gate reads the champion's figures back from.
    figures = version_figures(client, name, CHAMPION_ALIAS)
    assert figures == ChampionFigures(version="1", mean_acceptance_length=2.24, speedup_c1=1.9)


def test_verdict_line_starts_with_figures_and_compares_both_figures() -> None:
    """Figures first, then the gate; a comparison shows both versions' figures, never a difference."""
    champion = ChampionFigures(version="3", mean_acceptance_length=2.0, speedup_c1=0.77)
    passed = GateDecision(passed=True, reasons=[], notes=[])
    inconsistent = GateDecision(passed=False, reasons=["engine acceptance 60.0 % disagrees"], notes=[])
    assert verdict_line(_results(2.31, 1.7), passed, "vLLM 0.32.0", champion) == (
        "AL 2.31 · 1.70x @ c=1 · vLLM 0.32.0 · champion · vs v3: AL 2.31 vs 2.00, 1.70x vs 0.77x @ c=1"
    )
    slower = verdict_line(_results(2.5, 0.4), inconsistent, "SGLang", champion)
    assert slower == (
        "AL 2.50 · 0.40x @ c=1 · SGLang · rejected: engine acceptance 60.0 % disagrees · "
        "vs champion v3: AL 2.50 vs 2.00, 0.40x vs 0.77x @ c=1"
    )
    assert "-0.37x" not in slower and "speedup -" not in slower
    flagged = dataclasses.replace(_results(2.36, 0.77), speedup_status={1: "inconclusive: [0.4, 1.3]"})
    assert verdict_line(flagged, passed, "vLLM 0.32.0", None) == (
        "AL 2.36 · 0.77x @ c=1 (inconclusive) · vLLM 0.32.0 · champion (the first)"
    )
    assert verdict_line(_results(1.6, 1.1), inconsistent, "SGLang", None) == (
        "AL 1.60 · 1.10x @ c=1 · SGLang · rejected: engine acceptance 60.0 % disagrees"
    )


def test_figures_read_the_same_wherever_they_are_shown() -> None:
    """The registry's, summary.md's, the log line's and the CLI's ways of writing a figure."""
    assert (format_figure(2.24567), format_figure(1.9, 2, "x"), format_figure(None)) == (
        "2.246",
        "1.90x",
        "n/a",
    )
    assert format_figure(240) == "240" and format_figure("lossless_consistent") == "lossless_consistent"
    assert (format_percent(0.26667), format_percent(0.61, 0), format_percent(None)) == (
        "26.7 %",
        "61 %",
        "n/a",
    )
    assert [format_significant(v) for v in (12.3456789, 1034.5678, 0.004567, 16)] == [
        "12.3",
        "1,035",
        "0.00457",
        "16",
    ]
    # `draftloop status`: numbers read back from JSON or metrics (ints too), a dash for anything else.
    assert [format_figure(as_number(v), 2, missing="-") for v in (2, 1.876, None, "x")] == [
        "2.00",
        "1.88",
        "-",
        "-",
    ]


def test_a_version_registered_before_the_record_is_read_from_its_old_tags() -> None:
    """Registries written before the six-tag rows keep working: their figures were version tags."""
    from draftloop.infra.registry.gate import _results_from_old_tags

    old = {"mean_acceptance_length": "2.240", "acceptance_rate": "0.413", "speedup_c1": "1.900"}
    old |= {"speedup_c4": "1.520", "speedup_c4_status": "inconclusive", "gate": "passed"}
    results = _results_from_old_tags(old)
    assert results is not None and results.mean_acceptance_length == 2.24
    assert results.speedup == {1: 1.9, 4: 1.52} and results.speedup_status[4] == "inconclusive"
    assert _results_from_old_tags({"engine": "vllm"}) is None


def test_the_consistency_reason_reads_in_percent_on_the_compared_figures() -> None:
    from draftloop.infra.registry.gate import evaluate_gate

    results = dataclasses.replace(
        _results(2.0, 1.0),
        acceptance_rate=0.454,
        compared_engine_acceptance_rate=0.45,
        simulator_acceptance_rate=0.12,
        consistent=False,
    )
    decision = evaluate_gate(GATE, results, champion_length=None)  # type: ignore[arg-type]
    assert "engine acceptance 45.0 % disagrees with the simulator's 12.0 % on the same prompts" in (
        "; ".join(decision.reasons)
    )
