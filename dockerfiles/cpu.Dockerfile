# CPU image for the pipeline's tasks: local clusters, CI-like sandboxes, evaluation-only deployments.
# Build from the repository root:  docker build -f dockerfiles/cpu.Dockerfile -t flyte-torch-pipeline:cpu .
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /root
# The CPU wheel index keeps the image free of the multi-GB CUDA libraries.
COPY pyproject.toml README.md ./
COPY traincore ./traincore
COPY tasks ./tasks
COPY workflows ./workflows
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu . \
    && python -c "import traincore.loop, tasks, workflows"
