"""The Hugging Face Hub when it cannot be reached: use the local cache at once.

    with offline_if_unreachable():
        datasets.load_dataset("openai/gsm8k", "main")   # or AutoTokenizer.from_pretrained(...), hf_hub_download(...)

On a machine without a network (a compute node, a laptop on a plane) every hub call otherwise
retries for about 25 s per file, printing a line per retry, before it falls back to the cache or
fails. Here one DNS lookup of the hub's host decides: if it does not resolve, the block runs in
huggingface_hub's and datasets' offline mode (as with HF_HUB_OFFLINE=1), so what is cached loads
and what is not fails at once; `hub_unreachable` then says so, and how to bring it over. With a
proxy set (HTTPS_PROXY, ALL_PROXY) the lookup is the proxy's to make, so the hub counts as reachable.
"""
from __future__ import annotations

import contextlib
import functools
import os
import socket
from urllib.parse import urlsplit


@functools.lru_cache(maxsize=None)
def reachable(endpoint: str) -> bool:
    """Whether the endpoint's host resolves (a DNS lookup, no request; once a process: a slow failing
    lookup is not paid again for the tokenizer, the model and the data)."""
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
    """When offline_if_unreachable went offline (the user did not), why `name` failed to load and what to
    do, for the error message; "" when the hub was reachable or offline mode was the user's."""
    import huggingface_hub.constants as hub
    if hub.HF_HUB_OFFLINE or reachable(hub.ENDPOINT):
        return ""
    repo = " --repo-type dataset" if kind == "dataset" else ""
    return (f"the hub ({urlsplit(hub.ENDPOINT).hostname}) cannot be reached from this machine and {name} is not in its "
            f"cache: download it where there is a network (hf download {name}{repo} --local-dir DIR), copy DIR here "
            "and give its path")
