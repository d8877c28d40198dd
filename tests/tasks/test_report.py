"""Deck pictures: real PNGs from metrics.jsonl records and confusion matrices, embedded in HTML."""

from __future__ import annotations

import base64
import json
import re

import matplotlib.image

from tasks.report import confusion_png, curves_png, figure_html, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode(png: bytes):
    """Pixels of a PNG, through matplotlib's own reader: fails on anything that is not a valid image."""
    import io

    return matplotlib.image.imread(io.BytesIO(png), format="png")


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 10, "kind": "train", "loss": 2.0}, {"step": 20, "kind": "eval", "accuracy": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 30, "ki')
    assert read_metrics(path) == records


def test_curves_draw_one_panel_per_available_metric():
    train = [{"step": s, "kind": "train", "loss": 1 / s, "lr": 0.01} for s in range(1, 40)]
    evals = [{"step": s, "kind": "eval", "accuracy": s / 40} for s in (10, 20, 39)]
    three = decode(curves_png(train + evals))
    one = decode(curves_png([{"step": 1, "kind": "train", "loss": 1.0}]))
    assert three.shape[1] > 2.5 * one.shape[1]  # three panels side by side are about three times wider
    assert curves_png([]) is None
    assert curves_png([{"step": 1, "kind": "train", "unrelated": 1.0}]) is None


def test_confusion_png_is_an_image_that_grows_with_the_class_count():
    heights = []
    for num_classes in (2, 40):
        confusion = [[(5 if t == p else 1) for p in range(num_classes)] for t in range(num_classes)]
        png = confusion_png(confusion, [f"c{k}" for k in range(num_classes)])
        assert png.startswith(PNG_SIGNATURE)
        heights.append(decode(png).shape[0])
    assert heights[1] > 2 * heights[0]


def test_figure_html_embeds_the_exact_png():
    png = confusion_png([[3, 1], [0, 4]], ["cat", "dog"])
    page = figure_html("Confusion <matrix>", png)
    assert "<h3>Confusion &lt;matrix&gt;</h3>" in page
    data = re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1)
    assert base64.b64decode(data) == png
