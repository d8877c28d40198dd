"""The package map holds: few modules at traincore's top, one way for imports, no cycle anywhere.

The import graph is read from the source (every ``import`` statement, those inside functions included;
``if TYPE_CHECKING:`` blocks left out, since they never run), so a cycle that only a lazy import closes is
found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("traincore", "tasks", "workflows", "replay")
# `python -m traincore.<name>`: each is a thin entry point into the module that holds the command.
CLI_SHIMS = {"traincore.train": "traincore.run.cli", "traincore.export": "traincore.artifacts.export",
             "traincore.evaluate": "traincore.artifacts.evaluate",
             "traincore.registry": "traincore.artifacts.registry", "traincore.stage": "traincore.data.cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def bound_names(init: Path) -> set[str]:
    """The names a package's ``__init__`` binds by importing them (a function may share its module's name)."""
    return {alias.asname or alias.name for node in ast.parse(init.read_text()).body
            if isinstance(node, ast.ImportFrom) for alias in node.names}


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports: ``from a.b import c`` counts as the module a.b.c where that is
    a module that a.b's ``__init__`` does not shadow with a name of its own."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                package = modules.get(node.module)
                shadowed = (package is not None and package.name == "__init__.py"
                            and alias.name in bound_names(package))
                found.add(full if full in modules and not shadowed else node.module)
        stack.extend(ast.iter_child_nodes(node))
    return {name for name in found if name in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_cycle_finder_finds_a_lazy_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_traincore_keeps_at_most_eight_top_level_modules():
    top = sorted(p.name for p in (ROOT / "traincore").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top


def test_every_subpackage_says_what_it_holds():
    for init in sorted((ROOT / "traincore").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py")
                         if p.name not in {"__init__.py", "__main__.py"})
        missing = [m for m in modules if m not in doc.split()]
        assert not missing, f"{init.relative_to(ROOT)}'s docstring does not name {missing}"


def test_no_module_imports_a_package_above_its_own(graph):
    """A module never imports its own package's __init__ or one above it (they import the module: a cycle
    waiting for the next export)."""
    bad = []
    for name, deps in graph.items():
        parts = name.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
        if name in project_modules() and (ROOT / Path(*parts) / "__init__.py").exists():
            ancestors.discard(name)
        bad += [(name, dep) for dep in deps & ancestors]
    assert bad == []


def test_other_packages_import_a_subpackage_through_its_init(graph):
    """Outside traincore/<pkg>/, only traincore.<pkg> itself is imported, never its modules (tests aside);
    the `python -m` entry points are the exception that proves it."""
    bad = []
    for name, deps in graph.items():
        for dep in deps:
            parts = dep.split(".")
            if parts[0] != "traincore" or len(parts) < 3:
                continue
            package = ".".join(parts[:2])
            if not (name == package or name.startswith(package + ".")) and CLI_SHIMS.get(name) != dep:
                bad.append((name, dep))
    assert bad == []
