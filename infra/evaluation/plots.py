"""Every plot draftloop draws (matplotlib, headless): training curves and the evaluation's figures."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    for run in (report.baseline, report.speculative):
        axis.plot(
            [lv.concurrency for lv in run.levels],
            [lv.output_tokens_per_s for lv in run.levels],
            marker="o",
            label=run.name,
        )
    axis.set_xlabel("concurrency")
    axis.set_ylabel("output tokens/s")
    axis.set_xscale("log", base=2)
    axis.set_title("Throughput vs concurrency")
    axis.legend()
    throughput = _save(figure, out_dir / "throughput_vs_concurrency.png")
    return [str(acceptance), str(throughput)]
