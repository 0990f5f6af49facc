"""Rollouts (rollout.py) and the policy they sample from, on tiny random models: groups, masks, EOS,
stops, chat templates, merged and static-cache sampling."""
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
import logprobs
import rollout
from config import ConfigError, DataConfig, LoraConfig, ModelConfig
from conftest import CHATML, make_tokenizer
from model import load_policy, load_tokenizer, reference_mode


def load(path):
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path).eval(), tok


def padded_batch(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def biased_to_eos(model, eos: int, bias: float) -> None:
    """The tiny random model with its EOS logit raised: completions that stop, at random lengths."""
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[eos] = bias
    model.lm_head = head


def test_generate_rollout_groups_masks_and_texts(tiny_llama):
    torch.manual_seed(0)
    model, tok = load(tiny_llama)
    biased_to_eos(model, tok.eos_token_id, 4.0)  # pad == eos here: the mask must keep the real EOS
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?", "Hello"]]
    r = rollout.generate_rollout(model, tok, prompts, num_generations=3, max_new_tokens=6)
    N, C = r.completion_ids.shape
    assert N == 6 and C <= 6
    # both branches below
    assert tok.pad_token_id == tok.eos_token_id and r.truncated.any() and not r.truncated.all()
    assert torch.equal(r.prompt_ids[0], r.prompt_ids[2]) \
        and not torch.equal(r.prompt_ids[0], r.prompt_ids[3])
    # rows i*G .. i*G+G-1: prompt i
    assert all(torch.equal(r.prompt_ids[i], r.prompt_ids[i // 3 * 3]) for i in range(N))
    eos = tok.eos_token_id
    for i in range(N):
        n = int(r.completion_mask[i].sum())
        ids = r.completion_ids[i, :n].tolist()
        if r.truncated[i]:
            assert n == C and eos not in ids
        else:
            assert ids[-1] == eos and eos not in ids[:-1]  # mask ends exactly at the first EOS
        assert r.texts[i] == tok.decode(ids, skip_special_tokens=True)


def test_render_prompt_adds_system_prompt_and_forced_prefix(tiny_llama):
    _, tok = load(tiny_llama)
    text = rollout.render_prompt(tok, "Q?", system_prompt="Be brief.", assistant_prefix="<think>")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>")


def test_stop_strings_end_the_completion_mask_at_the_stop(tiny_llama):
    _, tok = load(tiny_llama)
    ids = tok(" the answer is 5. Hello world", return_tensors="pt",
              add_special_tokens=False).input_ids
    mask, truncated = grpo.completion_mask(ids, [tok.eos_token_id])
    rollout._cut_at_stop_strings(tok, ids, mask, truncated, ["5."])
    n = int(mask[0].sum())
    assert tok.decode(ids[0, :n]).endswith("5.") and not truncated[0]


def test_a_model_without_chat_template_is_a_clear_error(tiny_no_template):
    with pytest.raises(ConfigError, match="no chat template"):
        load_tokenizer(ModelConfig(name=str(tiny_no_template)), str(tiny_no_template))


def test_a_configured_chat_template_rescues_such_a_model(tiny_no_template, tmp_path):
    (tmp_path / "t.jinja").write_text(CHATML)
    tok = load_tokenizer(ModelConfig(name=str(tiny_no_template),
                                     chat_template=str(tmp_path / "t.jinja")),
                         str(tiny_no_template))
    assert rollout.render_prompt(tok, "hi").endswith("<|im_start|>assistant\n")


def test_a_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        load_policy(ModelConfig(name=str(tmp_path / "nope")), LoraConfig(), torch.device("cpu"))


def test_reference_is_the_policy_with_the_adapter_disabled(tiny_llama):
    model, tok = load_policy(ModelConfig(name=str(tiny_llama)), LoraConfig(r=4, alpha=8),
                             torch.device("cpu"))
    ids, attn = padded_batch(tok, ["Hello world, 42"])
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)  # move the LoRA weights away from the identity
        policy = logprobs.sequence_log_probs(model, ids, attn, 3)
        with reference_mode(model) as ref:
            reference = logprobs.sequence_log_probs(ref, ids, attn, 3)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
        plain = logprobs.sequence_log_probs(base, ids, attn, 3)
    assert torch.allclose(reference, plain, atol=1e-5)
    assert not torch.allclose(policy, plain, atol=1e-3)
    # no second copy
    assert sum(p.numel() for p in model.parameters()) \
        < 1.5 * sum(p.numel() for p in base.parameters())


def test_policy_has_no_active_dropout(tiny_gpt2):
    model, _ = load_policy(ModelConfig(name=str(tiny_gpt2)), LoraConfig(r=4, dropout=0.3),
                           torch.device("cpu"))
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.0 for m in drops)


def test_a_shipped_generation_config_does_not_leak_into_sampling(tmp_path):
    """repetition_penalty, min_p or top_k from generation_config.json would make the sampler differ
    from the policy whose log-probs the loss uses (logits / T only)."""
    from transformers import GenerationConfig

    from conftest import write_tiny_model
    path = write_tiny_model(tmp_path / "m")
    gc = GenerationConfig.from_pretrained(path)
    gc.do_sample, gc.repetition_penalty, gc.min_p, gc.top_k = True, 1.3, 0.05, 20
    gc.save_pretrained(path)
    model, tok = load_policy(ModelConfig(name=str(path)), LoraConfig(r=4), torch.device("cpu"))
    g = model.generation_config
    assert (g.repetition_penalty, g.min_p, g.top_k) == (None, None, None)
    assert g.eos_token_id == tok.eos_token_id and g.pad_token_id == tok.pad_token_id


def test_ignore_eos_generates_fixed_length_completions_where_the_model_wants_to_stop(tiny_llama):
    torch.manual_seed(0)
    model, tok = load(tiny_llama)
    # EOS now wins almost every draw
    biased_to_eos(model, tok.convert_tokens_to_ids("<|im_end|>"), 8.0)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?", "Hello"]]
    free = rollout.generate_rollout(model, tok, prompts, 4, max_new_tokens=6)
    fixed = rollout.generate_rollout(model, tok, prompts, 4, max_new_tokens=6, ignore_eos=True)
    # without the flag most completions stop at once
    assert free.completion_mask.sum(1).float().mean() < 3
    assert fixed.completion_mask.sum(1).tolist() == [6] * 8 and fixed.truncated.all()


def test_chat_template_kwargs_reach_the_template(tiny_llama):
    """Qwen3's template reads enable_thinking; data.chat_template_kwargs passes such switches."""
    _, tok = load(tiny_llama)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}"
                         "<think></think>{% endif %}")
    data = DataConfig(system_prompt=None, assistant_prefix="{",
                      chat_template_kwargs={"enable_thinking": False})
    assert rollout.render_rows(tok, [{"prompt": "Q"}], data) == ["Q<think></think>{"]
    assert rollout.render_rows(tok, [{"prompt": "Q"}], DataConfig(assistant_prefix="")) == ["Q"]


def test_merged_sampling_is_the_same_policy_in_fp32_and_restores_the_base_weights_exactly(
        tiny_llama):
    from model import merged_for_sampling
    model, tok = load_policy(ModelConfig(name=str(tiny_llama)), LoraConfig(r=4, alpha=8),
                             torch.device("cpu"))
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, attn = padded_batch(tok, ["What is 2 + 3? The answer is 5.", "Hello world, this is 42"])
    with torch.no_grad():
        unmerged = logprobs.sequence_log_probs(model, ids, attn, 4)
        with merged_for_sampling(model):
            merged = logprobs.sequence_log_probs(model, ids, attn, 4)
            inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        after_lp = logprobs.sequence_log_probs(model, ids, attn, 4)
    assert torch.allclose(merged, unmerged, atol=1e-5)  # same policy
    # it did merge
    assert any(not torch.equal(inside[n], before[n]) for n in before if "base_layer" in n)
    # restored bit for bit
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(after_lp, unmerged)  # and the adapter is live again


def test_merged_sampling_trains(tmp_path, tiny_llama):
    import json

    import train
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"{a} + 1?", "answer": str(a + 1)}) + "\n"
                            for a in range(6)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{name: {tiny_llama}}}\ndata: {{name: {data}, prompt: '{{q}}'}}\n"
                   "rollout: {prompts_per_step: 2, num_generations: 2, max_new_tokens: 4, "
                   "merged_sampling: true}\n"
                   f"run: {{out_dir: {tmp_path / 'run'}, steps: 2}}\n"
                   f"rewards: [{{name: answer_match}}]\n")
    assert train.main(["--config", str(cfg)]) == 0


@pytest.mark.parametrize("arch, peft_args", [
    ("tiny_gpt2", {"target_modules": ["c_attn", "lm_head"]}),  # lm_head tied to wte
    ("tiny_llama", {"target_modules": ["q_proj", "v_proj"], "use_dora": True}),
    ("tiny_llama", {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})])
def test_merged_sampling_leaves_tied_dora_and_saved_modules_as_they_are(arch, peft_args, request):
    import peft

    from model import merged_for_sampling
    base = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(arch))
    model = peft.get_peft_model(base,
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **peft_args))
    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(arch))
    tok.padding_side = "left"
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(torch.randn_like(p) * 0.5)
    ids, attn = padded_batch(tok, ["What is 2 + 3? The answer is 5.", "Hello world, this is 42"])
    model.eval()
    with torch.no_grad():
        unmerged = logprobs.sequence_log_probs(model, ids, attn, 4)
        with merged_for_sampling(model):
            merged = logprobs.sequence_log_probs(model, ids, attn, 4)
    assert torch.allclose(merged, unmerged, atol=1e-5)


def test_static_cache_rollout_samples_what_the_dynamic_cache_samples(tiny_llama):
    """rollout.compile: a preallocated cache and prompts padded to a bucket (64 tokens) change no
    sample."""
    model, tok = load(tiny_llama)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?",
                                                       "Hello world, this is a tiny tokenizer."]]
    out = []
    for static in (False, True):
        torch.manual_seed(0)
        out.append(rollout.generate_rollout(model, tok, prompts, 3, 10, 1.0, share_prompt=True,
                                            static_cache=static))
    dynamic, static = out
    assert static.prompt_ids.shape[1] == rollout.STATIC_BUCKET \
        and dynamic.prompt_ids.shape[1] < rollout.STATIC_BUCKET
    assert static.texts == dynamic.texts \
        and torch.equal(static.completion_ids, dynamic.completion_ids)
    with torch.no_grad():  # the extra left padding is masked: the training forward scores the same
        C = dynamic.completion_ids.shape[1]
        a = logprobs.sequence_log_probs(model, dynamic.input_ids, dynamic.attention_mask, C)
        b = logprobs.sequence_log_probs(model, static.input_ids, static.attention_mask, C)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: transformers compiles generate only there")
def test_compiled_generate_on_cuda_decodes_like_eager(tiny_llama):
    model, tok = load(tiny_llama)
    model = model.cuda()
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?", "Hello"]]
    torch.manual_seed(0)
    eager = rollout.generate_rollout(model, tok, prompts, 1, 8, temperature=0.0)
    compiled = rollout.generate_rollout(model, tok, prompts, 1, 8, temperature=0.0,
                                        static_cache=True)
    assert compiled.texts == eager.texts


def test_a_stop_string_completed_by_the_last_token_keeps_every_token(tiny_llama):
    _, tok = load(tiny_llama)
    ids = tok(" the answer is 5.", return_tensors="pt", add_special_tokens=False).input_ids
    mask, truncated = grpo.completion_mask(ids, [tok.eos_token_id])
    rollout._cut_at_stop_strings(tok, ids, mask, truncated, ["5."])
    assert mask.tolist() == [[1] * ids.shape[1]] and not truncated[0]


def test_eos_ids_are_the_tokenizers_and_the_generation_configs():
    tok, model = SimpleNamespace(eos_token_id=2), \
        SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 7]))
    assert rollout.eos_token_ids(tok, model) == [2, 5, 7]
    model.generation_config.eos_token_id = 9
    assert rollout.eos_token_ids(tok, model) == [2, 9]


def test_joined_rollouts_pad_completions_outside_the_mask():
    def ro(C):
        return rollout.Rollout(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2),
                               torch.full((1, C), 7),
                               torch.ones(1, C), torch.zeros(1, dtype=torch.bool), ["x"],
                               entropy=torch.arange(1.0, C + 1)[None])
    both = rollout.concat_rollouts([ro(4), ro(2)], pad_id=0)
    assert both.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert both.completion_ids.tolist() == [[7, 7, 7, 7], [7, 7, 0, 0]]
    assert both.entropy.tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]]  # each token keeps its own entropy
    assert rollout.select_rows(both, [1]).entropy.tolist() == [[1, 2, 0, 0]]


@pytest.mark.parametrize("share", [False, True])
def test_sampling_entropy_is_that_of_the_distribution_each_token_was_drawn_from(tiny_llama, share):
    """EntropyMeter's per-token entropy equals -sum p log p of softmax(logits / T) from a plain
    forward over prompt + completion, at every unmasked position (TRL's entropy: no top-k cut)."""
    torch.manual_seed(0)
    model, tok = load(tiny_llama)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?", "Hi"]]
    r = rollout.generate_in_slices(model, tok, prompts, 1, 3, 7, 0.7, share_prompt=share,
                                   entropy=True)
    assert r.entropy.shape == r.completion_mask.shape
    P = r.prompt_ids.shape[1]
    with torch.no_grad():
        logits = model(r.input_ids, attention_mask=r.attention_mask,  # (N, C, V)
                       position_ids=logprobs.position_ids(r.attention_mask)
                       ).logits[:, P - 1:-1].double() / 0.7
    logp = torch.log_softmax(logits, -1)
    want = -(logp.exp() * logp).sum(-1)  # (N, C)
    m = r.completion_mask.bool()
    assert torch.allclose(r.entropy[m].double(), want[m], atol=1e-4) and (r.entropy[m] > 0).all()
    # EOS banned: -inf
    fixed = rollout.generate_rollout(model, tok, prompts, 3, 5, 0.7, ignore_eos=True, entropy=True)
    assert torch.isfinite(fixed.entropy).all() and (fixed.entropy > 0).all()
    # eval and benchmarks pay nothing
    assert rollout.generate_rollout(model, tok, prompts, 3, 4).entropy is None


# DeepSeek-R1's, QwQ's way
R1_TEMPLATE = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
QWEN3_OFF = CHATML.replace("'<|im_start|>assistant\n'",
                           "'<|im_start|>assistant\n<think>\n\n</think>\n\n'")


@pytest.mark.parametrize("template, forced, system, expected", [
    (CHATML, "", None, ""), (CHATML, "<think>", None, "<think>"), (CHATML, "{", None, "{"),
    # the template opens the block: rewards see it opened
    (R1_TEMPLATE, "", None, "<think>\n"),
    (R1_TEMPLATE, "<think>\n", None, "<think>\n"),          # written once, as the prompt has it
    (R1_TEMPLATE, "Let me", None, "<think>\nLet me"),
    (QWEN3_OFF, "", None, "<think>\n\n</think>\n\n"),       # a whole block: the answer follows it
    (R1_TEMPLATE, "</think>\n\n", None, "<think>\n</think>\n\n"),  # R1 with thinking forced off
    # the system prompt's words are not the reply's
    (CHATML, "", "Reason inside <think> tags, then answer.", ""),
])
def test_reply_prefix_is_what_every_reply_starts_with_that_the_policy_did_not_write(
        template, forced, system, expected):
    from graders import json_answers
    data = SimpleNamespace(system_prompt=system, assistant_prefix=forced, chat_template_kwargs={})
    prefix = rollout.reply_prefix(make_tokenizer(template), data)
    assert prefix == expected
    if "{" not in forced:
        # the rule rewards read the answer after it (after the reply closes an opened block)
        reply = ("</think>" if prefix.rfind("<think>") > prefix.rfind("</think>") else "") \
            + '{"a": 1}'
        assert json_answers.json_valid(reply, {}, assistant_prefix=prefix) == 1.0


def test_reply_prefix_of_a_template_that_wants_the_rows_own_system_message_is_the_forced_prefix():
    strict = ("{% if messages[0]['role'] != 'system' %}"
              "{{ raise_exception('a system message must come first') }}{% endif %}" + R1_TEMPLATE)
    data = SimpleNamespace(system_prompt=None, assistant_prefix="<think>", chat_template_kwargs={})
    assert rollout.reply_prefix(make_tokenizer(strict), data) == "<think>"


def test_nan_logits_stop_sampling_with_what_to_change(tiny_llama):
    """A float16 overflow (Qwen2.5 on a T4) makes NaN logits; torch.multinomial then fails with a
    message about probability tensors (a device-side assert on CUDA): one line naming model.dtype
    instead."""
    model, tok = load(tiny_llama)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(rollout.NonFiniteLogits, match="set model.dtype: float32"):
        rollout.generate_rollout(model, tok, [rollout.render_prompt(tok, "hi")], 2,
                                 max_new_tokens=3)


def test_a_completion_also_ends_at_the_template_s_end_of_turn_when_the_eos_is_another_token():
    """A base model's tokenizer (Qwen2.5's EOS is <|endoftext|>) under a ChatML template: sampling
    must stop at <|im_end|> too, or it runs on into a made-up next turn."""
    base = make_tokenizer()
    base.eos_token = "<|endoftext|>"
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    assert rollout.turn_end_id(base) == im_end \
        and rollout.eos_token_ids(base, None) == sorted({base.eos_token_id, im_end})
    instruct = make_tokenizer()  # EOS and end of turn the same token: nothing added
    assert rollout.eos_token_ids(instruct, None) == [instruct.eos_token_id]
    # text after a turn: no token
    plain = make_tokenizer("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert rollout.turn_end_id(plain) is None
    ids = torch.tensor([[5, 6, im_end, 7, 8]])
    mask, truncated = grpo.completion_mask(ids, rollout.eos_token_ids(base, None))
    assert mask.tolist() == [[1, 1, 1, 0, 0]] and not truncated[0]


def test_sampling_uses_the_rollout_temperature(tiny_llama):
    """generate samples from softmax(logits / T), the distribution the loss scores: near T = 0 that
    is greedy decoding (at T = 1 this random model's samples would differ from it)."""
    model, tok = load(tiny_llama)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?", "Hello"]]
    greedy = rollout.generate_rollout(model, tok, prompts, 1, max_new_tokens=8, temperature=0.0)
    torch.manual_seed(0)
    cold = rollout.generate_rollout(model, tok, prompts, 1, max_new_tokens=8, temperature=1e-4)
    assert torch.equal(cold.completion_ids, greedy.completion_ids) and cold.texts == greedy.texts


def test_a_rollout_of_a_base_tokenizer_under_chatml_ends_at_the_turn_end(tiny_llama):
    """The tokenizer's (and generation config's) EOS is <|endoftext|>, the template closes turns
    with <|im_end|>: sampling stops there and the mask ends there, instead of running on to
    max_new_tokens."""
    model, tok = load(tiny_llama)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = tok.eos_token_id
    biased_to_eos(model, im_end, 30.0)  # every completion closes its turn at once
    r = rollout.generate_rollout(model, tok, [rollout.render_prompt(tok, "Hello")], 4,
                                 max_new_tokens=6)
    assert r.completion_ids.shape[1] == 1 and r.completion_ids[:, 0].tolist() == [im_end] * 4
    assert r.completion_mask.tolist() == [[1.0]] * 4 and not r.truncated.any()
