# The two quickstart commands: `make demo` and `make test`. Each sets up what it needs.
VENV ?= .venv
export PROMPTSPLICE_VENV := $(VENV)

.PHONY: setup demo test bench
setup:
	@scripts/setup.sh

demo: setup
	$(VENV)/bin/promptsplice demo

test: setup
	$(VENV)/bin/python -m pytest

bench: setup
	$(VENV)/bin/python -m promptsplice.benchmarks.run_all
