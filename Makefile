# ddpflow: two commands on a fresh machine.
#   make run    set up .venv, then run the workflow on config/config.yaml (snakemake --cores all;
#               CONFIG=my.yaml for your own config)
#   make test   set up .venv and the test services (Docker engine), lint, run every test, then
#               the mutation ratchet (tests/mutation: changed functions' tests must catch bugs)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
STAMP := $(VENV)/.ddpflow-installed
CORES ?= all
# tests run in 2 processes, a test file per process at a time (--dist loadfile): the suite
# spends much of its time waiting (process start-up, Snakemake, Slurm, Docker), and a file's
# tests share its fixtures and its external service (test_slurm.py: the cluster); the
# longest files start first (tests/conftest.py)
TEST_JOBS ?= 2

.PHONY: run test install lint test-env bench mutate mutate-check clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

install: $(STAMP)

run: $(STAMP)
	snakemake --cores $(CORES) $(if $(CONFIG),--configfile $(CONFIG))

lint: $(STAMP)
	ruff check src tests bench
	snakemake --lint
	snakefmt --check Snakefile workflow
	hadolint --failure-threshold error Dockerfile

test-env:
	bash tests/setup/system.sh

test: $(STAMP) test-env lint
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder
	$(PY) tests/mutation/mutate.py check

bench: $(STAMP)
	$(PY) bench/ddp_scaling.py
	$(PY) bench/input_pipeline.py
	$(PY) bench/prepare_imagefolder.py
	$(PY) bench/optimizer_step.py
	$(PY) bench/sweep_pool.py
	$(PY) bench/user_dataset.py
	$(PY) bench/trainer_vs_reference.py
	$(PY) bench/vs_lightning.py

# mutation testing (tests/mutation/mutate.py): the functions whose source changed since
# tests/mutation/records.json are mutated against the tests that reach them, and the records
# updated; then the table per module. MUTATE=--all: every function (hours on 2 cores)
mutate: $(STAMP)
	$(PY) tests/mutation/mutate.py run $(MUTATE)

# the ratchet alone (the last step of `make test`)
mutate-check: $(STAMP)
	$(PY) tests/mutation/mutate.py check

clean:
	rm -rf results logs .snakemake
