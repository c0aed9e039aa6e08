"""Every plot draftloop draws (matplotlib, headless): training curves and the evaluation's figures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from draftloop.infra.evaluation.judge import KSweepEntry
    from draftloop.infra.evaluation.report import EvalReport


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: str | Path) -> Path:
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def plot_training_curves(history: list[Mapping[str, float]], path: str | Path) -> Path:
    """Loss and per-position accuracy per step -> PNG."""
    plt = _pyplot()
    steps = [row.get("step", index) for index, row in enumerate(history)]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axis.plot(steps, [row.get("loss", float("nan")) for row in history])
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("TTT loss")
    loss_axis.set_title("training loss")
    accuracy_keys = sorted(
        (key for key in (history[0] if history else {}) if key.startswith("acc_")),
        key=lambda key: int(key.split("_")[-1]) if key.split("_")[-1].isdigit() else 0,
    )
    for key in accuracy_keys:
        accuracy_axis.plot(steps, [row.get(key, float("nan")) for row in history], label=key)
    accuracy_axis.set_xlabel("step")
    accuracy_axis.set_ylabel("accuracy")
    accuracy_axis.set_title("per-position accuracy")
    if accuracy_keys:
        accuracy_axis.legend(fontsize="small")
    return _save(figure, path)


def write_plots(report: EvalReport, out_dir: Path) -> list[str]:
    """acceptance_per_position.png (engine vs simulator) and throughput_vs_concurrency.png."""
    plt = _pyplot()
    out_dir = Path(out_dir)

    engine_pos = list((report.engine_acceptance or {}).get("per_position_acceptance") or [])
    sim_pos = [v if v is not None else 0.0 for v in (report.simulator or {}).get("per_position", [])]
    positions = list(range(max(len(engine_pos), len(sim_pos), 1)))
    figure, axis = plt.subplots(figsize=(5, 3.5))
    if engine_pos:
        axis.bar([p - 0.2 for p in positions[: len(engine_pos)]], engine_pos, width=0.4, label=report.engine)
    if sim_pos:
        axis.bar([p + 0.2 for p in positions[: len(sim_pos)]], sim_pos, width=0.4, label="simulator")
    axis.set_xlabel("draft position")
    axis.set_ylabel("acceptance rate")
    axis.set_ylim(0, 1)
    axis.set_xticks(positions)
    axis.set_title(f"Acceptance per position ({report.verdict})")
    axis.legend()
    acceptance = _save(figure, out_dir / "acceptance_per_position.png")

    figure, axis = plt.subplots(figsize=(5, 3.5))
    for run in (report.baseline, report.speculative, *report.sweep_runs.values()):
        medians = [lv.output_tokens_per_s for lv in run.levels]
        # Error bars: min..max over the repeats.
        below = [m - (lv.throughput.get("min") or m) for m, lv in zip(medians, run.levels, strict=True)]
        above = [(lv.throughput.get("max") or m) - m for m, lv in zip(medians, run.levels, strict=True)]
        axis.errorbar(
            [lv.concurrency for lv in run.levels], medians, yerr=[below, above], marker="o", capsize=3,
            label=run.name,
        )  # fmt: skip
    axis.set_xlabel("concurrency")
    axis.set_ylabel("output tokens/s")
    axis.set_xscale("log", base=2)
    axis.set_title("Throughput vs concurrency")
    axis.legend()
    throughput = _save(figure, out_dir / "throughput_vs_concurrency.png")
    paths = [str(acceptance), str(throughput)]
    if report.category_acceptance:
        paths.append(
            str(_plot_categories(report.category_acceptance, out_dir / "acceptance_per_category.png"))
        )
    if report.k_sweep:
        paths.append(str(_plot_k_sweep(report.k_sweep, out_dir / "acceptance_length_per_k.png")))
    return paths


def _plot_categories(categories: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Mean acceptance length per prompt category (simulator on the engine's text; engine if reported)."""
    plt = _pyplot()
    names = list(categories)
    figure, axis = plt.subplots(figsize=(max(5.0, 0.9 * len(names)), 3.5))
    for offset, source in ((-0.2, "simulator"), (0.2, "engine")):
        values = [((categories[name].get(source) or {}).get("mean_acceptance_length")) for name in names]
        if any(value is not None for value in values):
            axis.bar(
                [i + offset for i in range(len(names))],
                [value if value is not None else 0.0 for value in values],
                width=0.4,
                label=source,
            )
    axis.set_xticks(range(len(names)))
    axis.set_xticklabels(names, rotation=30, ha="right")
    axis.set_ylabel("mean acceptance length")
    axis.set_title("Acceptance length per prompt category")
    if axis.get_legend_handles_labels()[0]:
        axis.legend()
    return _save(figure, path)


def _plot_k_sweep(sweep: Sequence[KSweepEntry], path: Path) -> Path:
    """Predicted (simulator) against measured (engine) mean acceptance length per k."""
    plt = _pyplot()
    ks = [entry.k for entry in sweep]
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for label, values in (
        ("predicted", [entry.predicted_mean_acceptance_length for entry in sweep]),
        ("measured", [entry.measured_mean_acceptance_length for entry in sweep]),
    ):
        points = [(k, value) for k, value in zip(ks, values, strict=True) if value is not None]
        if points:
            axis.plot([k for k, _ in points], [v for _, v in points], marker="o", label=label)
    axis.set_xlabel("speculative tokens k")
    axis.set_ylabel("mean acceptance length")
    axis.set_xticks(ks)
    axis.set_title("Acceptance length per k")
    if axis.get_legend_handles_labels()[0]:
        axis.legend()
    return _save(figure, path)


def plot_sweep(points: Sequence[tuple[str, Any, Mapping[str, float | None]]], path: str | Path) -> Path:
    """A sweep's comparison: one column per swept key, one row per figure (AL, acceptance %, speedup
    @ c=1), each variant a point at its swept value. `points`: (swept key, value, figures by name)."""
    plt = _pyplot()
    keys = list(dict.fromkeys(key for key, _, _ in points))
    names = list(dict.fromkeys(name for _, _, figures in points for name in figures))
    figure, axes = plt.subplots(
        len(names), len(keys), figsize=(4 * len(keys), 2.6 * len(names)), squeeze=False
    )
    for column, key in enumerate(keys):
        # Values may be strings or lists: placed in first-seen order, labelled as given.
        values = list(dict.fromkeys(str(value) for k, value, _ in points if k == key))
        for row, name in enumerate(names):
            axis = axes[row][column]
            xs = [values.index(str(value)) for k, value, figures in points if k == key]
            ys = [figures.get(name) for k, _, figures in points if k == key]
            axis.scatter(xs, [float("nan") if y is None else y for y in ys])
            axis.set_xticks(range(len(values)), values)
            axis.set_xlabel(key)
            axis.set_ylabel(name)
    return _save(figure, path)
