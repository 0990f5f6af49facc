"""The settings left at "auto", chosen for the device the run is on. An explicit setting always
wins. Called once by run/lifecycle.setup, after the model has loaded:

    cfg, line = auto.resolve(cfg, model, device, longest_prompt)   # line: what was chosen, or ""

The loss forward's speed levers (SPEED), on every device; each gives the plain path's values up to
float rounding, and with all of them off (false) a step runs the plain code:

    grpo.share_prompt        true on a CPU (bound by arithmetic: the prompt work saved wins),
                             "prefill" on a GPU (the sampling prefill only: the loss's second pass
                             costs more kernel launches than it saves at short prompts)
    grpo.logprob_kernel      on: the hand-written log-softmax holds one fp32 chunk of logits

On a CPU every other "auto" takes the value it had before it was a choice, so a CPU run is what it
always was. On a CUDA GPU:

    rollout.compile          on (HF generate with a static KV cache, compiled by transformers) on
                             compute capability >= 8 (A10, A100, L4, H100); off on older GPUs (a T4:
                             untested there, and the compilation eats into a short session), for a
                             4-bit base (not compiled by transformers) and for multi-turn episodes
                             (their token prompts are not padded to buckets: a recompile a shape)
    rollout.merged_sampling  on where rollout.compile's auto is, with LoRA: one matmul a layer
    optim.micro_batch_size,  from the estimated peak against the GPU's free memory
    model.gradient_checkpointing   (gpu/memory.choose_levers); SFT and DPO keep 8 and off

With the compiled sampler, a GQA model decodes through gpu/attention.py's attention, which reads
the grouped K/V without repeating it (unless model.attn_implementation names one). The chosen
values are what config.yaml saves; a resume whose config still says "auto" chooses again.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from config import Config, ConfigError

AUTO_KEYS = ("rollout.compile", "rollout.merged_sampling", "optim.micro_batch_size",
             "model.gradient_checkpointing")
CPU = {"rollout.compile": False, "rollout.merged_sampling": False, "optim.micro_batch_size": 8,
       "model.gradient_checkpointing": False}  # what each was before "auto"
COMPILE_CAPABILITY = (8, 0)  # Ampere and newer
SPEED = ("grpo.share_prompt", "grpo.logprob_kernel")  # the loss forward's levers, on every device


def speed_levers(cfg: Config, device: torch.device) -> dict:
    """SPEED's values for those left at auto. Prompt sharing runs a micro-batch through the model
    twice (the prompts, then the completions on their cache), doubling its kernel launches (25k vs
    12k aten operators for Qwen3-0.6B's 28 layers, counted on CPU:
    bench/gpu_training_pass/op_count_cpu.log).
    A CPU is bound by arithmetic, so the prompt work saved wins there (0.64x the training time at
    45-token prompts); a GPU on a small model is bound by launches, and on an H100 (same model and
    prompts) minigrpo's training took 2.5x TRL's with it on. The sampling prefill shares unless it
    is false: one extra forward per rollout."""
    cpu = device.type != "cuda"
    choice = {"grpo.share_prompt": True if cpu else "prefill", "grpo.logprob_kernel": True}
    return {k: v for k, v in choice.items() if get(cfg, k) == "auto"}


def get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def put(cfg: Config, key: str, value) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)


def fast_sampler(cfg: Config, capability: tuple[int, int]) -> tuple[bool, str]:
    """(rollout.compile's auto on this GPU, why not when off)."""
    if cfg.rollout.engine != "hf":
        return False, "vLLM samples"
    if cfg.model.quant:
        return False, "a 4-bit base is not compiled by transformers"
    if cfg.env or cfg.tools:
        return False, "multi-turn episodes' prompts are not bucketed"
    if tuple(capability) < COMPILE_CAPABILITY:
        return False, f"compute capability {capability[0]}.{capability[1]} < 8.0"
    return True, ""


def check_importance_weights(cfg: Config) -> None:
    """grpo.tis_cap with HF generate weighs by the log-probs a merged or compiled sampler records:
    with both chosen off (a CPU's auto) there are none, and the cap would do nothing."""
    ro = cfg.rollout
    if cfg.grpo.tis_cap and ro.engine == "hf" and not (ro.merged_sampling or ro.compile):
        raise ConfigError(f"grpo.tis_cap={cfg.grpo.tis_cap}: rollout.merged_sampling and "
                          "rollout.compile are off here (their auto, on this device), so the "
                          "sampler records no log-probs to weigh by; set rollout.merged_sampling: "
                          "true, or grpo.tis_cap: 0")


def memory_levers(cfg: Config, model: torch.nn.Module, levers: set[str], prompt_tokens: int,
                  free_bytes: int | None, device: torch.device):
    """gpu/memory.choose_levers for the `levers` left at auto (the other one as written), with
    checkpointing switched on when chosen; a model the estimate cannot trace (a 4-bit base, say)
    keeps the CPU's levers, and the line says why. free_bytes None: what the process may still
    allocate on `device`."""
    from gpu import memory
    if free_bytes is None:
        free_bytes = memory.allocatable_bytes(device)
    mb = None if "optim.micro_batch_size" in levers else cfg.optim.micro_batch_size
    ck = None if "model.gradient_checkpointing" in levers else cfg.model.gradient_checkpointing
    try:
        lv = memory.choose_levers(model, cfg, prompt_tokens, free_bytes, mb, ck)
    except Exception as e:
        return memory.Levers(mb or CPU["optim.micro_batch_size"], ck is True, 0, 0,
                             f"no memory estimate ({type(e).__name__}: {str(e)[:80]}), so the "
                             "CPU's levers")
    if ck is None and lv.checkpointing:
        memory.enable_checkpointing(model)
    return lv


def resolve(cfg: Config, model: torch.nn.Module, device: torch.device,
            longest_prompt: Callable[[], int], free_bytes: int | None = None,
            capability: tuple[int, int] | None = None) -> tuple[Config, str]:
    """-> (a copy of cfg with no "auto" left, one line saying what was chosen on a GPU, or "").
    longest_prompt() gives the longest rendered prompt in tokens (called on a GPU only);
    free_bytes and capability default to the device's own (tests give them)."""
    auto = [k for k in AUTO_KEYS if get(cfg, k) == "auto"]
    cfg, speed = copy.deepcopy(cfg), speed_levers(cfg, device)
    if device.type != "cuda":
        for k, v in ({k: CPU[k] for k in auto} | speed).items():
            put(cfg, k, v)
        check_importance_weights(cfg)
        return cfg, said("CPU", speed, [])
    chosen, notes = {}, []
    fast, why_not = fast_sampler(cfg, capability or torch.cuda.get_device_capability(device))
    if "rollout.compile" in auto:
        chosen["rollout.compile"] = fast
    if "rollout.merged_sampling" in auto:
        chosen["rollout.merged_sampling"] = fast and cfg.lora.enabled
    if why_not and {"rollout.compile", "rollout.merged_sampling"} & set(auto):
        notes.append(f"fast sampler off: {why_not}")
    levers = {"optim.micro_batch_size", "model.gradient_checkpointing"} & set(auto)
    if levers and cfg.mode != "grpo":
        chosen |= {k: CPU[k] for k in levers}
    elif levers:
        lv = memory_levers(cfg, model, levers, longest_prompt(), free_bytes, device)
        chosen |= {k: v for k, v in (("optim.micro_batch_size", lv.micro_batch_size),
                                     ("model.gradient_checkpointing", lv.checkpointing))
                   if k in levers}
        notes.append(lv.why)
    chosen |= speed
    for k, v in chosen.items():
        put(cfg, k, v)
    check_importance_weights(cfg)
    if cfg.rollout.compile is True and cfg.model.attn_implementation is None:
        from gpu import attention
        if attention.use_gqa_decode(model):
            notes.append("GQA decode without repeated K/V (gpu/attention.py)")
    return cfg, said("GPU", chosen, notes)


def said(machine: str, chosen: dict, notes: list[str]) -> str:
    """The "chosen for this machine" line, or "" when nothing was chosen."""
    if not chosen and not notes:
        return ""
    values = ", ".join(f"{k}={str(v).lower()}" for k, v in chosen.items())
    return (f"[minigrpo] chosen for this {machine}: {values}" + "".join(f"; {n}" for n in notes)
            + " (write a value in the config to choose it yourself)")
