"""Where does a GPU training micro-batch spend its time and memory? A probe of minigrpo's training
forward and backward against the alternatives, on a random model of a real shape (CUDA; a CPU can
smoke-test it and count operators with --device cpu).

    python bench/gpu_training_pass/gpu_train_probe.py --model random:qwen3-0.6b \\
        --tokenizer .gpu/tokenizer

One micro-batch as bench/speed_vs_trl/vs_trl.py's GPU preset makes it: 8 rows of one shared
~45-token prompt and 512 completion tokens, bf16 weights, LoRA r=16 on q/k/v/o/gate/up/down. For
each setting it times logprobs.sequence_log_probs(...).sum().backward() under train.py's mixed
precision (median of 3 after a warm-up, synchronised) and reads torch.cuda.max_memory_allocated over
the call (on a CPU, the process's peak RSS). "plain rows" is the textbook computation (the model's
logits for all rows, then log_softmax in fp32 row by row), for reference. --profile prints the GPU
default's top kernels.

--count-ops counts the aten operators each setting dispatches instead (each one a kernel launch or
more on a GPU; views and other metadata-only operators left out). A GPU running a small model is
bound by launches, so the count predicts its time where arithmetic does not; it runs on a CPU:

    python bench/gpu_training_pass/gpu_train_probe.py --device cpu --count-ops \\
        --model random:qwen3-0.6b-narrow --new-tokens 64

Not part of the test suite.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: random_models


METADATA_OPS = {"aten::" + k for k in (
    "view", "as_strided", "slice", "empty", "empty_strided", "detach", "t", "transpose", "expand",
    "unsqueeze", "reshape", "_unsafe_view", "select", "permute", "squeeze", "alias", "resolve_conj",
    "resolve_neg", "lift_fresh", "result_type", "narrow")}


def plain_rows(model, ids, attn, C, temperature):
    """Every row's logits, then an fp32 log_softmax one row at a time (what most trainers do)."""
    # logits: (n, C, V)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, -C - 1:-1]
    return torch.stack([
        torch.log_softmax(row.float() / temperature, -1).gather(-1, t[:, None])[:, 0]
        for row, t in zip(logits, ids[:, -C:])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--tokenizer")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--count-ops", action="store_true",
                    help="count dispatched operators instead of timing")
    ap.add_argument("--only", help="run only the settings whose name contains this text (on CPU, "
                                   "the peak RSS then printed is that setting's: run each in its "
                                   "own process)")
    ap.add_argument("--device", default="cuda",
                    help="cpu only to smoke-test the script (memory then reads 0)")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_train_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = (lambda: torch.cuda.memory_allocated() / 2**20) if cuda else (lambda: 0.0)
    import resource
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**20) if cuda else (
        lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # CPU: peak RSS (MB)
    from random_models import LORA_TARGETS, model_dir

    import logprobs
    import rollout
    from config import LoraConfig, ModelConfig
    from logprobs import mixed_precision
    from model import load_policy
    path = model_dir(a.model, a.device, a.tokenizer, 0)
    dev = torch.device(a.device)
    model, tok = load_policy(ModelConfig(name=str(path)),
                             LoraConfig(r=16, alpha=32, target_modules=LORA_TARGETS), dev)
    model.train()
    prompt = tok(rollout.render_prompt(tok, "What is 17 + 25? Think step by step, then reply "
                                            "with just the number."),
                 return_tensors="pt", add_special_tokens=False).input_ids.to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    C = a.new_tokens
    comp = torch.randint(0, model.config.vocab_size, (a.rows, C), device=dev, generator=g)
    ids = torch.cat([prompt.expand(a.rows, -1), comp], 1)
    attn = torch.ones_like(ids)
    base = allocated()
    print(f"[probe] {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}; "
          f"{path.name}, {model.dtype}, {a.rows} rows x ({prompt.shape[1]} prompt + {C} "
          f"completion) tokens; weights etc. {base:.0f} MB allocated", flush=True)
    settings = {
        "one pass (the GPU default), auto chunk": dict(),
        "one pass, chunk 4096 rows (the old default)": dict(chunk=4096),
        "shared prompt (the CPU default), auto chunk": dict(share_prompt=True),
        "shared prompt, chunk 4096 rows": dict(share_prompt=True, chunk=4096),
        "one pass, fused head, auto chunk": dict(fused_head=True),
        "plain rows (reference)": None,
    }

    def once(kw):
        model.zero_grad(set_to_none=True)
        with mixed_precision(model):  # as train.py's training pass
            lp = (plain_rows(model, ids, attn, C, 1.0) if kw is None
                  else logprobs.sequence_log_probs(model, ids, attn, C, 1.0, **{"kernel": True,
                                                                                 **kw}))
        lp.sum().backward()

    settings = {k: v for k, v in settings.items() if not a.only or a.only in k}
    if a.count_ops:
        from torch.profiler import ProfilerActivity, profile
        for name, kw in settings.items():
            once(kw)  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                once(kw)
            n = sum(e.count for e in prof.key_averages()
                    if e.key.startswith("aten::") and e.key not in METADATA_OPS)
            print(f"[probe] {name:45s} {n:7d} aten operators (fwd + bwd)", flush=True)
        return 0
    for name, kw in settings.items():
        once(kw)  # warm-up
        times, peaks = [], []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            once(kw)
            sync()
            times.append(time.perf_counter() - t)
            peaks.append(peak())
        print(f"[probe] {name:45s} {statistics.median(times) * 1e3:8.1f} ms   peak "
              f"{max(peaks):8.0f} MiB " + (f"(+{max(peaks) - base:.0f} over the weights)" if cuda
                                           else "(the process's RSS)"), flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            once(settings["one pass (the GPU default), auto chunk"])
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                        max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
