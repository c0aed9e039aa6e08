"""How a measured figure is written for people: the registry's prose, summary.md, stage log lines, the CLI.

One formatter per way of writing a figure, so that a number reads the same wherever it is shown.
"""

from __future__ import annotations

from typing import Any

MISSING = "n/a"  # what a figure that was not measured reads as


def format_figure(value: Any, digits: int = 3, unit: str = "", missing: str = MISSING) -> str:
    """A figure to `digits` decimals: `missing` when absent, a float rounded, anything else as is."""
    if value is None:
        return missing
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def format_percent(value: float | None, digits: int = 1) -> str:
    """A fraction as a percentage: 0.612 -> `61.2 %`; `n/a` when absent."""
    return MISSING if value is None else f"{100 * value:.{digits}f} %"


def format_significant(value: Any) -> str:
    """Three significant digits, without exponents for large figures (tokens/s 1,035, not 1.03e+03)."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def as_number(value: Any) -> float | None:
    """A figure read back from JSON or a run's metrics as a float (ints too); None when it is no number."""
    return float(value) if isinstance(value, int | float) else None
