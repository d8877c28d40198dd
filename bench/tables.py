"""Markdown tables of benchmark rows: shared by the benchmarks that print them and bench/run.py."""

from __future__ import annotations

from typing import Any


def cell(value: Any) -> str:
    """A table cell: floats with 3 significant digits (thousands separated), None as "n/a"."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows (dicts) as a markdown table; the columns are the keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines)
