"""What people read about a drafter in MLflow's registry: its card, the tags of a version, the one-line
verdict, the description table and the registered model's leaderboard.

All of it is prose built from `CycleResults`, `GateDecision` and the champion's figures (gate.py); the
leaderboard is rebuilt from the versions' tags, so it never disagrees with them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient

from draftloop.infra.registry.figures import format_figure, format_percent
from draftloop.infra.registry.gate import (
    ChampionFigures,
    CycleResults,
    GateDecision,
    current_champion,
    tag_float,
)

# How the registry names an engine kind for people (the kind itself stays the `engine` tag).
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
SHORT_HASH = 12  # characters of a content hash shown in tags


def engine_label(kind: str, version: str | None) -> str:
    """`vLLM 0.32.0`; the bare name when the version is unknown."""
    name = ENGINE_NAMES.get(kind, kind)
    return name if not version or version == "unknown" else f"{name} {version}"


def target_label(target: str) -> str:
    """The target as people name it: a hub id as is, a local folder by its name (no absolute paths)."""
    path = Path(target)
    return path.name if path.is_absolute() or path.exists() else target


@dataclass(frozen=True)
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
        f"| acceptance rate | {format_percent(results.acceptance_rate)} |",
        f"| simulator acceptance rate | {format_percent(results.simulator_acceptance_rate)} |",
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


REGISTERED_MODEL_INTRO = "EAGLE-3 drafters trained by draftloop."
_LEADERBOARD_ROWS = 50  # newest versions shown; the rest stay in the versions list


def _speedup_cell(tags: Mapping[str, str], concurrency: int) -> str:
    value = tag_float(tags, f"speedup_c{concurrency}")
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
            f"AL {format_figure(tag_float(tags, 'mean_acceptance_length'), 2)}, "
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
            format_figure(tag_float(tags, "mean_acceptance_length"), 2),
            format_percent(tag_float(tags, "acceptance_rate")),
            *(_speedup_cell(tags, c) for c in concurrencies),
            engine_label(tags.get("engine", "-"), tags.get("engine_version")),
            tags.get("target", "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(versions) > _LEADERBOARD_ROWS:
        lines += ["", f"{len(versions) - _LEADERBOARD_ROWS} older versions are in the versions list."]
    lines += ["", "Rebuilt at every registration from the versions' tags."]
    return "\n".join(lines) + "\n"
