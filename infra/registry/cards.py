"""What people read about a drafter in MLflow's registry: its card, the six tags of a version, the
one-line verdict, the description table and the registered model's leaderboard.

A version's row shows six short tags (`version_tags`): engine, AL, speedup @ c=1, gate, target, variant.
Everything else the card knows (engine version, layer ids and their convention, content hashes), the
gate's reasons and the results themselves live on the version's logged model (`model_tags`, and its
MLmodel, models.py), where the gate and the leaderboard read them back (gate.read_version). All of it is
prose built from `CycleResults`, `GateDecision` and the champion's figures (gate.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient

from draftloop.infra.registry.figures import format_figure, format_percent
from draftloop.infra.registry.gate import (
    RESULTS_TAG,
    ChampionFigures,
    CycleResults,
    GateDecision,
    VersionRecord,
    current_champion,
    read_version,
)

# How the registry names an engine kind for people (the kind itself stays the `engine` tag).
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
SHORT_HASH = 12  # characters of a content hash shown on the logged model
MAX_VERSION_TAGS = 6  # what MLflow's versions list shows of a row without cutting it off


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
    variant: str = "eagle3"  # the drafter variant (training.drafter: eagle3, eagle3.1)
    origin: str | None = None  # what chose it, when not a lone cycle: "winner of sweep ab12cd34 (4 variants)"

    @property
    def engine_label(self) -> str:
        return engine_label(self.engine, self.engine_version)

    def tags(self) -> dict[str, str]:
        """Everything the card knows, as the logged model's tags (not the version's: version_tags)."""
        return {
            "target": self.target,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "variant": self.variant,
            "aux_layer_ids": json.dumps(self.aux_layer_ids),
            "layer_id_convention": self.layer_id_convention,
            "convention_exported": self.convention_exported,
            **{key: value[:SHORT_HASH] for key, value in self.hashes.items()},
            **({"origin": self.origin} if self.origin else {}),
        }

    def provenance_rows(self) -> list[tuple[str, str]]:
        """The card's facts as description rows (what the version's tags leave out)."""
        ids = "-" if self.aux_layer_ids is None else json.dumps(self.aux_layer_ids)
        rows = [
            ("drafter", f"{self.variant}, aux layers {ids} ({self.layer_id_convention}), "
                        f"exported for {self.convention_exported}"),
        ]  # fmt: skip
        if self.origin:
            rows.append(("origin", self.origin))
        if self.hashes:
            hashes = ", ".join(f"{key} {value[:SHORT_HASH]}" for key, value in self.hashes.items())
            rows.append(("content hashes", hashes))
        return rows


def speedup_text(results: CycleResults, concurrency: int = 1) -> str:
    """`0.77x`, `0.77x (inconclusive)` (a flagged figure), `n/a`."""
    speedup = results.speedup.get(concurrency)
    if speedup is None:
        return "n/a"
    status = results.speedup_status.get(concurrency, "ok")
    return f"{speedup:.2f}x" + ("" if status == "ok" else f" ({status.split(':')[0]})")


def version_tags(card: DrafterCard, results: CycleResults, gate: str) -> dict[str, str]:
    """The version's row: engine, AL, speedup @ c=1, gate, target, variant (MAX_VERSION_TAGS, short)."""
    return {
        "engine": card.engine,
        "AL": format_figure(results.mean_acceptance_length, 2),
        "speedup_c1": speedup_text(results),
        "gate": gate,
        "target": card.target,
        "variant": card.variant,
    }


def model_tags(results: CycleResults, decision: GateDecision | None = None) -> dict[str, str]:
    """What the logged model keeps beyond the card: the results whole (gate.read_version reads them) and
    the gate's decision."""
    tags = {RESULTS_TAG: json.dumps(results.to_dict(), sort_keys=True)}
    if results.recommended_k is not None:
        tags["num_speculative_tokens"] = str(results.recommended_k)
    if decision is not None:
        tags["gate"] = "passed" if decision.passed else "rejected"
        if decision.reasons:
            tags["gate_reasons"] = "; ".join(decision.reasons)
        if decision.notes:
            tags["gate_notes"] = "; ".join(decision.notes)
    return tags


def headline(results: CycleResults, engine: str) -> str:
    """`AL 2.36 · 0.77x @ c=1 (inconclusive) · vLLM 0.32.0`: what a description starts with."""
    speedup = results.speedup.get(1)
    shown = "speedup n/a @ c=1" if speedup is None else f"{speedup:.2f}x @ c=1"
    status = results.speedup_status.get(1, "ok")
    if speedup is not None and status != "ok":
        shown += f" ({status.split(':')[0]})"
    return f"AL {format_figure(results.mean_acceptance_length, 2)} · {shown} · {engine}"


def comparison(results: CycleResults, champion: ChampionFigures) -> str:
    """Both figures, never their difference: `AL 1.80 vs 2.24, 0.40x vs 0.77x @ c=1`."""
    text = (
        f"AL {format_figure(results.mean_acceptance_length, 2)} vs "
        f"{format_figure(champion.mean_acceptance_length, 2)}"
    )
    if results.speedup.get(1) is not None or champion.speedup_c1 is not None:
        text += (
            f", {format_figure(results.speedup.get(1), 2, 'x')} vs "
            f"{format_figure(champion.speedup_c1, 2, 'x')} @ c=1"
        )
    return text


def verdict_line(
    results: CycleResults, decision: GateDecision, engine: str, champion: ChampionFigures | None
) -> str:
    """The description's first line, what the registry's versions list shows, figures first:
    `AL 2.31 · 1.70x @ c=1 · vLLM 0.32.0 · champion · vs v3: AL 2.31 vs 2.00, 1.70x vs 1.50x @ c=1`.
    A rejected version names the gate's reasons after its figures."""
    head = "champion" if decision.passed else f"rejected: {'; '.join(decision.reasons)}"
    line = f"{headline(results, engine)} · {head}"
    if champion is None:
        return line + (" (the first)" if decision.passed else "")
    return f"{line} · vs {'' if decision.passed else 'champion '}v{champion.version}: " + comparison(
        results, champion
    )


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
    engine_rate, simulator_rate = results.engine_rate_compared, results.simulator_acceptance_rate
    compared = f"{format_percent(engine_rate)} vs {format_percent(simulator_rate)}"
    lines += [
        f"| mean acceptance length | {format_figure(results.mean_acceptance_length)} tokens/step |",
        f"| acceptance rate | {format_percent(results.acceptance_rate)} |",
        f"| engine vs simulator acceptance (same prompts and mix) | {compared} |",
        f"| engine/simulator consistent | {consistent} |",
    ]
    if results.simulator_unweighted_acceptance_rate is not None:
        lines.append(
            "| simulator acceptance, each prompt once (unweighted) | "
            f"{format_percent(results.simulator_unweighted_acceptance_rate)} |"
        )
    if results.per_position_acceptance:
        per_position = ", ".join(format_percent(value, 0) for value in results.per_position_acceptance)
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
    rows = [("engine", card.engine_label), ("target", card.target), *card.provenance_rows()]
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


def _speedup_cell(results: CycleResults | None, concurrency: int) -> str:
    if results is None or results.speedup.get(concurrency) is None:
        return "-"
    return speedup_text(results, concurrency)


def _gate_cell(record: VersionRecord, champion: bool) -> str:
    gate = record.tags.get("gate", "-")
    if champion:
        return "champion"
    return "passed (former champion)" if gate == "passed" else gate


def leaderboard_markdown(client: MlflowClient, name: str) -> str:
    """The registered model's description: its versions newest first (gate, AL, acceptance rate, speedup
    per concurrency, engine, target, variant), rebuilt from the versions' records."""
    escaped = name.replace("'", "\\'")
    versions = sorted(
        client.search_model_versions(f"name = '{escaped}'"), key=lambda v: int(v.version), reverse=True
    )
    records = [read_version(client, version) for version in versions[:_LEADERBOARD_ROWS]]
    concurrencies = sorted({c for record in records if record.results for c in record.results.speedup})
    # By the alias itself: search results do not carry aliases.
    holder = current_champion(client, name)
    champion = next((r for r in records if holder is not None and r.version == holder.version), None)
    if champion is None:
        head = "No champion yet."
    else:
        length = champion.results.mean_acceptance_length if champion.results else None
        engine = engine_label(champion.fact("engine", "?"), champion.fact("engine_version"))
        head = (
            f"Champion: v{champion.version}, AL {format_figure(length, 2)}, "
            f"speedup {_speedup_cell(champion.results, 1)} @ c=1 on {engine}."
        )
    header = ["version", "gate", "AL (tokens/step)", "acceptance rate"]
    header += [f"speedup @ c={c}" for c in concurrencies] + ["engine", "target", "variant"]
    lines = [
        f"{REGISTERED_MODEL_INTRO} {head}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for record in records:
        results = record.results
        cells = [
            f"v{record.version}",
            _gate_cell(record, record is champion),
            format_figure(results.mean_acceptance_length if results else None, 2),
            format_percent(results.acceptance_rate if results else None),
            *(_speedup_cell(results, c) for c in concurrencies),
            engine_label(record.fact("engine", "-"), record.fact("engine_version")),
            record.fact("target", "-"),
            record.fact("variant", "-"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(versions) > _LEADERBOARD_ROWS:
        lines += ["", f"{len(versions) - _LEADERBOARD_ROWS} older versions are in the versions list."]
    lines += ["", "Rebuilt at every registration from the versions' records."]
    return "\n".join(lines) + "\n"
