"""The Decks a reviewer reads: the evaluation Deck and the promotion Deck, with their pictures.

Pictures are PNGs drawn with matplotlib and embedded as data URIs, tables come from :mod:`tasks.decks`: each
Deck is one self-contained HTML page. matplotlib is imported where a figure is drawn: importing it costs
about 0.7 s of CPU, and every pod that loads the workflow imports this module (through tasks.evaluate).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.decks import (
    STYLE,
    by_class,
    figures_table,
    lineage_pair_table,
    lineage_table,
    per_class_delta_table,
    per_class_table,
    validation_table,
)
from traincore.artifacts import EvalResult, format_result

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# (metric, panel title): one panel per training metric that metrics.jsonl actually holds ("train" records).
CURVES = (("loss", "training loss"), ("lr", "learning rate"), ("samples_per_s", "samples/s"),
          ("data_wait_share", "data-wait share (time in next())"))
# Up to this many points a curve gets its values written next to the markers; beyond, they would overlap.
LABELLED_POINTS = 12


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _points(records: list[dict], kind: str, metric: str) -> list[tuple[int, float]]:
    """(step, value) of ``metric`` in the records of ``kind``, by step."""
    return sorted((r["step"], r[metric]) for r in records if r.get("kind") == kind and metric in r)


def png_bytes(figure: Figure) -> bytes:
    """``figure`` as PNG bytes."""
    buffer = io.BytesIO()
    # A figure with a layout engine already fits its labels; trimming it too ("tight") draws it twice, the
    # largest part of the evaluation Deck's time.
    figure.savefig(buffer, format="png", dpi=100, bbox_inches=None if figure.get_layout_engine() else "tight")
    return buffer.getvalue()


def _plot(axis: Axes, points: list[tuple[int, float]], label: str | None = None, fmt: str = ".3f",
          **style) -> None:
    """A curve against the step; a short one gets markers and its values written at each point."""
    steps, values = zip(*points, strict=True)
    few = len(points) <= LABELLED_POINTS
    axis.plot(steps, values, marker="o" if few else None, label=label, **style)
    if few:
        for step, value in points:
            axis.annotate(format(value, fmt), (step, value), textcoords="offset points", xytext=(0, 6),
                          ha="center", fontsize=8)


def curves_png(records: list[dict]) -> bytes | None:
    """One panel per available training curve against the step, and the world size where it changed (an
    elastic run's membership changes); None when there is nothing to draw."""
    series = [(metric, title, points) for metric, title in CURVES
              if (points := _points(records, "train", metric))]
    world = _points(records, "train", "world_size")
    if len({size for _, size in world}) > 1:
        series.append(("world_size", "world size (processes)", world))
    if not series:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    # Two panels a row: four side by side would be wider than the Deck.
    columns, rows = min(2, len(series)), (len(series) + 1) // 2
    figure = Figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for axis in axes[len(series):]:
        axis.set_visible(False)  # an odd panel count leaves one cell empty
    for axis, (metric, title, points) in zip(axes, series, strict=False):
        steps, values = zip(*points, strict=True)
        axis.plot(steps, values, marker="." if len(points) < 30 else None)
        if metric == "data_wait_share":
            axis.yaxis.set_major_formatter(PercentFormatter(1.0))
            axis.set_ylim(0, max(max(values) * 1.1, 0.05))  # a near-zero share must read as near zero
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    return png_bytes(figure)


def validation_png(records: list[dict]) -> bytes | None:
    """Validation accuracy, and validation loss over the training loss, against the step; None without
    validation records. Validation runs a few times per run, so each point is marked and labelled."""
    accuracy = _points(records, "eval", "accuracy")
    val_loss = _points(records, "eval", "loss")
    if not (accuracy or val_loss):
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.4))
    left, right = figure.subplots(1, 2)
    if accuracy:
        _plot(left, accuracy, color="tab:green")
        # Room above 1.0 for the labels over the points, but no tick there: accuracy ends at 1.
        lowest = min(v for _, v in accuracy) - 0.05
        left.set_ylim(lowest, 1.1)
        left.set_yticks([tick for tick in left.get_yticks() if lowest <= tick <= 1.0])
    left.set_title("validation accuracy")
    train_loss = _points(records, "train", "loss")
    if train_loss:
        right.plot(*zip(*train_loss, strict=True), color="tab:blue", alpha=0.5, label="training")
    if val_loss:
        _plot(right, val_loss, label="validation", color="tab:orange")
    right.set_title("loss")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    return png_bytes(figure)


def confusion_png(confusion: list[list[int]], classes: list[str]) -> bytes:
    """The confusion matrix as a heat map with the counts written in."""
    from matplotlib.figure import Figure

    size = max(4.0, 0.45 * len(classes) + 2)
    figure = Figure(figsize=(size, size))
    axis = figure.subplots()
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
    return png_bytes(figure)


def per_class_png(challenger: EvalResult, champion: EvalResult | None) -> bytes:
    """Per-class precision and recall as bars, the champion's (matched by class name) beside the
    challenger's."""
    from matplotlib.figure import Figure

    width = min(max(6.0, 0.5 * len(challenger.classes) + 2), 30.0)
    figure = Figure(figsize=(width, 5.5))
    axes = figure.subplots(2, 1, sharex=True)
    positions = range(len(challenger.classes))
    for axis, metric in zip(axes, ("precision", "recall"), strict=True):
        mine = getattr(challenger, metric)
        if champion is not None:
            theirs = by_class(champion, metric)
            old = [theirs.get(name, 0.0) for name in challenger.classes]
            axis.bar([p - 0.2 for p in positions], old, width=0.4, color="tab:gray", label="champion")
        axis.bar([p + (0.2 if champion else 0.0) for p in positions], mine, width=0.4 if champion else 0.6,
                 color="tab:blue", label="challenger")
        axis.set_ylim(0, 1.05)
        axis.set_ylabel(metric)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not on them
    axes[1].set_xticks(positions, challenger.classes, rotation=90 if len(challenger.classes) > 10 else 0)
    return png_bytes(figure)


def figure_html(title: str, png: bytes) -> str:
    """An HTML section with ``png`` embedded as a data URI, so the Deck needs no other file."""
    data = base64.b64encode(png).decode("ascii")
    title = html.escape(title)
    return f'<h3>{title}</h3>\n<img class="deck-figure" alt="{title}" src="data:image/png;base64,{data}"/>'


def evaluation_deck_html(result: EvalResult, metrics: list[dict], lineage: dict | None,
                         records: str = "") -> str:
    """The evaluation Deck: the accuracy line, where the training records are (``records``: the training
    attempt's records in the durable root, if kept there), training and validation curves (with the
    validation points as a table), the confusion matrix, per-class precision/recall and, when given, the
    model's lineage."""
    parts = [STYLE, f"<p><b>{html.escape(format_result(result))}</b></p>"]
    if records:
        every = records.rsplit("/", 1)[0]
        parts.append('<p id="records">Training records (metrics.jsonl, TensorBoard events, workers\' '
                     f"stderr) of this attempt: <code>{html.escape(records)}</code>; of every attempt: "
                     f"<code>tensorboard --logdir {html.escape(every)}</code></p>")
    curves = curves_png(metrics)
    if curves is None:
        parts.append("<p>No training records (metrics.jsonl): no training curves to draw.</p>")
    else:
        parts.append(figure_html("Training curves (metrics.jsonl)", curves))
    validation = validation_png(metrics)
    if validation is not None:
        parts.append(figure_html("Validation during training", validation))
        parts.append(validation_table(sorted((r for r in metrics if r.get("kind") == "eval"),
                                             key=lambda r: r["step"])))
    parts.append(figure_html(f"Confusion matrix ({result.split} split)", confusion_png(result.confusion,
                                                                                        result.classes)))
    parts.append(per_class_table(result))
    if lineage:
        parts.append(lineage_table(lineage))
    return "\n".join(parts)


def promotion_deck_html(challenger: EvalResult, champion: EvalResult | None, reason: str,
                        challenger_lineage: dict, champion_lineage: dict | None, *, promoted: bool) -> str:
    """The promotion Deck: the gate's verdict (``promoted``) and its reason, both models' figures and
    per-class deltas (worse ones highlighted) and both lineages side by side. Without a champion (the first
    run) the challenger's figures stand alone."""
    verdict = (f'<p class="verdict {"promoted" if promoted else "refused"}" id="verdict">'
               f'{"PROMOTED" if promoted else "NOT PROMOTED"}</p>')
    parts = [STYLE, verdict, f'<p id="reason">{html.escape(reason)}</p>']
    if champion is None:
        parts.append('<p id="first-run">First run: no champion is in service, so there is nothing to compare '
                     "against; the challenger's figures stand alone.</p>")
    parts.append(figures_table(challenger, champion))
    parts.append(figure_html("Per-class precision and recall", per_class_png(challenger, champion)))
    if champion is None:
        parts += [per_class_table(challenger), lineage_table(challenger_lineage)]
    else:
        # A champion published before lineage was recorded has none: its column then stays empty.
        parts += [per_class_delta_table(challenger, champion),
                  lineage_pair_table(challenger_lineage, champion_lineage or {})]
    return "\n".join(parts)
