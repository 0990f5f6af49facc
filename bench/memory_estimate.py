"""Estimate a GPU run's peak memory on a CPU: a training micro-batch traced without its arithmetic.

    # the H100 benchmark's work: old and new defaults, the memory levers
    python bench/memory_estimate.py --compare
    python bench/memory_estimate.py --config configs/t4.yaml --model random:qwen2.5-1.5b \\
        --prompt-tokens 160
    python bench/memory_estimate.py --config my.yaml --optim.micro_batch_size=4  # overrides apply
    python bench/memory_estimate.py --config configs/grubrics.yaml --model random:qwen3-8b \\
        --prompt-tokens 100 --meta

With --config, the run's own settings size the estimate: model dtype and 4-bit base, LoRA, gradient
checkpointing, G, max_new_tokens, rollout.prompts_per_generate (rows a generate call holds),
optim.micro_batch_size / micro_batch_tokens, grpo.logprob_chunk and fused_lm_head. Without it, the
H100 benchmark's work (bench/speed_vs_trl/vs_trl.py --preset gpu: random Qwen3-0.6B, 16 prompts x 8,
512 new tokens). --prompt-tokens is the longest rendered prompt (chat template included).

The model (a `random:` shape of bench/random_models.py, or a model directory) is loaded on the CPU
in the GPU dtype by model.load_policy, as train.py loads it, then logprobs.sequence_log_probs and
its backward run under torch's FakeTensorMode (gpu/memory.py, with which the trainer chooses its
micro-batch and gradient checkpointing): every operator computes only its output's shape, and a
dispatch mode adds up the bytes of the tensor storage each operator creates, minus what autograd
and Python have freed. Its peak is what torch.cuda.max_memory_allocated would show above the
weights, before the CUDA allocator's rounding, cuBLAS workspaces and kernels' scratch memory. It
follows train.py's training pass (mixed_precision's autocast included) in the one-pass form: prompt
sharing (torch.unique) cannot be traced without data, and a GPU does not use it by default.
Sampling is computed: the KV cache (layers x rows x positions x KV heads x head dim x 2) plus three
fp32 (rows, vocab) buffers of the sampler. The run's peak is taken as weights + AdamW state +
the larger of the two. A 4-bit base counts its frozen Linear weights as NF4 with double
quantization (about 0.52 bytes a weight) and is otherwise traced in the compute dtype, which is
what bitsandbytes computes in; its dequantized weight (one layer at a time) is not counted. Not
counted either: the reference forward (grpo.beta > 0) and the old-policy forward (num_iterations >
1 or num_mini_batches > 1), both without gradients and so below the training pass.

--meta builds a `random:` shape on the meta device and traces it with a CPU fake per weight: nothing
is written or held in RAM (about 0.5 GB for an 8B shape), so the recipes' 7B and 8B models estimate
here too; it agrees with real weights to 0.02 GiB on the run peak (Qwen3-0.6B, Qwen2.5-1.5B). SFT
and DPO have no sampling term, and their rows are as long as sft/dpo.max_length allows. Sizes
are GiB (2^30 bytes), as max_memory_allocated() / 2**30.
Checked once: for the H100 run of bench/RESULTS.md ("GPU"), whose training pass used prompt sharing
and 4096-row chunks, this gives 17.23 GiB (one pass) against the 18.24 GiB measured: 6% under. Not
part of the test suite; the first use of a `random:` shape writes its weights under
~/.cache/minigrpo/bench, and the estimate needs RAM for them in the GPU dtype.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the trainer's own estimate (it chooses the memory levers with it); imported by the tests from here
from gpu.memory import (  # noqa: F401
    NF4_BYTES,
    GiB,
    LiveBytes,
    kv_cache_bytes,
    micro_batch_peak,
    sampling_bytes,
    weight_bytes,
)

if TYPE_CHECKING:
    from config import LoraConfig, ModelConfig


def build(mcfg: ModelConfig, lora: LoraConfig, tokenizer: str | None = None):
    """(model, config) as train.py trains it (model.load_policy: LoRA in fp32 on the GPU dtype), on
    the CPU, with no 4-bit quantization and no checkpointing (micro_batch_peak sets that per trace):
    a `random:` model.name is a shape written once by bench/random_models.py's model_dir."""
    import dataclasses

    from random_models import model_dir, random_config

    import model as model_mod
    from model import load_policy
    # weights on the meta device: nothing written, nothing materialised
    if META and mcfg.name.startswith("random:"):
        from transformers import AutoModelForCausalLM
        hf, tok = random_config(mcfg.name.split(":", 1)[1], tokenizer)
        dtype = getattr(torch, mcfg.dtype)
        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
        meta_model.config.use_cache = False
        real_load_base = model_mod.load_base
        model_mod.load_base = lambda *a, **k: (meta_model, tok)
        try:
            with torch.device("meta"):  # peft's LoRA layers too
                model, _ = load_policy(
                    dataclasses.replace(mcfg, quant=None, gradient_checkpointing=False), lora,
                    torch.device("cpu"))
        finally:
            model_mod.load_base = real_load_base
        assert all(p.is_meta for p in model.parameters())
        return model.train(), model.config
    name = (str(model_dir(mcfg.name, "cuda", tokenizer, 0))  # "cuda": bf16
            if mcfg.name.startswith("random:") else mcfg.name)
    mcfg = dataclasses.replace(mcfg, name=name, quant=None, gradient_checkpointing=False)
    model, _ = load_policy(mcfg, lora, torch.device("cpu"))
    return model.train(), model.config


META = False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="a train.py config: its model, lora, rollout, grpo and optim "
                    "settings size the estimate; --section.key=value overrides follow as for "
                    "train.py")
    ap.add_argument("--model", help="random:<shape> (bench/random_models.py) or a model directory; "
                    "replaces model.name (default without --config: random:qwen3-0.6b)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                    help="GPU dtype (default: model.dtype, auto as bfloat16)")
    ap.add_argument("--tokenizer",
                    help="tokenizer directory for random shapes (default: the built-in model's)")
    ap.add_argument("--prompt-tokens", type=int, default=45,
                    help="longest prompt in a micro-batch, chat template included")
    ap.add_argument("--meta", action="store_true", help="random shapes only: build the model on "
                    "the meta device (no weights written or held in RAM), so 7B/8B shapes estimate "
                    "in little memory")
    ap.add_argument("--free-gb", type=float, default=70.0,
                    help="GiB free on the GPU after loading, for the settings left at auto "
                    "(optim.micro_batch_size, model.gradient_checkpointing: gpu/memory.py); "
                    "default 70, an 80 GB card's")
    ap.add_argument("--compare", action="store_true",
                    help="the H100 run's old defaults, the defaults now, and the memory levers")
    a, overrides = ap.parse_known_args()
    global META
    META = a.meta
    from config import Config, ConfigError, length_limit, load_config
    if not a.config and overrides:
        ap.error(f"--section.key overrides need --config: {' '.join(overrides)}")
    try:
        cfg = load_config(a.config, overrides) if a.config else Config()
    except ConfigError as e:
        ap.error(str(e))
    if not a.config:  # the H100 benchmark's work (bench/speed_vs_trl/vs_trl.py --preset gpu)
        cfg.model.name, cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens = (
            "random:qwen3-0.6b", 16, 512)
        from random_models import LORA_TARGETS
        cfg.lora.target_modules = LORA_TARGETS
    spec = cfg.model.name = a.model or cfg.model.name
    dtype_name = cfg.model.dtype = a.dtype or (cfg.model.dtype if cfg.model.dtype != "auto"
                                               else "bfloat16")
    dtype = getattr(torch, dtype_name)
    try:
        model, mcfg = build(cfg.model, cfg.lora, a.tokenizer)
    except ConfigError as e:  # a hub model without network, say: one line, as train.py gives it
        print(f"error: {e}" + ("" if spec.startswith("random:") else "; --model random:SHAPE "
                               "estimates a random model of a known shape (bench/random_models.py: "
                               "qwen3-0.6b, qwen2.5-1.5b, qwen3-1.7b, qwen3-4b-instruct-2507, "
                               "qwen2.5-7b, qwen3-8b; --meta for the large ones) without "
                               "downloading"), file=sys.stderr)
        return 2
    weights = weight_bytes(model, cfg.model.quant)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    P, G = a.prompt_tokens, cfg.rollout.num_generations
    # SFT and DPO: a row as long as sft/dpo.max_length allows (prompt + reply)
    C = cfg.rollout.max_new_tokens if cfg.mode == "grpo" else length_limit(cfg)[1] - P
    if C <= 0:
        ap.error(f"--prompt-tokens {P} leaves no reply under {cfg.mode}.max_length")
    print(f"[estimate] {spec} in {dtype_name}{', 4-bit base' if cfg.model.quant else ''}, "
          f"{'LoRA r=' + str(cfg.lora.r) if cfg.lora.enabled else 'all weights trained'}: "
          f"weights {weights / GiB:.2f} GiB, AdamW state {2 * trained / GiB:.2f} GiB; "
          + (f"{cfg.rollout.prompts_per_step} prompts x G={G}, " if cfg.mode == "grpo"
             else f"{cfg.mode}, no sampling: ") + f"{P} + {C} tokens", flush=True)
    o, g, ro = cfg.optim, cfg.grpo, cfg.rollout
    if "auto" in (o.micro_batch_size, cfg.model.gradient_checkpointing):  # what a GPU would choose
        import time

        from gpu.memory import choose_levers
        began = time.perf_counter()
        auto = choose_levers(model, cfg, P, int(a.free_gb * GiB), *(
            None if v == "auto" else v for v in (o.micro_batch_size,
                                                 cfg.model.gradient_checkpointing)))
        o.micro_batch_size, cfg.model.gradient_checkpointing = auto.micro_batch_size, \
            auto.checkpointing
        print(f"[estimate] auto, with {a.free_gb:g} GiB free after loading (--free-gb): "
              f"{auto.why} (chosen in {time.perf_counter() - began:.1f} s)", flush=True)
    now = dict(rows=o.micro_batch_size, chunk=g.logprob_chunk, fused_head=g.fused_lm_head,
               checkpointing=cfg.model.gradient_checkpointing,
               prompts=ro.prompts_per_generate or ro.prompts_per_step)
    settings = {"as configured": now}
    if a.compare:
        settings = {
            "4096-row chunks, no autocast (before 83ae6c3)": now | dict(chunk=4096, autocast=False),
            "chunks by vocabulary, no autocast": now | dict(autocast=False),
            "the defaults (chunks by vocabulary + autocast)": now,
            "+ grpo.fused_lm_head": now | dict(fused_head=True),
            "+ optim.micro_batch_size=4": now | dict(fused_head=True, rows=4),
            "+ rollout.prompts_per_generate=8": now | dict(fused_head=True, rows=4, prompts=8),
            "fused head, 2 prompts a call, gradient checkpointing":
                now | dict(fused_head=True, prompts=2, checkpointing=True)}
    if o.micro_batch_tokens:
        for s in settings.values():
            s["rows"] = max(1, min(s["rows"], o.micro_batch_tokens // (P + C)))
    for name, s in settings.items():
        kw = {k: v for k, v in s.items() if k != "prompts"}
        fwd, both = micro_batch_peak(model, prompt=P, completion=C, **kw)
        # SFT never samples
        sample = sampling_bytes(mcfg, s["prompts"] * G, P + C, dtype) if cfg.mode == "grpo" else 0
        total = weights + 2 * trained + max(both, sample)
        print(f"[estimate]   {name:54s} training {s['rows']} rows: {fwd / GiB:5.2f} GiB forward, "
              f"{both / GiB:5.2f} with backward; "
              + (f"sampling {s['prompts'] * G} rows: {sample / GiB:5.2f} GiB; "
                 if cfg.mode == "grpo" else "") + f"run peak ~{total / GiB:5.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
