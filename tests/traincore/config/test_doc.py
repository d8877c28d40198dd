"""The config table of docs/config.md is generated from the field docstrings in traincore/config/schema.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from traincore.config import doc as config_doc
from traincore.config.schema import Config

ROOT = Path(__file__).resolve().parents[3]
CONFIG_PAGE = ROOT / "docs" / "config.md"
SECTIONS = [f.default_factory for f in dataclasses.fields(Config)]


def test_committed_config_page_is_up_to_date():
    text = CONFIG_PAGE.read_text(encoding="utf-8")
    assert text.count(config_doc.START) == 1 and text.count(config_doc.END) == 1
    between = text.split(config_doc.START)[1].split(config_doc.END)[0]
    assert between == "\n" + config_doc.config_table(), "docs/config.md is stale: run `make docs`"
    assert config_doc.main(["--check", str(CONFIG_PAGE)]) == 0


def test_make_docs_writes_the_config_page():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "-m traincore.config.doc --write docs/config.md" in recipe


def test_readme_links_the_config_page():
    assert "(docs/config.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("cls", [Config, *SECTIONS], ids=lambda cls: cls.__name__)
def test_every_field_has_a_docstring(cls):
    docs = config_doc.field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
    assert not missing, f"{cls.__name__} fields without an attribute docstring: {missing}"


def test_one_row_per_field():
    rows = config_doc.config_table().splitlines()[2:]
    expected = [f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
                for f in dataclasses.fields(section.default_factory)]
    assert [row.split(" | ")[0].strip("| `") for row in rows] == expected
    assert all(row.startswith("| `") and row.endswith(" |") and row.count(" | ") >= 3 for row in rows)


def test_check_fails_on_drift_and_write_fixes_it(tmp_path, capsys):
    page = tmp_path / "config.md"
    start, end = config_doc.START, config_doc.END
    page.write_text(f"intro\n{start}\n| old | table |\n{end}\noutro\n", encoding="utf-8")
    assert config_doc.main(["--check", str(page)]) == 1
    assert "config table is out of date: run `make docs`" in capsys.readouterr().err
    assert config_doc.main(["--write", str(page)]) == 0
    assert config_doc.main(["--check", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith(f"intro\n{start}\n| field |") and text.endswith(f"{end}\noutro\n")


def test_missing_markers_are_an_error(tmp_path):
    page = tmp_path / "config.md"
    page.write_text("no markers here\n", encoding="utf-8")
    assert config_doc.main(["--check", str(page)]) == 2
