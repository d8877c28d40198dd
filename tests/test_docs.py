"""Every command shown in README.md and docs/*.md exists as written, and every relative link resolves.

A command is a line of a fenced code block (backslash continuations joined, a leading ``$ `` prompt dropped)
or an inline code span. What is checked:

- ``python -m <module> ...`` and ``torchrun ... -m <module> ...`` for a module of this repository: the module
  exists and its argparse parser accepts every ``--flag`` shown (and the subcommand shown, if it has some);
  the parser is captured by running the module as ``__main__`` until it parses its arguments, nothing more;
- ``python <script>.py --flag`` for a script of this repository: the same;
- ``pyflyte ... run <file>.py <workflow> --<input> ...``: the workflow exists and takes every input shown;
- ``make <target>``: a target of the Makefile;
- ``pip install``: only ``.[extra]`` of a checkout, with extras pyproject.toml defines (the package is not
  published, so never by its name);
- ``scripts/<name>`` and every other repository path the pages name (traincore/..., tests/..., ...) exist;
- every relative link ``[text](path#anchor)`` resolves to a file and, for a page, to one of its headings.

Tables and sample output are checked against the code too:

- a table of ``--flags`` documents the CLI its section names first (``traincore.train``, ...): it lists
  every option of that CLI's argparse parser and no other, with the parser's choices where it shows them;
- a table of workflow inputs (first column ``input``) names only inputs of the workflow its section names
  first, with the signature's defaults; the README's table of ``training_pipeline`` and retraining's table
  of ``retrain_and_promote`` list every input;
- every sample ``plan: ...`` line has the shape of the line ``plan_run`` prints (tasks/plan.py).

And what the pages say against the code, deploy/ and the benchmarks:

- every ``enabled-plugins`` list is deploy/'s, and a gang scheduler named is deploy/'s first;
- no secret value on a command line (``--from-literal``); every launch-plan activation names its project and
  domain; every ``$VAR`` a code block uses is set in that block;
- a page that runs the project with a bare ``python``/``torchrun`` says to activate ``.venv``, and stages the
  ``--data`` directories its commands read;
- the README's presets exist with the sources it gives them, and the workflow replaces a preset's source
  as it says; every list of data sources (pages, the ``source`` help) names every source kind;
- benchmark figures quoted are bench/results/latest.json's, and the build context described is
  .dockerignore's.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_PACKAGES = ("traincore", "tasks", "workflows", "replay", "bench")
PATH_PREFIXES = ("traincore", "tasks", "tests", "workflows", "replay", "bench", "scripts", "dockerfiles",
                 "docs", ".ci")
SEPARATORS = {"&&", "||", ";", "|", "&"}
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(map(re.escape, PATH_PREFIXES)) + r")/[\w./-]*)")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    tokens: tuple[str, ...]

    @property
    def id(self) -> str:
        text = " ".join(self.tokens)
        return f"{self.page}:{self.line}: {text[:70]}"


# --- reading the pages ---------------------------------------------------------------------------------


def split_fences(text: str) -> tuple[list[tuple[int, str]], str]:
    """(the lines inside fenced code blocks with their line numbers, the prose with those lines blanked)."""
    code, prose, inside = [], [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            inside = not inside
            prose.append("")
        elif inside:
            code.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return code, "\n".join(prose)


def tokenize(text: str) -> list[str]:
    """Shell words of ``text``, comments dropped, ``&&``/``|``/``;`` as tokens of their own."""
    # Not "<" and ">": placeholders such as IMAGE=<registry>/<name>:<tag> stay one word.
    lexer = shlex.shlex(text, posix=True, punctuation_chars="();|&")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote in a shortened example: plain words will do
        return text.split("#")[0].split()


def commands_in(snippet: str) -> list[list[str]]:
    """The simple commands of a snippet: split at separators; env assignments, ``sudo``, ``$`` dropped."""
    snippet = snippet.replace("\\|", "|")
    result, current = [], []
    for token in [*tokenize(snippet), ";"]:
        if token in SEPARATORS:
            while current and (current[0] in ("$", "sudo") or re.fullmatch(r"[A-Za-z_]\w*=.*", current[0])):
                current.pop(0)
            if current:
                result.append(current)
            current = []
        else:
            current.append(token)
    return result


def page_commands(page: Path) -> list[Command]:
    return text_commands(page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8"))


def text_commands(name: str, text: str, inline: bool = True) -> list[Command]:
    """The commands of a page's code blocks and (with ``inline``) of its inline code spans."""
    code, prose = split_fences(text)
    found = []
    pending, start = "", 0
    for number, line in code:
        stripped = line.strip()
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        found += [Command(name, start, tuple(c)) for c in commands_in(pending + stripped)]
        pending = ""
    for match in INLINE_CODE.finditer(prose if inline else ""):
        number = prose.count("\n", 0, match.start()) + 1
        found += [Command(name, number, tuple(c)) for c in commands_in(match.group(1).replace("\n", " "))]
    return found


ALL_COMMANDS = [command for page in PAGES for command in page_commands(page)]


def is_python(token: str) -> bool:
    return re.fullmatch(r"python(3(\.\d+)?)?", os.path.basename(token)) is not None


def module_command(tokens: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of ``python -m M ...`` / ``torchrun ... -m M ...`` for a module of ours."""
    if not (is_python(tokens[0]) or os.path.basename(tokens[0]) == "torchrun") or "-m" not in tokens:
        return None
    at = tokens.index("-m")
    if at + 1 >= len(tokens) or tokens[at + 1].split(".")[0] not in REPO_PACKAGES:
        return None
    return tokens[at + 1], list(tokens[at + 2:])


def script_command(tokens: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(script path, its arguments) of ``python <path>.py ...`` for a path inside this repository."""
    if is_python(tokens[0]) and len(tokens) > 1 and tokens[1].endswith(".py") \
            and tokens[1].split("/")[0] in PATH_PREFIXES:
        return tokens[1], list(tokens[2:])
    return None


def pyflyte_run(tokens: tuple[str, ...]) -> tuple[str, str, list[str]] | None:
    """(file, entity, arguments) of ``pyflyte ... run [options] <file>.py <entity> ...``."""
    if os.path.basename(tokens[0]) != "pyflyte" or "run" not in tokens:
        return None
    rest = tokens[tokens.index("run") + 1:]
    files = [i for i, token in enumerate(rest) if token.endswith(".py")]
    if not files or files[0] + 1 >= len(rest):
        return None
    return rest[files[0]], rest[files[0] + 1], list(rest[files[0] + 2:])


def make_targets_of(tokens: tuple[str, ...]) -> list[str]:
    if os.path.basename(tokens[0]) != "make":
        return []
    return [t for t in tokens[1:] if not t.startswith("-") and "=" not in t]


# --- what the repository offers ------------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parsed")
        self.parser = parser


@cache
def parser_of(target: str) -> argparse.ArgumentParser:
    """The argparse parser of a module (``pkg.mod``) or script (``path.py``), captured as it parses its
    arguments when run as ``__main__`` (with ``--help`` as its argv, in case it does not use argparse)."""

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    original, saved_argv, saved_path = argparse.ArgumentParser.parse_known_args, sys.argv, list(sys.path)
    argparse.ArgumentParser.parse_known_args = capture
    sys.argv = [target, "--help"]
    try:
        if target.endswith(".py"):
            runpy.run_path(str(ROOT / target), run_name="__main__")
        else:
            with warnings.catch_warnings():  # runpy warns when the module was imported before: harmless here
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except _Parsed as parsed:
        return parsed.parser
    except SystemExit as exc:
        raise AssertionError(f"{target} exited ({exc.code}) before parsing arguments with argparse") from exc
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise AssertionError(f"{target} ran to its end without parsing arguments with argparse")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _values_taken(nargs, following: list[str]) -> int:
    """How many of ``following`` an option with this ``nargs`` consumes."""
    if nargs == 0:
        return 0
    if nargs is None:
        return 1
    if isinstance(nargs, int):
        return nargs
    count = 0
    while count < len(following) and not following[count].startswith("-"):
        count += 1
        if nargs == "?":
            break
    return count


def flag_problems(target: str, args: list[str]) -> list[str]:
    """What in ``args`` the parser of ``target`` would not accept as written: unknown flags, subcommands."""
    parser = parser_of(target)
    options, subcommands = _options(parser), _subcommands(parser)
    problems, i, chosen = [], 0, False
    while i < len(args):
        token = args[i]
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            action = options.get(flag)
            if action is None:
                problems.append(f"{target} has no option {flag} (it has {', '.join(sorted(options))})")
                i += 1
                continue
            i += 1 + (0 if "=" in token else _values_taken(action.nargs, args[i + 1:]))
            continue
        if subcommands and not chosen and not token.startswith("-"):
            chosen = True
            if token not in subcommands:
                known = ", ".join(sorted(subcommands))
                problems.append(f"{target} has no subcommand {token} (it has {known})")
            else:
                options = {**options, **_options(subcommands[token])}
        i += 1
    return problems


@cache
def workflow_inputs(file: str, entity: str) -> dict[str, type]:
    module = importlib.import_module(Path(file).with_suffix("").as_posix().replace("/", "."))
    if not hasattr(module, entity):
        raise AssertionError(f"{file} has no workflow or task {entity}")
    return dict(getattr(module, entity).python_interface.inputs)


def input_problems(file: str, entity: str, args: list[str]) -> list[str]:
    if not (ROOT / file).is_file():
        return [f"{file} does not exist"]
    inputs = workflow_inputs(file, entity)
    problems, i = [], 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("--") or token == "--help":
            continue
        name = token[2:].split("=", 1)[0]
        if name not in inputs:
            problems.append(f"{entity} ({file}) has no input {name} (it has {', '.join(inputs)})")
        elif "=" not in token and inputs[name] is not bool:
            i += 1
    return problems


@cache
def makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*):(?!=)", line)
        if match:
            targets.update(match.group(1).split())
    return targets


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> set[str]:
    _, prose = split_fences(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in prose.splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def link_problems(page: Path) -> list[str]:
    _, prose = split_fences(page.read_text(encoding="utf-8"))
    problems = []
    for match in LINK.finditer(re.sub(r"`[^`]*`", "", prose)):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"link {target}: {path} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"link {target}: {resolved.name} has no heading #{anchor}")
    return problems


def path_problems(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    problems = []
    for match in REPO_PATH.finditer(text):
        following = text[match.end():match.end() + 1]
        if following in ("*", "<", "{", "["):  # a pattern (bench/results/latest.*), not a path
            continue
        path = match.group(1).rstrip(".,:")
        if not (ROOT / path).exists():
            problems.append(f"{path} does not exist")
    return sorted(set(problems))


# --- tables and sample output ----------------------------------------------------------------------------

TABLE_ROW = re.compile(r"^\s*\|(.*)\|\s*$")
TABLE_RULE = re.compile(r"^\s*\|(\s*:?-+:?\s*\|)+\s*$")
HEADING = re.compile(r"^#{1,6}\s")
CLI_NAME = re.compile(r"(?<![\w/.])((?:" + "|".join(REPO_PACKAGES) + r")(?:\.\w+)+)")
BACKTICKED = re.compile(r"`([^`]+)`")
# The input tables that must list every input of their workflow: (page, workflow).
COMPLETE_INPUT_TABLES = {("README.md", "training_pipeline"), ("docs/retraining.md", "retrain_and_promote")}


@dataclass(frozen=True)
class Table:
    page: str
    line: int  # of the header row
    context: str  # the page from the heading above the table down to the table, code blocks included
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def split_row(line: str) -> tuple[str, ...]:
    """The cells of a table row; ``\\|`` inside a cell is part of the cell."""
    inner = TABLE_ROW.match(line).group(1)
    return tuple(cell.strip() for cell in re.split(r"(?<!\\)\|", inner))


def text_tables(name: str, text: str) -> list[Table]:
    lines = text.splitlines()
    _, prose = split_fences(text)
    plain = prose.splitlines()
    tables, i = [], 0
    while i < len(plain) - 1:
        if not (TABLE_ROW.match(plain[i]) and TABLE_RULE.match(plain[i + 1])):
            i += 1
            continue
        end = i + 2
        while end < len(plain) and TABLE_ROW.match(plain[end]):
            end += 1
        start = next((k for k in range(i, -1, -1) if HEADING.match(plain[k])), 0)
        tables.append(Table(name, i + 1, "\n".join(lines[start:i]), split_row(plain[i]),
                            tuple(split_row(row) for row in plain[i + 2:end])))
        i = end
    return tables


def page_tables(page: Path) -> list[Table]:
    return text_tables(page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8"))


ALL_TABLES = [table for page in PAGES for table in page_tables(page)]


def is_flag_table(table: Table) -> bool:
    return bool(table.rows) and all(row[0].startswith("`--") for row in table.rows)


def documented_cli(table: Table) -> str | None:
    """The module the table's section names first (``traincore.train``), or None."""
    found = CLI_NAME.findall(table.context)
    return found[0] if found else None


def flag_table_problems(table: Table) -> list[str]:
    """What a flag table gets wrong against its CLI's parser, in both directions."""
    cli = documented_cli(table)
    if cli is None:
        return [f"{table.id}: a flag table whose section names no CLI of this repository "
                "(e.g. traincore.train)"]
    parser = parser_of(cli)
    actions = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    options = _options(parser)
    documented: dict[str, str] = {}  # flag -> what the table shows after it (its value or choices)
    for row in table.rows:
        for span in BACKTICKED.findall(row[0]):
            if span.startswith("--"):
                flag, _, shown = span.partition(" ")
                documented[flag] = shown.replace("\\|", "|")
    problems = [f"{table.id}: {cli} has no option {flag}" for flag in documented if flag not in options]
    problems += [f"{table.id}: the table of {cli} omits {'/'.join(a.option_strings)}" for a in actions
                 if not set(a.option_strings) & set(documented)]
    for flag, shown in documented.items():
        action = options.get(flag)
        if action is not None and action.choices and "|" in shown:
            if set(shown.split("|")) != {str(choice) for choice in action.choices}:
                problems.append(f"{table.id}: {flag} shows {shown}, but {cli} accepts "
                                f"{'|'.join(map(str, action.choices))}")
    return problems


@cache
def workflow_files() -> dict[str, str]:
    """Every @workflow of workflows/*.py: name -> file."""
    found = {}
    for path in sorted((ROOT / "workflows").glob("*.py")):
        for name in re.findall(r"^@workflow\b.*\n(?:@.*\n)*def (\w+)\(", path.read_text(encoding="utf-8"),
                               flags=re.MULTILINE):
            found[name] = path.relative_to(ROOT).as_posix()
    return found


def is_input_table(table: Table) -> bool:
    return bool(table.rows) and table.header[0].strip().lower() == "input"


def documented_workflow(table: Table) -> str | None:
    """The workflow the table's section names first, or None."""
    names = "|".join(map(re.escape, workflow_files()))
    found = re.findall(rf"(?<!\w)({names})(?!\w)", table.context)
    return found[0] if found else None


def shown_default(value) -> str:
    """A default as the tables show it: ``""``, ``0``, ``false``, none, a string as it is."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


@cache
def workflow_defaults(entity: str) -> dict[str, object]:
    file = workflow_files()[entity]
    module = importlib.import_module(Path(file).with_suffix("").as_posix().replace("/", "."))
    return {name: default for name, (_, default) in
            getattr(module, entity).python_interface.inputs_with_defaults.items()}


def input_table_problems(table: Table) -> list[str]:
    """Inputs the workflow does not have, defaults it does not use, and (for the tables that list them all)
    inputs the table leaves out."""
    entity = documented_workflow(table)
    if entity is None:
        return [f"{table.id}: an input table whose section names no workflow ({', '.join(workflow_files())})"]
    defaults = workflow_defaults(entity)
    problems, named = [], []
    for row in table.rows:
        names = BACKTICKED.findall(row[0])
        shown = BACKTICKED.findall(row[1]) or [row[1].strip()] if len(row) > 1 else []
        if len(shown) == 1:
            shown = shown * len(names)
        if len(shown) != len(names):
            problems.append(f"{table.id}: row {row[0]}: {len(names)} inputs but {len(shown)} defaults")
            shown = [None] * len(names)
        for name, default in zip(names, shown, strict=True):
            named.append(name)
            if name not in defaults:
                problems.append(f"{table.id}: {entity} has no input {name} (it has {', '.join(defaults)})")
            elif default is not None and default != shown_default(defaults[name]):
                problems.append(f"{table.id}: the default of {name} is {shown_default(defaults[name])}, "
                                f"not {default}")
    if (table.page, entity) in COMPLETE_INPUT_TABLES:
        missing = [name for name in defaults if name not in named]
        if missing:
            problems.append(f"{table.id}: the table of {entity} omits {', '.join(missing)}")
    return problems


@cache
def plan_line_pattern() -> re.Pattern:
    """The line plan_run prints, as a regex: its f-string in tasks/plan.py with every field as ``.+?``."""
    tree = ast.parse((ROOT / "tasks" / "plan.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
                and str(node.values[0].value).startswith("plan: preset "):
            return re.compile("".join(re.escape(part.value) if isinstance(part, ast.Constant) else ".+?"
                                      for part in node.values))
    raise AssertionError("tasks/plan.py prints no line starting 'plan: preset '")


def sample_plan_lines(text: str) -> list[tuple[int, str]]:
    code, _ = split_fences(text)
    return [(number, line.strip()) for number, line in code if line.strip().startswith("plan: preset ")]


# --- the tests ------------------------------------------------------------------------------------------


def _pick(kind) -> list:
    return [pytest.param(c, id=c.id) for c in ALL_COMMANDS if kind(c.tokens)]


@pytest.mark.parametrize("command", _pick(module_command))
def test_module_commands_exist_with_their_flags(command):
    module, args = module_command(command.tokens)
    assert importlib.util.find_spec(module) is not None, f"{command.id}: no module {module}"
    if args:
        problems = flag_problems(module, args)
        assert not problems, f"{command.id}: " + "; ".join(problems)


@pytest.mark.parametrize("command", _pick(script_command))
def test_script_commands_exist_with_their_flags(command):
    script, args = script_command(command.tokens)
    assert (ROOT / script).is_file(), f"{command.id}: {script} does not exist"
    if any(a.startswith("--") for a in args):
        problems = flag_problems(script, args)
        assert not problems, f"{command.id}: " + "; ".join(problems)


@pytest.mark.parametrize("command", _pick(pyflyte_run))
def test_pyflyte_run_names_inputs_of_the_workflow(command):
    problems = input_problems(*pyflyte_run(command.tokens))
    assert not problems, f"{command.id}: " + "; ".join(problems)


@pytest.mark.parametrize("command", _pick(make_targets_of))
def test_make_targets_exist(command):
    missing = [t for t in make_targets_of(command.tokens) if t not in makefile_targets()]
    assert not missing, f"{command.id}: no Makefile target {missing}"


@pytest.mark.parametrize("command", _pick(lambda tokens: re.fullmatch(r"scripts/[\w.-]+", tokens[0])))
def test_scripts_exist_and_are_executable(command):
    script = ROOT / command.tokens[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{command.id}: not an executable file"


PACKAGE_NAME = "flyte-torch-pipeline"
EXTRA_SPEC = re.compile(r"^(?:\.|\./|" + re.escape(PACKAGE_NAME) + r")\[([\w,-]+)\]$")


def _pip_install(tokens: tuple[str, ...]) -> bool:
    return os.path.basename(tokens[0]) == "pip" and "install" in tokens


def pip_problems(tokens: tuple[str, ...]) -> list[str]:
    """A pip install of this package must name the checkout (``.[extra]``), with extras that exist."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, flags=re.MULTILINE))
    problems = []
    for token in tokens[tokens.index("install") + 1:]:
        if token.startswith(PACKAGE_NAME):
            problems.append(f"{token}: {PACKAGE_NAME} is not published; from a checkout install "
                            f"'.{token[len(PACKAGE_NAME):]}'")
        match = EXTRA_SPEC.match(token)
        if match:
            problems += [f"pyproject.toml has no extra {extra}" for extra in match.group(1).split(",")
                         if extra not in extras]
    return problems


@pytest.mark.parametrize("command", _pick(_pip_install))
def test_pip_installs_the_checkout_with_extras_that_exist(command):
    problems = pip_problems(command.tokens)
    assert not problems, f"{command.id}: " + "; ".join(problems)


@pytest.mark.parametrize("table", [t for t in ALL_TABLES if is_flag_table(t)], ids=lambda t: t.id)
def test_flag_tables_match_their_parsers(table):
    problems = flag_table_problems(table)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("table", [t for t in ALL_TABLES if is_input_table(t)], ids=lambda t: t.id)
def test_input_tables_match_their_workflows(table):
    problems = input_table_problems(table)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_sample_plan_lines_have_the_printed_shape(page):
    pattern = plan_line_pattern()
    wrong = [f"{number}: {line}" for number, line in sample_plan_lines(page.read_text(encoding="utf-8"))
             if not pattern.fullmatch(line)]
    assert not wrong, f"lines unlike tasks/plan.py's ({pattern.pattern}): " + "; ".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    problems = link_problems(page)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_repository_paths_exist(page):
    problems = path_problems(page)
    assert not problems, "; ".join(problems)


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    code, _ = split_fences(text.split("## Quickstart", 1)[1].split("\n## ", 1)[0])
    assert [line.split("#")[0].strip() for _, line in code] == ["make run", "make test"]
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(text)}
    pages = {p.relative_to(ROOT).as_posix() for p in PAGES[1:]}
    assert pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"


def test_the_pages_show_commands_of_every_kind():
    """The collector finds what it is meant to check (a broken one would pass everything)."""
    kinds = {"module": module_command, "script": script_command, "pyflyte run": pyflyte_run,
             "make": make_targets_of}
    for kind, pick in kinds.items():
        assert _pick(pick), f"no {kind} command found in {[p.name for p in PAGES]}"
    modules = {module_command(c.tokens)[0] for c in ALL_COMMANDS if module_command(c.tokens)}
    assert {"traincore.stage", "traincore.train", "traincore.export", "traincore.evaluate"} <= modules
    assert _pick(_pip_install), "no pip install found"


def test_the_pages_show_the_tables_and_lines_checked():
    """The table and sample-line collectors find what they are meant to check."""
    flag_tables = {(t.page, documented_cli(t)) for t in ALL_TABLES if is_flag_table(t)}
    assert ("docs/core.md", "traincore.train") in flag_tables
    input_tables = {(t.page, documented_workflow(t)) for t in ALL_TABLES if is_input_table(t)}
    assert COMPLETE_INPUT_TABLES <= input_tables
    assert ("docs/backends.md", "training_pipeline") in input_tables  # the Slurm inputs
    assert sample_plan_lines((ROOT / "docs" / "retraining.md").read_text(encoding="utf-8"))


def test_the_checks_fail_on_what_does_not_exist(tmp_path):
    [problem] = flag_problems("traincore.train", ["--data", "d", "--no-such-flag", "1"])
    assert problem.startswith("traincore.train has no option --no-such-flag (it has ")
    assert not flag_problems("traincore.train", ["--data", "d", "--config", '{"optim.lr": 0.01}'])
    assert flag_problems("traincore.registry", ["promote", "uri"])
    assert input_problems("workflows/pipeline.py", "training_pipeline", ["--no_such_input", "1"])
    assert not input_problems("workflows/pipeline.py", "training_pipeline", ["--slurm_setup", "--x=1"])
    assert "no-such-target" not in makefile_targets() and {"run", "test", "docs"} <= makefile_targets()
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere)\n", encoding="utf-8")
    assert len(link_problems(page)) == 2
    page.write_text("see `traincore/no_such_module.py`, `tasks/slurm/connector.py`\n", encoding="utf-8")
    assert path_problems(page) == ["traincore/no_such_module.py does not exist"]
    assert pip_problems(("pip", "install", f"{PACKAGE_NAME}[connector]"))
    assert pip_problems(("pip", "install", "-e", ".[no-such-extra]"))
    assert not pip_problems(("pip", "install", "-e", ".[connector,dev]"))
    assert make_targets_of(tuple(tokenize("make run IMAGE=<registry>/<name>:<tag>"))) == ["run"]


FLAG_TABLE = """## Training: `traincore.train`

| flag | meaning |
|---|---|
| `--data DIR` | data |
| `--checkpoint-mode sync\\|dcp` | modes |
| `--no-such-flag` | nothing |
"""


def test_flag_table_check_fails_both_ways():
    [table] = text_tables("page.md", FLAG_TABLE)
    assert documented_cli(table) == "traincore.train"
    problems = flag_table_problems(table)
    assert "page.md:3: traincore.train has no option --no-such-flag" in problems
    assert "page.md:3: the table of traincore.train omits --output" in problems
    assert "page.md:3: the table of traincore.train omits --parallelism" in problems
    assert any("--checkpoint-mode shows sync|dcp, but traincore.train accepts sync|dcp|async" in p
               for p in problems)
    [orphan] = text_tables("page.md", FLAG_TABLE.replace("`traincore.train`", "training"))
    assert flag_table_problems(orphan) == ["page.md:3: a flag table whose section names no CLI of this "
                                           "repository (e.g. traincore.train)"]


def test_input_table_check_fails_both_ways():
    text = """## Inputs of `training_pipeline`

| input | default | meaning |
|---|---|---|
| `preset` | `mnist` | wrong default |
| `epochs` / `max_steps` | `0` / `0` | two at once |
| `no_such_input` | `""` | unknown |
"""
    [table] = text_tables("README.md", text)
    problems = input_table_problems(table)
    assert "README.md:3: the default of preset is digits, not mnist" in problems
    assert any(p.startswith("README.md:3: training_pipeline has no input no_such_input") for p in problems)
    [omits] = [p for p in problems if "omits" in p]
    assert "nproc_per_node" in omits and "epochs" not in omits.split("omits", 1)[1]
    [partial] = text_tables("docs/other.md", text)  # only the listed tables must be complete
    assert not [p for p in input_table_problems(partial) if "omits" in p]


def test_plan_line_check_fails_on_the_old_shape():
    pattern = plan_line_pattern()
    line = ("plan: preset debug, source digits (input source; digits:sha256:0123), model small_cnn, "
            "20 steps; 1 node(s) x 1 process(es) on local")
    assert pattern.fullmatch(line + ", ddp")
    assert not pattern.fullmatch(line)
    assert not pattern.fullmatch(line.replace("input source; ", "") + ", ddp")  # no word of its origin


# --- what the pages say against deploy/, the presets, the benchmarks and the code ------------------------
#
# Each check reads a page as (name, text), so that it runs on any version of a page, and returns its problems.


def page_texts() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8")) for page in PAGES]


def line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def code_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced code block."""
    blocks, current, start, inside = [], [], 0, False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            if inside:
                blocks.append((start, "\n".join(current)))
                current = []
            start = number + 1
            inside = not inside
        elif inside:
            current.append(line)
    return blocks


def _yaml_items(node):
    """Every (key, value) pair of a YAML tree, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _yaml_items(value)
    elif isinstance(node, list):
        for value in node:
            yield from _yaml_items(value)


@cache
def deploy_items() -> tuple:
    """Every (key, value) pair of every YAML document under deploy/."""
    import yaml

    items = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            items += _yaml_items(document)
    return tuple(items)


@cache
def deploy_plugins() -> frozenset[str]:
    """The plugins deploy/'s values enable (the flyte-binary and flyte-core lists must agree)."""
    lists = {frozenset(value) for key, value in deploy_items() if key == "enabled-plugins"}
    assert len(lists) == 1, f"deploy/ has {len(lists)} different enabled-plugins lists: {lists}"
    return next(iter(lists))


PLUGIN_LIST = re.compile(r"enabled-plugins:\s*(?:\[([^\]]*)\]|\n((?:[ \t]*-[ \t]*[\w-]+[ \t]*\n)+))")


def plugin_lists(text: str) -> list[tuple[int, set[str]]]:
    """(line, plugins) of every ``enabled-plugins:`` list a page shows, flow (``[a, b]``) or block style."""
    found = []
    for match in PLUGIN_LIST.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        plugins = {item.strip(" \t-`") for item in re.split(r"[,\n]", body)} - {""}
        found.append((line_of(text, match.start()), plugins))
    return found


def plugin_list_problems(name: str, text: str) -> list[str]:
    """Helm replaces the list as a whole: one shown without a plugin deploy/ enables disables it."""
    expected = deploy_plugins()
    return [f"{name}:{line}: enabled-plugins {sorted(shown)} differs from deploy/'s {sorted(expected)} "
            f"(missing {sorted(expected - shown)}, extra {sorted(shown - expected)})"
            for line, shown in plugin_lists(text) if shown != expected]


@cache
def deploy_gang_scheduler() -> str:
    names = {value.split("=", 1)[1] for _, value in deploy_items()
             if isinstance(value, str) and value.startswith("--gang-scheduler-name=")}
    assert len(names) == 1, f"deploy/ names {len(names)} gang schedulers: {names}"
    return names.pop()


def gang_scheduler_problems(name: str, text: str) -> list[str]:
    """A page that names a gang scheduler names deploy/'s first (another one only as the alternative)."""
    named = list(re.finditer(r"--gang-scheduler-name=([\w.-]+)", text))
    if named and named[0].group(1) != deploy_gang_scheduler():
        return [f"{name}:{line_of(text, named[0].start())}: --gang-scheduler-name={named[0].group(1)}, but "
                f"deploy/training-operator starts the operator with {deploy_gang_scheduler()}"]
    return []


def secret_value_problems(name: str, text: str) -> list[str]:
    """A secret's value on a command line is visible in ``ps`` and the shell history (docs/deploy.md)."""
    return [f"{name}:{line_of(text, match.start())}: --from-literal puts the secret's value on the command "
            "line: use --from-file (a file holding the value) or deploy/create-secrets.sh"
            for match in re.finditer(r"--from-literal\b", text)]


def launch_plan_command(tokens: tuple[str, ...]) -> list[str] | None:
    """The arguments after ``launchplan`` of ``pyflyte ... launchplan`` or ``flytectl update launchplan``."""
    tool = os.path.basename(tokens[0])
    if "launchplan" not in tokens or not (tool == "pyflyte" or (tool == "flytectl" and "update" in tokens)):
        return None
    return list(tokens[tokens.index("launchplan") + 1:])


@cache
def pyflyte_options(subcommand: str) -> frozenset[str]:
    from flytekit.clis.sdk_in_container.pyflyte import main

    params = main.commands[subcommand].params
    return frozenset(opt for p in params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-"))


def launch_plan_problems(command: Command) -> list[str]:
    """Activation without --project and --domain acts on the defaults, not where the plan was registered."""
    args = launch_plan_command(command.tokens)
    flags = {arg.split("=", 1)[0] for arg in args if arg.startswith("-")}
    problems = [f"names no {long} ({short})" for long, short in (("--project", "-p"), ("--domain", "-d"))
                if not flags & {long, short}]
    if os.path.basename(command.tokens[0]) == "pyflyte":
        problems += [f"pyflyte launchplan has no option {flag}" for flag in sorted(flags)
                     if flag not in pyflyte_options("launchplan")]
    return problems


@cache
def presets() -> dict:
    """PRESETS (name -> function) of the presets module, wherever the config package keeps it."""
    for module in ("traincore.config", "traincore.presets"):
        try:
            found = getattr(importlib.import_module(module), "PRESETS", None)
        except ImportError:
            continue
        if found:
            return dict(found)
    raise AssertionError("neither traincore.config nor traincore.presets has PRESETS")


PRESET_BULLET = re.compile(r"^- `(\w+)` \(own source `([^`]+)`\)", flags=re.MULTILINE)
PRESET_LIST_PAGE = "README.md"  # the page that lists every preset


def preset_problems(name: str, text: str) -> list[str]:
    """A list of presets (``- `name` (own source `source`): ...``) gives each the source it has, the
    README's names every preset, and the ``preset`` input's row names only presets that exist."""
    known = presets()
    listed = PRESET_BULLET.findall(text)
    problems = [f"{name}: no preset {preset}" for preset, _ in listed if preset not in known]
    problems += [f"{name}: preset {preset} has the source {known[preset]().data.source!r}, not {source!r}"
                 for preset, source in listed if preset in known and known[preset]().data.source != source]
    missing = set(known) - {preset for preset, _ in listed}
    if name == PRESET_LIST_PAGE and missing:
        problems.append(f"{name}: the list of presets omits, or gives no own source for, {sorted(missing)}")
    for table in text_tables(name, text):
        for row in table.rows:
            if row[0] == "`preset`" and len(row) > 2:
                problems += [f"{table.id}: the preset row names {span}, which is no preset"
                             for span in BACKTICKED.findall(row[2])
                             if re.fullmatch(r"[a-z_]+", span) and span not in known]
    return problems


# Names a block may use without setting them: the shell's own environment.
SHELL_ENVIRONMENT = {"HOME", "USER", "PATH", "PWD", "SHELL"}
# Set in one code block and used in a later one on purpose: docs/deploy.md sets CONNECTOR_IMAGE where it
# builds the connector's image (step 1) and uses it where it applies the connector (step 4).
CARRIED_VARIABLES = {"CONNECTOR_IMAGE"}
VARIABLE_USE = re.compile(r"\$\{?([A-Za-z_]\w*)")
VARIABLE_SET = re.compile(r"(?:^|[\s;&|(])(?:export\s+)?([A-Za-z_]\w*)=", flags=re.MULTILINE)


def variable_problems(name: str, text: str) -> list[str]:
    """Every ``$VAR`` a code block uses is set in that block: readers run one block, the one they need (of
    two alternatives, say), and an unset variable expands to nothing without an error."""
    problems, earlier = [], set()
    for line, block in code_blocks(text):
        assigned = set(VARIABLE_SET.findall(block))
        for variable in sorted(set(VARIABLE_USE.findall(block)) - assigned - SHELL_ENVIRONMENT):
            if not (variable in CARRIED_VARIABLES and variable in earlier):
                problems.append(f"{name}:{line}: the code block uses ${variable} but does not set it")
        earlier |= assigned
    return problems


ACTIVATE = re.compile(r"(?:^|[\s`(])(?:\.|source) \.venv/bin/activate\b", flags=re.MULTILINE)


def runs_project_code_from_path(tokens: tuple[str, ...]) -> bool:
    """A command that runs this repository's code with whatever ``python`` or ``torchrun`` is on PATH."""
    if tokens[0] == "torchrun" or re.fullmatch(r"examples/[\w./-]+\.sh", tokens[0]):
        return True
    return re.fullmatch(r"python(3(\.\d+)?)?", tokens[0]) is not None \
        and (module_command(tokens) is not None or script_command(tokens) is not None)


def venv_problems(name: str, text: str) -> list[str]:
    """A page whose code blocks run the project with a bare ``python``/``torchrun`` says to activate .venv."""
    if ACTIVATE.search(text):
        return []
    return [f"{c.id}: runs the project with the python on PATH, but the page never says to activate .venv "
            "(`. .venv/bin/activate`)" for c in text_commands(name, text, inline=False)
            if runs_project_code_from_path(c.tokens)]


def _option_values(args: list[str], flag: str) -> list[str]:
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(flag + "=")]
    return values + [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == flag]


def staged_data_problems(name: str, text: str) -> list[str]:
    """Every ``--data DIR`` a page's train / evaluate commands read is staged on the page
    (``traincore.stage --output DIR``); placeholders and URIs aside."""
    commands = [(c, *module_command(c.tokens)) for c in text_commands(name, text, inline=False)
                if module_command(c.tokens)]
    staged = {value for _, module, args in commands if module == "traincore.stage"
              for value in _option_values(args, "--output")}
    return [f"{c.id}: --data {value} is never staged on this page (traincore.stage --output {value})"
            for c, module, args in commands if module in ("traincore.train", "traincore.evaluate")
            for value in _option_values(args, "--data")
            if value not in staged and not re.search(r"[<$]|://", value)]


@cache
def source_forms() -> tuple[str, ...]:
    """Every form of a data source, as parse_source's error lists them ('digits', ..., 'python:...')."""
    from traincore.config import ConfigError, parse_source

    try:
        parse_source("no-such-kind")
    except ConfigError as exc:
        return tuple(re.findall(r"'([^']+)'", str(exc).split(" is unknown", 1)[1]))
    raise AssertionError("parse_source accepted the source 'no-such-kind'")


def source_lists(text: str) -> list[tuple[int, str]]:
    """(line, text) of every paragraph or table row that lists the sources (names imagefolder's form)."""
    found, position = [], 0
    for paragraph in re.split(r"(\n[ \t]*\n)", text):
        units = paragraph.split("\n") if paragraph.lstrip().startswith("|") else [paragraph]
        offset = position
        for unit in units:
            if "imagefolder:<path-or-URI>" in unit:
                found.append((line_of(text, offset), unit))
            offset += len(unit) + 1
        position += len(paragraph)
    return found


def source_list_problems(name: str, text: str) -> list[str]:
    return [f"{name}:{line}: lists the sources without {form}" for line, unit in source_lists(text)
            for form in source_forms() if form not in unit]


def workflow_source_helps() -> list[tuple[str, str]]:
    """(where, text) of the ``source`` input's description in every workflow docstring that lists sources."""
    found = []
    for path in sorted((ROOT / "workflows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                match = re.search(r"^    source: (.*?)(?=^    \S|^\S|\Z)", ast.get_docstring(node),
                                  flags=re.MULTILINE | re.DOTALL)
                if match and "imagefolder:" in match.group(1):
                    found.append((f"{path.relative_to(ROOT).as_posix()}:{node.name}", match.group(1)))
    return found


@cache
def bench_results() -> dict[str, dict]:
    import json

    data = json.loads((ROOT / "bench" / "results" / "latest.json").read_text(encoding="utf-8"))
    return {entry["benchmark"]: entry for entry in data["benchmarks"]}


def _save_blocks(variant: str) -> float:
    return next(row["blocking_steady_s"] for row in bench_results()["checkpoint"]["results"]
                if row["variant"] == variant)


# Figures the pages quote from bench/results/latest.json: (the quote, its figure as group 1, the value now).
BENCH_FIGURES = [
    (re.compile(r"(\d+(?:\.\d+)?) of a bare (?:step|one)"),
     lambda: bench_results()["preemption"]["ratios"]["watched/bare step"]),
    (re.compile(r"`sync` save blocks (\d+(?:\.\d+)?) s\b"), lambda: _save_blocks("sync")),
    (re.compile(r"`dcp` (\d+(?:\.\d+)?) s\b"), lambda: _save_blocks("dcp")),
    (re.compile(r"`async` (\d+(?:\.\d+)?) s\b"), lambda: _save_blocks("async")),
]


def bench_figures(text: str) -> list[tuple[str, float]]:
    """(quoted figure, latest.json's value) of every benchmark figure a page quotes (across line breaks)."""
    return [(match.group(1), value())
            for pattern, value in BENCH_FIGURES for match in pattern.finditer(re.sub(r"\s+", " ", text))]


def bench_figure_problems(name: str, text: str) -> list[str]:
    problems = []
    for quoted, value in bench_figures(text):
        decimals = len(quoted.split(".")[1]) if "." in quoted else 0
        if round(value, decimals) != float(quoted):
            problems.append(f"{name}: quotes {quoted}, bench/results/latest.json has {value:.{decimals}f}")
    return problems


def dockerignore_allowed() -> list[str]:
    text = (ROOT / ".dockerignore").read_text(encoding="utf-8")
    return [line[1:].strip() for line in text.splitlines() if line.startswith("!")]


def build_context_paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n[ \t]*\n", text) if "`.dockerignore`" in p and "context to" in p]


def build_context_problems(name: str, text: str) -> list[str]:
    """A page that says what the build context holds names every entry .dockerignore lets in."""
    return [f"{name}: the build context it describes omits {entry} (.dockerignore lets it in)"
            for paragraph in build_context_paragraphs(text) for entry in dockerignore_allowed()
            if f"`{entry}`" not in paragraph]


PAGE_CHECKS = {
    "plugin lists": plugin_list_problems, "gang scheduler": gang_scheduler_problems,
    "secret values": secret_value_problems, "presets": preset_problems, "variables": variable_problems,
    "venv": venv_problems, "staged data": staged_data_problems, "sources": source_list_problems,
    "bench figures": bench_figure_problems, "build context": build_context_problems,
}


@pytest.mark.parametrize("check", PAGE_CHECKS)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_agree_with_the_code(page, check):
    problems = PAGE_CHECKS[check](page.relative_to(ROOT).as_posix(), page.read_text(encoding="utf-8"))
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("command", _pick(launch_plan_command))
def test_launch_plan_activation_names_project_and_domain(command):
    problems = launch_plan_problems(command)
    assert not problems, f"{command.id}: " + "; ".join(problems)


def test_source_helps_name_every_source():
    helps = [*workflow_source_helps(), ("traincore.stage --source", _options(parser_of("traincore.stage"))
                                        ["--source"].help)]
    assert any(where.endswith(":training_pipeline") for where, _ in helps)
    problems = [f"{where}: no {form}" for where, text in helps for form in source_forms() if form not in text]
    assert not problems, "; ".join(problems)


def test_the_workflow_keeps_a_presets_source_unless_given_one_as_the_readme_says():
    """README: the ``source`` input defaults to "" (the preset's own source stands); given, it replaces it."""
    from tasks.plan import launch_config

    assert "Without `--source`, a run trains on its preset's own source" in (ROOT / "README.md").read_text(
        encoding="utf-8")
    assert workflow_defaults("training_pipeline")["source"] == ""
    for name, build in presets().items():
        assert launch_config(name, "", "", 0, 0).data.source == build().data.source
        assert launch_config(name, "", "synthetic", 0, 0).data.source == "synthetic"


def test_the_pages_show_what_these_checks_read():
    """The collectors of the checks above find what they are meant to check."""
    texts = dict(page_texts())
    assert plugin_lists(texts["docs/backends.md"]) and re.search(r"--gang-scheduler-name=",
                                                                 texts["docs/backends.md"])
    assert PRESET_BULLET.findall(texts["README.md"])
    assert _pick(launch_plan_command), "no launch plan activation found"
    assert "--project" in pyflyte_options("launchplan")
    assert [block for _, block in code_blocks(texts["docs/deploy.md"]) if "$CHART_VERSION" in block]
    assert any(runs_project_code_from_path(c.tokens) for c in text_commands("own-model.md",
                                                                            texts["docs/own-model.md"]))
    assert [c for c in text_commands("own-model.md", texts["docs/own-model.md"], inline=False)
            if module_command(c.tokens) and module_command(c.tokens)[0] == "traincore.train"]
    assert source_lists(texts["README.md"]) and len(source_forms()) == 4
    assert {figure for figure, _ in bench_figures(texts["docs/checkpoints.md"])} >= {"0.91", "1.08", "0.011"}
    assert len(bench_figures(texts["docs/checkpoints.md"])) == 4
    assert build_context_paragraphs(texts["docs/images.md"]) and "examples" in dockerignore_allowed()


def test_the_page_checks_fail_on_what_is_wrong():
    block = "```bash\nCHART_VERSION=v1\nhelm upgrade --version \"$CHART_VERSION\"\n```\n"
    assert not variable_problems("p.md", block)
    assert variable_problems("p.md", block + block.replace("CHART_VERSION=v1\n", ""))
    assert plugin_list_problems("p.md", "`enabled-plugins: [container, pytorch]`")
    assert plugin_list_problems("p.md", "```yaml\nenabled-plugins:\n  - container\n  - pytorch\n```\n")
    assert gang_scheduler_problems("p.md", "`--gang-scheduler-name=volcano`")
    assert secret_value_problems("p.md", "kubectl create secret generic s --from-literal=key=value")
    assert preset_problems("README.md", "- `debug` (own source `digits`): wrong\n")
    assert venv_problems("p.md", "```bash\npython -m traincore.train --data d --output o\n```\n")
    assert not venv_problems("p.md", "`. .venv/bin/activate`\n```bash\npython -m traincore.train\n```\n")
    assert staged_data_problems("p.md", "```bash\npython -m traincore.train --data runs/d --output o\n```\n")
    assert source_list_problems("p.md", "`digits`, `synthetic` or `imagefolder:<path-or-URI>`")
    assert bench_figure_problems("p.md", "a watched step took 0.99 of a bare one")
    assert build_context_problems("p.md", "`.dockerignore` limits the context to `pyproject.toml`.")
    [command] = text_commands("p.md", "`pyflyte --config c launchplan --activate lp`")
    assert launch_plan_problems(command) == ["names no --project (-p)", "names no --domain (-d)"]
