"""tasks/ stays on flytekit's public API: it sets no private attribute of a flytekit class, overrides
neither flytekit's ``name`` nor any private flytekit method, and never calls a base class's method past the
parent (``SomeBase.method(self, ...)``). flytekit's internals change between releases without notice; what
is public is what a subclass may rely on.

Every module under tasks/ is read as an AST; which classes derive from flytekit (flytekit or a flytekit
plugin) and which private attributes their flytekit bases define is found by introspection: class
attributes through ``vars``, instance attributes from the ``self._x = ...`` assignments in the bases'
source.

Importing every tasks/ module and workflows.pipeline (in one fresh process, as a pod does) changes no
process-wide state (environment, working directory, sys.path, logging, signal handlers) and imports none of
scikit-learn, scipy, matplotlib and asyncssh, not even once the digits are fingerprinted and read.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tasks"
# A task's name and type, and a transformer's cached type: never ours to set, in any class, whether or not
# the flytekit release at hand defines them where the introspection below finds them.
ALWAYS_FORBIDDEN = frozenset({"_name", "_task_type", "_config_type"})
FLYTEKIT_PACKAGES = ("flytekit", "flytekitplugins")


def module_paths() -> list[Path]:
    return sorted(TASKS.rglob("*.py"))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def is_flytekit(cls: type) -> bool:
    return cls.__module__.split(".")[0] in FLYTEKIT_PACKAGES


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def self_attribute(target: ast.expr) -> str | None:
    """``x`` for a target ``self.x``."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return target.attr
    return None


def assigned_self_attributes(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every ``self.x = / += / : T =`` and ``setattr(self, "x", ...)`` in ``tree``."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            found.append((node.args[1].value, node.lineno))
        for target in targets:
            for element in ast.walk(target):  # tuple targets: self.a, self._b = ...
                name = self_attribute(element)
                if name is not None:
                    found.append((name, node.lineno))
    return found


@functools.cache
def private_attributes(base: type) -> frozenset[str]:
    """The private attributes one flytekit class defines: in its body, or assigned to ``self`` in its code."""
    names = {name for name in vars(base) if is_private(name)}
    try:
        source = textwrap.dedent(inspect.getsource(base))
    except (OSError, TypeError):  # no source (a C type, a generated class): its body is all there is
        return frozenset(names)
    names.update(name for name, _ in assigned_self_attributes(ast.parse(source)) if is_private(name))
    return frozenset(names)


def flytekit_private_attributes(cls: type) -> frozenset[str]:
    return frozenset().union(*(private_attributes(base) for base in cls.__mro__ if is_flytekit(base)))


def resolve_class(node: ast.ClassDef, namespace: dict) -> type | None:
    """The class object a ``class`` statement built: the module's attribute, else one built from its bases
    (a class defined inside a function)."""
    defined = namespace.get(node.name)
    if isinstance(defined, type):
        return defined
    bases = []
    for base in node.bases:
        try:
            bases.append(eval(ast.unparse(base), dict(namespace)))  # noqa: S307 (our own source)
        except Exception:
            continue
    try:
        return type(node.name, tuple(b for b in bases if isinstance(b, type)), {})
    except TypeError:  # bases that cannot be combined without the class's own body (a metaclass conflict)
        return None


def is_property(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in function.decorator_list)


def flytekit_property(cls: type, name: str) -> bool:
    """Whether a flytekit base of ``cls`` defines ``name`` as a property (a task's name; a resolver's
    ``name()`` is a method every resolver must define)."""
    return any(isinstance(vars(base).get(name), property) for base in cls.__mro__ if is_flytekit(base))


def names_a_class(expression: ast.expr, namespace: dict) -> bool:
    """Whether ``expression`` (a name or a dotted path) evaluates to a class in the module's namespace."""
    if not isinstance(expression, (ast.Name, ast.Attribute)):
        return False
    try:
        return isinstance(eval(ast.unparse(expression), dict(namespace)), type)  # noqa: S307 (our source)
    except Exception:  # a local variable, say: not a class reference
        return False


def violations(source: str, namespace: dict, filename: str) -> list[str]:
    """Every use of flytekit internals in one module's source; ``namespace`` is the module's, run."""
    tree = ast.parse(source, filename)
    found = []

    def report(line: int, what: str) -> None:
        found.append(f"{filename}:{line}: {what}")

    # Anywhere, in any class: the attributes flytekit keeps its task name, task type and cached types in.
    for name, line in assigned_self_attributes(tree):
        if name in ALWAYS_FORBIDDEN:
            report(line, f"assigns self.{name}")

    def visit_class(node: ast.ClassDef) -> None:
        cls = resolve_class(node, namespace)
        if cls is None or not any(is_flytekit(base) for base in cls.__mro__[1:]):
            return
        private = flytekit_private_attributes(cls)
        for name, line in assigned_self_attributes(node):
            if name in private and name not in ALWAYS_FORBIDDEN:
                report(line, f"{node.name} assigns self.{name}, an attribute of its flytekit bases")
        for member in node.body:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if member.name == "name" and (is_property(member) or flytekit_property(cls, "name")):
                    report(member.lineno, f"{node.name} overrides flytekit's name")
                elif member.name in private:
                    report(member.lineno, f"{node.name} overrides {member.name}, private to flytekit")

    def visit_call(node: ast.Call, enclosing: str | None) -> None:
        func, args = node.func, node.args
        passes_self = [isinstance(arg, ast.Name) and arg.id == "self" for arg in args]
        # Base.method(self, ...): runs a chosen base's method instead of the one the MRO puts first.
        if passes_self[:1] == [True] and isinstance(func, ast.Attribute) and names_a_class(func.value,
                                                                                            namespace):
            report(node.lineno, f"calls {ast.unparse(func)}(self, ...) past the method resolution order")
        # super(Base, self) for a Base other than the class itself: starts the lookup past the parent.
        if (isinstance(func, ast.Name) and func.id == "super" and passes_self == [False, True]
                and not (isinstance(args[0], ast.Name) and args[0].id == enclosing)):
            report(node.lineno, f"calls super({ast.unparse(args[0])}, self), skipping the parent")

    def visit(node: ast.AST, enclosing: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            visit_class(node)
            enclosing = node.name
        elif isinstance(node, ast.Call):
            visit_call(node, enclosing)
        for child in ast.iter_child_nodes(node):
            visit(child, enclosing)

    visit(tree, None)
    return found


@pytest.mark.parametrize("path", module_paths(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tasks_use_only_flytekits_public_api(path):
    namespace = vars(importlib.import_module(module_name(path)))
    assert violations(path.read_text(), namespace, str(path.relative_to(ROOT))) == []


# Each pattern the checker must catch, as a task or a transformer would write it.
INTERNALS = '''
from flytekit.core.python_function_task import PythonFunctionTask
from flytekit.core.type_engine import DataclassTransformer
from flytekit.extend.backend.base_connector import AsyncConnectorExecutorMixin
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask


class Elastic(PytorchElasticFunctionTask):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._name = "tasks.train.train-local-1x2"
        self._task_function, self.mine = print, 1

    @property
    def name(self):
        return self._name

    def _execute(self, **kwargs):
        return PythonFunctionTask.execute(self, **kwargs)


class Slurm(AsyncConnectorExecutorMixin, Elastic):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._task_type = "slurm_train"

    def execute(self, **kwargs):
        if kwargs:
            return Elastic.execute(self, **kwargs)
        return super(Elastic, self).execute(**kwargs)


class Transformer(DataclassTransformer):
    def __init__(self):
        super().__init__()
        self._config_type = None
'''


def test_the_checker_catches_every_use_of_internals():
    namespace: dict = {}
    exec(compile(INTERNALS, "internals.py", "exec"), namespace)  # noqa: S102 (the source above)
    found = "\n".join(violations(INTERNALS, namespace, "internals.py"))
    for expected in ("assigns self._name", "Elastic assigns self._task_function", "overrides flytekit's name",
                     "overrides _execute, private to flytekit", "calls PythonFunctionTask.execute(self, ...)",
                     "assigns self._task_type", "calls Elastic.execute(self, ...)",
                     "calls super(Elastic, self)", "assigns self._config_type"):
        assert expected in found, found
    assert "self.mine" not in found  # an attribute of our own is ours to set


# Libraries a pod has no use for: each costs 0.15 s to 1.5 s of CPU at import, in every pod of every run.
# matplotlib draws a Deck's figures and asyncssh reaches a Slurm cluster, where they are imported; the digits
# are read without scikit-learn (traincore.data.digits), which would bring scipy.
UNUSED_IN_PODS = ("sklearn", "scipy", "matplotlib", "asyncssh")

# Imports the dependencies a pod needs first (their import-time behaviour is theirs), then every tasks/ module
# and the workflow module in turn, and reports what each import changed of the process-wide state a library
# must leave alone; then which of UNUSED_IN_PODS are imported: after the imports, and after reading the
# bundled digits as plan_run (the fingerprint) and the stage task (the source) do.
POD_IMPORTS = '''
import importlib, json, logging, os, signal, sys
import flytekit, flytekitplugins.kfpytorch, torch.distributed.run  # noqa: F401

unused = json.loads(sys.argv[1])

def state():
    return {"env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path),
            "root logger": [logging.root.level, [repr(h) for h in logging.root.handlers]],
            "logging.disable": logging.root.manager.disable,
            "signals": {s.name: repr(signal.getsignal(s))
                        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)},
            "our loggers": {n: [l.level, len(l.handlers), l.propagate]
                            for n, l in logging.root.manager.loggerDict.items()
                            if isinstance(l, logging.Logger) and n.split(".")[0] in ("tasks", "traincore")}}

changes = {}
for name in sys.argv[2:]:
    before = state()
    importlib.import_module(name)
    after = state()
    for key in before:
        if key == "our loggers":
            changed = {n: v for n, v in after[key].items() if v != [0, 0, True]}
        elif key == "env":
            changed = {n: after[key].get(n) for n in set(before[key]) | set(after[key])
                       if before[key].get(n) != after[key].get(n)}
        else:
            changed = after[key] if after[key] != before[key] else None
        if changed:
            changes.setdefault(name, {})[key] = changed
after_imports = sorted(name for name in unused if name in sys.modules)

from tasks.plan import fingerprint_source
from traincore.config import DataConfig
from traincore.data.sources import digits_source

fingerprint = fingerprint_source(DataConfig(source="digits"))
count = digits_source(DataConfig(source="digits")).count  # the digits are read here, the chunks made later
print(json.dumps({"changes": changes, "after imports": after_imports,
                  "after digits": sorted(name for name in unused if name in sys.modules),
                  "fingerprint": fingerprint, "count": count}))
'''


@pytest.fixture(scope="module")
def pod_imports() -> dict:
    """What importing every tasks/ module and workflows.pipeline, then reading the digits, did (in one
    process)."""
    modules = [module_name(path) for path in module_paths()] + ["workflows.pipeline"]
    run = subprocess.run([sys.executable, "-c", POD_IMPORTS, json.dumps(UNUSED_IN_PODS), *modules], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_importing_tasks_changes_no_process_wide_state(pod_imports):
    """Registering type transformers and connectors is what importing a flytekit plugin does; setting
    environment variables, configuring logging or installing signal handlers is left to the program."""
    assert pod_imports["changes"] == {}


def test_a_pod_imports_no_library_it_does_not_use(pod_imports):
    """Every pod imports the workflow or task modules; plan_run fingerprints the digits and the stage task
    reads them. None of that imports a library of UNUSED_IN_PODS."""
    assert pod_imports["after imports"] == [], "importing tasks/ and workflows.pipeline imported these"
    assert pod_imports["after digits"] == [], "fingerprinting and reading the digits imported these"
    assert pod_imports["fingerprint"].startswith("digits:sha256:") and pod_imports["count"] == 1797
