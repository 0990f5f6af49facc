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


def filtered_log_softmax(logits, top_k: int, top_p: float):
    """log softmax over the tokens HF's top-k then top-p warpers keep (the distribution drawn
    from), -inf elsewhere: a slow reference, one row of logits already divided by T."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    order = logits.argsort(descending=True)[:top_k]  # top-k
    probs = logits[order].softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass ranked above each token
    keep[order[before < top_p]] = True  # top-p over what top-k kept (the first always)
    return torch.where(keep, logits, float("-inf")).log_softmax(-1)


def test_hf_generate_records_the_log_prob_before_the_top_k_top_p_filter(tiny_llama):
    """Which log-prob the merged/compiled HF sampler records (docs/gpu.md): for each sampled
    token, one forward over that row's own prompt and completion so far, no padding and no cache,
    gives log softmax(logits / T)[token] equal to the recorded one; the filtered distribution's
    (renormalised over the tokens top-k = 5 and top-p = 0.8 keep, what vLLM records) differs."""
    torch.manual_seed(2)
    model, tok = load_biased_to_eos(tiny_llama)
    prompts = [rollout.render_prompt(tok, p) for p in ["What is 2 + 3?", "Hi"]]
    T = 0.7
    r = rollout.generate_rollout(model, tok, prompts, 2, 6, T, top_p=0.8, top_k=5,
                                 sampler_logp=True)
    gaps = []
    for i in range(r.completion_ids.shape[0]):
        ids = r.prompt_ids[i][r.prompt_mask[i].bool()].tolist()
        for t in range(int(r.completion_mask[i].sum())):
            token = int(r.completion_ids[i, t])
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float() / T  # (V,)
            full, kept = logits.log_softmax(-1)[token], filtered_log_softmax(logits, 5, 0.8)[token]
            assert float(r.sampler_logp[i, t]) == pytest.approx(float(full), abs=1e-4)
            assert kept > float("-inf")  # the token was drawn from the filtered distribution
            gaps.append(float(kept - full))
            ids.append(token)
    assert min(gaps) >= -1e-5 and max(gaps) > 0.05  # the filter's renormalisation: what vLLM adds
