# CPU image for the pipeline's tasks: local clusters, CI-like sandboxes, evaluation-only deployments.
#
# Build from the repository root (scripts/build-image does this with podman and tags it by git revision):
#   docker build -f dockerfiles/cpu.Dockerfile \
#       --build-arg FLYTE_INTERNAL_IMAGE=ghcr.io/<you>/flyte-torch-pipeline:cpu-<rev> \
#       -t ghcr.io/<you>/flyte-torch-pipeline:cpu-<rev> .
#
# Build arguments (none carries a secret; none is needed at run time except FLYTE_INTERNAL_IMAGE):
#   BASE_IMAGE            any Debian/Ubuntu-like image with python3 (>= 3.11: tomllib) and python3-venv
#   TORCH_INDEX_URL       extra pip index for torch/torchvision; the CPU index keeps the multi-GB CUDA
#                         libraries out. Empty = PyPI's torch (the CUDA build on Linux).
#   EXTRAS                optional dependency groups of pyproject.toml, comma-separated: "connector" for
#                         the Slurm connector service (pyflyte serve connector --modules tasks.slurm.connector)
#   PIP_OPTS              extra pip options, e.g. --find-links/--extra-index-url of a wheel store that
#                         the build mounts (offline builds); empty by default
#   FLYTE_INTERNAL_IMAGE  this image's own name:tag. flytekit reads it at run time as the default image,
#                         e.g. when the @dynamic train_on_backend compiles the train task it launches.

ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A venv, because Debian's Python refuses system-wide pip installs (PEP 668). It is owned by root: the
# task user can read and run it but not change it. The user has a fixed numeric UID so that Kubernetes'
# runAsNonRoot can verify it (a user name cannot be checked without the image's /etc/passwd).
RUN python3 -m venv /opt/venv \
    && groupadd --gid 1000 flyte \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/flyte --shell /bin/sh flyte

# Dependencies first, in their own layer: it depends on pyproject.toml only, so editing the code does not
# reinstall torch. The requirement list (build backend + runtime dependencies) is read from pyproject.toml,
# the single source of truth, instead of being repeated here.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_OPTS=""
ARG EXTRAS=""
COPY pyproject.toml /tmp/deps/pyproject.toml
RUN python -c "import os, tomllib; p = tomllib.load(open('/tmp/deps/pyproject.toml', 'rb')); \
extras = [r for e in os.environ['EXTRAS'].split(',') if e for r in p['project']['optional-dependencies'][e]]; \
print('\n'.join(p['build-system']['requires'] + p['project']['dependencies'] + extras))" \
        > /tmp/deps/requirements.txt \
    && pip install ${PIP_OPTS} ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -r /tmp/deps/requirements.txt \
    && rm -rf /tmp/deps

# The code, in the user's home: the working directory is where flytekit expects code. Fast registration
# (pyflyte-fast-execute --dest-dir .) unpacks the registered code over it, so the user owns it. The package
# is also installed (no dependencies, no network: the build backend came with the dependency layer), so
# the modules import from any working directory.
WORKDIR /home/flyte
COPY --chown=1000:1000 pyproject.toml README.md ./
COPY --chown=1000:1000 traincore ./traincore
COPY --chown=1000:1000 tasks ./tasks
COPY --chown=1000:1000 workflows ./workflows
RUN pip install --no-deps --no-index --no-build-isolation . \
    && rm -rf build ./*.egg-info \
    && pip check

USER 1000:1000
ENV HOME=/home/flyte
# Import check as the task user, from / so the installed package (not the working copy) is imported.
RUN cd / && python -c "import traincore.run.cli, tasks.train, tasks.stage, tasks.export, tasks.evaluate, \
workflows.pipeline; import torch, torchvision, flytekit, flytekitplugins.kfpytorch; print('torch', torch.__version__)"

# Last, so that a new tag (every git revision) changes only this metadata layer.
ARG FLYTE_INTERNAL_IMAGE=""
ENV FLYTE_INTERNAL_IMAGE=${FLYTE_INTERNAL_IMAGE}
