"""Deck pictures and pages: real PNGs from metrics.jsonl records and EvalResults, tables read back from the
HTML by a parser, user text escaped."""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser

import matplotlib.image
import pytest
from matplotlib.figure import Figure

from tasks.report import (
    _plot,
    confusion_png,
    curves_png,
    evaluation_deck_html,
    figure_html,
    promotion_deck_html,
    read_metrics,
    validation_png,
)
from traincore.artifacts.evaluate import EvalResult

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode(png: bytes):
    """Pixels of a PNG, through matplotlib's own reader: fails on anything that is not a valid image."""
    return matplotlib.image.imread(io.BytesIO(png), format="png")


class Tables(HTMLParser):
    """Every <table id=...> of a page as {id: [[(cell text, td class, tr class), ...], ...]} (body rows)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str, str]]]] = {}
        self.images: list[str] = []
        self._table = self._row_css = self._cell = None
        self._row: list[tuple[str, str, str]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self._table is not None:
            self._row_css, self._row = attrs.get("class", ""), []
        elif tag == "td" and self._table is not None:
            self._cell = ["", attrs.get("class", "")]
        elif tag == "img":
            self.images.append(attrs["src"])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0] += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row.append((self._cell[0].strip(), self._cell[1], self._row_css))
            self._cell = None
        elif tag == "tr" and self._table is not None and self._row:
            self._table.append(self._row)
        elif tag == "table":
            self._table = None

    def texts(self, table_id: str) -> list[list[str]]:
        """The cell texts of one table, row by row."""
        return [[text for text, _, _ in row] for row in self.tables[table_id]]


def result(accuracy: float, precision: list[float], recall: list[float],
           classes: list[str] | None = None) -> EvalResult:
    classes = classes or ["cat", "dog", "<script>alert(1)</script> & co"]
    confusion = [[8, 1, 1], [2, 6, 2], [0, 0, 10]][:len(classes)]
    return EvalResult(split="test", accuracy=accuracy, loss=1.0 - accuracy, count=30, classes=classes,
                      precision=precision, recall=recall, confusion=confusion)


def run_records(evals: int = 3) -> list[dict]:
    """metrics.jsonl records as traincore.train writes them: startup, train intervals, eval passes."""
    records = [{"step": 1, "kind": "startup", "total_s": 0.2}]
    records += [{"step": s, "kind": "train", "loss": 2.0 / s, "lr": 0.01, "samples_per_s": 900.0 + s,
                 "data_wait_share": 0.01 * (s % 7)} for s in range(5, 61, 5)]
    records += [{"step": 20 * k, "kind": "eval", "loss": 1.0 / k, "accuracy": 0.5 + 0.1 * k}
                for k in range(1, evals + 1)]
    return records


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 10, "kind": "train", "loss": 2.0}, {"step": 20, "kind": "eval", "accuracy": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 30, "ki')
    assert read_metrics(path) == records


def test_curves_draw_one_panel_per_available_training_metric_two_a_row():
    def train(*metrics: str) -> list[dict]:
        return [{"step": s, "kind": "train", **{m: 1 / s for m in metrics}} for s in range(1, 40)]

    evals = [{"step": s, "kind": "eval", "accuracy": s / 40} for s in (10, 20, 39)]
    one = decode(curves_png(train("loss") + evals)).shape  # validation has a figure of its own
    two = decode(curves_png(train("loss", "lr"))).shape
    four = decode(curves_png(train("loss", "lr", "samples_per_s", "data_wait_share"))).shape
    assert 1.8 * one[1] < two[1] < 2.2 * one[1] and abs(two[0] - one[0]) < 0.1 * one[0]
    assert 1.8 * two[0] < four[0] < 2.2 * two[0] and abs(four[1] - two[1]) < 0.1 * two[1]
    assert curves_png([]) is None
    assert curves_png(evals) is None
    assert curves_png([{"step": 1, "kind": "train", "unrelated": 1.0}]) is None


def test_the_world_size_gets_a_panel_only_where_it_changed():
    def run(worlds: list[int]) -> list[dict]:
        return [{"step": s, "kind": "train", "loss": 1 / s, "world_size": world}
                for s, world in enumerate(worlds, 1)]

    steady = decode(curves_png(run([2] * 40))).shape
    elastic = decode(curves_png(run([2] * 15 + [1] * 10 + [2] * 15))).shape  # lost a node, got one back
    assert 1.8 * steady[1] < elastic[1] < 2.2 * steady[1]  # the loss, and the world size beside it


def test_validation_figure_needs_eval_records():
    assert validation_png([r for r in run_records() if r["kind"] != "eval"]) is None
    assert decode(validation_png(run_records())).shape[1] > 500


@pytest.mark.parametrize("points, labels", [(3, 3), (12, 12), (13, 0)])
def test_short_curves_get_markers_and_their_values_written(points, labels):
    axis = Figure().subplots()
    _plot(axis, [(10 * k, k / 100) for k in range(points)])
    assert len(axis.texts) == labels
    assert axis.lines[0].get_marker() == ("o" if labels else "None")
    if labels:
        assert axis.texts[-1].get_text() == f"{(points - 1) / 100:.3f}"


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


def test_evaluation_deck_holds_every_section_with_the_results_rows():
    evaluated = result(0.8, [0.8, 6 / 7, 10 / 13], [0.8, 0.6, 1.0])
    config = {"train": {"max_steps": 60, "eval_every": 20}, "data": {"source": "/data/<raw>"}}
    lineage = {"source": "/data/<raw> & more", "checkpoint_step": 60, "config": json.dumps(config),
               "metrics": {"final_loss": 0.5, "steps": 60.0}, "execution_id": "", "test_accuracy": None}
    page = evaluation_deck_html(evaluated, run_records(), lineage)
    parsed = Tables(page)
    assert "<b>test accuracy: 0.800 (30 samples, loss 0.2000)</b>" in page
    assert len(parsed.images) == 3  # training curves, validation, confusion matrix
    for src in parsed.images:
        assert decode(base64.b64decode(src.removeprefix("data:image/png;base64,"))).size > 0
    assert parsed.texts("per-class") == [
        ["cat", "0.8000", "0.8000", "10"], ["dog", "0.8571", "0.6000", "10"],
        ["<script>alert(1)</script> & co", "0.7692", "1.0000", "10"]]
    assert parsed.texts("validation") == [["20", "0.6000", "1.0000"], ["40", "0.7000", "0.5000"],
                                          ["60", "0.8000", "0.3333"]]
    assert [row[0][2] for row in parsed.tables["validation"]] == ["", "", "best"]
    source, step, folded, summary, execution, test_accuracy = parsed.texts("lineage")
    assert source == ["source", "/data/<raw> & more"] and step == ["checkpoint_step", "60"]
    assert folded[0] == "config" and json.loads(folded[1].removeprefix("2 entries")) == config
    assert page.count("<details>") == 1  # the nested config folds away; the flat summary is written out
    assert summary == ["metrics", "final_loss: 0.5000steps: 60.0000"] and "0.5000<br>steps" in page
    assert execution == ["execution_id", "\u2014"] and test_accuracy == ["test_accuracy", "\u2014"]


def test_evaluation_deck_escapes_user_text():
    evaluated = result(0.8, [0.8, 0.8, 0.8], [0.8, 0.8, 0.8])
    page = evaluation_deck_html(evaluated, [], {"path": '/x/"><img src=y onerror=alert(1)>'},
                                's3://b/run/records/attempt-2"><b onclick=x()>')
    assert "<script>" not in page and "onerror=alert(1)>" not in page
    records = re.search(r'<p id="records">(.*?)</p>', page)[1]  # where the records are, escaped
    assert "s3://b/run/records/attempt-2&quot;&gt;&lt;b onclick=x()&gt;" in records and "<b " not in page
    assert "tensorboard --logdir s3://b/run/records</code>" in records
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
    assert "&quot;&gt;&lt;img src=y onerror=alert(1)&gt;" in page
    assert len(Tables(page).images) == 1  # only the confusion matrix: no records, no curves, no lineage img


def test_evaluation_deck_without_records_or_lineage_says_what_is_missing():
    page = evaluation_deck_html(result(0.8, [0.8] * 3, [0.8] * 3), [], None)
    parsed = Tables(page)
    assert "No training records" in page
    assert set(parsed.tables) == {"per-class"}


def test_evaluation_deck_without_validation_records_has_no_validation_section():
    records = [r for r in run_records() if r["kind"] != "eval"]
    parsed = Tables(evaluation_deck_html(result(0.8, [0.8] * 3, [0.8] * 3), records, None))
    assert len(parsed.images) == 2 and "validation" not in parsed.tables


def test_promotion_deck_compares_figures_and_classes_and_highlights_what_got_worse():
    champion = result(0.7, [0.9, 0.5, 0.6], [0.5, 0.8, 0.9])
    challenger = result(0.8, [0.8, 0.7, 0.6], [0.6, 0.7, 0.95])
    champion_lineage = {"source_fingerprint": "aa", "config": {"train": {"max_steps": 60, "lr": 0.01}},
                        "execution": "run-1"}
    new_config = json.dumps({"train": {"max_steps": 90, "lr": 0.01}})  # JSON text compares as its content
    challenger_lineage = {"source_fingerprint": "bb", "config": new_config, "execution": "run-1",
                          "code_version": "1.2.0"}
    page = promotion_deck_html(challenger, champion, "challenger 0.8000 >= champion 0.7000",
                               challenger_lineage, champion_lineage, promoted=True)
    parsed = Tables(page)
    assert 'id="verdict">PROMOTED</p>' in page and "challenger 0.8000 &gt;= champion 0.7000" in page
    assert parsed.texts("figures") == [["accuracy", "0.7000", "0.8000", "+0.1000"],
                                       ["loss (mean cross-entropy)", "0.3000", "0.2000", "-0.1000"],
                                       ["samples", "30", "30", ""]]
    assert [parsed.tables["figures"][k][3][1] for k in (0, 1)] == ["num better", "num better"]
    deltas = parsed.tables["per-class-deltas"]
    assert [[text for text, _, _ in row] for row in deltas][0] == [
        "cat", "0.9000", "0.8000", "-0.1000", "0.5000", "0.6000", "+0.1000"]
    worse = [(row[0][0], k) for row in deltas for k in (3, 6) if "worse" in row[k][1]]
    assert worse == [("cat", 3), ("dog", 6)]  # cat's precision and dog's recall dropped
    assert parsed.texts("lineage")[0] == ["source_fingerprint", "aa", "bb"]
    assert [row[0][2] for row in parsed.tables["lineage"]] == ["differs", "differs", "", "differs"]
    assert parsed.texts("lineage-changes") == [["config.train.max_steps", "60", "90"]]
    assert len(parsed.images) == 1


def test_promotion_deck_matches_classes_by_name_not_position():
    champion = result(0.7, [0.6, 0.9, 0.5], [0.9, 0.5, 0.8], classes=["c", "cat", "dog"])
    challenger = result(0.8, [0.8, 0.7, 0.6], [0.6, 0.7, 0.95], classes=["cat", "dog", "new"])
    parsed = Tables(promotion_deck_html(challenger, champion, "r", {}, {}, promoted=True))
    assert parsed.texts("per-class-deltas") == [
        ["cat", "0.9000", "0.8000", "-0.1000", "0.5000", "0.6000", "+0.1000"],
        ["dog", "0.5000", "0.7000", "+0.2000", "0.8000", "0.7000", "-0.1000"],
        ["new", "\u2014", "0.6000", "\u2014", "\u2014", "0.9500", "\u2014"]]


def test_first_run_promotion_deck_shows_the_challenger_alone():
    challenger = result(0.8, [0.8, 0.7, 0.6], [0.6, 0.7, 0.95])
    page = promotion_deck_html(challenger, None, "no champion yet: accuracy 0.8000 reaches the threshold",
                               {"source_fingerprint": "bb"}, None, promoted=True)
    parsed = Tables(page)
    assert 'id="first-run"' in page and "champion" not in "".join(re.findall(r"<th>[^<]*</th>", page))
    assert parsed.texts("figures") == [["accuracy", "0.8000"], ["loss (mean cross-entropy)", "0.2000"],
                                       ["samples", "30"]]
    assert parsed.texts("per-class")[0] == ["cat", "0.8000", "0.6000", "10"]
    assert parsed.texts("lineage") == [["source_fingerprint", "bb"]]
    assert "per-class-deltas" not in parsed.tables and len(parsed.images) == 1


def test_a_refusal_says_so_above_its_reason():
    page = promotion_deck_html(result(0.8, [0.8] * 3, [0.8] * 3), None, "below the threshold <0.9>", {}, None,
                               promoted=False)
    assert re.search(r'<p class="verdict refused" id="verdict">NOT PROMOTED</p>\s*'
                     r'<p id="reason">below the threshold &lt;0.9&gt;</p>', page)
