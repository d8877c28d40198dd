"""The config reference (docs/config.md): its table is generated from the attribute docstrings in
``traincore/config/schema.py``.

    python -m traincore.config.doc                          # print the table
    python -m traincore.config.doc --write docs/config.md   # regenerate the table between the markers
    python -m traincore.config.doc --check docs/config.md   # exit 1 when the page's table is out of date

The page is written by hand around the table; only the lines between the two markers are generated
(`make docs` runs the --write line).

Only the standard library and the config schema are imported, so this runs without flytekit or torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
from itertools import pairwise
from pathlib import Path

from traincore.config import schema

START = "<!-- config-table:start -->"
END = "<!-- config-table:end -->"
HEADER = "| field | type | default | description |\n|---|---|---|---|\n"


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: attribute docstring}`` for the dataclass ``cls``, read from its module's source.

    An attribute docstring is the string literal on the statement right after an annotated field.
    Fields without one are left out.
    """
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs = {}
    for stmt, after in pairwise(node.body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def sections() -> dict[str, type]:
    """``{section name: dataclass}`` in ``Config``'s field order."""
    return {f.name: f.default_factory for f in dataclasses.fields(schema.Config)}


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _cell(text: str) -> str:
    """Markdown for one table cell: rst ``literals`` become `code`, pipes are escaped."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def config_table() -> str:
    """A markdown table with one row per field of every section of ``Config``, ending in a newline."""
    rows = []
    for section, cls in sections().items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            description = _cell(docs.get(f.name, ""))
            rows.append(f"| `{section}.{f.name}` | `{kind}` | `{_default(f)!r}` | {description} |")
    return HEADER + "\n".join(rows) + "\n"


def splice(text: str, table: str) -> str:
    """``text`` with everything between the config-table markers replaced by ``table``."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the markers {START} and {END} are missing (or out of order)")
    return text[:start + len(START)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m traincore.config.doc",
                                     description="Generate or check the config table of docs/config.md.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="PAGE", help="replace the table between the markers in this file")
    mode.add_argument("--check", metavar="PAGE", help="exit 1 when this file's table differs")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(config_table())
        return 0
    path = Path(args.write or args.check)
    text = path.read_text(encoding="utf-8")
    try:
        updated = splice(text, config_table())
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if updated != text:
            print(f"{path}'s config table is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        path.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
