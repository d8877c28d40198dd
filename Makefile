# Two commands matter: `make run` and `make test`. Both create .venv with pip when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench lint docs clean install install-dev replay image register

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The stamp files make a second install a no-op until pyproject.toml changes.
$(VENV)/.stamp-install: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.stamp-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(VENV)/.stamp-install

install: $(VENV)/.stamp-install
install-dev: $(VENV)/.stamp-dev

# The whole workflow, locally, on the bundled digits data: stage -> train (2 processes) -> export -> evaluate.
run: install
	$(BIN)/pyflyte run workflows/pipeline.py training_pipeline

# The suite on TEST_WORKERS pytest-xdist workers, each taking whole test files, longest first (tests/scopes.py):
# two, the CI machine's cores; `make test TEST_WORKERS=4` on a larger machine, 0 for one process.
TEST_WORKERS ?= 2
test: install-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# Loader, checkpoint, sharded-state, per-step, start-up, preemption, validation, end-to-end and staging benchmarks
# (about 20 minutes on 2 cores): writes bench/results/latest.json and latest.md (commit them); generated data and runs go to runs/bench.
bench: install
	$(BIN)/python bench/run.py

# Package the workflow as a platform team registers it (fast registration), then replay it node by node as a
# cluster runs it: one pod of two processes, then a 2-pod PyTorchJob. Prints each node's wall time and the
# test accuracy; fails if a node fails or the two pods do not form one world. See "Replaying a registration
# locally" in docs/backends.md; REPLAY_INPUTS="--input max_steps=80 --input parallelism=fsdp" shards the model.
# REPLAY_INPUTS comes last, and the last value of a repeated --input wins: REPLAY_INPUTS="--input
# nproc_per_node=4" overrides the replays' own nnodes/nproc_per_node in both.
REPLAY_DIR ?= runs/replay
REPLAY_INPUTS ?= --input max_steps=80
REPLAY_OPTS ?= --node-timeout 600
replay: install
	rm -rf $(REPLAY_DIR) && mkdir -p $(REPLAY_DIR)
	$(BIN)/pyflyte --pkgs workflows package --image flyte-torch-pipeline:replay --copy all --force \
		--output $(REPLAY_DIR)/package.tgz
	$(BIN)/python -m replay $(REPLAY_DIR)/package.tgz --workdir $(REPLAY_DIR)/1-node $(REPLAY_OPTS) \
		--input nnodes=1 --input nproc_per_node=2 $(REPLAY_INPUTS)
	$(BIN)/python -m replay $(REPLAY_DIR)/package.tgz --workdir $(REPLAY_DIR)/2-pods $(REPLAY_OPTS) \
		--input backend=kubernetes --input nnodes=2 --input nproc_per_node=1 $(REPLAY_INPUTS)

lint: install-dev
	$(BIN)/ruff check traincore tasks workflows replay tests bench examples

# The config table of docs/config.md, generated from the field docstrings in traincore/config/schema.py.
docs: install
	$(BIN)/python -m traincore.config.doc --write docs/config.md

clean:
	rm -rf runs .pytest_cache

# The image a cluster runs, and the registration that uses it (docs/deploy.md):
#   make image IMAGE=ghcr.io/acme/flyte-torch-pipeline:v1 [VARIANT=cpu|cuda] [EXTRAS=connector]
#              [BUILD_OPTS="--local-base ..."]
#     builds dockerfiles/$(VARIANT).Dockerfile with podman (scripts/build-image), with the optional
#     dependency groups EXTRAS (connector: the Slurm connector's image), and pushes it when IMAGE names a
#     registry (log in first: podman login ghcr.io);
#   make register IMAGE=... [PROJECT=flytesnacks] [DOMAIN=development] [VERSION=...] [CONFIG=flyte.config]
#     registers workflows/ and its launch plans with that image (PACKAGE=out.tgz writes the package instead).
IMAGE ?=
VARIANT ?= cpu
EXTRAS ?=
BUILD_OPTS ?=
PROJECT ?= flytesnacks
DOMAIN ?= development
VERSION ?=
CONFIG ?= flyte.config
PACKAGE ?=
image:
	@test -n '$(subst ','\'',$(IMAGE))' || { echo "make image: set IMAGE=<registry>/<name>:<tag>, e.g." \
		"IMAGE=ghcr.io/acme/flyte-torch-pipeline:v1 (a name without a registry builds a local image only)" >&2; exit 2; }
	@# Single-quoted, with each ' spelled '\'', so that the shell passes any value as it is to the script
	@# (which says what is wrong with a bad one) and expands nothing in it.
	scripts/build-image --from-make --variant '$(subst ','\'',$(VARIANT))' --tag '$(subst ','\'',$(IMAGE))' \
		--extras '$(subst ','\'',$(EXTRAS))' --push $(BUILD_OPTS)

register: install
	@# Quoted as in `image`: the script gets each value as it is and says what is wrong with a bad one.
	PYFLYTE=$(BIN)/pyflyte scripts/register --image '$(subst ','\'',$(IMAGE))' \
		--project '$(subst ','\'',$(PROJECT))' --domain '$(subst ','\'',$(DOMAIN))' \
		--config '$(subst ','\'',$(CONFIG))' $(if $(VERSION),--version '$(subst ','\'',$(VERSION))') \
		$(if $(PACKAGE),--package '$(subst ','\'',$(PACKAGE))')

# Build the CPU image with podman from a local Debian base and run the workflow inside it as the image's
# non-root user (about 10 minutes cold). Installs podman, buildah and debootstrap with apt-get first when
# they are missing and it runs as root (scripts/ensure-image-tools). Not part of `make test`.
.PHONY: image-check
image-check:
	scripts/image-check
