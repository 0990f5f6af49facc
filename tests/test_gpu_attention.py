"""gpu/attention.py on a CPU: the folded decode attention against transformers' sdpa function (both
its eager and its compiled branch) and a slow obvious reference, then whole tiny GQA models
(Llama, Qwen3, a LoRA-wrapped one) switched to it: same logits, same greedy static-cache tokens,
and in generate's compiled decode graph SDPA reads the un-repeated cache; a non-GQA model is left
alone.

    pytest -q tests/test_gpu_attention.py   # ~10 s on 2 cores
"""
from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import gpu.attention as attention
from gpu.attention import NAME, gqa_fold_attention, use_gqa_decode

PAD = 0
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32: same math, different summation order


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Layer(torch.nn.Module):
    """What the attention functions read from a model's attention layer."""

    def __init__(self, n_rep: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = n_rep, True


def slow_attention(q, k, v, mask, scale):
    """softmax(q K^T * scale + mask) V with K/V repeated to every query head (head h reads KV head
    h // n_rep); q (B, H, L, D), k/v (B, Hkv, S, D), bool mask (B, 1, L, S) -> (B, L, H, D)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)  # (B, H, S, D)
    scores = q @ k.transpose(-1, -2) * scale  # (B, H, L, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, L, H, D)


def padded_mask(pads: list[int], L: int, S: int, filled: int) -> torch.Tensor:
    """(B, 1, L, S) bool: row b sees keys from its left padding pads[b] up to its own position
    (queries are the last L of `filled` written cache slots); slots >= filled are an empty static
    cache's tail."""
    keys = torch.arange(S)
    queries = torch.arange(filled - L, filled)[:, None]  # (L, 1)
    rows = [(keys >= p) & (keys <= queries) for p in pads]  # each (L, S)
    return torch.stack(rows)[:, None]  # (B, 1, L, S)


def qkv(B: int, H: int, Hkv: int, L: int, S: int, D: int = 16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, L, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


@pytest.mark.parametrize("H,Hkv", [(4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("masked", [True, False])
def test_folded_decode_equals_sdpa_and_the_slow_reference(monkeypatch, H, Hkv, masked):
    q, k, v = qkv(B=3, H=H, Hkv=Hkv, L=1, S=9)
    mask = padded_mask([0, 2, 5], L=1, S=9, filled=7) if masked else None
    layer, scale = Layer(H // Hkv), 0.3
    out, _ = gqa_fold_attention(layer, q, k, v, mask, scaling=scale)
    assert out.shape == (3, 1, H, 16) and out.is_contiguous()
    torch.testing.assert_close(out, slow_attention(q, k, v, mask, scale), **TOL)
    torch.testing.assert_close(out, sdpa_attention_forward(layer, q, k, v, mask, scaling=scale)[0],
                               **TOL)
    # under dynamo transformers repeats K/V instead (the copy this module removes): same numbers
    monkeypatch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: True)
    torch.testing.assert_close(out, sdpa_attention_forward(layer, q, k, v, mask, scaling=scale)[0],
                               **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_cuda_kernel_runs_the_folded_decode_of_qwen3_shapes(dtype):
    """128 rows, 16 query heads on 8 KV heads of 128 dims, a padded static-cache mask: with the
    math kernel barred, some fused SDPA kernel takes the folded call, and matches the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = qkv(B=128, H=16, Hkv=8, L=1, S=192, D=128)
    mask = padded_mask([i % 8 for i in range(128)], L=1, S=192, filled=100)
    args = [x.to("cuda", dtype) for x in (q, k, v)] + [mask.cuda()]
    fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(fused):
        out, _ = gqa_fold_attention(Layer(2), *args, scaling=128 ** -0.5)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float().cpu(), slow_attention(q, k, v, mask, 128 ** -0.5),
                               **tol)


def test_prefill_with_left_padding_equals_sdpa_and_the_slow_reference():
    q, k, v = qkv(B=3, H=4, Hkv=2, L=6, S=8)
    mask = padded_mask([0, 1, 3], L=6, S=8, filled=6)
    layer = Layer(2)
    out, _ = gqa_fold_attention(layer, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(out, sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)[0])
    seen = mask[:, 0].any(-1)  # (B, L): a padding query sees no key (NaN or 0, by kernel)
    torch.testing.assert_close(out[seen], slow_attention(q, k, v, mask, 0.25)[seen], **TOL)


def tiny(arch: str, kv_heads: int = 2):
    """A 2-layer model, 4 query heads of 16 dims, random weights, on sdpa."""
    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                  max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama"
             else Qwen3ForCausalLM(Qwen3Config(**common)))
    model.config._attn_implementation_internal = "sdpa"
    return model.eval()


def left_padded_batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [PAD, PAD, 11, 12, 13, 14],
                        [PAD, PAD, PAD, PAD, 15, 16]])  # (B, T), left-padded
    return ids, (ids != PAD).long()


def greedy(model, **kwargs):
    ids, attn = left_padded_batch()
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6, min_new_tokens=6,
                         do_sample=False, cache_implementation="static", pad_token_id=PAD,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)  # (B, T), (new, B, V)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_switched_model_decodes_like_sdpa_and_eager(monkeypatch, arch):
    """Logits of a left-padded batch and greedy static-cache generation: the same with sdpa, with
    the folded attention, and with transformers' eager attention (repeat K/V, matmul, softmax);
    every decode step folds (none reaches transformers' sdpa function)."""
    model = tiny(arch)
    ids, attn = left_padded_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    tokens, step_logits = greedy(model)
    assert use_gqa_decode(model) and model.config._attn_implementation == NAME
    fallback_lengths = []

    def spy(module, query, *args, **kwargs):
        fallback_lengths.append(query.shape[2])
        return sdpa_attention_forward(module, query, *args, **kwargs)
    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=attn).logits, logits, **TOL)
    fallback_lengths.clear()
    fold_tokens, fold_logits = greedy(model)
    assert fallback_lengths and set(fallback_lengths) == {ids.shape[1]}  # the prefill only
    assert torch.equal(fold_tokens, tokens)
    torch.testing.assert_close(fold_logits, step_logits, **TOL)
    model.set_attn_implementation("eager")
    eager_tokens, eager_logits = greedy(model)
    assert torch.equal(eager_tokens, tokens)
    torch.testing.assert_close(eager_logits, fold_logits, **TOL)


def test_a_lora_wrapped_model_switches_its_base():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    tokens, logits = greedy(model)
    assert use_gqa_decode(model)
    assert model.get_base_model().config._attn_implementation == NAME
    fold_tokens, fold_logits = greedy(model)
    assert torch.equal(fold_tokens, tokens)
    torch.testing.assert_close(fold_logits, logits, **TOL)


def test_models_without_gqa_or_off_sdpa_are_left_alone():
    model = tiny("llama", kv_heads=4)
    assert not use_gqa_decode(model) and model.config._attn_implementation == "sdpa"
    model = tiny("llama")
    model.set_attn_implementation("eager")
    assert not use_gqa_decode(model) and model.config._attn_implementation == "eager"


def compiled_sdpa_key_heads(model) -> tuple[torch.Tensor, list[int]]:
    """Greedy tokens through generate's own compile of the decode step (fullgraph: a graph break
    fails), with a backend that keeps dynamo's graph and runs it uncompiled (inductor and CUDA
    graphs need a GPU); and the head count of the key that each SDPA call in that graph reads."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    config = CompileConfig(fullgraph=True, backend=keep, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    tokens, _ = greedy(model, compile_config=config)
    return tokens, [node.args[1].meta["example_value"].shape[1] for gm in graphs
                    for node in gm.graph.nodes
                    if node.target is torch.nn.functional.scaled_dot_product_attention]


def test_the_compiled_decode_reads_the_cache_without_repeating_it():
    """Under dynamo transformers' sdpa hands SDPA keys repeated to the 4 query heads; the folded
    attention hands it the 2-head cache itself, in one graph, with sdpa's tokens."""
    model = tiny("llama")
    tokens, heads = compiled_sdpa_key_heads(model)
    assert heads == [4, 4]  # one call per layer, K/V repeated
    use_gqa_decode(model)
    fold_tokens, fold_heads = compiled_sdpa_key_heads(model)
    assert fold_heads == [2, 2] and torch.equal(fold_tokens, tokens)
