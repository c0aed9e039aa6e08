"""What people read about a finished cycle in Prefect: the summary artifact (its title says what
happened, not that the flow completed), and the flow's last log line, a sentence with the verdict.

Both are built from summary.json's shape (flows/cycle.py `build_summary`). Links (summary `links`: label
-> URL) are shown wherever they are present: whoever fills them needs to change nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from draftloop.infra.registry.figures import format_figure, format_percent, format_significant


def _last_stage(summary: Mapping[str, Any]) -> str | None:
    stages = summary.get("stages") or {}
    return next(reversed(stages), None) if stages else None


def summary_title(summary: Mapping[str, Any]) -> str:
    """What happened, in a few words: `champion: drafter-x v2`, `rejected: <reason>`, `registered, not
    champion: ...`, `evaluated (ok), not registered`, `stopped after extract`, `failed after train`."""
    last = _last_stage(summary)
    if summary.get("status") != "completed":
        return f"{summary.get('status')} after {last}" if last else str(summary.get("status"))
    registered = summary.get("registered_model") or {}
    if registered:
        version = f"{registered.get('name')} v{registered.get('version')}"
        if registered.get("champion"):
            return f"champion: {version}"
        reasons = (registered.get("gate") or {}).get("reasons") or []
        if reasons:
            return "rejected: " + "; ".join(reasons)
        return f"registered, not champion: {version}"
    if summary.get("verdict"):
        return f"evaluated ({summary['verdict']}), not registered (until {last})"
    return f"stopped after {last} (until {last})" if last else "nothing ran"


def _figures(summary: Mapping[str, Any]) -> str | None:
    """`AL 2.24 · acceptance 41.2 % · 0.66x @ c=1 (inconclusive)`; None before evaluation."""
    if summary.get("mean_acceptance_length") is None and not summary.get("speedup"):
        return None
    parts = [
        f"AL {format_figure(summary.get('mean_acceptance_length'), 2)}",
        f"acceptance {format_percent(summary.get('acceptance_rate'))}",
    ]
    speedup = (summary.get("speedup") or {}).get("1")
    if speedup is not None:
        flag = str((summary.get("speedup_status") or {}).get("1", "ok")).split(":")[0]
        parts.append(f"{speedup:.2f}x @ c=1" + (f" ({flag})" if flag != "ok" else ""))
    return " · ".join(parts)


def _results_rows(summary: Mapping[str, Any]) -> list[str]:
    """The evaluation's figures with units; nothing at all when no evaluation ran (no n/a rows)."""
    if summary.get("verdict") is None:
        return []
    consistent = {True: "consistent", False: "inconsistent (integration fault)", None: "not compared"}
    engine = summary.get("compared_engine_acceptance_rate")
    engine = summary.get("acceptance_rate") if engine is None else engine
    simulator = summary.get("simulator_acceptance_rate")
    length = format_figure(summary.get("mean_acceptance_length"), 2, " tokens/step")
    rows = [
        "| result | value |",
        "|---|---|",
        f"| evaluation verdict | {summary['verdict']} |",
        f"| acceptance rate | {format_percent(summary.get('acceptance_rate'))} |",
        f"| engine vs simulator acceptance (same prompts and mix) | {format_percent(engine)} vs "
        f"{format_percent(simulator)}, {consistent.get(summary.get('consistent'), 'not compared')} |",
        f"| mean acceptance length | {length} |",
    ]
    statuses = summary.get("speedup_status") or {}
    for concurrency, speedup in (summary.get("speedup") or {}).items():
        flag = str(statuses.get(concurrency, "ok")).split(":")[0]
        rows.append(
            f"| speedup @ concurrency {concurrency} | {format_figure(speedup, 2, 'x')}"
            + (f" ({flag})" if flag != "ok" else "")
            + " |"
        )
    if summary.get("recommended_k") is not None:
        rows.append(f"| recommended k | {summary['recommended_k']} |")
    epoch = summary.get("drafter_epoch") or {}
    if epoch.get("exported_epoch") is not None:
        rows.append(
            f"| exported epoch | {epoch['exported_epoch']} "
            f"(held-out AL {format_figure(epoch.get('held_out_acceptance_length'), 2)}) |"
        )
    return rows


def _stage_rows(summary: Mapping[str, Any]) -> list[str]:
    """Per stage: time, cache, what it produced (rows and its declared figures) and where."""
    rows = ["| stage | seconds | cache | rows | produced | output |", "|---|---|---|---|---|---|"]
    for name, timing in (summary.get("stages") or {}).items():
        raw = timing.get("figures") or {}
        # (a summary.json written before the figures were kept as shown: the raw ones, dicts left out)
        shown = timing.get("shown") or {
            label: format_significant(value) for label, value in raw.items() if not isinstance(value, dict)
        }
        # Lists (per-epoch figures) have rows of their own.
        figures = ", ".join(
            f"{label} {text}" for label, text in shown.items() if not isinstance(raw.get(label), list)
        )
        rows.append(
            f"| {name} | {timing['seconds']:.1f} | {'hit' if timing['cache_hit'] else 'run'} | "
            f"{timing.get('rows', '-')} | {figures or '-'} | `{timing.get('uri') or '-'}` |"
        )
    return rows


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The Prefect run page's artifact: what happened first, figures rounded with units, the gate's
    reason, the links; every run lists what each stage produced and where (a partial run's result)."""
    registered = summary.get("registered_model") or {}
    lines = [f"# draftloop cycle `{summary['config']}`: {summary_title(summary)}", ""]
    if registered.get("verdict"):
        lines += [f"**{registered['verdict']}**", ""]
    elif summary.get("status") == "completed" and summary.get("verdict") is None:
        lines += [f"A partial cycle, up to {_last_stage(summary)}: its outputs are listed below.", ""]
    table = _results_rows(summary)
    if registered:
        table = table or ["| result | value |", "|---|---|"]
        table.append(
            f"| model version | {registered.get('name')} v{registered.get('version')} "
            f"({registered.get('alias_status')}) |"
        )
        reasons = (registered.get("gate") or {}).get("reasons")
        if reasons:
            table.append(f"| gate | rejected: {'; '.join(reasons)} |")
    links = summary.get("links") or {}
    if links:
        table = table or ["| result | value |", "|---|---|"]
        table += [f"| {label} | [{url}]({url}) |" for label, url in links.items()]
    if table:
        lines += [*table, ""]
    lines += _stage_rows(summary)
    if summary.get("run_folder"):
        lines += ["", f"Run folder (config, progress markers, summary.json): `{summary['run_folder']}`"]
    return "\n".join(lines) + "\n"


def final_log_line(summary: Mapping[str, Any]) -> str:
    """The flow's last log line: one sentence with the verdict, the figures, the time and the links."""
    run = str(summary.get("run_id") or "")[:8]
    sentence = f"Cycle {run} of {summary.get('config')}: {summary_title(summary)}."
    figures = _figures(summary)
    if figures:
        sentence += f" {figures}."
    stages = summary.get("stages") or {}
    hits = summary.get("cache_hits") or []
    sentence += f" {len(stages)} stage(s) in {float(summary.get('total_seconds') or 0):.0f} s"
    sentence += f" ({len(hits)} reused)." if hits else "."
    if summary.get("run_folder"):
        sentence += f" Summary: {summary['run_folder']}/summary.json."
    for label, url in (summary.get("links") or {}).items():
        sentence += f" {label}: {url}"
    return sentence
