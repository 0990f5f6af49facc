"""Decode speed of a Qwen3-0.6B-shaped model in transformers' static-cache generate: "sdpa" against
the folded GQA attention (gpu/attention.py), eager and compiled, as a share of the bandwidth bound.

    TORCH_LOGS=cudagraphs,recompiles python bench/gpu_defaults/decode_speed.py  # H100 SXM, ~3 min
    TORCH_LOGS=cudagraphs,recompiles python bench/gpu_defaults/decode_speed.py --hbm 4.8e12  # H200
    python bench/gpu_defaults/decode_speed.py --modes compiled --impls fold     # one case
    python bench/gpu_defaults/decode_speed.py --tiny                            # CPU smoke test

The model has random weights in bf16 (the shape is what costs time): hidden 1024, 28 layers, 16
query heads and 8 KV heads of 128 dims, MLP 3072, vocab 151936, tied embeddings. Each row's
prompt is --prompt tokens, the first (row % 8) of them left padding as in a rollout; generate
writes exactly --new tokens (min_new_tokens = max_new_tokens, EOS ignored). "compiled" is what
generate does by default on CUDA for a static cache (torch.compile, mode reduce-overhead: inductor
and CUDA graphs; the prefill stays eager); "eager" passes disable_compile=True. A logits processor
reads the clock after each step (generate synchronises each step anyway), so the decode time is
first step -> last step, prefill excluded. The first call of each case (compile, graph capture)
is reported apart, then --reps timed calls; the median is kept. A later case's first call may
reuse the compile caches of an earlier one. Outside dynamo transformers' sdpa already folds the
query for one token (its pack_gqa), so the two eager rows run the same kernels: the compiled rows
are the comparison, where sdpa repeats K/V (repeat_kv) and the folded attention does not.

Bound, per decode step (every step reads every weight once and the whole static cache, its
masked tail included, since SDPA's kernels read K/V before applying the mask):

    bytes  = weight bytes + layers * rows * positions * kv_heads * head_dim * 2 (K, V) * 2 (bf16)
    bound  = rows / (bytes / hbm)   tokens/s,   positions = prompt + new (the cache's length)

With TORCH_LOGS=cudagraphs inductor logs why it skips CUDA graphs, and TORCH_LOGS=recompiles
each recompilation; the script also prints, per compiled case, the CUDA graphs recorded and
skipped (torch._inductor's cudagraph trees and its "cudagraph_skips" counter).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import chain
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import (
    CompileConfig,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from gpu.attention import use_gqa_decode

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                 tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                            "rope_theta": 1e6},
                 rms_norm_eps=1e-6, max_position_embeddings=40960)
TINY = dict(QWEN3_06B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1000)
PAD = 0


class StepClock(LogitsProcessor):
    """Records the time after each generated step's forward (scores unchanged)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def build(tiny: bool, device: torch.device) -> Qwen3ForCausalLM:
    config = Qwen3Config(**(TINY if tiny else QWEN3_06B), pad_token_id=PAD, bos_token_id=1,
                         eos_token_id=2, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        torch.manual_seed(0)
        return Qwen3ForCausalLM(config).to(dtype).eval()


def prompts(rows: int, length: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (rows, length); row i starts with i % 8 pad tokens (left padding)."""
    ids = torch.randint(3, vocab, (rows, length), device=device)
    pads = torch.arange(rows, device=device)[:, None] % 8  # (rows, 1)
    mask = (torch.arange(length, device=device)[None] >= pads).long()  # (rows, length)
    return ids.masked_fill(mask == 0, PAD), mask


def decode_tokens_per_s(model, ids, mask, new: int, compiled: bool) -> float:
    """One generate call -> decode tokens/s over its steps 2..new (the prefill excluded)."""
    clock, kwargs = StepClock(), {}  # compiled on CUDA: transformers' default for a static cache
    if not compiled:
        kwargs = dict(disable_compile=True)
    elif not ids.is_cuda:  # generate compiles only on accelerators unless told so
        kwargs = dict(compile_config=CompileConfig())
        kwargs["compile_config"]._compile_all_devices = True
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, cache_implementation="static",
                       pad_token_id=PAD, logits_processor=LogitsProcessorList([clock]), **kwargs)
    return ids.shape[0] * (new - 1) / (clock.times[-1] - clock.times[0])


def cudagraphs_recorded(device: torch.device) -> int:
    """CUDA graphs that inductor's cudagraph trees hold on this device (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    nodes, count = list(chain.from_iterable(manager.roots.values())) if manager else [], 0
    while nodes:
        count += 1
        nodes.extend(chain.from_iterable(nodes.pop().children.values()))
    return count


def bound_tokens_per_s(model, rows: int, positions: int, hbm: float) -> tuple[float, float, float]:
    """-> (weight bytes, KV bytes read per step, bound tokens/s); see the module docstring."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    kv = (c.num_hidden_layers * rows * positions * c.num_key_value_heads * c.head_dim * 2
          * model.dtype.itemsize)
    return weights, kv, rows / ((weights + kv) / hbm)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row, padding included")
    p.add_argument("--new", type=int, default=128, help="tokens generated per row")
    p.add_argument("--reps", type=int, default=3, help="timed calls per case, after the first")
    p.add_argument("--hbm", type=float, default=3.35e12,
                   help="HBM bytes/s: H100 SXM 3.35e12, H200 4.8e12")
    p.add_argument("--impls", default="sdpa,fold", help="sdpa and/or fold (gpu/attention.py)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, 4 rows: a smoke test")
    args = p.parse_args()
    if args.tiny:
        args.rows, args.prompt, args.new, args.reps = 4, 8, 8, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.tiny, device)
    ids, mask = prompts(args.rows, args.prompt, model.config.vocab_size, device)
    positions = args.prompt + args.new
    weights, kv, bound = bound_tokens_per_s(model, args.rows, positions, args.hbm)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; {args.rows} rows, prompt {args.prompt}, new "
          f"{args.new}, cache {positions} positions; weights {weights / 1e9:.3f} GB + KV read "
          f"{kv / 1e9:.3f} GB per step -> bound {bound:,.0f} tokens/s at {args.hbm:.3g} B/s",
          flush=True)
    for impl in args.impls.split(","):
        model.set_attn_implementation("sdpa")
        assert impl == "sdpa" or use_gqa_decode(model), "the model has no GQA"
        for mode in args.modes.split(","):
            compiled = mode == "compiled"
            torch._dynamo.reset()  # a fresh compile (and cudagraph trees) for each case
            model.__dict__.pop("_compiled_call", None)
            skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
            start = time.perf_counter()
            decode_tokens_per_s(model, ids, mask, args.new, compiled)
            first = time.perf_counter() - start
            speed = statistics.median(decode_tokens_per_s(model, ids, mask, args.new, compiled)
                                      for _ in range(args.reps))
            graphs = ""
            if compiled:
                skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
                graphs = f"   cudagraphs {cudagraphs_recorded(device)} recorded, {skips} skipped"
            print(f"{impl:5s} {mode:9s} first call {first:6.1f} s   decode {speed:9,.0f} tokens/s"
                  f" ({1e3 * args.rows / speed:6.2f} ms/step, median of {args.reps})   "
                  f"{100 * speed / bound:5.1f}% of bound{graphs}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
