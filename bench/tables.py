"""What the benchmarks share: markdown tables of their rows (also bench/run.py's), the digits data they
stage, and the JSON file each writes for bench/run.py."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


@contextmanager
def digits_and_scratch(data: str | None, prefix: str) -> Iterator[tuple[Path, Path]]:
    """(staged digits directory, scratch directory): ``data`` when given, else digits staged into the
    scratch directory, which is removed afterwards."""
    from traincore.config.schema import DataConfig  # here: bench/run.py imports this module without torch
    from traincore.data.staging import stage

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        staged = Path(data) if data else Path(tmp) / "digits"
        if not data:
            stage(DataConfig(source="digits", image_size=32, channels=1), staged)
        yield staged, Path(tmp)


def scratch_directory(prefix: str, given: Path | None) -> Path:
    """A new directory for a benchmark's files: under ``given``, else the checkout's runs/ when it exists
    (ignored by git), else the system's temporary directory."""
    runs = Path(__file__).resolve().parents[1] / "runs"
    parent = given or (runs if runs.is_dir() else None)
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def write_results(path: str | None, benchmark: str, rows: list[dict], ratios: dict[str, float],
                  targets: dict[str, str] | None = None) -> None:
    """The JSON bench/run.py collects (``{"benchmark", "results", "ratios"}``, and the ratios' ``targets``
    when given), when ``path`` is given."""
    if path:
        result = {"benchmark": benchmark, "results": rows, "ratios": ratios}
        if targets:
            result["targets"] = targets
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
