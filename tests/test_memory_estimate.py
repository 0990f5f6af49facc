"""bench/memory_estimate.py's live-storage count: traced without arithmetic (FakeTensorMode), it
must count what a real run allocates, and the micro-batch estimate must react to what it models."""
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from memory_estimate import LiveBytes, kv_cache_bytes, micro_batch_peak  # noqa: E402


def test_fake_trace_counts_what_a_real_run_allocates():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step(mem):
        y = net(x).pow(2).sum()
        # saved: the two (32, 256) fp32 activations, the (32, 64) output (for pow), the sum
        forward = mem.cur
        y.backward()
        return forward

    with LiveBytes() as real:
        # nothing registered: W.t() is still no new memory, as it aliases its input
        assert step(real) == 2 * 32 * 256 * 4 + 32 * 64 * 4 + 4
    real_end = real.cur  # the gradients
    net.zero_grad(set_to_none=True)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        with LiveBytes([fake.from_tensor(t) for t in list(net.parameters()) + [x]]) as traced:
            assert step(traced) == 2 * 32 * 256 * 4 + 32 * 64 * 4 + 4
    # the peak (in the backward) holds activations and gradients: more than the gradients alone
    grads = sum(p.numel() * 4 for p in net.parameters())
    assert traced.peak == real.peak > grads and traced.cur == real_end == grads


def test_micro_batch_estimate_grows_with_tokens_and_shrinks_with_small_chunks(tiny_llama):
    from config import LoraConfig, ModelConfig
    from model import load_policy
    model, _ = load_policy(ModelConfig(name=str(tiny_llama), dtype="bfloat16"),
                           LoraConfig(r=4, alpha=8), torch.device("cpu"))
    small = micro_batch_peak(model, 2, 5, 16)
    big = micro_batch_peak(model, 4, 5, 16)
    assert 0 < small[0] <= small[1] and big[1] > small[1]
    assert micro_batch_peak(model, 4, 5, 16, chunk=1)[1] \
        < micro_batch_peak(model, 4, 5, 16, chunk=4096, autocast=False)[1]


def test_kv_cache_formula():
    from transformers import LlamaConfig
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      hidden_size=64)
    assert kv_cache_bytes(cfg, rows=3, positions=10, dtype=torch.bfloat16) == \
        2 * 3 * 10 * 2 * 16 * 2 * 2


def test_gradient_checkpointing_keeps_less_and_leaves_the_model_as_it_was(tiny_llama):
    from config import LoraConfig, ModelConfig
    from model import load_policy
    model, _ = load_policy(ModelConfig(name=str(tiny_llama), dtype="bfloat16"),
                           LoraConfig(r=4, alpha=8), torch.device("cpu"))
    plain = micro_batch_peak(model, 8, 5, 64)
    ckpt = micro_batch_peak(model, 8, 5, 64, checkpointing=True)
    assert ckpt[0] < plain[0]  # the forward keeps only each layer's input
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert micro_batch_peak(model, 8, 5, 64) == plain


def test_4bit_weights_count_the_frozen_linears_as_nf4(tiny_llama):
    from memory_estimate import NF4_BYTES, weight_bytes

    from config import LoraConfig, ModelConfig
    from gpu.memory import NF4_LAYER_BYTES
    from model import load_policy
    model, _ = load_policy(ModelConfig(name=str(tiny_llama), dtype="bfloat16"),
                           LoraConfig(r=4, alpha=8), torch.device("cpu"))
    linears = [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and not m.weight.requires_grad and not n.endswith("lm_head")]
    # q k v o gate up down in each of 2 layers (the base layers under LoRA)
    assert len(linears) == 2 * 7
    full = weight_bytes(model, None)
    assert full == sum(p.numel() * p.element_size() for p in model.parameters())
    # bf16 -> NF4, and each layer's code books
    saved = sum(w.numel() * (2 - NF4_BYTES) - NF4_LAYER_BYTES for w in linears)
    assert weight_bytes(model, "4bit") == int(full - saved) \
        or abs(weight_bytes(model, "4bit") - (full - saved)) < 1


def test_meta_weights_estimate_what_real_weights_do(tiny_llama, tmp_path, monkeypatch):
    """--meta: a random shape on the meta device (an 8B model in little RAM) traces as its real
    weights do."""
    import memory_estimate as me
    import pytest
    import random_models

    from config import LoraConfig, ModelConfig
    # the real weights are written here, not in ~/.cache
    monkeypatch.setattr(random_models, "CACHE", tmp_path)
    mcfg, lora = ModelConfig(name="random:tiny", dtype="bfloat16"), LoraConfig(r=4, alpha=8)
    real, _ = me.build(mcfg, lora, str(tiny_llama))
    monkeypatch.setattr(me, "META", True)
    meta, _ = me.build(mcfg, lora, str(tiny_llama))
    assert all(p.is_meta for p in meta.parameters()) \
        and not any(p.is_meta for p in real.parameters())
    assert me.weight_bytes(meta, None) == me.weight_bytes(real, None)
    for kw in ({}, {"checkpointing": True}, {"fused_head": True}):
        assert me.micro_batch_peak(meta, 2, 5, 16, **kw)[1] == \
            pytest.approx(me.micro_batch_peak(real, 2, 5, 16, **kw)[1], rel=0.05)
