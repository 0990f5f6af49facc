"""Tests for rating_queue.py through the page's app (Starlette's TestClient): the seed's trainer
client submits a question, polls its result while a person rates it on the page, and reads the
seed's fields; duplicates, unknown ids and bad bodies get the seed's answers or a clear refusal."""
import json
import uuid

import pytest

from files import jsonl
from rating_client import form, post_form, shown

SEED = ["relevance", "clarity", "discriminative"]


def submit(client, **body):
    return client.post("/api/queue/submit", json=body)


def test_the_seeds_client_submits_polls_and_gets_the_rating_a_person_gave_on_the_page(page):
    """As the seed's human_feedback.py: submit with a uuid4 request_id, poll result until "rated",
    then read reward, relevance, clarity and discriminative."""
    client, folder = page
    assert client.get("/api/health").status_code == 200  # the client's check_health()
    rid = str(uuid.uuid4())
    r = submit(client, request_id=rid, question="What does a goroutine cost?",
               role_context="Backend engineer, Go", role_id="role-7")
    assert (r.status_code, r.json()) == (200, {"success": True, "id": rid})
    assert client.get(f"/api/queue/result/{rid}").json() == {"status": "pending", "reward": None}
    assert client.get("/api/queue/pending").json() == {"count": 1, "pending": [{
        "request_id": rid, "question": "What does a goroutine cost?",
        "role_context": "Backend engineer, Go", "role_id": "role-7", "status": "pending",
        "criteria": SEED, "scale": [1, 5]}]}
    text = client.get("/").text  # a person sees it on the page: the role as the prompt
    ids, answers, token = shown(text)
    assert ids == [rid] and answers == ["What does a goroutine cost?"] \
        and "Backend engineer, Go" in text and 'name="' + rid + '.discriminative"' in text
    assert post_form(client, form(ids, [{"relevance": "5", "clarity": "4",
                                         "discriminative": "3"}], token)) == 303
    got = client.get(f"/api/queue/result/{rid}").json()
    # the human reward's value: mean of (score - 1) / 4 = (1 + 0.75 + 0.5) / 3
    assert got == {"status": "rated", "reward": pytest.approx(0.75), "relevance": 5.0,
                   "clarity": 4.0, "discriminative": 3.0,
                   "scores": {"relevance": 5.0, "clarity": 4.0, "discriminative": 3.0}}
    assert client.get("/api/queue/pending").json() == {"count": 0, "pending": []}
    assert client.get("/api/health").json() == {"status": "healthy", "service": "minigrpo ratings",
                                                "pending": 0}
    (queued,) = [json.loads(x) for x in (folder / "queue.jsonl").read_text().splitlines()]
    assert (queued["id"], queued["prompt"], queued["role_id"]) == (rid, "Backend engineer, Go",
                                                                   "role-7")
    (rated,) = [json.loads(x) for x in client.get("/export").text.splitlines()]
    assert (rated["id"], rated["completion"], rated["reward"]) == \
        (rid, "What does a goroutine cost?", pytest.approx(0.75))


def test_a_request_id_is_submitted_once_and_an_unknown_one_is_not_found(page):
    client, _ = page
    assert submit(client, request_id="r1", question="q?").json()["success"] is True
    assert submit(client, request_id="r1", question="other?").json() == \
        {"success": False, "message": "Request ID already exists"}
    assert client.get("/api/queue/result/nope").json() == {"status": "not_found", "reward": None}
    # no role_context: the prompt is empty; role_id null
    assert client.get("/api/queue/pending").json()["pending"][0] == {
        "request_id": "r1", "question": "q?", "role_context": "", "role_id": None,
        "status": "pending", "criteria": SEED, "scale": [1, 5]}


def test_the_queue_lists_the_trainers_items_too_oldest_first_and_rates_on_other_criteria(page):
    client, folder = page
    jsonl.append(folder / "queue.jsonl", [{"id": "t1", "batch": 1, "prompt": "p", "completion": "c",
                                           "criteria": ["overall"], "scale": [1, 10], "time": 0}])
    assert submit(client, request_id="s1", question="q?", criteria=["tone"],
                  scale=[0, 2]).json()["success"]
    pending = client.get("/api/queue/pending").json()["pending"]
    assert [(p["request_id"], p["criteria"], p["scale"]) for p in pending] == \
        [("t1", ["overall"], [1, 10]), ("s1", ["tone"], [0, 2])]  # the page shows s1 first
    assert client.post("/api/rate", json={"ratings": [
        {"id": "s1", "scores": {"tone": 1}}, {"id": "t1", "scores": {"overall": 10}}]}).json() == \
        {"saved": 2}
    assert client.get("/api/queue/result/s1").json()["reward"] == 0.5
    assert client.get("/api/queue/result/t1").json() == {
        "status": "rated", "reward": 1.0, "overall": 10.0, "scores": {"overall": 10.0}}


def test_a_bad_submit_is_refused_with_why_and_writes_nothing(page):
    client, folder = page
    for body, why in (({"question": "q?"}, "expected"),
                      ({"request_id": "a,b", "question": "q?"}, "request_id 'a,b'"),
                      ({"request_id": "x" * 129, "question": "q?"}, "1-128"),
                      ({"request_id": 7, "question": "q?"}, "request_id 7"),
                      ({"request_id": "r", "question": ["q?"]}, "question is text"),
                      ({"request_id": "r", "question": "q?", "role_id": 3}, "role_id"),
                      ({"request_id": "r", "question": "q?", "criteria": "tone"}, "criteria"),
                      ({"request_id": "r", "question": "q?", "scale": [5, 1]}, "scale")):
        r = submit(client, **body)
        assert r.status_code == 400 and r.json()["success"] is False \
            and why in r.json()["message"], (body, r.json())
    # what a cross-site form could send
    r = client.post("/api/queue/submit", content=b'{"request_id": "r", "question": "q?"}',
                    headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = client.post("/api/queue/submit", content=b"[" * 100_000,
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert not (folder / "queue.jsonl").exists()
    assert client.post("/api/queue/submit", json={"request_id": "r", "question": "q?"},
                       headers={"Host": "evil.example"}).status_code == 403
    assert client.get("/api/queue/pending").json()["count"] == 0
