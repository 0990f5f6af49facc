"""What can be checked before vLLM starts, in the trainer's own process, so that a run vLLM would
refuse (or serve otherwise than the trainer trains) stops before step 1 with one line that says why:

    version = check_install(rank)     # vLLM in requirements-vllm.txt's window; the rank it serves
    check_policy(model, version)      # the adapter: its peft features, architecture, target modules
    costs = startup_costs(model, ...)  # what vLLM holds in its share besides its KV cache
    check_memory(share, free, total, device, costs)  # the share: free, and enough for the costs
    reason(error)                     # when vLLM fails anyway: the line of its error that says why

What a version serves is read from engines/vllm_surface.json: tools/vllm_surface.py's reading of the
real wheels' source (the window's release, and the releases before it), without importing vLLM; the
checks read the installed version's (the newest stored at or below it). A failure at start-up
reaches the trainer as the exception itself because vLLM's engine runs in this process
(distributed_executor_backend="external_launcher", as TRL's colocate mode runs it): its log says
the same line above.
"""
from __future__ import annotations

import json
from pathlib import Path

from packaging.version import InvalidVersion, Version

from config import ConfigError

MIN_VLLM, NEXT_VLLM = "0.32.0", "0.33.0"  # requirements-vllm.txt's window: vllm>=MIN,<NEXT
SURFACE = json.loads(Path(__file__).with_name("vllm_surface.json").read_text())["versions"]
SERVED = sorted((v for v in SURFACE if "LLM.__init__" in SURFACE[v]), key=Version)  # full readings
INSTALL = "pip install -r requirements-vllm.txt"
# peft's LoRA initialisations that change the base weights (PiSSA, CorDA, OLoRA) or quantize them
# (LoftQ): the saved adapter is a difference from that changed base, while vLLM serves model.name
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq")
GIB = 2 ** 30


def surface_of(version: str = MIN_VLLM) -> tuple[str, dict]:
    """(the stored version, its surface) that describes vLLM `version`: the newest reading at or
    below it (0.32.1 is read as 0.32.0), else the oldest.

    >>> surface_of("0.32.1")[0], surface_of("0.30.0")[0], surface_of("0.29.0")[0]
    ('0.32.0', '0.30.0', '0.27.0')
    """
    at = [v for v in SERVED if Version(v) <= Version(version)]
    found = at[-1] if at else SERVED[0]
    return found, SURFACE[found]


def in_window(version: str) -> bool:
    """A release inside [MIN_VLLM, NEXT_VLLM): local builds of one too, release candidates and dev
    builds by packaging's order (0.32.1rc1 is inside, 0.32.0rc1 and 0.33.0.dev1 are not).

    >>> [in_window(v) for v in ("0.32.0+cu130", "0.32.1", "0.32.1rc1", "0.32.0rc1", "0.33.0.dev1",
    ...                         "0.31.0", "0.33.0", "dev")]
    [True, True, True, False, False, False, False, False]
    """
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return Version(MIN_VLLM) <= v < Version(NEXT_VLLM) and not (
        v.is_prerelease and v.release >= Version(NEXT_VLLM).release)


def check_install(lora_rank: int) -> str:
    """vLLM is installed, imports, is inside the window and serves the adapter's rank -> its
    version; ConfigError otherwise. train.py calls it in a dry run too, before the engine (and its
    GPU memory) would start."""
    try:
        import vllm
    except Exception as e:  # not installed, or installed and broken (another torch, no CUDA, ...)
        if isinstance(e, ModuleNotFoundError) and e.name == "vllm":
            raise ConfigError(f"rollout.engine: vllm needs the vllm package ({INSTALL}; Linux, "
                              f"CUDA): {e}") from None
        raise ConfigError(f"rollout.engine: vllm is installed but does not import ({reason(e)}): "
                          f"{INSTALL} in a fresh environment") from None
    found = getattr(vllm, "__version__", "?")
    if not in_window(found):
        raise ConfigError(f"rollout.engine: vllm needs vllm>={MIN_VLLM},<{NEXT_VLLM}, the "
                          f"releases that declare and test requirements-vllm.txt's torch and "
                          f"transformers; found {found}: {INSTALL}")
    ranks = surface_of(found)[1]["max_lora_ranks"]
    if lora_rank > ranks[-1]:
        raise ConfigError(f"rollout.engine: vllm supports LoRA ranks up to {ranks[-1]}, "
                          f"the adapter has rank {lora_rank}")
    return found


def served_rank(lora_rank: int, version: str) -> int:
    """vLLM's max_lora_rank for an adapter: the smallest of the ranks it accepts that holds it."""
    return min(r for r in surface_of(version)[1]["max_lora_ranks"] if r >= lora_rank)


def unserved_features(pc, read: list[str] = ()) -> list[str]:
    """The settings of a peft LoraConfig that vLLM refuses (DoRA, modules_to_save, biases, aLoRA,
    QALoRA, BD-LoRA) or would serve otherwise (a base changed by the initialisation, replicated
    layers, trained token rows, per-module ranks where its PEFTHelper does not `read` them), by
    name. vLLM 0.27-0.30 read 9 keys of adapter_config.json and ignored the rest (an aLoRA adapter
    applied to every token); 0.32 refuses them, and reads rank_pattern and alpha_pattern."""
    init = str(getattr(pc, "init_lora_weights", True)).lower()
    checks = (("use_dora", getattr(pc, "use_dora", False)),
              ("modules_to_save", getattr(pc, "modules_to_save", None)),
              ("rank_pattern", getattr(pc, "rank_pattern", None) and "rank_pattern" not in read),
              ("alpha_pattern", getattr(pc, "alpha_pattern", None) and "alpha_pattern" not in read),
              (f"bias={getattr(pc, 'bias', 'none')}", getattr(pc, "bias", "none") != "none"),
              ("lora_bias", getattr(pc, "lora_bias", False)),
              (f"init_lora_weights={init}", init.startswith(BASE_CHANGING_INITS)),
              ("layer_replication", getattr(pc, "layer_replication", None)),
              ("alora_invocation_tokens", getattr(pc, "alora_invocation_tokens", None)),
              ("use_qalora", getattr(pc, "use_qalora", False)),
              ("use_bdlora", getattr(pc, "use_bdlora", None)),
              ("trainable_token_indices", getattr(pc, "trainable_token_indices", None)))
    return [name for name, on in checks if on]


def check_policy(model, version: str = MIN_VLLM) -> None:
    """What vLLM `version` would serve otherwise than the trainer trains, for the adapter actually
    built (a continued init adapter may be another tool's): ConfigError, before vLLM starts."""
    merged = getattr(model, "minigrpo_base", {}).get("merged") or []
    if merged:  # the trainer merged them into its base; vLLM loads the bare model.name
        raise ConfigError("rollout.engine: vllm serves model.name bare, but the init adapter was "
                          f"trained on {len(merged)} merged adapter(s): export that chain with "
                          "tools/export.py and set model.name to the export")
    odd = unserved_features(model.peft_config["default"], surface_of(version)[1]["PEFTHelper"])
    if odd:
        raise ConfigError("rollout.engine: vllm serves plain LoRA adapters on the base as loaded; "
                          f"the adapter uses {', '.join(odd)}: use rollout.engine: hf")
    check_targets(model, version)


def check_targets(model, version: str = MIN_VLLM) -> None:
    """The architecture serves LoRA in vLLM `version`, and on each adapted module: linear layers,
    and the embedding modules vLLM's class lists (its own error otherwise, at the first
    generate)."""
    arch = (getattr(getattr(model, "config", None), "architectures", None) or ["?"])[0]
    read, surface = surface_of(version)
    if arch in surface["no_lora_archs"]:
        raise ConfigError(f"rollout.engine: vllm {read} serves no LoRA adapter on {arch}; "
                          "rollout.engine: hf samples with any model")
    import torch.nn as nn
    served = surface["lora_archs"].get(arch)  # None: served by vLLM's transformers backend
    wrong = []
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(module, "lora_A"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        embedding = isinstance(base, nn.Embedding) or leaf in ("lm_head", "embed_tokens")
        if (not isinstance(base, (nn.Linear, nn.Embedding))
                or embedding and served is not None and leaf not in served):
            wrong.append(f"{leaf} ({type(base).__name__})")
    if wrong:
        allowed = ", ".join(served or []) or "none"
        raise ConfigError(f"rollout.engine: vllm {read} adapts the linear layers of {arch} (and "
                          f"these embedding modules: {allowed}), not "
                          f"{', '.join(sorted(set(wrong)))}: change lora.target_modules, or use "
                          "rollout.engine: hf")


def startup_costs(model, dtype_bytes: int, lora_rank: int, seqs: int, batched_tokens: int,
                  max_model_len: int) -> dict[str, int]:
    """What vLLM holds in its share of the GPU before its KV cache beyond one sequence, in bytes,
    estimated from the trainer's model (the same base, in vLLM's dtype; h: hidden size, I: the
    MLP's width, q, kv: the attention projections' widths, V: the vocabulary, L: layers):

        weights         the base's parameters x dtype bytes (vLLM loads its own copy)
        LoRA buffers    lora_rank x sum over the linear layers of (in + out) x dtype bytes (one
                        slot, max_loras=1, on every linear layer: vLLM wraps them all)
        profiling peak  batched_tokens x (2I + q + 2kv + h) x dtype bytes: one layer of the
                        profiling batch; and seqs x V x 4 x 2: the sampler's fp32 logits and
                        processed log-probs for max_num_seqs requests
        CUDA graphs     the largest captured decode batch, min(2 seqs, 512) tokens, the same way
        KV cache        one max_model_len sequence: 2 x kv x dtype bytes x its tokens in each
                        layer (max_model_len; a sliding-window layer's window at most, a linear
                        attention layer's none): the least vLLM starts with, refusing less

    Rough (no vLLM ran them: the development machine cannot install it), meant as a floor."""
    import torch.nn as nn
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q = c.num_attention_heads * d
    kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
    width = 2 * getattr(c, "intermediate_size", 4 * h) + q + 2 * kv + h  # one layer's activations
    weights = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    linears = sum(m.in_features + m.out_features for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and "lora_" not in n and not n.endswith("lm_head"))
    graph_tokens = min(2 * seqs, 512)
    window = min(getattr(c, "sliding_window", None) or max_model_len, max_model_len)
    kept = {"full_attention": max_model_len, "sliding_attention": window}  # tokens a layer keeps
    kv_tokens = sum(kept.get(kind, 0) for kind in getattr(c, "layer_types", None)
                    or ["full_attention"] * L)
    return {"weights": weights * dtype_bytes,
            "LoRA buffers": lora_rank * linears * dtype_bytes,
            "profiling peak": batched_tokens * width * dtype_bytes + seqs * V * 4 * 2,
            "CUDA graphs": graph_tokens * width * dtype_bytes,
            "one sequence's KV cache": 2 * kv * kv_tokens * dtype_bytes}


def check_memory(share: float, free: int, total: int, device: str,
                 costs: dict[str, int] | None = None) -> None:
    """vLLM asks for share x the GPU's total memory at start and refuses when less is free (its
    request_memory), then holds its weights, LoRA buffers, profiling peak and CUDA graphs in that
    share and refuses a KV cache too small for one sequence: both compared here, after the
    trainer's model is on the GPU, with startup_costs' numbers."""
    wanted, g = share * total, GIB
    if free < wanted:
        raise ConfigError(f"rollout.vllm_gpu_memory_utilization={share} asks vLLM for "
                          f"{wanted / g:.1f} GiB of {device}'s {total / g:.1f} GiB, but "
                          f"{free / g:.1f} GiB are free with the trainer loaded: set it to at "
                          f"most {int(free / total * 100) / 100:.2f}, or free memory")
    needed = sum((costs or {}).values())
    if needed > wanted:
        parts = " + ".join(f"{k} {v / g:.2f}" for k, v in costs.items())
        least = -(-needed * 100 // total) / 100  # rounded up to a hundredth
        raise ConfigError(f"rollout.vllm_gpu_memory_utilization={share} gives vLLM "
                          f"{wanted / g:.2f} GiB of {device}'s {total / g:.1f} GiB, less than it "
                          f"holds before any batch: {parts} = {needed / g:.2f} GiB (estimated): "
                          f"set it to at least {least:.2f}"
                          + (f" (at most {int(free / total * 100) / 100:.2f} is free)"
                             if least * total > free else "")
                          + ", or shorten rollout.max_prompt_tokens + max_new_tokens")


def reason(error: BaseException) -> str:
    """The line of vLLM's error that says why: the innermost exception of the chain (vLLM wraps
    the cause, e.g. "Engine core initialization failed. See root cause above"), its first line
    that is not a traceback, its type named."""
    root, seen = error, set()
    while (root.__cause__ or root.__context__) is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__ or root.__context__
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    return f"{type(root).__name__}: {(lines or [''])[0][:300]}"
