"""Estimate a GPU run's peak memory on a CPU: one training micro-batch traced without its arithmetic.

    python bench/memory_estimate.py --model random:qwen3-0.6b --rows 8 --prompt-tokens 45 --completion-tokens 512
    python bench/memory_estimate.py --model random:qwen3-0.6b --compare     # old and new defaults, fused head

The model (a `random:` shape of bench/vs_trl.py, or a model directory) is loaded on the CPU in the
GPU dtype by model.load_policy, as train.py loads it, then grpo.sequence_log_probs and its
backward run under torch's FakeTensorMode: every operator computes only its output's shape, and a
dispatch mode adds up the bytes of the tensor storage each operator creates, minus what autograd
and Python have freed. Its peak is what torch.cuda.max_memory_allocated would show above the
weights, before the CUDA allocator's rounding, cuBLAS workspaces and kernels' scratch memory. It
follows train.py's training pass (mixed_precision's autocast included) in the one-pass form: prompt
sharing (torch.unique) cannot be traced without data, and a GPU does not use it by default. The
sampling KV cache is computed: layers x rows x positions x KV heads x head dim x 2 (keys, values).

Sizes are GiB (2^30 bytes), as torch.cuda.max_memory_allocated() / 2**30. Checked once: for the H100
run of bench/RESULTS.md ("GPU"), whose training pass used prompt sharing and 4096-row chunks, this
gives 17.15 GiB (one pass) against the 18.24 GiB measured: 6% under. 4-bit (QLoRA) bases are not
modelled. Not part of the test suite; the first use of a `random:` shape writes its weights under
~/.cache/minigrpo/bench, and the estimate needs RAM for them in the GPU dtype.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage that operators create inside the mode and that are still referenced;
    `peak` is their maximum. Outputs that share an input's storage (views, in-place) are not new."""

    def __init__(self, preexisting=()):
        super().__init__()
        self.cur = self.peak = 0
        self.keep = list(preexisting)  # alive, so a fake tensor's storage keeps its identity (the converter's memo is weak)
        self.live: dict[int, object] = {t.untyped_storage()._cdata: None for t in self.keep}

    def _freed(self, key: int, n: int) -> None:
        self.cur -= n
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in inputs:
                continue
            n = storage.nbytes()
            self.cur += n
            self.peak = max(self.peak, self.cur)
            self.live[key] = weakref.ref(storage, lambda _, key=key, n=n: self._freed(key, n))
        return out


def build(spec: str, dtype: str, lora_r: int, tokenizer: str | None = None):
    """(model, config) as train.py trains it (model.load_policy: LoRA in fp32 on the GPU dtype), on
    the CPU: a `random:` shape written once by bench/vs_trl.py's model_dir, or a model directory."""
    from config import LoraConfig, ModelConfig
    from model import load_policy
    from vs_trl import LORA_TARGETS, model_dir
    path = model_dir(spec, "cuda", tokenizer, 0)  # "cuda": the random weights are written in bf16
    model, _ = load_policy(ModelConfig(name=str(path), dtype=dtype),
                           LoraConfig(r=lora_r, alpha=2 * lora_r, target_modules=LORA_TARGETS), torch.device("cpu"))
    return model.train(), model.config


def micro_batch_peak(model, rows: int, prompt: int, completion: int, chunk: int = 0, fused_head: bool = False,
                     autocast: bool = True) -> tuple[int, int]:
    """(forward peak, forward + backward peak) bytes above the weights for one micro-batch."""
    import grpo
    from model import mixed_precision
    from torch._subclasses.fake_tensor import FakeTensorMode
    model.zero_grad(set_to_none=True)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        weights = [fake.from_tensor(p) for p in model.parameters()]
        ids = torch.zeros(rows, prompt + completion, dtype=torch.long)
        with LiveBytes(weights) as mem:
            with mixed_precision(model) if autocast else contextlib.nullcontext():
                logp = grpo.sequence_log_probs(model, ids, torch.ones_like(ids), completion, 1.0, chunk, fused_head)
            forward = mem.peak
            logp.sum().backward()
    model.zero_grad(set_to_none=True)
    return forward, mem.peak


def kv_cache_bytes(cfg, rows: int, positions: int, dtype: torch.dtype) -> int:
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * rows * positions * heads * head_dim * 2 * dtype.itemsize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-0.6b", help="random:<shape> (bench/vs_trl.py) or a model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--tokenizer", help="tokenizer directory for random shapes (default: the built-in model's)")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8, help="completions in a training micro-batch (optim.micro_batch_size)")
    ap.add_argument("--prompt-tokens", type=int, default=45)
    ap.add_argument("--completion-tokens", type=int, default=512)
    ap.add_argument("--rollout-rows", type=int, default=128, help="B x G rows sampled at once (KV cache)")
    ap.add_argument("--chunk", type=int, default=0, help="grpo.logprob_chunk (0: by vocabulary)")
    ap.add_argument("--fused-head", action="store_true", help="grpo.fused_lm_head")
    ap.add_argument("--no-autocast", action="store_true", help="without train.py's mixed precision (before it existed)")
    ap.add_argument("--compare", action="store_true", help="the old defaults, the new ones, and the fused head")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    model, cfg = build(a.model, a.dtype, a.lora_r, a.tokenizer)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = kv_cache_bytes(cfg, a.rollout_rows, a.prompt_tokens + a.completion_tokens, dtype)
    print(f"[estimate] {a.model} in {a.dtype}, LoRA r={a.lora_r}: weights {weights / GiB:.2f} GiB; sampling "
          f"{a.rollout_rows} rows x {a.prompt_tokens + a.completion_tokens} positions: KV cache {kv / GiB:.2f} GiB; "
          f"training micro-batch {a.rows} x ({a.prompt_tokens} + {a.completion_tokens}) tokens:", flush=True)
    settings = {"as given": dict(chunk=a.chunk, fused_head=a.fused_head, autocast=not a.no_autocast)}
    if a.compare:
        settings = {"4096-row chunks, no autocast (before 83ae6c3)": dict(chunk=4096, autocast=False),
                    "chunks by vocabulary, no autocast": dict(autocast=False),
                    "chunks by vocabulary + autocast (the defaults)": dict(),
                    "+ fused head (grpo.fused_lm_head)": dict(fused_head=True)}
    for name, kw in settings.items():
        fwd, both = micro_batch_peak(model, a.rows, a.prompt_tokens, a.completion_tokens, **kw)
        total = weights + max(both, kv)
        print(f"[estimate]   {name:48s} forward {fwd / GiB:5.2f} GiB, forward + backward {both / GiB:5.2f} GiB "
              f"above the weights; run peak ~{total / GiB:5.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
