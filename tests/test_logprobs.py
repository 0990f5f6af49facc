"""The log-prob forward (logprobs.py): chunked selective log-softmax against the full one, the fused
head, positions under left padding, temperature, prompt sharing's switch (CPU, tiny random
models)."""
import pytest
import torch

import logprobs
from config import LoraConfig, ModelConfig
from model import load_policy
from test_rollout import biased_to_eos, load, padded_batch


@pytest.mark.parametrize("chunk", [1, 5, 7, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_selective_log_probs_equal_the_full_log_softmax(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (3, 4), generator=g)
    got = logprobs.selective_log_probs(logits, ids, temperature, chunk)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5)
    (g1,) = torch.autograd.grad(got.sum(), logits)
    (g2,) = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-5)


def test_automatic_chunk_size_scales_with_the_vocabulary(monkeypatch):
    """logprob_chunk 0 sizes chunks by logits, not rows: a large vocabulary gets fewer rows per
    chunk."""
    assert logprobs.chunk_rows(0, 151_936) == 441 and logprobs.chunk_rows(0, 49_152) == 1365 \
        and logprobs.chunk_rows(7, 151_936) == 7
    assert logprobs.chunk_rows(0, 2**27) == 1
    # 2 rows of 50 a chunk: the automatic size really chunks
    monkeypatch.setattr(logprobs, "LOGITS_PER_CHUNK", 100)
    seen = []
    real = logprobs._pick_and_lse
    monkeypatch.setattr(logprobs, "_pick_and_lse",
                        lambda z, *a: seen.append(z.shape[0]) or real(z, *a))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g)
    ids = torch.randint(0, 50, (3, 4), generator=g)
    got = logprobs.selective_log_probs(logits, ids, 0.7)
    assert seen == [2] * 6 \
        and torch.allclose(got, logprobs.selective_log_probs(logits, ids, 0.7, 12), atol=1e-6)


def test_the_speed_levers_are_chosen_at_setup_prompt_sharing_in_the_loss_on_cpu_only():
    """gpu/auto.speed_levers: auto shares the prompt in the loss on a CPU, only in the sampling
    prefill on a GPU, and keeps the hand-written kernel on; a written value is kept."""
    from config import Config
    from gpu import auto
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert auto.speed_levers(Config(), cpu) == {"grpo.share_prompt": True,
                                                "grpo.logprob_kernel": True}
    assert auto.speed_levers(Config(), cuda) == {"grpo.share_prompt": "prefill",
                                                 "grpo.logprob_kernel": True}
    written = Config()
    written.grpo.share_prompt, written.grpo.logprob_kernel = False, False
    assert auto.speed_levers(written, cpu) == {}


@pytest.mark.parametrize("kernel, fused, share", [
    (True, False, False), (False, True, False), (False, False, True), (True, False, True),
    (True, True, True)])
def test_each_speed_lever_gives_the_plain_paths_log_probs_and_gradients(kernel, fused, share,
                                                                         tiny_llama):
    """The plain path (logits, log_softmax, gather: every lever off) against each lever and some of
    their combinations: the same log-probs and LoRA gradients up to float rounding."""
    from test_share_prompt import grouped_batch, log_probs_and_grads, lora_policy
    model, tok = lora_policy(tiny_llama)
    ids, attn, C = grouped_batch(tok, ["What is 2 + 3? Reply with just the number.", "Hello"],
                                 [3, 2], ["5", "The answer is 5.", "42 0 1", "world", "0 1 2 3"])
    weights = torch.linspace(-1, 1, ids.shape[0] * C).view(-1, C)
    plain, plain_grads = log_probs_and_grads(model, ids, attn, C, weights, kernel=False)
    lp, grads = log_probs_and_grads(model, ids, attn, C, weights, kernel=kernel, fused_head=fused,
                                    share_prompt=share)
    assert torch.allclose(lp, plain, atol=1e-5) and grads.keys() == plain_grads.keys() and grads
    # fp32 rounding differs between the paths (~1e-6 of each gradient's largest entry)
    assert all((grads[n] - plain_grads[n]).abs().max() <= 1e-4 * plain_grads[n].abs().max()
               for n in grads)


def test_position_ids_skip_left_padding():
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert logprobs.position_ids(attn).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_trim_drops_only_padding_columns():
    ids = torch.arange(16).view(2, 8)
    # prompt = 4 cols, completion = 4
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0]])
    cmask = attn[:, 4:].clone()
    i, a, C = logprobs.trim(ids, attn, cmask)
    assert C == 3 and i.tolist() == [[1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14]]


def test_selective_log_probs_keep_the_logits_dtype_in_the_gradient_and_pass_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: logprobs.selective_log_probs(x, ids, 0.7, 4),
                                    (logits,))
    half = torch.randn(2, 3, 11, generator=g).bfloat16().requires_grad_()
    logprobs.selective_log_probs(half, ids, 1.0, 4).sum().backward()
    assert half.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_left_padded_batch_log_probs_equal_each_unpadded_sample(arch, request):
    model, tok = load(request.getfixturevalue(arch))
    texts = ["What is 2 + 3? The answer is 5.", "Hello world, this is 42"]
    C = 4  # score the last 4 tokens of each row
    ids, attn = padded_batch(tok, texts)
    assert (attn == 0).any(), "the batch must actually be padded"
    with torch.no_grad():
        batched = logprobs.sequence_log_probs(model, ids, attn, C, temperature=0.7)
        for i, t in enumerate(texts):
            one_ids, one_attn = padded_batch(tok, [t])
            alone = logprobs.sequence_log_probs(model, one_ids, one_attn, C, temperature=0.7)
            assert torch.allclose(batched[i], alone[0], atol=1e-5)


def test_without_position_ids_an_absolute_position_model_would_disagree(tiny_gpt2):
    """Shows the test above has teeth: GPT-2 counts pads as positions unless told otherwise."""
    model, tok = load(tiny_gpt2)
    ids, attn = padded_batch(tok, ["What is 2 + 3? The answer is 5.", "Hello world, 42"])
    with torch.no_grad():
        right = model(input_ids=ids, attention_mask=attn,
                      position_ids=logprobs.position_ids(attn)).logits[1, -1]
        wrong = model(input_ids=ids, attention_mask=attn,
                      position_ids=torch.arange(ids.shape[1])[None].expand_as(ids)).logits[1, -1]
    assert not torch.allclose(right, wrong, atol=1e-4)


def test_log_probs_use_the_sampling_temperature(tiny_llama):
    model, tok = load(tiny_llama)
    ids, attn = padded_batch(tok, ["Hello world, this is a tiny tokenizer."])
    with torch.no_grad():
        lp = logprobs.sequence_log_probs(model, ids, attn, 3, temperature=0.5)
        logits = model(input_ids=ids).logits[0, -4:-1] / 0.5
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, -3:, None]).squeeze(-1)
    assert torch.allclose(lp[0], want, atol=1e-5)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_fused_lm_head_gives_the_same_log_probs_and_gradients(arch, request):
    """grpo.fused_lm_head builds no (N, C, V) logits; values and LoRA gradients must not change."""
    model, tok = load_policy(ModelConfig(name=str(request.getfixturevalue(arch))),
                             LoraConfig(r=4, alpha=8), torch.device("cpu"))
    # else the test would compare the default path with itself
    assert logprobs.plain_output_head(model) is not None
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    ids, attn = padded_batch(tok, ["What is 2 + 3? The answer is 5.", "Hello world, this is 42"])
    weights = torch.linspace(-1, 1, 8).view(2, 4)
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        lp = logprobs.sequence_log_probs(model, ids, attn, 4, temperature=0.7, chunk=3,
                                         fused_head=fused)
        (lp * weights).sum().backward()
        results.append((lp.detach(), {n: p.grad.clone()
                                      for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-5) and ga.keys() == gb.keys() and ga
    assert all(torch.allclose(ga[k], gb[k], atol=1e-5) for k in ga)


def test_fused_lm_head_gradient_reaches_a_trained_head():
    """Full fine-tuning trains the head too: d/dW by gradcheck."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (5,), generator=g)
    assert torch.autograd.gradcheck(
        lambda h, w: logprobs._FusedHeadLogSoftmax.apply(h, w, ids, 0.8, 2), (h, w))


def test_a_head_with_logit_scaling_or_softcapping_is_not_fused(tiny_llama):
    """Gemma-style final_logit_softcapping (or a logit scale) changes the logits after hidden @ W^T:
    the fused head would compute the wrong log-probs, so it must decline."""
    model, _ = load(tiny_llama)
    assert logprobs.plain_output_head(model) is not None
    for key, value in (("final_logit_softcapping", 30.0), ("logit_scale", 0.5)):
        setattr(model.config, key, value)
        assert logprobs.plain_output_head(model) is None, key
        setattr(model.config, key, None)


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.5),
                                        ("logits_scaling", 8.0), ("output_multiplier_scale", 0.25)])
def test_every_known_logit_scale_keeps_the_head_unfused(tiny_llama, key, value):
    """Granite's logits_scaling and output_multiplier_scale divide or scale the logits after hidden
    @ W^T as Gemma's soft-capping does: the fused head would compute other log-probs than the
    model."""
    model, _ = load(tiny_llama)
    setattr(model.config, key, value)
    assert logprobs.plain_output_head(model) is None


def test_a_head_with_a_bias_is_not_fused_and_scores_as_the_model(tiny_llama):
    """hidden @ W^T omits a bias (Phi-2's lm_head has one): that head must take the logits path."""
    model, tok = load(tiny_llama)
    biased_to_eos(model, tok.eos_token_id, 3.0)
    assert logprobs.plain_output_head(model) is None
    ids, attn = padded_batch(tok, ["What is 2 + 3? The answer is 5.", "Hello world, this is 42"])
    with torch.no_grad():
        fused = logprobs.sequence_log_probs(model, ids, attn, 4, temperature=0.7, chunk=3,
                                            fused_head=True)
        plain = logprobs.sequence_log_probs(model, ids, attn, 4, temperature=0.7)
    assert torch.allclose(fused, plain, atol=1e-5)
