# CUDA image for GPU nodes (PyTorchJob workers, GPU pods). ImageSpec's default builder rejects cuda=, so
# this is a Dockerfile.
#
# PyPI's Linux torch wheels are the CUDA 13.0 build and bring the CUDA runtime, cuDNN, NCCL etc. as
# nvidia-* wheels. The base therefore needs no CUDA libraries of its own: the small `base` flavour is
# enough. It contributes the NVIDIA_* variables the NVIDIA container runtime reads to mount the host's
# driver (NVIDIA_REQUIRE_CUDA=cuda>=13.0: the node's driver must be R580 or newer).
#
# Build from the repository root (scripts/build-image --variant cuda does this with podman):
#   docker build -f dockerfiles/cuda.Dockerfile \
#       --build-arg FLYTE_INTERNAL_IMAGE=ghcr.io/<you>/flyte-torch-pipeline:cuda-<rev> \
#       -t ghcr.io/<you>/flyte-torch-pipeline:cuda-<rev> .
#
# Build arguments, as in cpu.Dockerfile: BASE_IMAGE, TORCH_INDEX_URL (empty: PyPI's CUDA build; or e.g.
# https://download.pytorch.org/whl/cu130), PIP_OPTS (offline wheel stores), FLYTE_INTERNAL_IMAGE.

ARG BASE_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python from the distribution (Ubuntu 24.04: 3.12) in a venv, because the system Python refuses pip
# installs (PEP 668). Ubuntu 24.04 images ship a user `ubuntu` with UID 1000: it is removed so that the
# task user gets the same numeric UID as in the CPU image (runAsNonRoot checks a numeric USER).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid 1000 flyte \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/flyte --shell /bin/sh flyte

# Dependencies first, in their own layer, read from pyproject.toml: editing the code does not reinstall
# torch and its ~3 GB of CUDA wheels.
ARG TORCH_INDEX_URL=""
ARG PIP_OPTS=""
COPY pyproject.toml /tmp/deps/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/deps/pyproject.toml', 'rb')); \
print('\n'.join(p['build-system']['requires'] + p['project']['dependencies']))" > /tmp/deps/requirements.txt \
    && pip install ${PIP_OPTS} ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -r /tmp/deps/requirements.txt \
    && rm -rf /tmp/deps

# The code in the task user's home, where flytekit expects it and where fast registration unpacks the
# registered code (so the user owns it); installed without dependencies so it imports from anywhere.
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
# Import check as the task user (no GPU needed: importing torch does not initialise CUDA).
RUN cd / && python -c "import traincore.run.cli, tasks.train, tasks.stage, tasks.export, tasks.evaluate, \
workflows.pipeline; import torch, torchvision, flytekit, flytekitplugins.kfpytorch; \
print('torch', torch.__version__, 'built for CUDA', torch.version.cuda)"

# Last, so that a new tag (every git revision) changes only this metadata layer.
ARG FLYTE_INTERNAL_IMAGE=""
ENV FLYTE_INTERNAL_IMAGE=${FLYTE_INTERNAL_IMAGE}
