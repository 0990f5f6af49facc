"""Side-by-side micro-benchmarks of minigrpo's speed levers against the alternative they replace,
in one run, reported as ratios. Not part of the test suite.

    .venv/bin/python bench/speed_levers/levers.py  # logprob lever, CPU, SmolLM2's vocab (49,152)
    .venv/bin/python bench/speed_levers/levers.py --device cuda --vocab 151936 --rows 4096 \\
        --dtype bfloat16
    .venv/bin/python bench/speed_levers/levers.py --lever generate [--compile]  # SmolLM2 + LoRA
    .venv/bin/python bench/speed_levers/levers.py --lever microbatch
    .venv/bin/python bench/speed_levers/levers.py --lever fusedhead
    .venv/bin/python bench/speed_levers/levers.py --lever share [--context-words 300]
    .venv/bin/python bench/speed_levers/levers.py --lever entropy

Levers measured:
  logprob   logprobs.selective_log_probs (a hand-written backward that keeps one fp32 chunk and the
            per-row logsumexp) against the plain expression `logits[id] - logsumexp(logits)` run
            chunk by chunk under torch.utils.checkpoint (what grpo.py did before): forward +
            backward time, and the peak memory above the inputs (CUDA: max_memory_allocated; CPU:
            the whole peak RSS of a fresh subprocess per implementation: the same imports and
            inputs on both sides, so the difference is the implementation's).
  generate  HF generate of B=4 prompts x G=8 x 64 fixed new tokens with peft's LoRA layers as they
            are (the default), against model.merged_for_sampling (rollout.merged_sampling; its
            merge and restore timed too), alternating after a warm-up; then a static KV cache
            (with --compile: plus torch.compile of the forward, its first call shown apart).
  microbatch the training forward + backward of 32 sequences x 110 tokens split into micro-batches
            of 8, 16 and 32.
  fusedhead the training forward + backward of one micro-batch (8 x 110 tokens, 64 scored) with
            the model's head and logits (default) against grpo.fused_lm_head (the logits never
            exist): time alternating after a warm-up, and each mode's peak RSS in a fresh process.
  share     grpo.share_prompt (each prompt through the model once per group) against G identical
            prompt passes: HF generate of B=4 prompts x G=8 x 64 fixed new tokens, and the training
            forward + backward of that rollout in micro-batches of 8, alternating after a warm-up.
            --context-words N puts an N-word passage before each question (document-grounded
            prompts, where most tokens are prompt).
  entropy   the cost of the logged `entropy` (rollout.EntropyMeter, a softmax over the vocabulary
            per decoding step): HF generate of B=4 prompts x G=8 x 64 fixed new tokens with and
            without it, alternating after a warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import logprobs  # noqa: E402
import rollout  # noqa: E402


def checkpointed_expression(logits, ids, temperature, chunk):
    """The alternative: chunked log-softmax of the selected ids, each chunk checkpointed."""
    def rows(lg, ix):
        lg = lg.float() / temperature
        return lg.gather(-1, ix[:, None]).squeeze(-1) - torch.logsumexp(lg, dim=-1)
    return torch.cat([checkpoint(rows, logits[s:s + chunk], ids[s:s + chunk], use_reentrant=False)
                      for s in range(0, logits.shape[0], chunk)])


def hand_written(logits, ids, temperature, chunk):
    return logprobs.selective_log_probs(logits[None], ids[None], temperature, chunk)[0]


def print_times(times: dict[str, list[float]], width: int) -> None:
    """One line a case: its seconds, alternating runs in order, then their median."""
    for k, v in times.items():
        print(f"  {k:{width}s} " + " ".join(f"{t:6.2f}" for t in v)
              + f"   median {statistics.median(v):.2f} s")


def measure(fn, logits, ids, args, reps: int) -> tuple[float, float]:
    """(median seconds of forward + backward, peak CUDA MB above the inputs or nan on CPU)."""
    times, peak = [], float("nan")
    for _ in range(reps + 1):  # the first run warms up
        x = logits.detach().requires_grad_()
        if x.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = fn(x, ids, args.temperature, args.chunk)
        (out * torch.linspace(-1, 1, out.numel(), device=out.device)).sum().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), peak


def cpu_peak_rss_mb(name: str, args) -> float:
    """Peak RSS of a fresh process that makes the inputs, runs 3 fwd+bwd of one implementation."""
    code = (f"import sys, resource, torch; sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
            f"import levers; g = torch.Generator().manual_seed(0); "
            f"x = torch.randn({args.rows}, {args.vocab}, generator=g); "
            f"ids = torch.randint(0, {args.vocab}, ({args.rows},), generator=g); "
            f"fn = levers.{name}\n"
            f"for _ in range(3): fn(x.clone().requires_grad_(), ids, {args.temperature}, "
            f"{args.chunk}).sum().backward()\n"
            f"print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.split()[-1])


def builtin_policy():
    from config import LoraConfig, ModelConfig
    from model import load_policy
    torch.manual_seed(0)
    return load_policy(ModelConfig(name="smollm2-135m"), LoraConfig(r=16, alpha=32),
                       torch.device("cpu"))


def generate_lever(args) -> None:
    import contextlib

    from model import merged_for_sampling
    model, tok = builtin_policy()
    with torch.no_grad():  # a trained-looking adapter (B starts at zero), so merging has work to do
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    prompts = [rollout.render_prompt(tok, f"What is {a} + {a + 3}? Reply with just the number.")
               for a in range(4)]

    def once(merged: bool) -> float:
        t0 = time.perf_counter()  # the merge and the restore are timed too
        with merged_for_sampling(model) if merged else contextlib.nullcontext():
            rollout.generate_rollout(model, tok, prompts, 8, 64, 1.0, ignore_eos=True)
        return time.perf_counter() - t0

    once(False), once(True)  # warm-up: the first call of each pays page faults and allocations
    times: dict[str, list[float]] = {"peft LoRA layers (default)": [], "merged_for_sampling": []}
    for _ in range(args.reps // 2 or 1):  # alternating
        times["peft LoRA layers (default)"].append(once(False))
        times["merged_for_sampling"].append(once(True))
    print(f"generate lever: SmolLM2-135M + LoRA r=16 (all linear), 4 prompts x 8 x 64 tokens, "
          f"fp32 CPU, {torch.get_num_threads()} threads; seconds per rollout incl. merge and "
          "restore, alternating after a warm-up")
    print_times(times, 28)
    a, b = (statistics.median(v) for v in times.values())
    print(f"  ratio merged / default {b / a:.3f}")
    model.generation_config.cache_implementation = "static"
    static = [once(False) for _ in range(3)]
    print(f"  static KV cache (default layers) {' '.join(f'{t:6.2f}' for t in static)}   "
          f"ratio to default {statistics.median(static) / a:.3f}")
    if args.compile:
        base = model.get_base_model()
        base.forward = torch.compile(base.forward, dynamic=False)
        compiled = [once(False) for _ in range(3)]
        print(f"  static + torch.compile: first call (compilation) {compiled[0]:.1f} s; "
              f"ratio to default (calls 2-3) {statistics.median(compiled[1:]) / a:.3f}")


def microbatch_lever(args) -> None:
    model, _ = builtin_policy()
    model.train()
    ids = torch.randint(0, 49000, (32, 110), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    times: dict[int, list[float]] = {}
    for size in (8, 16, 32) * 3:  # alternating; the first round is warm-up
        t0 = time.perf_counter()
        for s in range(0, 32, size):
            logprobs.sequence_log_probs(model, ids[s:s + size], attn[s:s + size], 64,
                                        1.0, kernel=True).sum().backward()
        times.setdefault(size, []).append(time.perf_counter() - t0)
    print(f"microbatch lever: fwd+bwd of 32 x 110 tokens (64 scored), SmolLM2-135M + LoRA r=16, "
          f"fp32 CPU, {torch.get_num_threads()} threads; median of rounds 2-3")
    base = statistics.median(times[8][1:])
    for size, t in times.items():
        print(f"  micro-batch {size:2d}: {statistics.median(t[1:]):6.2f} s  "
              f"ratio to 8: {statistics.median(t[1:]) / base:.3f}")


def fusedhead_step(fused: bool, reps: int, chunk: int = 4096) -> list[float]:
    model, _ = builtin_policy()
    model.train()
    ids = torch.randint(0, 49000, (8, 110), generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(reps + 1):  # the first is warm-up
        t0 = time.perf_counter()
        logprobs.sequence_log_probs(model, ids, torch.ones_like(ids), 64, 1.0, chunk,
                                    fused_head=fused, kernel=True).sum().backward()
        out.append(time.perf_counter() - t0)
    return out[1:]


def fusedhead_lever(args) -> None:
    model_times = {False: [], True: []}
    for _ in range(2):  # alternating processes; each process's peak RSS is its mode's
        for fused in (False, True):
            code = (f"import sys, resource; sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
                    "import levers; "
                    f"t = levers.fusedhead_step({fused}, {args.reps}, {args.chunk}); "
                    f"print(*t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
            vals = [float(x) for x in subprocess.run([sys.executable, "-c", code],
                                                     capture_output=True, text=True,
                                                     check=True).stdout.split()]
            model_times[fused].append((vals[:-1], vals[-1]))
    print(f"fusedhead lever: one micro-batch fwd+bwd, 8 x 110 tokens (64 scored), SmolLM2-135M "
          f"(V=49152) + LoRA r=16, fp32 CPU, {torch.get_num_threads()} threads, logprob chunk "
          f"{args.chunk} rows; 2 processes per mode, {args.reps} timed calls each after a warm-up")
    stats = {}
    for fused, runs in model_times.items():
        t = statistics.median(x for ts, _ in runs for x in ts)
        rss = max(r for _, r in runs)
        stats[fused] = (t, rss)
        print(f"  {'fused head' if fused else 'logits (default)':18s} {t:6.2f} s   "
              f"peak RSS {rss:7.1f} MB")
    print(f"  ratio fused / default: time {stats[True][0] / stats[False][0]:.3f}, "
          f"peak RSS {stats[True][1] / stats[False][1]:.3f}")


def share_lever(args) -> None:
    model, tok = builtin_policy()
    with torch.no_grad():  # a trained-looking adapter, as in the generate lever
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    passage = " ".join(f"Fact {i}: the value of item {i} is {3 * i + 1}."
                       for i in range(args.context_words // 8 + 1))
    passage = " ".join(passage.split()[:args.context_words])
    prompts = [rollout.render_prompt(tok, (passage + "\n\n" if passage else "")
                                     + f"What is {a} + {a + 3}? Reply with just the number.")
               for a in range(4)]

    def sample(share: bool) -> tuple[float, rollout.Rollout]:
        t0 = time.perf_counter()
        r = rollout.generate_rollout(model, tok, prompts, 8, 64, 1.0, ignore_eos=True,
                                     share_prompt=share)
        return time.perf_counter() - t0, r

    def train(share: bool, r: rollout.Rollout) -> float:
        model.train()
        ids, attn = r.input_ids, r.attention_mask
        t0 = time.perf_counter()
        for s in range(0, ids.shape[0], 8):
            logprobs.sequence_log_probs(model, ids[s:s + 8], attn[s:s + 8],
                                        r.completion_ids.shape[1], 1.0,
                                        share_prompt=share, kernel=True).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    _, r = sample(False)
    sample(True), train(False, r), train(True, r)  # warm-up
    times = {k: [] for k in ("rollout", "rollout shared", "train", "train shared")}
    for _ in range(args.reps // 2 or 1):  # alternating
        times["rollout"].append(sample(False)[0])
        times["rollout shared"].append(sample(True)[0])
        times["train"].append(train(False, r))
        times["train shared"].append(train(True, r))
    P = int(r.prompt_mask[0].sum())
    print(f"share lever: SmolLM2-135M + LoRA r=16, fp32 CPU, {torch.get_num_threads()} threads; "
          f"4 prompts of ~{P} tokens x G=8 x 64 fixed new tokens; training fwd+bwd in "
          "micro-batches of 8; seconds, alternating after a warm-up")
    print_times(times, 15)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  ratio shared / one pass per row: rollout {med['rollout shared'] / med['rollout']:.3f}"
          f", training {med['train shared'] / med['train']:.3f}, both "
          f"{(med['rollout shared'] + med['train shared']) / (med['rollout'] + med['train']):.3f}")


def entropy_lever(args) -> None:
    model, tok = builtin_policy()
    prompts = [rollout.render_prompt(tok, f"What is {a} + {a + 3}? Reply with just the number.")
               for a in range(4)]

    def sample(entropy: bool) -> float:
        t0 = time.perf_counter()
        rollout.generate_rollout(model, tok, prompts, 8, 64, 1.0, ignore_eos=True,
                                 share_prompt=True, entropy=entropy)
        return time.perf_counter() - t0
    sample(False), sample(True)  # warm-up
    times = {"without": [], "with entropy": []}
    for _ in range(args.reps // 2 or 1):  # alternating
        times["without"].append(sample(False))
        times["with entropy"].append(sample(True))
    print(f"entropy lever: SmolLM2-135M + LoRA r=16, fp32 CPU, {torch.get_num_threads()} threads; "
          "4 prompts x G=8 x 64 fixed new tokens; seconds, alternating after a warm-up")
    print_times(times, 13)
    print(f"  ratio with / without: "
          f"{statistics.median(times['with entropy']) / statistics.median(times['without']):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lever", default="logprob",
                    choices=["logprob", "generate", "microbatch", "fusedhead", "share", "entropy"])
    ap.add_argument("--compile", action="store_true",
                    help="generate: also time torch.compile (slow to compile)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", type=int, default=8 * 64,
                    help="completion tokens in a micro-batch (8 x 64)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--context-words", type=int, default=0,
                    help="share: words of passage before each question")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.lever != "logprob":
        return {"generate": generate_lever, "microbatch": microbatch_lever,
                "fusedhead": fusedhead_lever, "share": share_lever,
                "entropy": entropy_lever}[args.lever](args)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab,
                         generator=g).to(args.device, getattr(torch, args.dtype))
    ids = torch.randint(0, args.vocab, (args.rows,), generator=g).to(args.device)
    a = checkpointed_expression(logits.float(), ids, args.temperature, args.chunk)
    b = hand_written(logits.float(), ids, args.temperature, args.chunk)
    assert torch.allclose(a, b, atol=1e-5), "the two implementations disagree"
    results = {}
    for name, fn in (("checkpointed expression", checkpointed_expression),
                     ("hand-written backward", hand_written),
                     ("checkpointed expression ", checkpointed_expression),
                     ("hand-written backward ", hand_written)):
        t, m = measure(fn, logits, ids, args, args.reps)  # each measured twice, alternating
        results.setdefault(name.strip(), []).append((t, m))
    print(f"logprob lever: {args.rows} rows x V={args.vocab}, {args.dtype} on {args.device}, "
          f"chunk {args.chunk}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {args.reps} fwd+bwd, 2 alternations")
    rows = {k: (statistics.median(t for t, _ in v), max(m for _, m in v))
            for k, v in results.items()}
    if args.device == "cpu":
        rows = {k: (t, cpu_peak_rss_mb(fn, args)) for (k, (t, _)), fn
                in zip(rows.items(), ("checkpointed_expression", "hand_written"))}
    for k, (t, m) in rows.items():
        print(f"  {k:24s} {t * 1000:8.1f} ms" + ("" if m != m else f"  peak {m:8.1f} MB"
                                                + (" RSS" if args.device == "cpu" else "")))
    (ta, ma), (tb, mb) = rows["checkpointed expression"], rows["hand-written backward"]
    print(f"  ratio hand-written / checkpointed: time {tb / ta:.3f}"
          + ("" if ma != ma else f", peak memory {mb / ma:.3f}"))


if __name__ == "__main__":
    main()
