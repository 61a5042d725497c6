# distlib — the two set-up commands are `make cluster-up` (the main job) and `make test`.
# Everything runs from a fresh clone: targets create their own virtual environments.

PYTHON  ?= python3
VENV    ?= .venv
IMAGE   ?= distlib:cpu
NODES   ?= 4
MODE    ?= tcp
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
# Where the three packages' sources are, for environments that import the tree without installing
# it (torch's interop environment, the GPU machine's plain copy).
SRC_PATH := $(CURDIR):$(CURDIR)/deploy:$(CURDIR)/bench

.PHONY: help venv host-tools lint test test-unit test-examples test-interop test-gpu demo image image-gpu cluster-up cluster-down cluster-logs cluster-kill \
        helm-lint helm-test kube-build bench-store bench-collectives clean

help:
	@echo "make cluster-up    build the image and run the 4-node Compose cluster job (NODES=8, MODE=tcp|rank0|file|nfs|mpi|slurm, GPU=1,"
	@echo "                   JOB=\"python my_train.py --epochs 3\": your own script, this directory mounted read-only;"
	@echo "                   MIN_NODES=2 MAX_RESTARTS=3: elastic, a lost node leaves a smaller job)"
	@echo "make cluster-kill NODE=2   kill worker-2 of the running cluster (SIGKILL): a lost node; NODE=master: the"
	@echo "                           master service (Compose restarts it)"
	@echo "make test          create .venv, install distlib with its test extras (and shellcheck when missing), lint, run the whole suite"
	@echo "make lint          ruff over the tree and mypy over the three packages (pyproject.toml); make test runs it first"
	@echo "make test-examples the user's example project (examples/ci, distlib.testing) from a copy outside the tree, against a wheel of it"
	@echo "make test-interop  install torch 2.13 once into $(INTEROP_VENV) and run the torch interoperability tests"
	@echo "make test-gpu      on a GPU machine (cupy, NCCL, pytest; torch to compare): the GPU tests and benchmark, <= 5 min"
	@echo "make demo          a TCP master service and 4 local processes, no Docker needed"
	@echo "make image         build the $(IMAGE) image (offline: a debootstrap base when no base image can be had)"
	@echo "make image-gpu     build the $(CUDA_IMAGE) image: cupy, NVRTC and NCCL from wheels (the driver comes from the host)"
	@echo "make helm-lint / helm-test   lint, render and validate the Helm chart; install it into a real Kubernetes 1.20"

# The three packages of the repository, editable: the library (.), the deployment (deploy/: the
# cluster driver and the jobs) and the benchmarks (bench/).
$(VENV)/.installed: pyproject.toml deploy/pyproject.toml bench/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test,testing,mpi]' -e './deploy[cluster]' -e ./bench
	touch $@

venv: $(VENV)/.installed

# What the suite needs on the host besides the venv: shellcheck, for the shell scripts' lint
# (tests/containers/test_build_script.py). Debian's package, installed only when missing (CI's
# fresh machine has none); apt-get's lists are refreshed only if the package is not in them.
# Where apt-get cannot run (not root, not Debian) it says so, and the lint skips.
host-tools:
	@command -v shellcheck >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "make: installing shellcheck (Debian's package) for the shell-script lint"; \
	    apt-get install -y -qq --no-install-recommends shellcheck >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq --no-install-recommends shellcheck >/dev/null; }; \
	  else \
	    echo "make: shellcheck is missing and apt-get cannot install it here (needs root on Debian): the shell-script lint will skip"; \
	  fi; }

# The static checks, before any test runs (pyproject.toml configures both; the versions are pinned
# in the test extra): ruff over distlib/, deploy/, bench/, tests/ and examples/, mypy over the three
# packages (distlib/, deploy/distlib_deploy, bench/distlib_bench). Under a second with mypy's cache
# (.mypy_cache), about 12 s without it on 2 cores at load 2.5; a finding fails `make test` before
# any test runs.
lint: venv
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy

test: venv host-tools kube-build lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The suite without Docker, VMs, torch or a GPU: the quick loop while developing. Every lane that
# needs Docker or VMs is left out by its marker (tests/support/lanes.py: tests/test_test_tree.py
# checks this line); the torch and GPU lanes skip by themselves.
test-unit: venv
	$(PY) -m pytest -m "not containers and not vms and not kube and not slurm" $(PYTEST_ARGS)

# The users' example project (examples/ci: their CI tests with distlib.testing), run the way a
# user runs it: from a copy outside the tree, against a wheel built from the tree (a file missing
# from the package fails here), in an environment of its own ($(EXAMPLES_VENV)): its third-party
# packages are installed once, the wheel and the example again each time. The container tests
# use distlib:cpu, built first (seconds when up to date); --distlib-strict makes a test that
# cannot run here (no Docker) fail, as CI wants: EXAMPLES_ARGS= for a lenient local run.
EXAMPLES_VENV ?= $(HOME)/.cache/distlib/examples-venv
EXAMPLES_ARGS ?= --distlib-strict
test-examples: venv
	rm -rf .build/examples && mkdir -p .build/examples
	$(PY) -m pip wheel --quiet --no-deps -w .build/examples .
	test -x $(EXAMPLES_VENV)/bin/python || $(PYTHON) -m venv $(EXAMPLES_VENV)
	$(EXAMPLES_VENV)/bin/pip install --quiet --force-reinstall --no-deps .build/examples/distlib_c10d-*.whl
	$(EXAMPLES_VENV)/bin/pip install --quiet --find-links .build/examples "$$(ls .build/examples/distlib_c10d-*.whl)[testing]"
	if command -v docker >/dev/null 2>&1; then IMAGE=distlib:cpu docker/build-image.sh >.build/examples/image.log 2>&1 || \
	  { tail -20 .build/examples/image.log; exit 1; }; fi
	copy=$$(mktemp -d /tmp/distlib-examples-XXXXXX) && cp -r examples/ci/. $$copy && \
	  $(EXAMPLES_VENV)/bin/pip install --quiet --find-links .build/examples $$copy && \
	  ( cd $$copy && $(EXAMPLES_VENV)/bin/python -m pytest -p no:cacheprovider $(EXAMPLES_ARGS) $(PYTEST_ARGS) ); \
	  status=$$?; rm -rf $$copy; exit $$status

# torch 2.13 is large (about 5 GB with its CUDA wheels): it lives in its own environment outside
# the clone, installed once and reused by every later run and clone. distlib is not installed
# into it: the tests import this checkout through PYTHONPATH, so the environment never goes
# stale. The marker is written last, so an interrupted install is redone.
INTEROP_VENV ?= $(HOME)/.cache/distlib/torch-2.13
INTEROP_PACKAGES := torch==2.13.0 numpy pytest pytest-timeout pyyaml cryptography
# The marker names the package list, so a changed list reinstalls into the same environment.
INTEROP_MARKER := $(INTEROP_VENV)/.installed-$(shell printf '%s' '$(INTEROP_PACKAGES)' | sha1sum | cut -c1-12)

$(INTEROP_MARKER):
	test -x $(INTEROP_VENV)/bin/python || $(PYTHON) -m venv $(INTEROP_VENV)
	$(INTEROP_VENV)/bin/pip install --quiet --upgrade pip
	$(INTEROP_VENV)/bin/pip install --quiet $(INTEROP_PACKAGES)
	touch $@

test-interop: $(INTEROP_MARKER)
	PYTHONPATH=$(SRC_PATH) $(INTEROP_VENV)/bin/python -m pytest -m interop -p no:cacheprovider $(PYTEST_ARGS)

# The GPU tests and the GPU benchmark in one go, on a machine with a GPU whose python3 has numpy,
# cupy (with NCCL), pytest and, for the comparison, torch: a plain copy of the tree, no venv, no
# pip, no Docker; at most 5 minutes; a summary at the end (tests/gpu/run_gpu_suite.py). Without a
# usable GPU it says why in one line and runs nothing. GPU_PYTHON picks the interpreter.
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=$(SRC_PATH) $(GPU_PYTHON) -m tests.gpu.run_gpu_suite $(PYTEST_ARGS)

demo: venv
	$(PY) -m distlib_deploy.demo

bench-store: venv
	$(PY) -m distlib_bench store

bench-collectives: venv
	$(PY) -m distlib_bench collectives --nproc 2

image:
	IMAGE=$(IMAGE) docker/build-image.sh

# The GPU image (cupy, NVRTC, NCCL as wheels; the driver comes from the host): distlib:cuda, or
# IMAGE when given on the command line or in the environment.
CUDA_IMAGE := $(if $(filter file,$(origin IMAGE)),distlib:cuda,$(IMAGE))
image-gpu:
	IMAGE=$(CUDA_IMAGE) TARGET=cuda docker/build-image.sh

# distlib cluster (deploy/distlib_deploy/cluster) reads the other variables from the environment:
# AUTH, GPU, NPROC_PER_NODE, MIN_NODES, MAX_RESTARTS, SKIP_BUILD, JOB, JOB_DIR, JOB_ARGS, JOB_MODULE, NFS_SERVER, NFS_PATH, COMPOSE,
# CLUSTER_TIMEOUT, CLUSTER_STATE_DIR, QUIET, RUN_ID (`make cluster-up JOB=...` passes them on).
# IMAGE is passed on only when given: the default is distlib:cpu, or distlib:cuda with GPU=1.
cluster-up: venv
	$(if $(filter file,$(origin IMAGE)),,IMAGE=$(IMAGE)) NODES=$(NODES) MODE=$(MODE) $(PY) -m distlib_deploy.cluster up

cluster-down: venv
	$(PY) -m distlib_deploy.cluster down

cluster-logs: venv
	$(PY) -m distlib_deploy.cluster logs

# A lost node, from another terminal while `make cluster-up` runs (an elastic job goes on without it).
cluster-kill: venv
	NODE=$(NODE) $(PY) -m distlib_deploy.cluster kill

helm-lint: venv
	$(PY) -m pytest tests/helm -k lint $(PYTEST_ARGS)

# The chart's real-cluster lane (tests/helm/test_rendered_run.py, test_kube_failures.py) needs
# Kubernetes 1.20's server binaries, built once from Debian's source package into
# ~/.cache/distlib/kube-1.20 (7-11 minutes on 2 cores; later runs find it at once). Built
# here rather than inside a test, so the tests' timeouts do not cover the cold build. Where the
# build cannot run (not root on Debian) it says so, and the lane skips (fails in CI).
kube-build:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  tests/platforms/build-kube.sh >/dev/null; \
	else \
	  echo "make: building Kubernetes needs root on Debian: the chart's real-cluster tests will skip"; \
	fi

# lint, render, validate, and install the chart into the real cluster (docs: helm/README.md)
helm-test: venv kube-build
	$(PY) -m pytest tests/helm $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .build
