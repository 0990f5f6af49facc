"""The sampler's own log-probs of HF generate (generate_rollout(sampler_logp=True), EntropyMeter):
each sampled token's log softmax(logits / T)[token], the trainer's log-prob of it, on a tiny random
fp32 model."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import logprobs
import rollout


def load_biased_to_eos(path, bias: float = 3.0):
    """The tiny model with its EOS logit raised: some completions stop early, at random lengths."""
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[tok.eos_token_id] = bias
    model.lm_head = head
    return model, tok


@pytest.mark.parametrize("top_p, per_call, share, static", [
    (1.0, 0, False, False), (0.8, 0, True, False), (0.9, 1, True, False), (1.0, 0, False, True)])
def test_the_sampler_logp_is_the_trainers_log_prob_of_each_sampled_token(
        tiny_llama, top_p, per_call, share, static):
    """Left-padded prompts of two lengths, T = 0.7, EOS ending some rows early: the recorded
    log-probs equal logprobs.sequence_log_probs over prompt + completion at every token of a
    completion (with top_p < 1 too: the untruncated softmax, as the loss's), and are 0 past its
    end; one generate call or one a prompt (concat_rollouts pads with 0), shared prompt cache or
    the static one."""
    torch.manual_seed(0)
    model, tok = load_biased_to_eos(tiny_llama)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3? Reply with the number.",
                                                       "Hi"]]
    r = rollout.generate_in_slices(model, tok, prompts, per_call, 4, 8, 0.7, top_p=top_p,
                                   share_prompt=share, static_cache=static, sampler_logp=True)
    m = r.completion_mask.bool()  # (N, C)
    assert r.sampler_logp.shape == m.shape and r.entropy is None
    assert (~m).any() and m[:, 0].all()  # some rows ended early
    assert r.prompt_mask[:, 0].eq(0).any()  # and some prompts are left-padded
    C = m.shape[1]
    with torch.no_grad():
        want = logprobs.sequence_log_probs(model, r.input_ids, r.attention_mask, C, 0.7)  # (N, C)
    assert torch.allclose(r.sampler_logp[m], want[m], atol=1e-5, rtol=0)
    assert (r.sampler_logp[~m] == 0).all() and (r.sampler_logp[m] < 0).all()


def test_sampler_logp_and_entropy_are_recorded_together(tiny_llama):
    torch.manual_seed(1)
    model, tok = load_biased_to_eos(tiny_llama)
    prompts = [rollout.render_prompt(tok, "Hello")]
    r = rollout.generate_rollout(model, tok, prompts, 3, 6, 1.3, entropy=True, sampler_logp=True)
    m = r.completion_mask.bool()
    assert r.entropy.shape == r.sampler_logp.shape == m.shape and (r.entropy[m] > 0).all()
    with torch.no_grad():
        want = logprobs.sequence_log_probs(model, r.input_ids, r.attention_mask, m.shape[1], 1.3)
    assert torch.allclose(r.sampler_logp[m], want[m], atol=1e-5, rtol=0)


def test_by_default_and_when_greedy_there_is_no_sampler_logp(tiny_llama):
    model, tok = load_biased_to_eos(tiny_llama)
    prompts = [rollout.render_prompt(tok, "Hello")]
    assert rollout.generate_rollout(model, tok, prompts, 2, 4).sampler_logp is None
    assert rollout.generate_rollout(model, tok, prompts, 2, 4, entropy=True).sampler_logp is None
    assert rollout.generate_rollout(model, tok, prompts, 1, 4, 0.0,
                                    sampler_logp=True).sampler_logp is None
