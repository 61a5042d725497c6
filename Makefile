# distlib — the two set-up commands are `make cluster-up` (the main job) and `make test`.
# Everything runs from a fresh clone: targets create their own virtual environments.

PYTHON  ?= python3
VENV    ?= .venv
IMAGE   ?= distlib:cpu
NODES   ?= 4
MODE    ?= tcp
PYTEST_ARGS ?=

PY := $(VENV)/bin/python

.PHONY: help venv test test-unit test-interop demo image cluster-up cluster-down cluster-logs \
        helm-lint helm-test bench-store bench-collectives clean

help:
	@echo "make cluster-up    build the image and run the 4-node Compose cluster job (NODES=8, MODE=tcp|rank0|file|nfs)"
	@echo "make test          create .venv, install distlib with its test extras, run the whole suite"
	@echo "make test-interop  install torch 2.13 into .venv-interop and run the torch interoperability tests"
	@echo "make demo          a TCP master service and 4 local processes, no Docker needed"
	@echo "make image         build the $(IMAGE) image (offline: a debootstrap base when no base image can be had)"
	@echo "make helm-lint / helm-test   lint, render and validate the Helm chart; run what it renders"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

# The suite without Docker, torch or a GPU: the quick loop while developing.
test-unit: venv
	$(PY) -m pytest -m "not containers" $(PYTEST_ARGS)

# torch 2.13 is large (CUDA wheels): it lives in its own environment, never in .venv.
.venv-interop/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-interop
	.venv-interop/bin/pip install --quiet --upgrade pip
	.venv-interop/bin/pip install --quiet 'torch==2.13.0' -e '.[test]'
	touch $@

test-interop: .venv-interop/.installed
	.venv-interop/bin/python -m pytest -m interop -p no:cacheprovider $(PYTEST_ARGS)

demo: venv
	$(PY) -m distlib.demo

bench-store: venv
	$(PY) -m distlib.cli bench store

bench-collectives: venv
	$(PY) -m distlib.cli bench collectives --nproc 2

image:
	IMAGE=$(IMAGE) docker/build-image.sh

cluster-up:
	IMAGE=$(IMAGE) NODES=$(NODES) MODE=$(MODE) compose/cluster.sh up

cluster-down:
	compose/cluster.sh down

cluster-logs:
	compose/cluster.sh logs

helm-lint: venv
	$(PY) -m pytest tests/helm -k lint $(PYTEST_ARGS)

helm-test: venv
	$(PY) -m pytest tests/helm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-interop .build
