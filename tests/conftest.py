"""Shared fixtures: tiny randomly initialised models with a real (tiny) BPE tokenizer and a ChatML
template, written to disk like any transformers model directory, so tests run the real loading
path."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["What is 2 + 3? Reply with just the number.", "The answer is 5.",
          "Hello world, this is a tiny tokenizer.",
          "Question: which vitamin? A) B12 B) C C) D D) K",
          '{"predicted_category": "A", "confidence": 0.9}',
          "<think> let me think </think> 0 1 2 3 4 5 6 7 8 9 10 11 12 20 30 42 100"]


def make_tokenizer(chat_template: str | None = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def write_tiny_model(path: Path, arch: str = "llama", chat_template: str | None = CHATML,
                     seed: int = 0) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    tok = make_tokenizer(chat_template)
    torch.manual_seed(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tok), bos_token_id=0, eos_token_id=eos, pad_token_id=eos)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=256,
                                             **common))
    else:  # absolute positions: a wrong position id changes the output, unlike RoPE
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                           **common))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    """One torch thread, restored after: on 2 shared cores two threads wait on each other (4x)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_gpt2"), arch="gpt2")


@pytest.fixture(scope="session")
def tiny_no_template(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_no_template"), chat_template=None)


def write_run_config(tmp_path: Path, model_path: Path, **sections) -> Path:
    """A small GRPO run config on 12 arithmetic rows: 2 prompts x G=4, 8 new tokens, 2 steps;
    `sections` update the config's sections key by key."""
    import json

    import yaml
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)})
                            + "\n" for a in range(4) for b in range(3)))
    cfg = {"model": {"name": str(model_path)}, "lora": {"r": 4, "alpha": 8},
           "data": {"name": str(data), "prompt": "{question} Reply with just the number."},
           "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8,
                       "temperature": 1.5},
           "optim": {"lr": 1e-2, "micro_batch_size": 4},
           "run": {"steps": 2, "save_every": 0, "sample_every": 0},
           "rewards": [{"name": "short_answer", "args": {"max_words": 2}}]}
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def page(tmp_path):
    """The rating page (Starlette's TestClient, tests/rating_client.py) on tmp_path/ratings, and
    that folder; skipped without the `ratings` extra. Each test starts from the files."""
    from graders import ratings
    from rating_client import needs_page, page_client
    needs_page()
    ratings._STORES.clear()  # one Store per folder per process
    yield page_client(tmp_path / "ratings"), tmp_path / "ratings"
    ratings._STORES.clear()


# what the recipes read from the environment (GRubrics' judge, its REWARD_LAMBDA_* weights):
# a developer's own settings must not send the tests to Azure or reweigh their rewards
RECIPE_ENV = ("AZURE_OPENAI_ENDPOINT", "AZURE_OPENAI_API_VERSION", "JUDGE_MODEL", "ANSWER_MODEL",
              "REWARD_LAMBDA_ALIGNMENT", "REWARD_LAMBDA_FORMAT", "REWARD_LAMBDA_LENGTH")


@pytest.fixture(autouse=True)
def _without_recipe_env(monkeypatch):
    for name in RECIPE_ENV:
        monkeypatch.delenv(name, raising=False)
