"""The rating page in tests: Starlette's TestClient over graders/rating_server.py's app, and a rater
thread standing in for a person.

    from rating_client import form, page_client, post_form, queue, rater, shown
    queue(folder, "id1", 1, "a prompt", "an answer")                # as the trainer queues it
    client = page_client(folder)             # addressed to 127.0.0.1:8000, as a browser would
    ids, answers, token = shown(client.get("/").text)
    post_form(client, form(ids, [{"clarity": "4"}], token))        # 303: saved, to the next group
    rater(client, lambda answer: {"clarity": "4"}, stop)           # rates until stop is set

It needs the `ratings` extra and httpx2 (the test client's, which openai brings); a test that uses
it starts with needs_page() (conftest.py's `page` fixture does).
"""
from __future__ import annotations

import re
import threading

import pytest

from files import jsonl

BASE = "http://127.0.0.1:8000"


def needs_page() -> None:
    """Skip the test where the `ratings` extra (or httpx2, the test client's) is not installed."""
    for name in ("starlette", "uvicorn", "httpx2"):
        pytest.importorskip(name)


def page_client(folder, **kw):
    """A TestClient on the page serving `folder` (make_app's keywords: host, allow_hosts, ...)."""
    from starlette.testclient import TestClient

    from graders.rating_server import make_app
    return TestClient(make_app(folder, **kw), base_url=BASE)


def queue(folder, id_, batch, prompt, completion, criteria=("relevance", "clarity")):
    """An item in the queue folder, as the human reward writes it (scale 1-5)."""
    jsonl.append(folder / "queue.jsonl", [{"id": id_, "batch": batch, "prompt": prompt,
                                           "completion": completion, "criteria": list(criteria),
                                           "scale": [1, 5], "time": 0}])


def shown(text: str) -> tuple[list[str], list[str], str]:
    """The ids, the (escaped) answers and the form token of the group the page shows."""
    ids = re.search(r'name="ids" value="([\w,.:-]+)"', text)
    token = re.search(r'name="token" value="([\w-]+)"', text)
    return ((ids.group(1).split(",") if ids else []),
            re.findall(r"<h3>Answer \d+</h3><pre>\n?(.*?)</pre>", text, re.S),
            token.group(1) if token else "")


def form(ids: list[str], scores: list[dict], token: str) -> dict:
    return {"token": token, "ids": ",".join(ids),
            **{f"{i}.{c}": v for i, s in zip(ids, scores) for c, v in s.items()}}


def post_form(client, data: dict) -> int:
    """POST the page's form; the status (303 is the redirect to the next group)."""
    return client.post("/rate", data=data, follow_redirects=False).status_code


def rater(client, scores_for, stop: threading.Event) -> threading.Thread:
    """A person at the page: reads the answers shown, rates each by scores_for(answer), repeats."""
    def run():
        while not stop.is_set():
            ids, answers, token = shown(client.get("/").text)
            if not ids:
                stop.wait(0.01)
                continue
            post_form(client, form(ids, [scores_for(a) for a in answers], token))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
