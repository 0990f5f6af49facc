"""How far merged 16-bit sampling (rollout.merged_sampling, model.merged_for_sampling) moves the
sampler from the policy the loss trains: per-token log-prob gaps on the built-in SmolLM2-135M with
a LoRA adapter, in bfloat16 (and float32, where merging is exact: the sanity check). Not part of the
test suite.

    .venv/bin/python bench/gpu_defaults/merged_gap.py --adapter /tmp/mg_qs \\
        --adapter /tmp/mg_qs10  # + fresh

An adapter is a run directory (or checkpoint, or adapter directory) of a LoRA r=16 / alpha=32 run of
the built-in model, e.g. configs/quickstart.yaml's 30 steps:
    .venv/bin/python train.py --config configs/quickstart.yaml --run.out_dir=/tmp/mg_qs \\
        --run.threads=1 --run.sample_every=0 [--optim.lr=2e-3]
"fresh" (B = 0, always measured first) is the adapter at step 0.

For each adapter and dtype, the quickstart's first --prompts training prompts, --generations
completions each of up to --tokens tokens at its temperature (0.8), sampled by the merged sampler
(generate_rollout(sampler_logp=True) inside merged_for_sampling); then each completion token's
log-prob under

    (1) trainer   sequence_log_probs of the unmerged model (16-bit base + fp32 LoRA) under
                  logprobs.mixed_precision's autocast, one forward: what the loss computes
    (2) merged    the same forward inside merged_for_sampling, no autocast (W + (alpha/r) B@A
                  rounded to the model dtype)
    (S) sampler   the log-probs the merged sampler recorded while generating (HF generate's
                  forward: a prefill, then one token at a time on the KV cache, no autocast)
    (U) unmerged  generate's forward (prefill + one token at a time on the KV cache, no autocast)
                  of the unmerged model: the sampler with rollout.merged_sampling off
    (3) base      the trainer's forward with the adapter disabled (how far the adapter moved it)

and, over the completions' tokens, mean |x - (1)|, max |x - (1)|, and mean exp(|x - (1)|) - 1
(the per-token importance weight's deviation from 1); "merge alone" is |(S) - (U)|. merge/adapter
is mean|(S) - (1)| / mean|(3) - (1)|: roughly the share of the adapter's effect the sampler does
not follow. "delta" lines: over every LoRA layer, ||dW|| / ||W|| and how much of dW = (alpha/r) B@A
a 16-bit merge keeps: the share of its elements rounded away (W + dW == W) and
||(W + dW)_16bit - W - dW|| / ||dW||.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
from config import LoraConfig, ModelConfig, load_config  # noqa: E402
from model import load_policy, merged_for_sampling, reference_mode  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@torch.no_grad()
def cached_log_probs(model, r: rollout.Rollout, temperature: float) -> torch.Tensor:
    """(N, C) log softmax(logits / T)[token] as HF generate computes the logits: the prompts'
    prefill on a DynamicCache, then one completion token at a time, every new position attended
    (generate's own mask; past a row's end nothing is compared)."""
    from transformers import DynamicCache
    P, C = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    mask = torch.cat([r.prompt_mask, torch.ones_like(r.completion_ids)], 1)  # (N, P + C)
    pos = logprobs.position_ids(mask)  # (N, P + C)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=r.prompt_ids, attention_mask=mask[:, :P], position_ids=pos[:, :P],
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1].float()]  # (N, V) a step
    for t in range(C - 1):
        out = model(input_ids=r.completion_ids[:, t:t + 1], attention_mask=mask[:, :P + t + 1],
                    position_ids=pos[:, P + t:P + t + 1], past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
    z = torch.stack(logits, 1) / temperature  # (N, C, V)
    return z.log_softmax(-1).gather(-1, r.completion_ids[..., None])[..., 0]  # (N, C)


@torch.no_grad()
def trainer_log_probs(model, r: rollout.Rollout, temperature: float,
                      autocast: bool = True) -> torch.Tensor:
    """(N, C): logprobs.sequence_log_probs over prompt + completion, under mixed_precision as
    logprobs.micro_batch_log_probs runs it (autocast=False: the plain forward)."""
    ctx = logprobs.mixed_precision(model) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        return logprobs.sequence_log_probs(model, r.input_ids, r.attention_mask,
                                           r.completion_ids.shape[1], temperature, kernel=True)


@torch.no_grad()
def delta_stats(model) -> dict:
    """||dW|| / ||W|| over all LoRA layers, and what a merge in the base dtype keeps of dW."""
    from peft.tuners.lora import LoraLayer
    sq = {"w": 0.0, "d": 0.0, "err": 0.0, "lost": 0, "n": 0}
    for m in model.modules():
        if not isinstance(m, LoraLayer):
            continue
        w = m.base_layer.weight
        d = m.get_delta_weight(m.active_adapters[0]).float()  # (out, in)
        merged = w.clone()
        merged += d.to(w.dtype)  # as merged_for_sampling does it
        kept = merged.float() - w.float()
        sq["w"] += float(w.float().square().sum())
        sq["d"] += float(d.square().sum())
        sq["err"] += float((kept - d).square().sum())
        sq["lost"] += int(((kept == 0) & (d != 0)).sum())
        sq["n"] += int((d != 0).sum())
    return {"rel_norm": (sq["d"] / sq["w"]) ** 0.5,
            "rounded_away": sq["lost"] / max(sq["n"], 1),
            "merge_err": (sq["err"] / sq["d"]) ** 0.5 if sq["d"] else 0.0}


def gap(x: torch.Tensor, ref: torch.Tensor, m: torch.Tensor) -> tuple[float, float, float]:
    d = (x - ref)[m].abs().double()  # the completions' tokens
    return float(d.mean()), float(d.max()), float(d.exp().sub(1).mean())


def measure(adapter: str, dtype: str, cfg, rows: list[dict], args) -> list[str]:
    torch.manual_seed(0)
    mcfg = ModelConfig(name="smollm2-135m", dtype=dtype,
                       init_adapter=None if adapter == "fresh" else adapter)
    model, tok = load_policy(mcfg, LoraConfig(), torch.device("cpu"))
    model.eval()
    T = cfg.rollout.temperature
    prompts = rollout.render_rows(tok, rows, cfg.data)
    with merged_for_sampling(model):
        r = rollout.generate_rollout(model, tok, prompts, args.generations, args.tokens, T,
                                     sampler_logp=True)
        merged = trainer_log_probs(model, r, T, autocast=False)  # (2)
        merged_cached = cached_log_probs(model, r, T)  # (S) again, by this loop: a check
    trainer = trainer_log_probs(model, r, T)  # (1)
    unmerged = cached_log_probs(model, r, T)  # (U)
    with reference_mode(model) as ref:
        base = trainer_log_probs(ref, r, T)  # (3)
    m = r.completion_mask.bool()
    sampler = r.sampler_logp
    ds = delta_stats(model)
    name = "fresh" if adapter == "fresh" else Path(adapter).name
    head = f"{name:<8} {dtype:<8}"
    lines = [f"{head} tokens {int(m.sum())} in {m.shape[0]} completions; delta: ||dW||/||W|| "
             f"{ds['rel_norm']:.2e}, rounded away {ds['rounded_away']:.1%}, merge error "
             f"{ds['merge_err']:.1%} of ||dW||; generate's recorded vs this loop's merged "
             f"log-probs: max {gap(merged_cached, sampler, m)[1]:.1e}"]
    for label, x, ref in (("(3) base vs trainer", base, trainer),
                          ("(2) merged fwd vs trainer", merged, trainer),
                          ("(S) sampler vs trainer", sampler, trainer),
                          ("(U) unmerged gen vs trainer", unmerged, trainer),
                          ("merge alone (S) vs (U)", sampler, unmerged)):
        mean, mx, w = gap(x, ref, m)
        lines.append(f"{head} {label:<28} mean {mean:.2e}  max {mx:.2e}  mean e^|d|-1 {w:.2e}")
    effect = gap(base, trainer, m)[0] or float("nan")  # fresh: the adapter changes nothing
    lines.append(f"{head} merge/adapter: (S) {gap(sampler, trainer, m)[0] / effect:.3f}  "
                 f"(2) {gap(merged, trainer, m)[0] / effect:.3f}  "
                 f"(U) {gap(unmerged, trainer, m)[0] / effect:.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", action="append", default=[],
                    help="a run/checkpoint/adapter directory (repeatable); fresh always runs")
    ap.add_argument("--dtype", action="append", default=None,
                    help="bfloat16 and/or float32 (default: both)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "configs/quickstart.yaml")
    rows = data.load_rows(cfg.data)[:args.prompts]
    t0 = time.perf_counter()
    for dtype in args.dtype or ["bfloat16", "float32"]:
        for adapter in ["fresh", *args.adapter]:
            for line in measure(adapter, dtype, cfg, rows, args):
                print(line, flush=True)
    print(f"wall {time.perf_counter() - t0:.0f}s on {args.threads} thread(s), torch "
          f"{torch.__version__}")


if __name__ == "__main__":
    main()
