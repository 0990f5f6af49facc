"""The Hugging Face Hub when it cannot be reached: use the local cache at once.

    with offline_if_unreachable():
        datasets.load_dataset("openai/gsm8k", "main")   # or AutoTokenizer.from_pretrained(...), hf_hub_download(...)

On a machine without a network (a compute node, a laptop on a plane) every hub call otherwise
retries for about 25 s per file, printing a line per retry, before it falls back to the cache or
fails. Here one DNS lookup of the hub's host decides: if it does not resolve, the block runs in
huggingface_hub's and datasets' offline mode (as with HF_HUB_OFFLINE=1), so what is cached loads
and what is not fails at once with their usual "not in the cached files" error.
"""
from __future__ import annotations

import contextlib
import functools
import socket
from urllib.parse import urlsplit


@functools.lru_cache(maxsize=None)
def reachable(endpoint: str) -> bool:
    """Whether the endpoint's host resolves (a DNS lookup, no request; once a process: a slow failing
    lookup is not paid again for the tokenizer, the model and the data)."""
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
