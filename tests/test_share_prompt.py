"""grpo.share_prompt: each prompt runs through the model once per group, in sampling and in the
loss. The values, gradients and samples must equal the one-pass path's, and the fallbacks must
engage."""
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import logprobs
import rollout
import train
from config import LoraConfig, ModelConfig
from model import checkpoint_layers, load_policy


def lora_policy(path, attn_implementation=None):
    """A LoRA policy whose adapter is not zero (B = 0 at init would hide a missing adapter path)."""
    model, tok = load_policy(ModelConfig(name=str(path), attn_implementation=attn_implementation),
                             LoraConfig(r=4, alpha=8), torch.device("cpu"))
    assert model.config._attn_implementation == (attn_implementation or "sdpa")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, tok


def grouped_batch(tok, prompts, groups, completions):
    """Rows as a rollout lays them out: prompt i repeated groups[i] times, left-padded prompts,
    right-padded completions whose masks end at different lengths. -> (ids, attn, C)."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    rep = torch.tensor(groups)
    p_ids, p_mask = enc.input_ids.repeat_interleave(rep, 0), \
        enc.attention_mask.repeat_interleave(rep, 0)
    comp = tok(completions, return_tensors="pt", padding=True, add_special_tokens=False,
               padding_side="right")
    assert comp.input_ids.shape[0] == p_ids.shape[0]
    return torch.cat([p_ids, comp.input_ids], 1), torch.cat([p_mask, comp.attention_mask], 1), \
        comp.input_ids.shape[1]


def log_probs_and_grads(model, ids, attn, C, weights, **kw):
    model.zero_grad(set_to_none=True)
    lp = logprobs.sequence_log_probs(model, ids, attn, C, temperature=0.7, chunk=5, **kw)
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone()
                         for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """Qwen3's shape (q/k norms, tied embeddings): the family the GPU configs train."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import make_tokenizer
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=256, eos_token_id=eos, pad_token_id=eos))
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused-head"])
@pytest.mark.parametrize("arch,attn", [("tiny_llama", "sdpa"), ("tiny_llama", "eager"),
                                       ("tiny_gpt2", "sdpa"), ("tiny_qwen3", "sdpa")])
def test_shared_prompt_gives_the_same_log_probs_and_gradients(arch, attn, fused, request):
    """Two prompts of different lengths (left padding), a full and a partial group, completions of
    different lengths; GPT-2's absolute positions catch a wrong position id."""
    model, tok = lora_policy(request.getfixturevalue(arch), attn)
    ids, attn, C = grouped_batch(tok, ["What is 2 + 3? Reply with just the number.", "Hello"],
                                 [3, 2],
                                 ["5", "The answer is 5.", "42 0 1", "world", "0 1 2 3 4 5 6"])
    assert (attn == 0).any()
    weights = torch.linspace(-1, 1, ids.shape[0] * C).view(-1, C)
    head = logprobs.plain_output_head(model) if fused else None
    with torch.no_grad():
        # the shared path itself runs (the comparison below would be vacuous otherwise)
        assert logprobs._shared_prompt_log_probs(model, ids, attn, C, 0.7, 5, head) is not None
    a, ga = log_probs_and_grads(model, ids, attn, C, weights, fused_head=fused)
    b, gb = log_probs_and_grads(model, ids, attn, C, weights, fused_head=fused, share_prompt=True)
    assert torch.allclose(a, b, atol=1e-5) and ga.keys() == gb.keys() and ga
    # fp32 rounding differs between one pass and two (~1e-6 of each gradient's largest entry)
    assert all((ga[k] - gb[k]).abs().max() <= 1e-4 * ga[k].abs().max() for k in ga)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused-head"])
def test_shared_prompt_scores_a_single_completion_token(tiny_llama, fused):
    model, tok = lora_policy(tiny_llama)
    ids, attn, C = grouped_batch(tok, ["What is 2 + 3?"], [3], ["5", "4", "7"])
    assert C == 1
    with torch.no_grad():
        want = logprobs.sequence_log_probs(model, ids, attn, C)
        got = logprobs._shared_prompt_log_probs(model, ids, attn, C, 1.0, 4096,
                                                logprobs.plain_output_head(model) if fused
                                                else None)
    assert got is not None and torch.allclose(want, got, atol=1e-5)


def test_shared_prompt_falls_back_where_it_cannot_or_need_not_share(tiny_llama, tmp_path):
    model, tok = lora_policy(tiny_llama)
    ids, attn, C = grouped_batch(tok, ["What is 2 + 3?", "Hello"], [1, 1], ["5", "world"])
    with torch.no_grad():
        # nothing shared
        assert logprobs._shared_prompt_log_probs(model, ids, attn, C, 1.0, 4096, None) is None
        ids, attn, C = grouped_batch(tok, ["What is 2 + 3?"], [2], ["5", "4"])
        checkpoint_layers(model)
        # HF drops the cache
        assert logprobs._shared_prompt_log_probs(model, ids, attn, C, 1.0, 4096, None) is None
    # a sliding-window cache is not plain keys and values: the one-pass path runs, same result
    eos = tok.eos_token_id
    mistral = MistralForCausalLM(
        MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      sliding_window=4, eos_token_id=eos, pad_token_id=eos)).eval()
    assert logprobs.prompt_cache(mistral) is None and logprobs.prompt_cache(model) is not None
    # not tested with prompt sharing: one pass per row
    model.config._attn_implementation = "flash_attention_2"
    assert logprobs.prompt_cache(model) is None
    with torch.no_grad():
        assert logprobs._shared_prompt_log_probs(mistral, ids, attn, C, 1.0, 4096, None) is None
        assert torch.equal(logprobs.sequence_log_probs(mistral, ids, attn, C, share_prompt=True),
                           logprobs.sequence_log_probs(mistral, ids, attn, C))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefill_samples_the_same_completions(tiny_llama, temperature):
    """Same seed, same tokens: the prefill is the only thing that changes, and it draws no random
    numbers."""
    model, tok = lora_policy(tiny_llama)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?",
                                                       "Hello world, this is a tiny tokenizer."]]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        assert rollout.prefill_shared(model, enc.input_ids, enc.attention_mask, 3) is not None
    out = []
    for share in (False, True):
        torch.manual_seed(0)
        out.append(rollout.generate_rollout(model, tok, prompts, 3, 12, temperature,
                                            share_prompt=share))
    a, b = out
    assert torch.equal(a.completion_ids, b.completion_ids) \
        and torch.equal(a.prompt_ids, b.prompt_ids)
    assert a.texts == b.texts and torch.equal(a.completion_mask, b.completion_mask)
    assert len(set(a.texts[:3])) > 1  # sampled rows of one prompt differ: the seed matters


def test_shared_prefill_is_skipped_for_one_sample_or_a_one_token_prompt(tiny_llama):
    model, tok = lora_policy(tiny_llama)
    enc = tok(["What is 2 + 3?", "Hello"], return_tensors="pt", padding=True,
              add_special_tokens=False)
    with torch.no_grad():
        assert rollout.prefill_shared(model, enc.input_ids, enc.attention_mask, 1) is None
        one = tok(["Hello"], return_tensors="pt", add_special_tokens=False)
        assert one.input_ids.shape[1] == 1
        assert rollout.prefill_shared(model, one.input_ids, one.attention_mask, 4) is None


@pytest.fixture
def train_config(tmp_path, tiny_llama):
    from conftest import write_run_config
    return write_run_config(tmp_path, tiny_llama, optim={"micro_batch_size": 3})


@pytest.mark.parametrize("extra", [[], ["--grpo.num_iterations=2", "--grpo.beta=0.1"]],
                         ids=["on-policy", "mu2-kl"])
def test_a_training_run_is_the_same_with_and_without_prompt_sharing(train_config, tmp_path, extra):
    """Micro-batches of 3 with G = 4 mix whole and partial groups; mu = 2 and beta > 0 add the old
    and reference passes. Two steps: the second step's rollout depends on the first update."""
    import json
    runs = []
    for share in ("false", "true"):
        out = tmp_path / f"run_{share}"
        assert train.main(["--config", str(train_config), f"--grpo.share_prompt={share}",
                           f"--run.out_dir={out}"] + extra) == 0
        runs.append([json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()])
    for a, b in zip(*runs):
        assert a["reward"] == b["reward"]
        assert a["grad_norm"] > 0 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
        assert a.get("kl", 0.0) == pytest.approx(b.get("kl", 0.0), rel=1e-3, abs=1e-8)


@pytest.mark.parametrize("setting,shares", [("auto", True), ("false", False)])
def test_auto_shares_the_prompt_in_the_loss_on_cpu(train_config, tmp_path, monkeypatch, setting,
                                                   shares):
    """The default, auto, takes the shared path in step.py's loss on CPU (gpu/auto.speed_levers)."""
    calls = []
    real = logprobs._shared_prompt_log_probs
    monkeypatch.setattr(logprobs, "_shared_prompt_log_probs",
                        lambda *a: calls.append(1) or real(*a))
    out = tmp_path / "run"
    assert train.main(["--config", str(train_config), f"--grpo.share_prompt={setting}",
                       f"--run.out_dir={out}", "--run.steps=1"]) == 0
    assert bool(calls) == shares
