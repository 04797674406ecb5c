# mopd_hpc — every target does its own set-up, idempotently (a second call skips what is done).
#   make run    the main job: configs/local_cpu.yaml on the local backend
#   make test   the whole test suite on PYTEST_WORKERS parallel workers, the real local Slurm cluster included (when root)
#   make lint   ruff

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On these machines `pip install torch==2.13.0` takes a local CPU wheel. The package itself only asks
# for a range (torch>=2.6), so GPU users keep their CUDA build: override with TORCH_SPEC=... or preinstall.
TORCH_SPEC ?= torch==2.13.0
# Debian packages the tests need: the Slurm cluster of tools/slurm_local, accounting, namespaces, tmux.
DEBIAN_PACKAGES := slurmctld slurmd slurm-client slurmdbd munge mariadb-server iproute2 procps tmux
RUN_CONFIG ?= configs/local_cpu.yaml
PYTEST_ARGS ?=
# Parallel test workers (pytest-xdist). The pass is CPU-bound on 2 cores (every process runs torch on one thread,
# tests/conftest.py; a job's children fork from its guard's fork server, the tests' own programs from the worker's:
# tests/helpers_fork.py), so workers beyond the cores only overlap the tests' waits on subprocesses and sockets; the longest work goes first (tests/durations.json, tools/test_durations.py).
# The Slurm-marked tests run after, in one process. PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= 4

.PHONY: run test lint setup debian clean-venv

# The venv gets uv, which installs the rest (tools/venv_install.sh: pip where uv can't be had).
INSTALL := bash tools/venv_install.sh $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv || echo "no uv: pip installs the packages"

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(INSTALL) "$(TORCH_SPEC)"
	touch $@

# What `make run` needs (the package and its dependencies), then what the tests add (the dev extra).
$(VENV)/.base: pyproject.toml $(VENV)/.torch
	$(INSTALL) -e .
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.base
	$(INSTALL) -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

debian:
	@bash tools/apt_install.sh $(DEBIAN_PACKAGES)

run: $(VENV)/.base
	$(VENV)/bin/mopd-submit $(RUN_CONFIG) --local

# Two passes: everything but the Slurm-marked end-to-end jobs on parallel workers, then those jobs alone, one after
# another on the local cluster (on 2 loaded cores their sbatch/requeue waits time out beside the other workers).
# The second pass collects only the test files that name the marker or the cluster fixture (collecting the whole
# suite again took 15-45 s). A pass that selects no test (exit 5) is not a failure.
SLURM_TEST_FILES = $(shell grep -rlE --include='test_*.py' 'mark\.slurm|slurm_cluster' tests | sort)
test: setup debian
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slurm" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -m slurm $(SLURM_TEST_FILES) $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint: setup
	$(VENV)/bin/ruff check mopd_hpc tests tools benchmarks
	$(VENV)/bin/ruff format --check mopd_hpc tests tools benchmarks

clean-venv:
	rm -rf $(VENV)
