"""A tiny OpenAI-compatible chat server for tests: stdlib only, runs in a background thread.
Also a stand-in judge for trying a judge recipe offline:

    python tests/fake_openai_server.py --port 8001
    # then --judge.base_url=http://127.0.0.1:8001/v1
    # (and precompute.answers.base_url: it answers questions too)

It serves `POST /v1/chat/completions` and the Azure form
`POST /openai/deployments/{deployment}/chat/completions?api-version=...`, records every request,
and misbehaves on demand so retry, timeout, cache and parsing code can be tested without a network.

    from fake_openai_server import FakeOpenAIServer, ok, rate_limited, server_error, stall

    with FakeOpenAIServer(reply=lambda body: '{"score": 7}') as server:
        # the next two requests fail, then `server.default` answers (dropped(): none is answered)
        server.script(rate_limited(retry_after="0.2"), server_error(500))
        ...
        JudgeConfig(base_url=server.url, ...)          # "http://127.0.0.1:PORT/v1"
        server.requests[-1].headers["authorization"]   # "Bearer sk-..."
        server.max_in_flight                           # most requests seen at once

How a request is answered: the next `Behaviour` from the `script(...)` queue, or `server.default`
when the queue is empty. A 200 answers with `behaviour.text`, or `server.reply(body)` when text is
None; `reply` gets the parsed JSON request body. Usage is counted in whitespace-separated words
(prompt = all message contents, completion = the reply) so tests can recompute it, and is recorded
with each request. A 401 echoes the presented key in its error message, as real servers do, so
tests can check the client redacts it.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit


@dataclass
class Behaviour:
    """How to answer one request."""

    status: int = 200  # HTTP status; non-200 sends an OpenAI-style error body
    text: str | None = None  # reply content for a 200; None = ask server.reply(body)
    retry_after: str | None = None  # value of the Retry-After header, if any
    delay_s: float = 0.0  # wait this long before answering (past the client timeout: a stall)
    code: str | None = None  # the error's "code" (OpenAI's 429 "insufficient_quota": out of credit)
    message: str | None = None  # the error body's message (None: "fake error <status>")
    headers: dict[str, str] = field(default_factory=dict)  # more headers (retry-after-ms, ...)
    raw: str | None = None  # a 200 whose body is this text as it is (a proxy's page, a cut body)
    finish_reason: str = "stop"  # "length": cut at max_tokens
    null_content: bool = False  # content null (vLLM reasoning parser when thinking used max_tokens)
    usage: dict | None = None  # the usage sent (None: counted in words; {}: none sent)
    drop: bool = False  # no answer at all: the connection closed unanswered (a killed server)


def length_score(body: dict, top: int = 10) -> str:
    """A reply for `reply=`: a 0-top score that varies with the last message's length, so different
    completions get different scores (the benchmarks' fake judge)."""
    return '{"score": %d}' % (len(body["messages"][-1]["content"]) % (top + 1))


def group_scores(body: dict, top: int = 10) -> str:
    """A reply for `reply=` to a group judge's prompt (judge.group_judge): {"scores": [...]}, a
    0-top score for each of its [Answer k]-labelled answers that varies with the answer's length
    (the last one's runs to the end of the prompt)."""
    parts = re.split(r"^\[Answer \d+\]$", body["messages"][-1]["content"], flags=re.M)[1:]
    return json.dumps({"scores": [len(p.strip()) % (top + 1) for p in parts]})


def shaped_score(body: dict, top: int = 10) -> str:
    """A reply in the shape the prompt asks for: each key of its `{"key": <number>, ...}` (a
    template's criteria) gets a 0-top score that varies with the message's length, else "score";
    a group judge's `{"scores": [<number>, ...]}`, one per labelled answer (group_scores)."""
    text = body["messages"][-1]["content"]
    if '{"scores": [<number>' in text:
        return group_scores(body, top)
    keys = re.findall(r'"(\w+)": <number>', text) or ["score"]
    # met: 0 or 1
    return json.dumps({k: (len(text) + i) % (2 if k == "met" else top + 1)
                       for i, k in enumerate(keys)})


class Answers:
    """Replies for an answer policy (precompute.py, API models in eval.py): the k-th request with
    the same messages gets the k-th of answers that differ in length and in the letter they pick, so
    the K samples of one question differ (and a length-based judge grades them differently)."""

    def __init__(self):
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()  # requests arrive on several handler threads

    def __call__(self, body: dict) -> str:
        key = json.dumps(body["messages"], sort_keys=True)
        with self.lock:
            self.seen[key] = k = self.seen.get(key, 0) + 1
        return "Let me think this through. " * (k % 4) \
            + f"Answer {k}: the answer is {'ABCD'[k % 4]}."


def judge_or_answer(top: int = 10) -> Callable[[dict], str]:
    """The command line's default: a judge's scores (shaped_score) for a prompt that asks for a
    score, else an answer (Answers): one server plays both the judge and the answer policy."""
    answers = Answers()

    def reply(body: dict) -> str:
        # a judge template asks to "Score ... from a to b" or for "<number>"s
        text = body["messages"][-1]["content"]
        asks_score = "<number>" in text or re.search(r"\bscore\b.{0,60}?\b(from|between|out of)\b",
                                                     text, re.I | re.S)
        return shaped_score(body, top) if asks_score else answers(body)
    return reply


def ok(text: str | None = None, delay_s: float = 0.0) -> Behaviour:
    """A normal 200 answer (fixed text, or server.reply(body) when text is None)."""
    return Behaviour(text=text, delay_s=delay_s)


def rate_limited(retry_after: str | None = "1") -> Behaviour:
    """429 Too Many Requests, with a Retry-After header unless retry_after is None."""
    return Behaviour(status=429, retry_after=retry_after)


def server_error(status: int = 500) -> Behaviour:
    """A 5xx (or any other) error status."""
    return Behaviour(status=status)


def stall(seconds: float = 30.0) -> Behaviour:
    """Answer only after `seconds` (cut short if the server closes), to trigger client timeouts."""
    return Behaviour(delay_s=seconds)


def dropped() -> Behaviour:
    """No answer: the connection is closed unanswered, as by a server killed mid-request (the
    client sees an APIConnectionError). As server.default: killed for every later request."""
    return Behaviour(drop=True)


def malformed() -> Behaviour:
    """A 200 whose content holds no score at all."""
    return ok("I am not sure how to grade this.")


def out_of_range(score: float = 42.0) -> Behaviour:
    """A 200 whose JSON score is outside any sane 0-10 range."""
    return ok(json.dumps({"score": score}))


@dataclass
class Recorded:
    """One request as the server saw it."""

    path: str  # URL path without the query string
    query: str  # raw query string ("api-version=..." on Azure)
    headers: dict[str, str]  # header names lower-cased
    body: dict  # parsed JSON request body
    status: int = 0  # status answered (0 until answered)
    usage: dict[str, int] = field(default_factory=dict)  # usage sent back with a 200

    @property
    def messages(self) -> list[dict]:
        return self.body.get("messages", [])

    @property
    def prompt_text(self) -> str:
        """All message contents joined, handy for routing replies by markers."""
        return "\n".join(str(m.get("content", "")) for m in self.messages)


def _words(text: str) -> int:
    return len(text.split())


class FakeOpenAIServer:
    """OpenAI-compatible chat server on 127.0.0.1 at a free port; see the module docstring."""

    def __init__(self, reply: Callable[[dict], str] | None = None, default: Behaviour | None = None,
                 port: int = 0):
        self.port = port  # 0: a free one
        self.reply = reply or (lambda body: '{"score": 5}')  # content for 200s without fixed text
        self.default = default or ok()  # behaviour once the script queue is empty
        self.requests: list[Recorded] = []  # every request, in arrival order
        self.max_in_flight = 0  # most requests being handled at the same moment
        self._in_flight = 0
        self._queue: deque[Behaviour] = deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "FakeOpenAIServer":
        self._httpd = _HTTPServer(("127.0.0.1", self.port), _make_handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()  # wakes stalled handlers
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- test-facing API -------------------------------------------------------------------
    @property
    def root(self) -> str:
        """http://127.0.0.1:PORT, e.g. for azure_endpoint."""
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def url(self) -> str:
        """OpenAI-style base_url: http://127.0.0.1:PORT/v1."""
        return self.root + "/v1"

    def script(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next requests, in order (shared by concurrent requests)."""
        with self._lock:
            self._queue.extend(behaviours)

    def reset(self) -> None:
        """Forget recorded requests, the in-flight maximum and any queued behaviours."""
        with self._lock:
            self.requests.clear()
            self._queue.clear()
            self.max_in_flight = 0

    # --- internals ---------------------------------------------------------------------------
    def _next(self) -> Behaviour:
        with self._lock:
            return self._queue.popleft() if self._queue else self.default

    def _enter(self, rec: Recorded) -> None:
        with self._lock:
            self.requests.append(rec)
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stalled handler must not keep the test process alive
    # the default listen backlog of 5 drops bursts of connects (1 s SYN retry)
    request_queue_size = 256


def _make_handler(server: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like real servers; needs Content-Length

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_POST(self) -> None:
            parts = urlsplit(self.path)
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not parts.path.endswith("/chat/completions"):
                return self._send(404, {"error": {"message": f"no route {parts.path}",
                                                  "type": "not_found"}})
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                return self._send(400, {"error": {"message": "body is not JSON",
                                                  "type": "invalid_request_error"}})
            headers = {k.lower(): v for k, v in self.headers.items()}
            rec = Recorded(path=parts.path, query=parts.query, headers=headers, body=body)
            server._enter(rec)
            try:
                self._answer(rec, server._next())
            finally:
                server._leave()

        def _answer(self, rec: Recorded, b: Behaviour) -> None:
            if b.delay_s > 0 and server._closing.wait(b.delay_s):
                return  # server closing: drop the request
            if b.drop:
                self.close_connection = True
                return
            rec.status = b.status
            if b.status != 200:
                message = b.message or f"fake error {b.status}"
                if b.status == 401:
                    # real servers echo (part of) the key; the client must redact it
                    key = rec.headers.get("authorization", rec.headers.get("api-key", ""))
                    message = f"Incorrect API key provided: {key.removeprefix('Bearer ')}"
                extra = {"Retry-After": b.retry_after} if b.retry_after is not None else {}
                return self._send(b.status, {"error": {"message": message, "type": "fake",
                                                       "code": b.code}}, extra | b.headers)
            if b.raw is not None:
                return self._send(200, b.raw, b.headers)
            text = b.text if b.text is not None else server.reply(rec.body)
            rec.usage = {"prompt_tokens": _words(rec.prompt_text),
                         "completion_tokens": _words(text)} if b.usage is None else b.usage
            if b.usage is None:
                rec.usage["total_tokens"] = rec.usage["prompt_tokens"] \
                    + rec.usage["completion_tokens"]
            self._send(200, {
                "id": f"chatcmpl-fake-{len(server.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": rec.body.get("model", ""),
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": None if b.null_content else text},
                             "finish_reason": b.finish_reason}],
                **({"usage": rec.usage} if rec.usage else {}),
            }, b.headers)

        def _send(self, status: int, payload: dict | str,
                  headers: dict[str, str] | None = None) -> None:
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            try:
                self.send_response(status)
                headers = dict(headers or {})
                self.send_header("Content-Type", headers.pop("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout) before we answered

    return Handler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A fake OpenAI-compatible judge on 127.0.0.1, to try "
                                             "judge recipes offline.")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--top", type=int, default=10,
                    help="scores run 0..top (the judge section's score_max)")
    ap.add_argument("--reply", help='the reply to every request instead, e.g. \'{"score": 7}\' '
                    "(default: to a prompt asking for a score, 0..top scores for the keys it asks "
                    "for, varying with its length; to any other, an answer that differs each time "
                    "the same prompt is asked: an answer policy)")
    args = ap.parse_args(argv)
    reply = (lambda body: args.reply) if args.reply else judge_or_answer(args.top)
    try:
        server = FakeOpenAIServer(reply=reply, port=args.port).start()
    except OSError as e:
        # run with `&`, a traceback would scroll by and the recipe talk to whatever holds the port
        raise SystemExit(f"error: cannot listen on 127.0.0.1:{args.port} ({e.strerror}): another "
                         "fake server? pick another --port") from None
    print(f"fake judge at {server.url}; Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
