"""The HTML pieces of our Decks: a small stylesheet, tables of EvalResults, validation points and lineage.

Every piece is plain HTML with no external resource, so a Deck stays one self-contained page; every piece of
user text (class names, paths, config values) is escaped here, at the one place it enters the HTML.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass

from traincore.artifacts import EvalResult

# Inline, because a Deck is a single page: Flyte's console shows it as it is, with nothing else to fetch.
STYLE = """<style>
.deck-table { border-collapse: collapse; margin: 0.5em 0 1.5em; font: 13px sans-serif; }
.deck-table caption { text-align: left; font-weight: bold; padding-bottom: 0.3em; white-space: nowrap; }
.deck-table th, .deck-table td { border: 1px solid #ccc; padding: 3px 8px; vertical-align: top; }
.deck-table th { background: #f2f2f2; }
.deck-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
.deck-table tr.best td, .deck-table td.better { background: #e3f4e3; }
.deck-table td.worse { background: #fbe0e0; font-weight: bold; }
.deck-table tr.differs td { background: #fff6d5; }
.deck-table pre { margin: 0.3em 0 0; font-size: 12px; }
.deck-figure { max-width: 100%; height: auto; }
.verdict { font: bold 16px sans-serif; padding: 0.4em 0.8em; display: inline-block; }
.verdict.promoted { background: #e3f4e3; }
.verdict.refused { background: #fbe0e0; }
</style>"""

INLINE_ENTRIES = 8  # a flat lineage dict up to this size reads better written out than folded away
MISSING = "\u2014"  # an em dash where a figure does not exist (no champion, a class it does not know)


@dataclass(frozen=True)
class Cell:
    """A table cell built here: ``html`` is inserted as it is (never user text), ``css`` is its class."""

    html: str
    css: str = ""


def cell(value: object) -> Cell:
    """``value`` as a cell: numbers right-aligned (floats to 4 places), anything else escaped text."""
    if isinstance(value, Cell):
        return value
    if isinstance(value, float):
        return Cell(f"{value:.4f}", "num")
    if isinstance(value, int) and not isinstance(value, bool):
        return Cell(str(value), "num")
    return Cell(html.escape(str(value)))


def table(table_id: str, caption: str, header: list[str], rows: list[list[object]],
          row_css: list[str] | None = None) -> str:
    """A captioned table; ``rows`` hold values or Cells, ``row_css`` an optional class per row."""
    head = "".join(f"<th>{html.escape(name)}</th>" for name in header)
    body = []
    for index, row in enumerate(rows):
        css = row_css[index] if row_css else ""
        cells = "".join(_td(cell(value)) for value in row)
        body.append(f'<tr class="{css}">{cells}</tr>' if css else f"<tr>{cells}</tr>")
    return (f'<table class="deck-table" id="{table_id}"><caption>{html.escape(caption)}</caption>\n'
            f"<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body) + "\n</tbody></table>")


def _td(content: Cell) -> str:
    return f'<td class="{content.css}">{content.html}</td>' if content.css else f"<td>{content.html}</td>"


def support(result: EvalResult) -> list[int]:
    """Samples of each true class in the split: the rows of the confusion matrix."""
    return [sum(row) for row in result.confusion]


def per_class_table(result: EvalResult) -> str:
    """Precision, recall and support of every class of ``result``."""
    rows = [[name, precision, recall, count] for name, precision, recall, count
            in zip(result.classes, result.precision, result.recall, support(result), strict=True)]
    caption = f"Per-class precision and recall ({result.split} split, {result.count} samples)"
    return table("per-class", caption, ["class", "precision", "recall", "support"], rows)


def validation_table(points: list[dict]) -> str:
    """One row per validation record (step, accuracy, loss); the best accuracy's row is highlighted."""
    best = max(range(len(points)), key=lambda k: points[k].get("accuracy", float("-inf")))
    rows = [[p["step"], p.get("accuracy", MISSING), p.get("loss", MISSING)] for p in points]
    return table("validation", "Validation passes during training", ["step", "accuracy", "loss"], rows,
                 ["best" if k == best else "" for k in range(len(points))])


def delta_cells(challenger: float, champion: float | None, higher_is_better: bool = True) -> list[Cell]:
    """[champion, challenger, challenger - champion] with the delta marked worse/better."""
    if champion is None:
        return [cell(MISSING), cell(challenger), cell(MISSING)]
    delta = challenger - champion
    gain = delta if higher_is_better else -delta
    css = "worse" if gain < 0 else "better" if gain > 0 else ""
    return [cell(champion), cell(challenger), Cell(f"{delta:+.4f}", f"num {css}".strip())]


def by_class(result: EvalResult, metric: str) -> dict[str, float]:
    """``{class name: value}`` of a per-class ``metric`` ("precision" or "recall"): models are compared by
    class name, never by index."""
    return dict(zip(result.classes, getattr(result, metric), strict=True))


def figures_table(challenger: EvalResult, champion: EvalResult | None) -> str:
    """Accuracy, loss and sample count of the challenger and, when there is one, of the champion with the
    deltas."""
    names = ["accuracy", "loss (mean cross-entropy)", "samples"]
    if champion is None:
        rows = [[name, value] for name, value in
                zip(names, (challenger.accuracy, challenger.loss, challenger.count), strict=True)]
        return table("figures", f"Challenger on the {challenger.split} split", ["figure", "challenger"], rows)
    rows = [[names[0], *delta_cells(challenger.accuracy, champion.accuracy)],
            [names[1], *delta_cells(challenger.loss, champion.loss, higher_is_better=False)],
            [names[2], champion.count, challenger.count, ""]]
    return table("figures", f"Champion vs challenger on the {challenger.split} split",
                 ["figure", "champion", "challenger", "delta"], rows)


def per_class_delta_table(challenger: EvalResult, champion: EvalResult) -> str:
    """Per class (matched by name): precision and recall of both models and their deltas; a class the
    champion does not know shows no champion figures."""
    old_precision, old_recall = by_class(champion, "precision"), by_class(champion, "recall")
    rows = [[name, *delta_cells(precision, old_precision.get(name)),
             *delta_cells(recall, old_recall.get(name))]
            for name, precision, recall in zip(challenger.classes, challenger.precision, challenger.recall,
                                               strict=True)]
    header = ["class", "precision champion", "precision challenger", "precision delta",
              "recall champion", "recall challenger", "recall delta"]
    return table("per-class-deltas", "Per-class precision and recall, champion vs challenger", header, rows)


def _structured(value: object) -> dict | list | None:
    """``value`` as a dict or list when it is one or is JSON text of one (a resolved config), else None."""
    if isinstance(value, dict | list):
        return value
    if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, dict | list) else None
    return None


def lineage_cell(value: object) -> Cell:
    """A lineage value: primitives as text; a small flat dict (a metric summary) as ``key: value`` lines; a
    larger or nested dict or list (the resolved config), or JSON text of one, folded in <details>; an
    unknown (empty) value as a dash."""
    if value is None or (isinstance(value, str | dict | list) and not value):
        return cell(MISSING)
    structured = _structured(value)
    if structured is None:
        return cell(value)
    flat = isinstance(structured, dict) and not any(isinstance(v, dict | list) for v in structured.values())
    if flat and len(structured) <= INLINE_ENTRIES:
        lines = [f"{html.escape(str(key))}: {cell(item).html}" for key, item in structured.items()]
        return Cell("<br>".join(lines))
    pretty = html.escape(json.dumps(structured, indent=2, sort_keys=True, default=str))
    return Cell(f"<details><summary>{len(structured)} entries</summary><pre>{pretty}</pre></details>")


def lineage_table(lineage: dict) -> str:
    """The lineage of one model as key/value rows, in the record's own order."""
    rows = [[key, lineage_cell(value)] for key, value in lineage.items()]
    return table("lineage", "Lineage", ["key", "value"], rows)


def _comparable(value: object) -> object:
    """A lineage value as compared: JSON text of a dict or list compares as the structure it holds."""
    structured = _structured(value)
    return value if structured is None else structured


def _flatten(value: object, path: str) -> dict[str, object]:
    """Nested dicts as ``{"a.b.c": leaf}``; lists and primitives are leaves."""
    if not isinstance(value, dict):
        return {path: value}
    flat: dict[str, object] = {}
    for key, item in value.items():
        flat.update(_flatten(item, f"{path}.{key}"))
    return flat


def _leaf(flat: dict[str, object], path: str) -> str:
    return json.dumps(flat[path], default=str) if path in flat else MISSING


def nested_changes(challenger: dict, champion: dict) -> list[list[str]]:
    """[path, champion's value, challenger's value] for every leaf that differs inside the nested values of
    both lineages (the resolved config): what a reviewer would otherwise diff two JSON blobs for."""
    rows = []
    for key, value in challenger.items():
        new, old = _comparable(value), _comparable(champion.get(key))
        if isinstance(new, dict) and isinstance(old, dict) and new != old:
            new_flat, old_flat = _flatten(new, key), _flatten(old, key)
            paths = list(new_flat) + [path for path in old_flat if path not in new_flat]
            rows += [[path, _leaf(old_flat, path), _leaf(new_flat, path)] for path in paths
                     if path not in old_flat or path not in new_flat or old_flat[path] != new_flat[path]]
    return rows


def lineage_pair_table(challenger: dict, champion: dict) -> str:
    """Both lineages side by side, one row per key of either, rows that differ highlighted; then the
    differing entries inside nested values, when there are any."""
    keys = list(challenger) + [key for key in champion if key not in challenger]
    rows = [[key, lineage_cell(champion.get(key)), lineage_cell(challenger.get(key))] for key in keys]
    differs = ["differs" if _comparable(champion.get(key)) != _comparable(challenger.get(key)) else ""
               for key in keys]
    page = table("lineage", "Lineage", ["key", "champion", "challenger"], rows, differs)
    changes = nested_changes(challenger, champion)
    if changes:
        caption = "Nested lineage entries that differ (e.g. the resolved config)"
        page += "\n" + table("lineage-changes", caption, ["entry", "champion", "challenger"], changes)
    return page
