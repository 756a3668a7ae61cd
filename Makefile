# Two commands matter (README's Quickstart):  make quickstart   and   make test
# Both install into .venv first. torch==2.13.0 goes in before anything that depends on torch
# (transformers, accelerate, lightning: the dev extra), so pip takes the CPU wheel on disk and
# never pulls a multi-GB CUDA build.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= ../shared/data
OUT ?= out/quickstart

.PHONY: install quickstart test check lint docs docs-serve clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(BIN)/python train/finetune_gpt2.py --local-peers 2 --model-config small \
		--dataset $(DATA)/imdb --tokenizer $(DATA)/gpt2-tokenizer --output-dir $(OUT) \
		--train-samples 300 --val-samples 16 --test-samples 50 --epochs 1 --batch-size 64 \
		--lr 1e-3 --sync-every 10 --eval-every 5

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site (mkdocs.yml): strict, so a broken link or a reference that does not resolve fails
# the build; the reference pages are generated from the code (docs/gen_reference.py). site/ opens
# from disk, offline. NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, not ours.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# install-chromium.sh apt-installs Debian's chromium system-wide (~155 MB download) unless
# `chromium` is on PATH or CHROMIUM names one; README says so. Two pytest workers (pytest-xdist):
# most tests wait on servers, subprocesses and shaped links, and the suite took 0.81x the time on
# 2 cores (worksteal: a worker that is done takes the other's queued tests, so one long test at
# the end does not hold the run)
test: install lint
	bash .ci/install-chromium.sh
	$(BIN)/python -m pytest -n 2 --dist worksteal

# The edit loop: lint and the tests that start no process of their own (tests/conftest.py marks
# the others `process`); about a minute and a half on 2 cores. `make test` and CI run everything.
check: install lint
	$(BIN)/python -m pytest -n 2 --dist worksteal -m "not process" -q

clean:
	rm -rf $(VENV) out artifacts site .pytest_cache .mypy_cache .ruff_cache
