"""The chat client behind every API call minigrpo makes (judges, API models in eval.py, the
answer policy of tools/precompute.py): any OpenAI-compatible endpoint, cached, rate-limited,
retried, costed.

    from api.client import Judge, JudgeConfig
    client = Judge(JudgeConfig(base_url="http://127.0.0.1:8000/v1", model="Qwen/Qwen3-8B"))
    replies = client.complete_many([[{"role": "user", "content": "Hi"}]])  # str, or None: failed
    client.pop_step_stats()  # {"judge_requests": 1.0, ..., "judge_cost_usd_total": 0.0}

Each call: cache lookup (in-memory LRU, then an append-only JSONL file that survives restarts), at
most `max_concurrent` requests in flight, optional requests-per-minute spacing, a hard per-request
timeout, and retries with exponential backoff + jitter on 429, 408, 5xx, timeouts, connection errors
and bodies that are not JSON, honouring retry-after-ms / Retry-After. Faults never raise: the call
yields None, `judge_failures` counts it, the caller applies its fallback. A 401, 403 or 404 (the
key, the model, the URL; not a 403 for one flagged input), a 402 or 429 insufficient_quota (the
bill), a 400 for a parameter the model does not take, or FAILED_LIMIT failed requests before any
reply, raise JudgeUnusable once the batch is done: no retry or later call fixes those. The key is
read without outer whitespace (a secret file's newline). judge.py builds the judge rewards on it.

Choices worth knowing:
- The openai client's retries are off (max_retries=0): the retry policy lives here and is tested.
- A reply that `score_many`'s parser rejects is a failure; it is not retried (at temperature 0 the
  same prompt mostly gets the same reply, so re-asking pays twice for nothing) but cached like any
  reply: a rerun gets the same fallback without paying (and parses it anew). A rerun pays only for
  the calls whose requests got no reply (failed after their retries, or refused).
- The cache (reply_cache.py: an append-only JSONL file plus a bounded LRU in memory) keeps only
  key -> byte offset in RAM for the file, so a long run does not grow RAM with reply text.
- Identical prompts in flight at once share one request (GRPO groups often repeat a completion);
  the n samples of one prompt (complete_many n=) are n requests, each cached under its own index.
- The API key is read from the env var named by `api_key_env` only when a client is built; it is not
  stored in the config and is masked, with every header value, in every log line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib
import json
import logging
import math
import os
import random
import socket
import time
from typing import Callable
from urllib.parse import urlsplit

from api.reply_cache import ReplyCache, cache_key  # noqa: F401 (cache_key: part of this module's API)
from config import (  # noqa: F401 (JudgeConfig: part of this module's API)
    JudgeConfig,
    JudgeUnusable,
    mask_urls,
)
from settings.checks import check_client
from settings.typed_config import expand_env

log = logging.getLogger(__name__)


# Counters behind pop_step_stats; reported as judge_<name> (since last pop) and judge_<name>_total.
# Each call lands in exactly one of requests (a new usable reply), cache_hits (a reply from the
# cache or from another call's request in flight) and failures (no usable reply: the caller's
# fallback); unusable counts the failures that had a reply, one without a usable score; sent counts
# the HTTP requests (retries included: what the server, its rate limit and the bill see);
# steps_skipped the training steps not trained on for this judge's failures (scoring/outage.py).
STAT_NAMES = ("calls", "requests", "cache_hits", "failures", "unusable", "sent", "retries",
              "prompt_tokens", "completion_tokens", "cost_usd", "constant_scores", "steps_skipped")
OUTAGE_MIN_CALLS = 4  # a step with fewer calls sent says too little of the endpoint to call it down
OUTAGE_SHARE = 0.9  # a step in which this share of the calls sent got no reply: a step down


def _sendable(messages: list[dict]) -> list[dict]:
    """messages with each lone surrogate (a reply cut inside an emoji, legal in JSON) as U+FFFD: the
    openai client cannot encode one. The cache keys hash the messages as they were.

    >>> _sendable([{"role": "user", "content": "cut " + chr(0xD83D)}])[0]["content"] == (
    ...     "cut " + chr(0xFFFD))
    True
    """
    def fix(text):
        return (text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                if isinstance(text, str) else text)
    return [{k: fix(v) for k, v in m.items()} for m in messages]


def _retry_after(headers) -> float | None:
    """Seconds the server asks to wait: retry-after-ms (OpenAI, Azure) first, then retry-after."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            value = float(headers.get(name)) * scale
        except (TypeError, ValueError):  # absent, or an HTTP date: use our own backoff
            continue
        if math.isfinite(value) and value >= 0:
            return value
    return None


UNPARSED_LIMIT = 16  # score_many: this many unusable replies, and no usable one, stop the run
FAILED_LIMIT = 16  # this many requests failed (after retries), and none answered, stop the run


# filled from ${NAME} (or ${NAME:-default}) when a client is built: JudgeConfig.FILLED_BY_CLIENT
# but the headers, which are read one by one
ENV_FIELDS = tuple(f for f in JudgeConfig.FILLED_BY_CLIENT if f != "extra_headers")
# api_key_env: null reads the key where the openai SDK looks for it: Azure's, or OpenAI's
SDK_KEY_ENV = {True: "AZURE_OPENAI_API_KEY", False: "OPENAI_API_KEY"}


def _expand(value: str, key: str, section: str = "judge") -> str:
    """A header value (or base_url, azure_endpoint, api_version, model) with each ${NAME} and
    ${NAME:-default} filled in from the environment, as every config field reads them
    (settings.typed_config.expand_env; a ConfigError, a ValueError, when one is unset).

    >>> import os; os.environ["MINIGRPO_DOC_TOKEN"] = "t0k"
    >>> _expand("Bearer ${MINIGRPO_DOC_TOKEN}", "extra_headers.Authorization", "judge")
    'Bearer t0k'
    >>> _expand("${MINIGRPO_DOC_UNSET:-gpt-4o-mini}", "model", "judge")
    'gpt-4o-mini'
    """
    if value == "***" or "://***@" in value:
        raise ValueError(
            f"{section}: {key} holds '***', a secret masked when a run saved its config; put the "
            "secret in an environment variable and write it as ${NAME}")
    return expand_env(value, f"{section}: {key}")


def run_sync(coro):
    """The coroutine's result, from sync code; also when an event loop runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Inside a running loop (a notebook): asyncio.run refuses there, so use a private thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class Judge:
    """Cached, rate-limited, retrying chat client; see the module docstring."""

    def __init__(self, cfg: JudgeConfig, label: str = "judge", key: str | None = None):
        """label: how warnings name this client (its config key: judge, judges.NAME, eval.api); key:
        its config section, where hints send the user, when the label says more (None: the label).
        base_url, azure_endpoint, api_version and model may read the environment as headers do:
        "${AZURE_OPENAI_ENDPOINT:-}" (empty: not Azure)."""
        section = key or label  # errors start with it: the caller's message as it stands
        cfg = dataclasses.replace(cfg, **{k: _expand(getattr(cfg, k), k, section)
                                          for k in ENV_FIELDS if getattr(cfg, k)})
        if cfg.api_key_env is None:  # one config for OpenAI or Azure (GRubrics' judge)
            cfg = dataclasses.replace(cfg, api_key_env=SDK_KEY_ENV[bool(cfg.azure_endpoint)])
        check_client(section, cfg, mask_urls)
        self.headers = {h: _expand(v, f"extra_headers.{h}", section)
                        for h, v in cfg.extra_headers.items()}
        self.cfg, self.label, self.key = cfg, label, key or label
        self._check_sendable(section)
        self.fatal: str | None = None  # a reply no retry fixes (401, 403, 404...): the caller stops
        self._unparsed_before_any = 0  # score_many: unusable replies before a usable one (then -1)
        self._first_unparsed = ""  # the first of those replies, for the error
        self._failed_before_any = 0  # failed requests before any reply (then -1): FAILED_LIMIT
        self._first_failure = ""  # why the first of those failed, for the error
        self.last_failure = ""  # why the latest request failed, for the outage line
        self.unusable_reply = ""  # the latest reply without a usable score, for the garbage line
        self.unusable_steps = 0  # steps in a row whose replies were mostly unusable
        #   (scoring/outage.py)
        self._last_failed: tuple[str, list[dict]] | None = None  # its key, messages: probe()'s
        self._asked = self._unanswered = 0  # this step's calls sent, and those without a reply
        self._no_reply: set[str] = set()  # this step's request keys that got no HTTP reply at all
        self.down_steps = 0  # steps in a row with (nearly) no call answered (run.judge_outage)
        self._step = dict.fromkeys(STAT_NAMES, 0.0)
        self.totals = dict.fromkeys(STAT_NAMES, 0.0)  # run totals: checkpointed, back on --resume
        self._logged: set[str] = set()  # error kinds logged this step: one line each, not per call
        self._next_slot = 0.0  # monotonic time the next request may start (requests_per_minute)
        # Client, semaphore and in-flight table belong to one event loop; rebuilt when it changes.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client = None
        self._sem: asyncio.Semaphore | None = None
        self._inflight: dict[str, asyncio.Future] = {}
        # every request task not yet done (shielded: they outlive a cancel)
        self._requests: set[asyncio.Future] = set()
        self.cache = ReplyCache(cfg.cache_path, cfg.memory_cache_size if cfg.memory_cache else 0,
                                label, self.key)

    def _check_sendable(self, section: str) -> None:
        """Build the request this client will send, with the HTTP client the openai package sends
        it with: a URL it cannot parse (http://host:notaport/v1) or a header or key it cannot
        encode raises ValueError here, before a run, not as every call of every step."""
        import openai
        # the package openai sends with (httpx2; httpx before it): its Request, without a client
        http = importlib.import_module(openai.DefaultHttpxClient.__base__.__module__.split(".")[0])
        cfg = self.cfg
        path = (f"/openai/deployments/{cfg.model}/chat/completions" if cfg.azure_endpoint
                else "/chat/completions")
        url = self._endpoint.rstrip("/") + path
        headers = {**self.headers, "Authorization": f"Bearer {self._key() or 'EMPTY'}"}
        try:
            http.Request("POST", url, headers=headers)
        except Exception as e:  # its InvalidURL, a UnicodeEncodeError, ...
            name = "azure_endpoint" if cfg.azure_endpoint else "base_url"
            why = ("a header or the key holds a character HTTP cannot carry"  # the error quotes it
                   if isinstance(e, UnicodeError) else f"{type(e).__name__}: {e}")
            raise ValueError(self.masked(
                f"{section}: cannot build a request to {url} ({why}); fix {section}.{name} (e.g. "
                f"http://127.0.0.1:8000/v1), the model, extra_headers or the key in "
                f"${cfg.api_key_env}")) from None

    def __repr__(self) -> str:
        return (f"Judge(model={self.cfg.model!r}, endpoint={mask_urls(self._endpoint)!r}, "
                f"max_concurrent={self.cfg.max_concurrent}, cache_path={self.cfg.cache_path!r})")

    @property
    def _endpoint(self) -> str:
        return self.cfg.azure_endpoint or self.cfg.base_url

    @property
    def key_missing(self) -> bool:
        """api_key_env is unset while the endpoint is not local: every call would be refused."""
        host = urlsplit(self._endpoint).hostname or ""
        return not self._key() and host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0")

    # --- stats ------------------------------------------------------------------------------------
    def add_stat(self, name: str, value: float = 1.0) -> None:
        self._step[name] += value
        self.totals[name] += value

    def pop_step_stats(self, prefix: str = "judge_") -> dict[str, float]:
        """Counters since the last pop (judge_<name>) plus run totals (judge_<name>_total)."""
        out = {f"{prefix}{k}": v for k, v in self._step.items()}
        out.update({f"{prefix}{k}_total": v for k, v in self.totals.items()})
        self._step = dict.fromkeys(STAT_NAMES, 0.0)
        if self._asked >= OUTAGE_MIN_CALLS:  # a step answered from the cache says nothing of it
            down = self._unanswered >= OUTAGE_SHARE * self._asked
            self.down_steps = self.down_steps + 1 if down else 0
        self._asked = self._unanswered = 0
        self._no_reply.clear()
        self._logged.clear()
        return out

    @property
    def unheard(self) -> bool:
        """Whether (nearly, OUTAGE_SHARE) every call sent this step so far got no HTTP reply at all:
        what makes a step down (pop_step_stats), whatever the count."""
        return self._asked > 0 and self._unanswered >= OUTAGE_SHARE * self._asked

    def step_calls(self) -> dict[str, float]:
        """This step's calls so far, those without a reply (failed after their retries, refused)
        and those whose reply held no usable score: what scoring/outage.py judges a step by."""
        step = self._step
        return {"calls": step["calls"], "no_reply": step["failures"] - step["unusable"],
                "unusable": step["unusable"]}

    def _warn_once(self, kind: str, msg: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(f"[minigrpo] warning: {self.masked(msg)}")

    def _key(self) -> str:
        """The key in $api_key_env, without the newline a secret file or `echo` often leaves
        (sent with it, the request never leaves the client)."""
        return (os.environ.get(self.cfg.api_key_env) or "").strip()

    def masked(self, text: str) -> str:
        """text with the key, every header value (and each long word of one) and the user info of
        every URL (http://user:pass@host) replaced by ***: servers echo a rejected key in a 401."""
        secrets = [os.environ.get(self.cfg.api_key_env) or "", self._key()]
        for v in self.headers.values():
            secrets += [v, *(w for w in v.split() if len(w) >= 8)]
        for secret in sorted((s for s in secrets if len(s) >= 8), key=len, reverse=True):
            text = text.replace(secret, "***")  # a shorter one is no real key, and "sk" is in "ask"
        return mask_urls(text)

    def _cache_put(self, key: str, reply: str, usage: dict[str, int]) -> None:
        try:
            self.cache.put(key, reply, usage)
        except OSError as e:  # a full disk: the paid reply is still used (raising would drop it)
            self._warn_once("cachewrite", f"{self.label}: cannot write its cache "
                            f"{self.cfg.cache_path} ({e.strerror or e}): replies are used but not "
                            "cached, so a rerun pays for them again; free space")

    # --- requests ---------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        import openai  # imported on first use: runs without a judge do not need the package
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        cfg = self.cfg
        common = dict(api_key=self._key() or "EMPTY", timeout=cfg.timeout_s,
                      max_retries=0, default_headers=self.headers or None)
        if cfg.azure_endpoint:
            self._client = openai.AsyncAzureOpenAI(azure_endpoint=cfg.azure_endpoint,
                                                   api_version=cfg.api_version, **common)
        else:
            self._client = openai.AsyncOpenAI(base_url=cfg.base_url, **common)
        self._loop, self._sem, self._inflight = loop, asyncio.Semaphore(cfg.max_concurrent), {}

    async def aclose(self) -> None:
        """Close the HTTP client of the current loop (its connections belong to that loop)."""
        if self._client is not None:
            await self._client.close()
        self._client = self._loop = None

    async def _acomplete(self, messages: list[dict], accept: Callable[[str], bool] | None,
                         sample: int = 0) -> str | None:
        self._bind_loop()
        self.add_stat("calls")
        key = self._cache_key(messages, sample)
        reply = self.cache.get(key)
        if reply is not None:
            return self._counted(reply, accept, "cache_hits")
        if self.fatal:  # the endpoint refused the key or the model: send nothing more
            self.add_stat("failures")
            return None
        shared = key in self._inflight
        if not shared:
            self._inflight[key] = task = asyncio.ensure_future(self._request(key, messages))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
        try:
            reply = await asyncio.shield(self._inflight[key])
        finally:
            if not shared:
                self._inflight.pop(key, None)
        self._asked += 1
        if key in self._no_reply:  # an HTTP status (a 400, a flagged input) is a reply: not down
            self._unanswered += 1
            self._last_failed = key, messages
        return self._counted(reply, accept, "cache_hits" if shared else "requests")

    def _counted(self, reply: str | None, accept, answered: str) -> str | None:
        """reply, its call counted in exactly one of `answered` (requests, cache_hits) and failures:
        a call without a reply, or with one `accept` rejects (score_many's parser), gets the
        fallback."""
        usable = reply is not None and (accept is None or accept(reply))
        self.add_stat(answered if usable else "failures")
        if reply is not None and not usable:
            self.add_stat("unusable")
        return reply

    async def _request(self, key: str, messages: list[dict]) -> str | None:
        """One request's reply, retried on what a retry may fix (module docstring); None when it
        got none, was refused or came back unusable."""
        import openai
        cfg = self.cfg
        options = self._request_options()
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                self.add_stat("retries")
            if self.fatal:  # refused while this one waited for its turn
                return None
            try:
                async with self._sem:
                    # the rate slot is taken once a connection is free: taken before, the slots of
                    # those that waited for one would all have passed, and they would start at once
                    await self._rate_slot()
                    if self.fatal:
                        return None
                    self.add_stat("sent")
                    resp = await asyncio.wait_for(self._client.chat.completions.create(
                        model=cfg.model, messages=_sendable(messages), **options), cfg.timeout_s)
            except (asyncio.TimeoutError, openai.APIConnectionError) as e:  # APITimeoutError too
                why, wait = self._no_reply_why(e), None
            except openai.APIStatusError as e:
                if self._refused(e):
                    return None
                why, wait = f"HTTP {e.status_code}", _retry_after(e.response.headers)
            except openai.APIError as e:  # a 200 whose body is not a chat completion
                self._warn_once("badbody", f"{self.label}: unusable response from "
                                f"{self._endpoint}: {type(e).__name__}")
                self._note_failure(f"an unusable response ({type(e).__name__})")
                return None
            except json.JSONDecodeError:  # a 200 whose JSON body is cut: the SDK's json() raised
                why, wait = "a response that is not JSON", None
            else:
                if not isinstance(resp, str):  # str: the text of a non-JSON reply (a proxy's page)
                    return self._take_response(key, resp)
                why, wait = "a response that is not JSON", None
            if attempt < cfg.max_retries:
                if wait is None:  # jitter spreads a burst of 429s: retries do not land in lockstep
                    wait = min(cfg.backoff_s * 2 ** attempt * random.uniform(0.5, 1.0),
                               cfg.backoff_max_s)
                await asyncio.sleep(min(wait, cfg.retry_after_max_s))
        tries = f"{cfg.max_retries + 1} tr{'y' if cfg.max_retries == 0 else 'ies'}"
        self._warn_once(f"gaveup:{why}",
                        f"{self.label}: {self._endpoint} failed {tries}, last {why}")
        self._note_failure(f"{tries}, the last {why}")
        self._no_reply.add(key)
        return None

    def _request_options(self) -> dict:
        """The request's sampling fields besides model and messages: max tokens under its
        token_param, temperature (unless null), extra_body."""
        cfg = self.cfg
        options = {cfg.token_param: cfg.max_tokens}
        if cfg.temperature is not None:
            options["temperature"] = cfg.temperature
        if cfg.extra_body:
            options["extra_body"] = cfg.extra_body
        return options

    def _refused(self, e) -> bool:
        """Whether an HTTP error status is one no retry fixes (all but 408, 429 and 5xx; a 402 or
        429 out of credit): then warned, noted, and made fatal where the key, model, URL, bill or
        request must change (not a 403 for one flagged input)."""
        code, text = getattr(e, "code", None), str(e.message)
        no_credit = ((e.status_code == 429 and code == "insufficient_quota")  # OpenAI's
                     or e.status_code == 402)  # OpenRouter's
        flagged = e.status_code == 403 and ("flagged" in text.lower()  # one request's
                                            or "moderation" in text.lower())
        if (e.status_code in (408, 429) or e.status_code >= 500) and not no_credit:
            return False
        msg = (f"{self.label}: HTTP {e.status_code} from {self._endpoint}, "
               f"not retried: {self.masked(text)[:300]}")
        unsupported = e.status_code == 400 and code in ("unsupported_parameter",
                                                        "unsupported_value")
        if (e.status_code in (401, 403, 404) and not flagged or no_credit
                or unsupported) and self.fatal is None:
            hint = (f"; reasoning models (o-series, GPT-5) take "
                    f"{self.key}.token_param: max_completion_tokens and "
                    f"{self.key}.temperature: null" if unsupported else
                    f" (out of credit at {self._endpoint}: top up the account or use "
                    "another key)" if no_credit else
                    f" (check {self.key}'s base_url, model and the key in "
                    f"${self.cfg.api_key_env})")
            # a key, model, URL, bill or request to fix
            self.fatal = self.masked(" ".join(msg.split()) + hint)
        self._warn_once(f"http{e.status_code}", msg)
        self._note_failure(msg)
        return True

    def _no_reply_why(self, e: BaseException) -> str:
        """A timeout or connection error in words, with the host it was for: "connection refused
        by 127.0.0.1:8012", "no reply within 60 s from ...", else the error and its cause's."""
        url = urlsplit(self._endpoint)
        where = f"{url.hostname}{f':{url.port}' if url.port else ''}"  # no user info
        chain = [e]  # what it was raised from (httpx's error, the socket's)
        while len(chain) < 8 and (cause := chain[-1].__cause__ or chain[-1].__context__):
            chain.append(cause)
        if isinstance(e, asyncio.TimeoutError) or "Timeout" in type(e).__name__:
            return f"no reply within {self.cfg.timeout_s:g} s from {where}"
        if any(isinstance(c, ConnectionRefusedError) for c in chain):
            return f"connection refused by {where}"
        if any(isinstance(c, socket.gaierror) for c in chain):
            return f"host {url.hostname} not found"
        cause = chain[1] if len(chain) > 1 else e
        return f"{type(e).__name__} for {where} ({type(cause).__name__}: {str(cause)[:120]})"

    @property
    def first_failure(self) -> str:
        """Why the first request failed, if it failed before any reply ("" otherwise)."""
        return self._first_failure

    def _note_failure(self, why: str) -> None:
        """A request that got no reply; FAILED_LIMIT before any reply stop the run (_gather)."""
        self.last_failure = why
        if self._failed_before_any >= 0:
            self._failed_before_any += 1
            self._first_failure = self._first_failure or why

    async def _rate_slot(self) -> None:
        rpm = self.cfg.requests_per_minute
        if not rpm:
            return
        now = time.monotonic()
        start = max(now, self._next_slot)  # no await before this update, so no lock is needed
        self._next_slot = start + 60.0 / rpm
        if start > now:
            await asyncio.sleep(start - now)

    def _take_response(self, key: str, resp) -> str | None:
        usage = getattr(resp, "usage", None)
        p, c = (int(getattr(usage, "prompt_tokens", 0) or 0),
                int(getattr(usage, "completion_tokens", 0) or 0))
        cached = int(getattr(getattr(usage, "prompt_tokens_details", None),
                             "cached_tokens", 0) or 0)
        cached_price = (self.cfg.price_prompt_per_m if self.cfg.price_cached_prompt_per_m is None
                        else self.cfg.price_cached_prompt_per_m)
        self.add_stat("prompt_tokens", p)
        self.add_stat("completion_tokens", c)
        self.add_stat("cost_usd", ((p - cached) * self.cfg.price_prompt_per_m
                                   + cached * cached_price
                                   + c * self.cfg.price_completion_per_m) / 1e6)
        if usage is None and (self.cfg.price_prompt_per_m or self.cfg.price_completion_per_m):
            self._warn_once("nousage", f"{self.label}: {self._endpoint} sent no token usage; "
                            "judge_cost_usd leaves those replies out")
        try:
            choice = resp.choices[0]
            reply, finish = choice.message.content, choice.finish_reason
        except (AttributeError, IndexError, TypeError):
            reply, finish = None, None
        if not isinstance(reply, str) or (not reply.strip() and finish == "length"):
            why = (f"its reply was cut at {self.cfg.token_param}={self.cfg.max_tokens} before any "
                   f"answer (a reasoning model's thinking counts): raise {self.key}.max_tokens"
                   if finish == "length" else "it had no text content")
            self._warn_once("nocontent",
                            f"{self.label}: a response from {self._endpoint} was unusable: {why}")
            self._note_failure(why)
            return None
        self._failed_before_any = -1
        if finish == "length":  # some text, cut at max_tokens: eval.py reports it as truncated
            self.cache.cut.add(key)
        # every reply is cached, one the caller cannot use too: at temperature 0 asking again mostly
        # gets it again, so a rerun reproduces its fallback (parsed anew: a fixed parser may read
        # it) for free
        self._cache_put(key, reply, {"prompt_tokens": p, "completion_tokens": c})
        return reply

    async def _gather(self, message_lists: list[list[dict]], accept,
                      samples: list[int] | None = None) -> list[str | None]:
        samples = samples or [0] * len(message_lists)
        accepts = accept if isinstance(accept, list) else [accept] * len(message_lists)
        try:
            replies = await asyncio.gather(*(self._acomplete(m, a, i) for m, a, i in zip(
                message_lists, accepts, samples, strict=True)))
        finally:
            loop = asyncio.get_running_loop()  # on Ctrl-C: this loop's requests still out
            pending = [f for f in self._requests if not f.done() and f.get_loop() is loop]
            for f in pending:
                f.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.aclose()  # its connections belong to this loop, which asyncio.run ends
        if self.fatal:
            raise JudgeUnusable(self.fatal)
        if self._failed_before_any >= FAILED_LIMIT:
            self.fatal = self.masked(
                f"{self.label}: none of its first {self._failed_before_any} requests to "
                f"{self._endpoint} got a reply (the first: {self._first_failure[:300]}); "
                "fix the endpoint or the request settings before paying for more")
            raise JudgeUnusable(self.fatal)  # and sends nothing more (to later models in eval.py)
        return replies

    @property
    def has_answered(self) -> bool:
        """Whether any request has had a reply (before that, FAILED_LIMIT judges the endpoint), in
        this process or, on --resume, in the run's earlier ones (answered_before)."""
        return self._failed_before_any < 0

    def answered_before(self) -> None:
        """The endpoint answered earlier in this run (its checkpoint says so): no reply now is an
        outage to wait for (run.judge_outage), not an endpoint to fix (FAILED_LIMIT)."""
        self._failed_before_any = -1

    def probe(self, timeout_s: float | None = None) -> bool:
        """Whether the endpoint answers now: the last request without a reply, sent once more past
        the cache, with no retries and at most timeout_s (run.judge_outage waits with it). Any
        HTTP reply counts; counted in `sent` only; JudgeUnusable if the endpoint refuses."""
        hello = [{"role": "user", "content": "Reply with one word."}]
        key, messages = self._last_failed or (self._cache_key(hello), hello)
        self._no_reply.discard(key)
        limit = min(self.cfg.timeout_s, timeout_s or self.cfg.timeout_s)
        cfg, self.cfg = self.cfg, dataclasses.replace(self.cfg, max_retries=0, timeout_s=limit)
        try:
            run_sync(self._probe(key, messages))
        finally:
            self.cfg = cfg
        if self.fatal:
            raise JudgeUnusable(self.fatal)
        up = key not in self._no_reply
        self._no_reply.discard(key)
        return up

    async def _probe(self, key: str, messages: list[dict]) -> None:
        self._bind_loop()
        try:
            await self._request(key, messages)
        finally:
            await self.aclose()

    def complete_many(self, message_lists: list[list[dict]], n: int = 1) -> list[str | None]:
        """All completions concurrently in one event loop; same order as the input. n > 1: n sampled
        replies to each request (request-major), each cached under its own sample index, so a rerun
        gets the same n back and pays for none of them (sampling needs temperature > 0 or null)."""
        return run_sync(self._gather([m for m in message_lists for _ in range(n)], None,
                                      [i for _ in message_lists for i in range(n)]))

    def _keys(self, message_lists: list[list[dict]], n: int) -> list[str]:
        """The cache keys of complete_many(message_lists, n)'s requests, in its order."""
        return [self._cache_key(m, i) for m in message_lists for i in range(n)]

    def _cache_key(self, messages: list[dict], sample: int = 0) -> str:
        """What a request's reply is cached under: this client's model and sampling settings, and
        the messages."""
        return cache_key(self.cfg.model, messages, self.cfg.temperature, self.cfg.max_tokens,
                         self.cfg.extra_body, sample)

    def cached(self, message_lists: list[list[dict]], n: int = 1) -> int:
        """How many of complete_many(message_lists, n)'s requests the cache would answer (free)."""
        return sum(k in self.cache for k in self._keys(message_lists, n))

    def was_cut(self, message_lists: list[list[dict]], n: int = 1) -> list[bool]:
        """Whether each of complete_many(message_lists, n)'s replies was cut at max_tokens (now or
        when cached)."""
        return [k in self.cache.cut for k in self._keys(message_lists, n)]

    def score_many(self, message_lists: list[list[dict]], parse: Callable | list[Callable]) -> list:
        """Complete then parse(reply, score_min, score_max) (judge.parse_score: a JudgeScore or
        None; or a list, a parser per request: judge.judge_group's, each reading its group's count
        of scores); a reply it rejects -> None, counted as a failure (cached, as every reply). When
        the judge's first UNPARSED_LIMIT replies all lack a usable score, it raises JudgeUnusable:
        the template or the score range is wrong for this model, and paying for more calls would
        train on fallbacks. Once one reply has scored, an unusable reply is only counted (the
        caller's fallback)."""
        lo, hi = self.cfg.score_min, self.cfg.score_max
        parses = parse if isinstance(parse, list) else [parse] * len(message_lists)
        replies = run_sync(self._gather(message_lists, [
            lambda r, p=p: p(r, lo, hi) is not None for p in parses]))
        scores = [None if r is None else p(r, lo, hi) for r, p in zip(replies, parses)]
        parse = parses[0] if parses else parse  # what the parsers read, for the lines below
        # judge_reward's partial(parse_score, criteria=...)
        criteria = getattr(parse, "keywords", {}).get("criteria")
        want = getattr(parse, "want", None) or (  # a parser may say what it reads (judge.parse_met)
            f"a number in [{lo:g}, {hi:g}]"
            + (f" for each of {', '.join(criteria)} (JSON)" if criteria else ""))
        for r, s in zip(replies, scores):
            if r is not None and s is None:  # counted in failures and unusable by _counted
                self.unusable_reply = r
                self._warn_once("unparsable",
                                f"{self.label}: no usable score in reply {r[:160]!r}: want {want}")
                if self._unparsed_before_any >= 0:
                    self._unparsed_before_any += 1
                    self._first_unparsed = self._first_unparsed or r[:160]
            elif s is not None:
                self._unparsed_before_any = -1
        if self._unparsed_before_any >= UNPARSED_LIMIT:
            raise JudgeUnusable(self.masked(
                f"{self.label}: none of its first {self._unparsed_before_any} replies held a "
                f"usable score (want {want}; the first was {self._first_unparsed!r}); fix its "
                "template (it must ask for that) or score_min / score_max"))
        return scores
