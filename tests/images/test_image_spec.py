"""tasks/image_spec.py: the ImageSpec equivalent of cpu.Dockerfile (constructed, never built here)."""

from __future__ import annotations

import pytest
import tomllib
from dockerfile_rules import REPO, parse

from tasks.image_spec import TORCH_CPU_INDEX, pipeline_image_spec, project_dependencies


def pyproject_dependencies() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def test_spec_installs_exactly_pyprojects_dependencies():
    spec = pipeline_image_spec(registry="ghcr.io/example")
    assert sorted(spec.packages) == sorted(pyproject_dependencies())
    assert any(p.startswith("torch") for p in spec.packages)


def test_spec_matches_the_cpu_dockerfile():
    spec = pipeline_image_spec()
    dockerfile = parse((REPO / "dockerfiles" / "cpu.Dockerfile").read_text())
    args = dict(i.args.split("=", 1) for i in dockerfile if i.keyword == "ARG" and "=" in i.args)
    assert args["TORCH_INDEX_URL"] == TORCH_CPU_INDEX
    assert spec.pip_extra_index_url == [TORCH_CPU_INDEX]
    assert args["BASE_IMAGE"] == f"python:{spec.python_version}-slim-bookworm"
    assert spec.env == {"PYTHONUNBUFFERED": "1"}


def test_spec_options():
    spec = pipeline_image_spec(registry="ghcr.io/example", torch_index_url="", python_version="3.12")
    assert spec.pip_extra_index_url is None and spec.python_version == "3.12"
    assert spec.image_name().startswith("ghcr.io/example/flyte-torch-pipeline:")


def test_dependencies_follow_pyproject(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["torch>=2.4", "numpy"]\n')
    assert project_dependencies(pyproject) == ["torch>=2.4", "numpy"]
    assert pipeline_image_spec(pyproject=pyproject).packages == ["torch>=2.4", "numpy"]


def test_missing_pyproject_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkout"):
        pipeline_image_spec(pyproject=tmp_path / "pyproject.toml")
