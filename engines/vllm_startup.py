"""What can be checked before vLLM starts, in the trainer's own process, so that a run vLLM would
refuse (or serve otherwise than the trainer trains) stops before step 1 with one line that says why:

    check_install(rank)            # vLLM inside requirements-vllm.txt's window; the rank it serves
    check_policy(model)            # the adapter: its peft features, architecture, target modules
    check_memory(share, device)    # free GPU memory against rollout.vllm_gpu_memory_utilization
    reason(error)                  # when vLLM fails anyway: the line of its own error that says why

What vLLM serves is read from engines/vllm_surface.json: tools/vllm_surface.py's reading of the
real wheels' source (the versions at the window's two ends), without importing vLLM. A failure at
start-up reaches the trainer as the exception itself because vLLM's engine runs in this process
(distributed_executor_backend="external_launcher", as TRL's colocate mode runs it): its log says
the same line above.
"""
from __future__ import annotations

import json
from pathlib import Path

from packaging.version import InvalidVersion, Version

from config import ConfigError

MIN_VLLM, NEXT_VLLM = "0.27.0", "0.31.0"  # requirements-vllm.txt's window: vllm>=MIN,<NEXT
SURFACE = json.loads(Path(__file__).with_name("vllm_surface.json").read_text())["versions"]
CHECKED = max((v for v in SURFACE if "LLM.__init__" in SURFACE[v]), key=Version)  # 0.30.0
LORA_RANKS = tuple(SURFACE[CHECKED]["max_lora_ranks"])  # the ranks vLLM accepts for max_lora_rank
INSTALL = "pip install -r requirements-vllm.txt"
# peft's LoRA initialisations that change the base weights (PiSSA, CorDA, OLoRA) or quantize them
# (LoftQ): the saved adapter is a difference from that changed base, while vLLM serves model.name
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq")


def in_window(version: str) -> bool:
    """A release inside [MIN_VLLM, NEXT_VLLM): local builds of one too, release candidates and dev
    builds by packaging's order (0.30.0rc1 is inside, 0.27.0rc1 and 0.31.0.dev1 are not).

    >>> [in_window(v) for v in ("0.27.0+cu130", "0.30.1", "0.30.0rc1", "0.27.0rc1", "0.31.0.dev1",
    ...                         "0.11.0", "0.33.0", "dev")]
    [True, True, True, False, False, False, False, False]
    """
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return Version(MIN_VLLM) <= v < Version(NEXT_VLLM) and not (
        v.is_prerelease and v.release >= Version(NEXT_VLLM).release)


def check_install(lora_rank: int) -> None:
    """vLLM is installed, inside the window, and serves the adapter's rank: ConfigError otherwise.
    train.py calls it in a dry run too, before the engine (and its GPU memory) would start."""
    if lora_rank > LORA_RANKS[-1]:
        raise ConfigError(f"rollout.engine: vllm supports LoRA ranks up to {LORA_RANKS[-1]}, "
                          f"the adapter has rank {lora_rank}")
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"rollout.engine: vllm needs the vllm package ({INSTALL}; Linux, CUDA): "
                          f"{e}") from None
    found = getattr(vllm, "__version__", "?")
    if not in_window(found):
        raise ConfigError(f"rollout.engine: vllm needs vllm>={MIN_VLLM},<{NEXT_VLLM}, the "
                          f"releases that keep the trainer's torch and transformers and record "
                          f"log-probs after temperature; found {found}: {INSTALL}")


def unserved_features(pc) -> list[str]:
    """The settings of a peft LoraConfig that vLLM refuses (DoRA, modules_to_save, biases) or
    would serve otherwise (per-module ranks, a base changed by the initialisation, replicated
    layers), by name."""
    init = str(getattr(pc, "init_lora_weights", True)).lower()
    checks = (("use_dora", getattr(pc, "use_dora", False)),
              ("modules_to_save", getattr(pc, "modules_to_save", None)),
              ("rank_pattern", getattr(pc, "rank_pattern", None)),
              ("alpha_pattern", getattr(pc, "alpha_pattern", None)),
              (f"bias={getattr(pc, 'bias', 'none')}", getattr(pc, "bias", "none") != "none"),
              ("lora_bias", getattr(pc, "lora_bias", False)),
              (f"init_lora_weights={init}", init.startswith(BASE_CHANGING_INITS)),
              ("layer_replication", getattr(pc, "layer_replication", None)))
    return [name for name, on in checks if on]


def check_policy(model) -> None:
    """What vLLM would serve otherwise than the trainer trains, for the adapter actually built (a
    continued init adapter may be another tool's): ConfigError, before vLLM starts."""
    merged = getattr(model, "minigrpo_base", {}).get("merged") or []
    if merged:  # the trainer merged them into its base; vLLM loads the bare model.name
        raise ConfigError("rollout.engine: vllm serves model.name bare, but the init adapter was "
                          f"trained on {len(merged)} merged adapter(s): export that chain with "
                          "tools/export.py and set model.name to the export")
    odd = unserved_features(model.peft_config["default"])
    if odd:
        raise ConfigError("rollout.engine: vllm serves plain LoRA adapters on the base as loaded; "
                          f"the adapter uses {', '.join(odd)}: use rollout.engine: hf")
    check_targets(model)


def check_targets(model) -> None:
    """The architecture serves LoRA in vLLM, and on each adapted module: linear layers, and the
    embedding modules vLLM's class lists (its own error otherwise, at the first generate)."""
    arch = (getattr(getattr(model, "config", None), "architectures", None) or ["?"])[0]
    surface = SURFACE[CHECKED]
    if arch in surface["no_lora_archs"]:
        raise ConfigError(f"rollout.engine: vllm {CHECKED} serves no LoRA adapter on {arch}; "
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
        raise ConfigError(f"rollout.engine: vllm adapts the linear layers of {arch} (and these "
                          f"embedding modules: {allowed}), not {', '.join(sorted(set(wrong)))}: "
                          "change lora.target_modules, or use rollout.engine: hf")


def check_memory(share: float, free: int, total: int, device: str) -> None:
    """vLLM asks for share x the GPU's total memory at start and refuses when less is free (its
    request_memory); the same comparison here, after the trainer's model is on the GPU."""
    wanted = share * total
    if free < wanted:
        gib = 2 ** 30
        raise ConfigError(f"rollout.vllm_gpu_memory_utilization={share} asks vLLM for "
                          f"{wanted / gib:.1f} GiB of {device}'s {total / gib:.1f} GiB, but "
                          f"{free / gib:.1f} GiB are free with the trainer loaded: set it to at "
                          f"most {int(free / total * 100) / 100:.2f}, or free memory")


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
