# CUDA image for GPU nodes (PyTorchJob workers). ImageSpec's default builder rejects cuda=, so the
# CUDA runtime comes from the base image.
# Build from the repository root:  docker build -f dockerfiles/cuda.Dockerfile -t flyte-torch-pipeline:cuda .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /root
COPY pyproject.toml README.md ./
COPY traincore ./traincore
COPY tasks ./tasks
COPY workflows ./workflows
RUN pip install . && python -c "import traincore.loop, tasks, workflows"
