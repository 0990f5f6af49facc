"""reward_model: a sequence classifier's score as a reward, checked against one unpadded forward per
completion on tiny random classifiers (a templated one and a pair one), and through train.py."""
import json

import pytest
import torch
import yaml

import rewards
import train
from config import ConfigError, RewardSpec
from conftest import make_tokenizer
from graders import reward_model as rm
from scoring import checks

PROMPTS = ["What is 2 + 3?", [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hello world"}], "Which vitamin?"]
REPLIES = ["The answer is 5.", "Hello", "B12, this is a tiny tokenizer."]


def write_classifier(path, chat_template=True, num_labels=1):
    from transformers import LlamaConfig, LlamaForSequenceClassification
    tok = make_tokenizer() if chat_template else make_tokenizer(None)
    torch.manual_seed(1)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model = LlamaForSequenceClassification(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, vocab_size=len(tok), bos_token_id=0,
        eos_token_id=eos, pad_token_id=eos, num_labels=num_labels))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return write_classifier(tmp_path_factory.mktemp("rm"))


@pytest.fixture(autouse=True)
def fresh_cache():
    rm._LOADED.clear()
    yield
    rm._LOADED.clear()


def one_by_one(path, texts_or_pairs, max_length=None):
    """The slow reference: each input alone, no padding, cut from the left to max_length."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok, clf = AutoTokenizer.from_pretrained(path), \
        AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for x in texts_or_pairs:
        ids = tok(*x).input_ids if isinstance(x, tuple) \
            else tok(x, add_special_tokens=False).input_ids
        ids = ids[-max_length:] if max_length else ids
        with torch.no_grad():
            out.append(float(clf(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


def rendered(path, prompt, reply, system=None):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path).apply_chat_template(
        rm.conversation(prompt, reply, system), tokenize=False)


def test_scores_match_one_unpadded_forward_per_completion_in_any_batch_size(classifier):
    """Padded batches of 2 (rows of unequal length) give each completion the logit it gets alone,
    rendered by the classifier's chat template: the conversation's own turns, or one user turn."""
    samples = [{"prompt": p} for p in PROMPTS]
    want = one_by_one(classifier, [rendered(classifier, p, c) for p, c in zip(PROMPTS, REPLIES)])
    for size in (1, 2, 8):
        got = rm.reward_model(REPLIES, samples, model=str(classifier), batch_size=size)
        assert got == pytest.approx(want, abs=1e-5), size
    assert len(set(round(x, 6) for x in want)) == 3  # the replies are told apart


def test_the_forced_prefix_and_the_system_message_reach_the_classifier(classifier):
    samples = [{"prompt": PROMPTS[0]}]
    with_prefix = rm.reward_model(["5."], samples, model=str(classifier),
                                  assistant_prefix="<think> ")
    assert with_prefix == \
        pytest.approx(rm.reward_model(["<think> 5."], samples, model=str(classifier)), abs=1e-6)
    assert with_prefix != pytest.approx(rm.reward_model(["5."], samples, model=str(classifier)),
                                        abs=1e-4)
    sys_score = rm.reward_model(["5."], samples, model=str(classifier), system="Be brief.")
    assert sys_score == pytest.approx(
        one_by_one(classifier, [rendered(classifier, PROMPTS[0], "5.", "Be brief.")]), abs=1e-5)


def test_long_inputs_lose_their_start_not_the_completions_end(classifier):
    samples = [{"prompt": p} for p in PROMPTS]
    got = rm.reward_model(REPLIES, samples, model=str(classifier), max_length=6, batch_size=3)
    want = one_by_one(classifier, [rendered(classifier, p, c) for p, c in zip(PROMPTS, REPLIES)],
                      max_length=6)
    assert got == pytest.approx(want, abs=1e-5)


def test_a_classifier_without_a_chat_template_scores_the_pair(tmp_path):
    path = write_classifier(tmp_path / "pair", chat_template=False)
    samples = [{"prompt": p} for p in PROMPTS]
    flat = [p if isinstance(p, str) else "\n".join(t["content"] for t in p) for p in PROMPTS]
    got = rm.reward_model(REPLIES, samples, model=str(path), batch_size=2)
    assert got == pytest.approx(one_by_one(path, list(zip(flat, REPLIES))), abs=1e-5)


@pytest.mark.parametrize("args,message", [
    ({}, "reward_model needs args: {model"),
    ({"model": "./no/such/rm"}, "no such directory"),
    ({"model": "org/rm", "batch_size": 0}, "batch_size must be a positive integer"),
    ({"model": "org/rm", "dtype": "fp8"}, "dtype must be auto"),
    ({"model": "org/rm", "label": -1}, "label must be the index"),
])
def test_bad_args_are_refused_before_anything_loads(args, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("(", r"\(")):
        checks.check_specs([RewardSpec("reward_model", args=args)])


def test_a_causal_lm_or_a_label_past_the_outputs_fails_when_the_rewards_open(tiny_llama, classifier,
                                                                             monkeypatch):
    """A causal LM would load as a classifier with a random score head: refused from its config,
    with one line, before its weights load (transformers would print a load report first)."""
    from transformers import AutoModelForSequenceClassification
    real = AutoModelForSequenceClassification.from_pretrained.__func__

    def only_classifiers(cls, path, *a, **k):
        assert str(path) != str(tiny_llama), "the causal LM's weights were loaded"
        return real(cls, path, *a, **k)
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained",
                        classmethod(only_classifiers))
    with pytest.raises(ConfigError, match="is a LlamaForCausalLM, not a sequence classifier"):
        checks.open_rewards([RewardSpec("reward_model", args={"model": str(tiny_llama)})])
    with pytest.raises(ConfigError, match="label=1 but .* has 1 output"):
        checks.open_rewards([RewardSpec("reward_model",
                                         args={"model": str(classifier), "label": 1})])
    checks.open_rewards([RewardSpec("reward_model", args={"model": str(classifier)})])
    assert len(rm._LOADED) == 1  # loaded once; the reward reuses it


def test_a_grpo_run_trains_on_the_reward_model_and_a_bad_one_stops_it_first(tmp_path, tiny_llama,
                                                                            classifier, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?"}) + "\n"
                            for a in range(3) for b in range(2)))
    cfg = {"model": {"name": str(tiny_llama)}, "lora": {"r": 4, "alpha": 8},
           "data": {"name": str(data), "prompt": "{question}", "answer_key": None},
           "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 8,
                       "temperature": 1.5}, "optim": {"lr": 1e-2, "micro_batch_size": 4},
           "run": {"out_dir": str(tmp_path / "run"), "steps": 1, "save_every": 0},
           "rewards": [{"name": "reward_model",
                        "args": {"model": str(classifier), "batch_size": 3}}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 0
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["reward_errors/reward_model"] == 0 and m["reward_std"] > 0 and m["grad_norm"] > 0
    assert train.main(["--config", str(path), f"--run.out_dir={tmp_path / 'bad'}",
                       f"--rewards=[{{name: reward_model, args: {{model: {tiny_llama}}}}}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: rewards: reward_model: model=") \
        and not (tmp_path / "bad").exists()


def test_eval_scores_with_the_reward_model_and_a_bad_one_stops_it_first(tmp_path, tiny_llama,
                                                                        classifier, capsys):
    import eval as ev
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + 1?"}) + "\n" for a in range(4)))
    cfg = {"model": {"name": str(tiny_llama)},
           "data": {"name": str(data), "prompt": "{question}", "answer_key": None},
           "rewards": [{"name": "reward_model", "args": {"model": str(classifier)}}],
           "eval": {"select": [2, 4], "max_new_tokens": 6, "batch_size": 2,
                    "out_dir": str(tmp_path / "eval")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert ev.main(["--config", str(path), "--models", "base", "--data.select=[0, 2]"]) == 0
    preds = [json.loads(x)
             for x in (tmp_path / "eval" / "predictions_base.jsonl").read_text().splitlines()]
    want = one_by_one(classifier,
                      [rendered(classifier, p["prompt"], p["completion"]) for p in preds])
    assert [p["rewards"]["reward_model"] for p in preds] == pytest.approx(want, abs=1e-5)
    assert ev.main(["--config", str(path), "--models", "base", "--data.select=[0, 2]",
                    f"--eval.out_dir={tmp_path / 'bad'}",
                    "--rewards=[{name: reward_model, args: {model: " + str(tiny_llama)
                    + ", label: 0}}]"]) == 2
    assert "not a sequence classifier" in capsys.readouterr().err \
        and not (tmp_path / "bad").exists()


def test_a_tokenizer_that_adds_bos_gets_it_once_and_a_checkpoint_without_a_pad_id_still_batches(
        tmp_path):
    """The chat template writes BOS itself, so the rendered text is tokenized without special tokens
    (else BOS twice); a classifier saved without pad_token_id gets the tokenizer's, which it needs
    to find each padded row's last token."""
    from tokenizers import processors
    path = write_classifier(tmp_path / "bos")
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    tok.save_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.pad_token_id = None
    cfg.save_pretrained(path)
    assert AutoTokenizer.from_pretrained(path)("x").input_ids[0] == 0  # the tokenizer does add BOS
    samples = [{"prompt": p} for p in PROMPTS]
    texts = [rendered(path, p, c) for p, c in zip(PROMPTS, REPLIES)]
    assert all(t.startswith("<|endoftext|>") and t.count("<|endoftext|>") == 1 for t in texts)
    got = rm.reward_model(REPLIES, samples, model=str(path), batch_size=3)
    assert got == pytest.approx(one_by_one(path, texts), abs=1e-5)


def test_a_truncated_checkpoint_or_a_missing_gpu_is_one_line(tmp_path):
    path = write_classifier(tmp_path / "cut")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"reward_model: could not load model=.* as a sequence "
                                          r"classifier \(\w+Error"):
        checks.open_rewards([RewardSpec("reward_model", args={"model": str(path)})])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="reward_model: device=cuda but no CUDA GPU is "
                                              "visible; use device=cpu"):
            checks.open_rewards([RewardSpec("reward_model",
                                             args={"model": str(path), "device": "cuda"})])


def test_out_of_memory_in_the_reward_model_stops_the_run_with_its_own_advice(
        tmp_path, tiny_llama, classifier, capsys, monkeypatch):
    """Not the fallback and a run that learns nothing: exit 2, one line naming its args to lower."""
    from transformers import LlamaForSequenceClassification

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(LlamaForSequenceClassification, "forward", oom)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + 1?"}) + "\n" for a in range(4)))
    cfg = {"model": {"name": str(tiny_llama)}, "lora": {"r": 4, "alpha": 8},
           "data": {"name": str(data), "prompt": "{question}", "answer_key": None},
           "rollout": {"prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4},
           "run": {"out_dir": str(tmp_path / "run"), "steps": 1},
           "rewards": [{"name": "reward_model",
                        "args": {"model": str(classifier), "batch_size": 4}}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: reward_model: out of GPU memory scoring 4 completions") \
        and "batch_size (now 4)" in last


def test_sft_with_held_out_scoring_opens_the_reward_model_before_training(tmp_path, tiny_llama,
                                                                          capsys):
    """SFT and DPO score held-out generations with the rewards (run.eval_every): a reward model that
    does not load stops them before step 1 too."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {a} + 1?", "a": str(a + 1)}) + "\n"
                            for a in range(8)))
    cfg = {"mode": "sft", "model": {"name": str(tiny_llama)}, "lora": {"r": 4, "alpha": 8},
           "data": {"name": str(data), "prompt": "{q}", "target": "a", "answer_key": None,
                    "select": [0, 6]},
           "sft": {"batch_size": 2}, "eval": {"select": [6, 8], "max_new_tokens": 4},
           "run": {"out_dir": str(tmp_path / "run"), "steps": 1, "eval_every": 1},
           "rewards": [{"name": "reward_model", "args": {"model": str(tiny_llama)}}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 2
    assert "not a sequence classifier" in capsys.readouterr().err \
        and not (tmp_path / "run").exists()


EOS_TERMINATED = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
                  "+ '<|im_end|>' }}{% endfor %}")


@pytest.mark.parametrize("config_pad", [0, None])
def test_an_eos_terminated_chat_is_scored_where_the_checkpoint_scores_it_alone(tmp_path,
                                                                               config_pad):
    """A tokenizer without a pad token (Llama 3's) pads with EOS; the checkpoint's own pad_token_id
    (or, without one, each input's last token, its EOS here) is what the classifier must read."""
    from transformers import AutoConfig, AutoTokenizer
    path = write_classifier(tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template, tok.pad_token = EOS_TERMINATED, None
    tok.save_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.pad_token_id = config_pad
    cfg.save_pretrained(path)
    texts = [rendered(path, p, c) for p, c in zip(PROMPTS, REPLIES)]
    assert all(t.endswith("<|im_end|>") for t in texts)
    want = one_by_one(path, texts)
    for size in (1, 3):
        rm._LOADED.clear()
        assert rm.reward_model(REPLIES, [{"prompt": p} for p in PROMPTS], model=str(path),
                               batch_size=size) == pytest.approx(want, abs=1e-5)


def test_a_pair_loses_the_end_of_its_longer_text_and_a_cut_is_reported(tmp_path, capsys):
    path = write_classifier(tmp_path / "pair", chat_template=False)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    prompt, reply = "What is 2 + 3? Reply with just the number.", \
        "The answer is 5. Hello world, this is a tiny tokenizer."
    # right side: the tokenizer's default
    ids = tok(prompt, reply, truncation="longest_first", max_length=12).input_ids
    from transformers import AutoModelForSequenceClassification
    with torch.no_grad():
        want = float(AutoModelForSequenceClassification.from_pretrained(path)(
            input_ids=torch.tensor([ids])).logits[0, 0])
    assert rm.reward_model([reply], [{"prompt": prompt}], model=str(path), max_length=12) == \
        pytest.approx([want], abs=1e-5)
    assert "1 of 1 inputs are longer than its max_length=12" in capsys.readouterr().err


def test_max_length_stops_at_the_models_positions(tmp_path):
    """A GPT-2 (or BERT) classifier has absolute positions: past them its forward is an IndexError,
    which would give every completion of the batch the fallback."""
    from transformers import GPT2Config, GPT2ForSequenceClassification
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    GPT2ForSequenceClassification(GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=len(tok), bos_token_id=0,
        eos_token_id=eos, pad_token_id=eos, num_labels=1)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    got = rm.reward_model(["Hello world, this is a tiny tokenizer. " * 5, "5"],
                          [{"prompt": "What is 2 + 3?"}] * 2, model=str(tmp_path))
    assert len(got) == 2


def test_non_finite_scores_stop_the_run_and_several_outputs_need_a_label(tmp_path, classifier,
                                                                         monkeypatch):
    from transformers import LlamaForSequenceClassification

    from config import JudgeUnusable
    real = LlamaForSequenceClassification.forward

    def overflow(self, *a, **k):
        out = real(self, *a, **k)
        out.logits[:] = float("inf")
        return out
    monkeypatch.setattr(LlamaForSequenceClassification, "forward", overflow)
    with pytest.raises(JudgeUnusable, match="non-finite score.*dtype: bfloat16"):
        rewards.compute_rewards(["5"], [{"prompt": "2 + 3?"}],
                                [RewardSpec("reward_model", args={"model": str(classifier)})])
    monkeypatch.setattr(LlamaForSequenceClassification, "forward", real)
    two = write_classifier(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match=r"has 2 outputs \(0: LABEL_0, 1: LABEL_1\); choose one "
                                          r"with args: \{label"):
        checks.open_rewards([RewardSpec("reward_model", args={"model": str(two)})])
    checks.open_rewards([RewardSpec("reward_model", args={"model": str(two), "label": 1})])


def test_a_causal_lm_saved_without_architectures_is_refused(tmp_path, tiny_llama):
    import shutil
    path = shutil.copytree(tiny_llama, tmp_path / "lm")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("architectures", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError,
                       match="without the weights score.weight, not a sequence classifier"):
        checks.open_rewards([RewardSpec("reward_model", args={"model": str(path)})])
