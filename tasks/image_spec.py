"""A flytekit ``ImageSpec`` equivalent of ``dockerfiles/cpu.Dockerfile``, for users who build with flytekit.

It is not wired into the tasks (they use the registration's ``--image``); use it from your own code:

.. code-block:: python

    from tasks.image_spec import pipeline_image_spec

    spec = pipeline_image_spec(registry="ghcr.io/<you>")
    @task(container_image=spec)            # per task, or
    ...

or build it and pass the name to pyflyte (a checkout is needed: the packages are read from pyproject.toml):

.. code-block:: bash

    python -m tasks.image_spec --registry ghcr.io/<you> --build   # prints the image name
    pyflyte --config flyte.config run --remote --image <printed name> workflows/pipeline.py training_pipeline

Differences from the Dockerfile: flytekit's builder chooses the base image and user, and the code is not
baked in (``pyflyte run --remote`` and ``pyflyte register`` fast-register it). For GPUs use
``dockerfiles/cuda.Dockerfile``: flytekit's default builder rejects ``cuda=``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flytekit import ImageSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# The CPU wheel index keeps the multi-GB CUDA libraries out, as in cpu.Dockerfile (TORCH_INDEX_URL).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The Python of cpu.Dockerfile's default base (python:3.11-slim-bookworm).
PYTHON_VERSION = "3.11"


def project_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """The runtime dependencies declared in pyproject.toml, verbatim."""
    if not pyproject.is_file():
        raise FileNotFoundError(f"{pyproject} not found: build the ImageSpec from a checkout of the repo")
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def pipeline_image_spec(registry: str | None = None, name: str = "flyte-torch-pipeline",
                        torch_index_url: str = TORCH_CPU_INDEX, python_version: str = PYTHON_VERSION,
                        pyproject: Path = PYPROJECT) -> ImageSpec:
    """The CPU image as an ImageSpec: pyproject's dependencies on ``python_version``, torch from
    ``torch_index_url`` (an extra index; '' for PyPI's torch), unbuffered Python output."""
    return ImageSpec(
        name=name,
        registry=registry,
        python_version=python_version,
        packages=project_dependencies(pyproject),
        pip_extra_index_url=[torch_index_url] if torch_index_url else None,
        env={"PYTHONUNBUFFERED": "1"},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.image_spec", description="Print (and optionally "
                                     "build) the name of the pipeline's ImageSpec image.")
    parser.add_argument("--registry", help="registry to push to, e.g. ghcr.io/<you>")
    parser.add_argument("--torch-index", default=TORCH_CPU_INDEX, help="torch wheel index (%(default)s)")
    parser.add_argument("--build", action="store_true", help="build (and push) the image with flytekit")
    args = parser.parse_args(argv)
    spec = pipeline_image_spec(registry=args.registry, torch_index_url=args.torch_index)
    if args.build:
        from flytekit.image_spec.image_spec import ImageBuildEngine

        ImageBuildEngine.build(spec)
    print(spec.image_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
