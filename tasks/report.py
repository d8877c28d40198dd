"""Pictures for the evaluation Deck: training curves and the confusion matrix as PNGs inside HTML."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display in a pod, nor in CI

import matplotlib.pyplot as plt  # noqa: E402

# (kind, metric, panel title): one panel per metric that metrics.jsonl actually holds.
CURVES = (("train", "loss", "training loss"), ("eval", "accuracy", "validation accuracy"),
          ("train", "lr", "learning rate"), ("train", "samples_per_s", "samples/s"))


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _png(figure: plt.Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def curves_png(records: list[dict]) -> bytes | None:
    """One panel per available curve against the step; None when there is nothing to draw."""
    series = []
    for kind, metric, title in CURVES:
        points = [(r["step"], r[metric]) for r in records if r.get("kind") == kind and metric in r]
        if points:
            series.append((title, points))
    if not series:
        return None
    figure, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for axis, (title, points) in zip(axes[0], series, strict=True):
        steps, values = zip(*points, strict=True)
        axis.plot(steps, values, marker="." if len(points) < 30 else None)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    return _png(figure)


def confusion_png(confusion: list[list[int]], classes: list[str]) -> bytes:
    """The confusion matrix as a heat map with the counts written in."""
    size = max(4.0, 0.45 * len(classes) + 2)
    figure, axis = plt.subplots(figsize=(size, size))
    axis.imshow(confusion, cmap="Blues")
    ticks = range(len(classes))
    axis.set_xticks(ticks, classes, rotation=90 if len(classes) > 10 else 0)
    axis.set_yticks(ticks, classes)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    if len(classes) <= 30:  # beyond that the numbers are unreadable; the colours still tell the story
        peak = max(max(row) for row in confusion) or 1
        for true, row in enumerate(confusion):
            for predicted, count in enumerate(row):
                axis.text(predicted, true, str(count), ha="center", va="center", fontsize=8,
                          color="white" if count > peak / 2 else "black")
    return _png(figure)


def figure_html(title: str, png: bytes) -> str:
    """An HTML section with ``png`` embedded as a data URI, so the Deck needs no other file."""
    data = base64.b64encode(png).decode("ascii")
    title = html.escape(title)
    return f'<h3>{title}</h3>\n<img alt="{title}" src="data:image/png;base64,{data}"/>'
