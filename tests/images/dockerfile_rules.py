"""A small Dockerfile parser and the rules our images follow, as functions that return the problems found.

The tests run the rules on dockerfiles/*.Dockerfile (no problems expected) and on broken variants of them
(the problem must be found), so a rule that cannot fail is caught too.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("traincore", "tasks", "workflows")
CODE_DIRS = FIRST_PARTY
# Import names whose distribution name differs.
DIST_OF_MODULE = {"flytekitplugins.kfpytorch": "flytekitplugins-kfpytorch", "sklearn": "scikit-learn",
                  "PIL": "pillow"}
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
SECRET_VALUE = re.compile(r"(-----BEGIN [A-Z ]*PRIVATE KEY|AKIA[0-9A-Z]{16}|ghp_[0-9A-Za-z]{20,}|"
                          r"://[^/\s:@]+:[^/\s@]+@)")
# Paths of one machine's wheel stores must come in as build arguments, never as defaults.
MACHINE_PATHS = re.compile(r"(/opt/wheels|/opt/pypi|/etc/ssl/certs/ca-certificates\.crt|/root/\.cache)")


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def parse(text: str) -> list[Instruction]:
    """Instructions in order: comments dropped, continuation lines joined."""
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def _kv(args: str) -> dict[str, str]:
    """ENV/ARG key=value pairs (ENV's legacy `KEY value` form too)."""
    parts = shlex.split(args, posix=True)
    if len(parts) == 2 and "=" not in parts[0]:
        return {parts[0]: parts[1]}
    return {k: v for k, _, v in (p.partition("=") for p in parts)}


def _copy_sources(inst: Instruction) -> list[str]:
    parts = [p for p in shlex.split(inst.args) if not p.startswith("--")]
    return parts[:-1]


def _is_code_copy(inst: Instruction) -> bool:
    return inst.keyword == "COPY" and any(
        src.rstrip("/").split("/")[0] in CODE_DIRS for src in _copy_sources(inst))


def _deps_install(inst: Instruction) -> bool:
    return inst.keyword == "RUN" and "pip install" in inst.args and " -r " in inst.args


def python_imports(inst: Instruction) -> list[str]:
    """Modules named in `python -c "import a.b, c; import d"` checks of a RUN instruction."""
    modules = []
    for code in re.findall(r"python3? -c \"([^\"]*)\"", inst.args):
        for statement in re.findall(r"\bimport\s+([\w., ]+)", code):
            modules += [m.strip().split(" as ")[0] for m in statement.split(",") if m.strip()]
    return modules


def module_exists(module: str, repo: Path = REPO) -> bool:
    path = repo.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def declared_distributions(pyproject_text: str) -> set[str]:
    import tomllib

    deps = tomllib.loads(pyproject_text)["project"]["dependencies"]
    return {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in deps}


def check(text: str, repo: Path = REPO, dockerignore: str | None = None) -> list[str]:
    """Every broken rule, as a sentence. An empty list: the Dockerfile follows them all."""
    insts = parse(text)
    problems: list[str] = []
    keywords = [i.keyword for i in insts]

    # The base is a build argument declared before FROM, with a default.
    froms = [i for i in insts if i.keyword == "FROM"]
    if len(froms) != 1:
        problems.append(f"expected one FROM, found {len(froms)}")
    else:
        first_from = keywords.index("FROM")
        pre = {k: v for i in insts[:first_from] if i.keyword == "ARG" for k, v in _kv(i.args).items()}
        if not pre.get("BASE_IMAGE"):
            problems.append("no `ARG BASE_IMAGE=<default>` before FROM")
        if froms[0].args.split()[0] not in ("${BASE_IMAGE}", "$BASE_IMAGE"):
            problems.append(f"FROM {froms[0].args!r} does not use ${{BASE_IMAGE}}")

    env: dict[str, str] = {}
    for i in insts:
        if i.keyword == "ENV":
            env.update(_kv(i.args))
    if env.get("PYTHONUNBUFFERED") != "1":
        problems.append("PYTHONUNBUFFERED=1 is not set")
    venv = env.get("VIRTUAL_ENV")
    if not venv or not any("-m venv " + venv in i.args for i in insts if i.keyword == "RUN"):
        problems.append("no venv (PEP 668): VIRTUAL_ENV is not set or not created with `python3 -m venv`")
    elif not env.get("PATH", "").startswith(f"{venv}/bin:"):
        problems.append("the venv's bin is not first on PATH")

    # Dependencies in a layer before the code: pyproject.toml copied alone, deps installed, then the code.
    code_copies = [n for n, i in enumerate(insts) if _is_code_copy(i)]
    deps = [n for n, i in enumerate(insts) if _deps_install(i)]
    pyproject_alone = [n for n, i in enumerate(insts)
                       if i.keyword == "COPY" and _copy_sources(i) == ["pyproject.toml"]]
    if not code_copies:
        problems.append("the code (traincore, tasks, workflows) is never copied")
    if not deps:
        problems.append("no dependency layer (`pip install ... -r requirements`)")
    if not pyproject_alone:
        problems.append("pyproject.toml is not copied on its own before the dependency layer")
    if code_copies and deps and not max(deps) < min(code_copies):
        problems.append("the dependencies are installed after the code is copied: code edits reinstall torch")
    if pyproject_alone and deps and not min(pyproject_alone) < min(deps):
        problems.append("the dependency layer runs before pyproject.toml is copied")
    code_installs = [i for n, i in enumerate(insts) if i.keyword == "RUN" and "pip install" in i.args
                     and code_copies and n > min(code_copies)]
    if not code_installs:
        problems.append("the package is not installed after the code is copied")
    elif not all("--no-deps" in i.args for i in code_installs):
        problems.append("a pip install after the code COPY lacks --no-deps")

    # The torch index is a build argument used by the dependency layer.
    args = {k: v for i in insts if i.keyword == "ARG" for k, v in _kv(i.args).items()}
    if "TORCH_INDEX_URL" not in args:
        problems.append("no ARG TORCH_INDEX_URL")
    elif deps and not all("TORCH_INDEX_URL" in insts[n].args for n in deps):
        problems.append("the dependency layer ignores TORCH_INDEX_URL")

    # The image knows its own name.
    if "FLYTE_INTERNAL_IMAGE" not in args:
        problems.append("no ARG FLYTE_INTERNAL_IMAGE")
    if env.get("FLYTE_INTERNAL_IMAGE") not in ("${FLYTE_INTERNAL_IMAGE}", "$FLYTE_INTERNAL_IMAGE"):
        problems.append("ENV FLYTE_INTERNAL_IMAGE is not set from the build argument")

    # A non-root user with a numeric UID that exists, and that owns the working directory's code.
    users = [i for i in insts if i.keyword == "USER"]
    if not users:
        problems.append("no USER: the tasks run as root")
    else:
        user = users[-1].args.split(":")[0]
        if not user.isdigit():
            problems.append(f"USER {user!r} is not numeric (Kubernetes' runAsNonRoot cannot check a name)")
        elif user == "0":
            problems.append("USER is root (0)")
        elif not any(re.search(rf"useradd\b[^&;]*--uid {user}\b", i.args)
                     for i in insts if i.keyword == "RUN"):
            problems.append(f"no `useradd --uid {user}` creates the USER")
        elif not all(f"--chown={user}" in i.args for i in insts if _is_code_copy(i)):
            problems.append("the code is not owned by the task user (fast registration unpacks over it)")
    workdirs = [i.args for i in insts if i.keyword == "WORKDIR"]
    if not workdirs or workdirs[-1] != env.get("HOME", ""):
        problems.append("the working directory is not the task user's HOME")

    # No secrets and no one machine's paths.
    for i in insts:
        if i.keyword in ("ARG", "ENV"):
            for name in _kv(i.args):
                if SECRET_NAME.search(name):
                    problems.append(f"line {i.line}: {i.keyword} {name} looks like a secret")
        if SECRET_VALUE.search(i.args):
            problems.append(f"line {i.line}: a credential-like value")
        if MACHINE_PATHS.search(i.args):
            problems.append(f"line {i.line}: a path of one machine ({MACHINE_PATHS.search(i.args).group(0)})")

    # The import checks name modules that exist: first-party in the repo, third-party in pyproject.
    declared = declared_distributions((repo / "pyproject.toml").read_text())
    checked = [m for i in insts if i.keyword == "RUN" for m in python_imports(i)]
    if not any(m.split(".")[0] in FIRST_PARTY for m in checked):
        problems.append("no RUN imports the code (python -c \"import ...\")")
    for module in checked:
        top = module.split(".")[0]
        if top in FIRST_PARTY:
            if not module_exists(module, repo):
                problems.append(f"the import check names {module}, which is not a module in the repository")
        elif top not in sys.stdlib_module_names:
            dist = DIST_OF_MODULE.get(module, DIST_OF_MODULE.get(top, top)).lower()
            if dist not in declared:
                problems.append(f"the import check names {module}, whose distribution {dist} is not declared")

    # Every COPY source exists and passes the .dockerignore allow-list.
    allowed = None
    if dockerignore is not None:
        lines = [ln.strip() for ln in dockerignore.splitlines() if ln.strip() and not ln.startswith("#")]
        if lines and lines[0] == "*":
            allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for i in insts:
        if i.keyword != "COPY" or "--from" in i.args:
            continue
        for src in _copy_sources(i):
            if not (repo / src).exists():
                problems.append(f"line {i.line}: COPY {src}: not in the repository")
            if allowed is not None and src.rstrip("/").split("/")[0] not in allowed:
                problems.append(f"line {i.line}: COPY {src}: excluded by .dockerignore")
    return problems
