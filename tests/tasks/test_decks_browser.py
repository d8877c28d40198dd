"""The Decks in a real browser: Debian's Chromium, headless, renders each Deck inside Flyte's own Deck page.

The models are real (two tiny CNNs trained, exported and evaluated on the staged synthetic data) and so is
the challenger's metrics.jsonl. A probe script in the page waits for the load event, then writes what the
browser made of the page (every image's decoded size, every table's rows and classes, the scripts present)
into the DOM, which ``--dump-dom`` prints. The network is closed to the browser: a Deck that needed anything
beyond its own page would show a broken image here.

Chromium is installed by scripts/ensure-chromium when it is missing; when it cannot be installed or started
the tests are skipped with the reason, or fail under CI=true.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
from flytekit.deck.deck import get_deck_template

from tasks.decks import support
from tasks.report import evaluation_deck_html, promotion_deck_html, read_metrics
from traincore.artifacts.evaluate import EvalResult, evaluate
from traincore.artifacts.export import export
from traincore.artifacts.lineage import Lineage, with_test
from traincore.config.presets import preset
from traincore.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
ENSURE = ROOT / "scripts" / "ensure-chromium"
BROWSER = Path("/usr/bin/chromium")
HOSTILE_PATH = '/data/<img src=x onerror="document.title=1">&co'

PROBE = """<script>
window.addEventListener("load", () => {
  const text = node => node.textContent.trim();
  const tables = {};
  for (const table of document.querySelectorAll("table[id]")) {
    const rows = [...table.tBodies[0].rows];
    tables[table.id] = {caption: text(table.caption), header: [...table.tHead.rows[0].cells].map(text),
                        rows: rows.map(row => [...row.cells].map(text)),
                        rowClasses: rows.map(row => row.className),
                        cellClasses: rows.map(row => [...row.cells].map(cell => cell.className))};
  }
  const images = [...document.images].map(img => ({alt: img.alt, complete: img.complete,
      width: img.naturalWidth, height: img.naturalHeight, shown: img.getBoundingClientRect().width}));
  const probe = document.createElement("pre");
  probe.id = "deck-probe";
  probe.textContent = JSON.stringify({images, tables, scripts: document.scripts.length,
      details: [...document.querySelectorAll("details pre")].map(text),
      paragraphs: Object.fromEntries([...document.querySelectorAll("p[id]")].map(p => [p.id, text(p)]))});
  document.body.appendChild(probe);
});
</script>"""


def _unavailable(reason: str) -> None:
    message = f"headless Chromium unavailable: {reason}"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _chromium_command(profile: Path, *args: str) -> list[str]:
    # Root needs --no-sandbox; a profile per call keeps concurrent runs off each other's profile lock; every
    # host name resolves to nothing, so the page gets no network.
    return [str(BROWSER), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", *args]


@pytest.fixture(scope="session")
def chromium(tmp_path_factory) -> Path:
    """/usr/bin/chromium, installed by scripts/ensure-chromium if need be, checked to start headless."""
    if not BROWSER.exists():
        try:
            done = subprocess.run([str(ENSURE)], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            _unavailable("scripts/ensure-chromium did not finish within 15 minutes")
        except OSError as exc:
            _unavailable(f"cannot run {ENSURE}: {exc}")
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            _unavailable(f"scripts/ensure-chromium exited {done.returncode}:\n{tail}")
    profile = tmp_path_factory.mktemp("chromium-profile")
    try:
        started = subprocess.run(_chromium_command(profile, "--dump-dom", "about:blank"), capture_output=True,
                                 text=True, timeout=120)
    except subprocess.TimeoutExpired:
        _unavailable(f"{BROWSER} did not render about:blank within 120 s")
    except OSError as exc:
        _unavailable(f"cannot run {BROWSER}: {exc}")
    if "<body>" not in started.stdout:
        _unavailable(f"{BROWSER} does not start headless (exit {started.returncode}): "
                     f"{started.stderr.strip()[-800:]}")
    return BROWSER


def render(deck: str, directory: Path) -> dict:
    """What the browser made of ``deck`` shown as the only tab of Flyte's Deck page (the probe's JSON)."""
    page = get_deck_template().substitute(NAV_HTML='<li onclick="handleLinkClick(this)">Deck</li>',
                                          BODY_HTML=f"<div>{deck}{PROBE}</div>")
    path = directory / "deck.html"
    path.write_text(page, encoding="utf-8")
    command = _chromium_command(directory / "profile", "--virtual-time-budget=10000", "--dump-dom",
                                path.as_uri())
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="deck-probe">(.*?)</pre>', done.stdout, re.DOTALL)
    assert found, f"no probe output (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def train_and_evaluate(data: Path, output: Path, steps: int) -> tuple[EvalResult, dict]:
    """A real tiny run: train ``steps`` steps, export, evaluate on the test split; the result and the
    lineage that export wrote, completed as the evaluation task completes it."""
    cfg = preset("debug").with_overrides({"train.max_steps": steps, "train.eval_every": 10,
                                          "telemetry.log_every": 2, "loader.batch_size": 16})
    Trainer(cfg, data, output / "train").train()
    exported = export(output / "train" / "checkpoints", output / "model" / "model.safetensors",
                      Lineage(source_fingerprint=f"files:{steps}", execution_id="local/development/run-1"))
    result = evaluate(exported.path, data, "test")
    lineage = asdict(with_test(exported.lineage, result.accuracy, result.count))
    return result, {**lineage, "source": f"imagefolder:{HOSTILE_PATH}"}


@pytest.fixture(scope="module")
def models(synthetic_dir, tmp_path_factory):
    """Champion (4 steps) and challenger (30 steps, validated every 10): results, lineages, records."""
    root = tmp_path_factory.mktemp("deck-models")
    champion, champion_lineage = train_and_evaluate(synthetic_dir, root / "champion", 4)
    challenger, challenger_lineage = train_and_evaluate(synthetic_dir, root / "challenger", 30)
    return {"champion": champion, "challenger": challenger, "champion_lineage": champion_lineage,
            "challenger_lineage": challenger_lineage,
            "metrics": read_metrics(root / "challenger" / "train" / "metrics.jsonl")}


def assert_images_decoded(seen: dict, count: int) -> None:
    assert len(seen["images"]) == count, seen["images"]
    for image in seen["images"]:
        assert image["complete"] and image["width"] > 100 and image["height"] > 100, image
        assert image["shown"] > 0, image  # laid out on the page, not hidden


def per_class_rows(result) -> list[list[str]]:
    return [[name, f"{p:.4f}", f"{r:.4f}", str(n)] for name, p, r, n
            in zip(result.classes, result.precision, result.recall, support(result), strict=True)]


def test_evaluation_deck_in_the_browser(chromium, models, tmp_path):
    result, records = models["challenger"], models["metrics"]
    seen = render(evaluation_deck_html(result, records, models["challenger_lineage"]), tmp_path)
    assert_images_decoded(seen, 3)
    assert [image["alt"] for image in seen["images"]] == [
        "Training curves (metrics.jsonl)", "Validation during training", "Confusion matrix (test split)"]
    tables = seen["tables"]
    assert tables["per-class"]["rows"] == per_class_rows(result)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [row[0] for row in tables["validation"]["rows"]] == [str(r["step"]) for r in evals]
    assert len(evals) == 3  # steps 10 and 20, and the final pass at 30
    assert tables["validation"]["rows"][-1][1] == f"{evals[-1]['accuracy']:.4f}"
    lineage_rows = dict(tables["lineage"]["rows"])
    assert list(lineage_rows) == list(models["challenger_lineage"])
    assert lineage_rows["source"] == f"imagefolder:{HOSTILE_PATH}"  # shown as text, not made an element
    assert seen["scripts"] == 2  # Flyte's tab script and the probe: nothing injected
    assert json.loads(seen["details"][0]) == models["challenger_lineage"]["config"]


def test_promotion_deck_in_the_browser(chromium, models, tmp_path):
    challenger, champion = models["challenger"], models["champion"]
    deck = promotion_deck_html(challenger, champion, "challenger reaches the threshold and the champion",
                               models["challenger_lineage"], models["champion_lineage"], promoted=True)
    seen = render(deck, tmp_path)
    assert_images_decoded(seen, 1)
    assert seen["paragraphs"]["verdict"] == "PROMOTED"
    tables = seen["tables"]
    accuracy = tables["figures"]["rows"][0]
    assert accuracy == ["accuracy", f"{champion.accuracy:.4f}", f"{challenger.accuracy:.4f}",
                        f"{challenger.accuracy - champion.accuracy:+.4f}"]
    deltas = tables["per-class-deltas"]
    assert [row[0] for row in deltas["rows"]] == challenger.classes
    for k, classes in enumerate(deltas["cellClasses"]):
        dropped = challenger.recall[k] < champion.recall[k]
        assert ("worse" in classes[6]) == dropped, (challenger.classes[k], deltas["rows"][k])
    lineage = tables["lineage"]
    assert lineage["header"] == ["key", "champion", "challenger"]
    step_row = lineage["rows"][list(models["challenger_lineage"]).index("checkpoint_step")]
    assert step_row == ["checkpoint_step", "4", "30"]
    config_changes = [row for row in tables["lineage-changes"]["rows"] if row[0].startswith("config.")]
    assert config_changes == [["config.train.max_steps", "4", "30"]]
    assert seen["scripts"] == 2


def test_first_run_promotion_deck_in_the_browser(chromium, models, tmp_path):
    challenger = models["challenger"]
    deck = promotion_deck_html(challenger, None, "no champion yet", models["challenger_lineage"], None,
                               promoted=True)
    seen = render(deck, tmp_path)
    assert_images_decoded(seen, 1)
    assert "first-run" in seen["paragraphs"]
    tables = seen["tables"]
    assert set(tables) == {"figures", "per-class", "lineage"}
    assert tables["figures"]["header"] == ["figure", "challenger"]
    assert tables["per-class"]["rows"] == per_class_rows(challenger)
    assert tables["lineage"]["header"] == ["key", "value"]
