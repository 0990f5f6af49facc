"""The seed's queue API on the ratings folder: a trainer of its own submits questions and polls.

The question-generation project's feedback UI (FastAPI) had a queue for online RL: its trainer's
client posted each question, then polled for people's rating. The same routes sit beside the page
(rating_server.py serves them), so that client works against `python -m tools.ratings serve`:

    POST /api/queue/submit            {"request_id": "<uuid4>", "question": "...", "role_context":
                                      "..." or null, "role_id": "..." or null} (application/json)
                                      -> {"success": true, "id": request_id}, or {"success": false,
                                      "message": "Request ID already exists"}; a body that is not
                                      this: 400 {"success": false, "message": why}
    GET  /api/queue/result/{id}       {"status": "pending", "reward": null}, {"status":
                                      "not_found", "reward": null}, or {"status": "rated", "reward":
                                      r, "relevance": 4.0, ..., "scores": {criterion: mean}}
    GET  /api/queue/pending           {"pending": [{"request_id", "question", "role_context",
                                      "role_id", "status": "pending", "criteria", "scale"}, ...],
                                      "count": n}, oldest first, as the seed listed them
    GET  /api/health                  {"status": "healthy", ...}: the client's check_health()

A submitted question is an item of the queue (queue.jsonl) like the trainer's: its id is the
request_id, its prompt the role_context, its completion the question; it is rated on the page (or
through /api/rate) on the seed's three criteria, relevance, clarity and discriminative, 1-5 (the
seed's scale); `criteria` and `scale` in the body choose others. Where the seed divided the sum of
the three by 30, `reward` is the human reward's: mean of (score - lo) / (hi - lo), in [0, 1].
The seed's "expired" never comes: an item waits until it is rated.
"""
from __future__ import annotations

import json
import re
import time

from files import jsonl
from graders.rating_page import NOT_SAVED, Reply, json_reply
from graders.ratings import QUEUE, Store, rescaled, scale_problem

SEED_CRITERIA, SEED_SCALE = ["relevance", "clarity", "discriminative"], [1, 5]
REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # a uuid4 fits; no comma (the form's ids list)


def _submitted(body: str) -> dict | str:
    """The queue record a submit body asks for, or why it is refused."""
    try:
        req = json.loads(body)
        rid, question = req["request_id"], req["question"]
        context, role_id = req.get("role_context"), req.get("role_id")
        criteria, scale = req.get("criteria", SEED_CRITERIA), req.get("scale", SEED_SCALE)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return 'expected {"request_id": ..., "question": ..., "role_context": ..., "role_id": ...}'
    if not (isinstance(rid, str) and REQUEST_ID.fullmatch(rid)):
        return f"request_id {rid!r}: 1-128 letters, digits and _.:- (a uuid4 fits)"
    if not (isinstance(question, str) and all(isinstance(v, (str, type(None)))
                                              for v in (context, role_id))):
        return "question is text; role_context and role_id are text or null"
    if problem := scale_problem(criteria, scale):
        return problem
    return {"id": rid, "batch": time.time_ns(), "prompt": context or "", "completion": question,
            "criteria": list(criteria), "scale": list(scale), "time": time.time(),
            **({"role_id": role_id} if role_id is not None else {})}


def submit(store: Store, body: str) -> Reply:
    """POST /api/queue/submit: the question joins the queue, to be rated on the page."""
    record = _submitted(body)
    if isinstance(record, str):
        return json_reply(400, {"success": False, "message": record})
    if record["id"] in store.items:
        return json_reply(200, {"success": False, "message": "Request ID already exists"})
    try:
        jsonl.append(store.dir / QUEUE, [record])
    except OSError as e:
        return json_reply(507, {"success": False, "message": f"{NOT_SAVED} the ratings folder "
                                f"{store.dir} cannot be written ({e.strerror or e})"})
    store.refresh()  # read back from the file, as every item is
    return json_reply(200, {"success": True, "id": record["id"]})


def result(store: Store, request_id: str) -> Reply:
    """GET /api/queue/result/{id}: pending, not_found, or rated with the reward and mean scores."""
    item = store.items.get(request_id)
    scores = item and store.rated(request_id, item["criteria"])
    if not scores:
        return json_reply(200, {"status": "pending" if item else "not_found", "reward": None})
    return json_reply(200, {**scores, "scores": scores, "status": "rated",
                            "reward": rescaled(scores, item["criteria"], item["scale"])})


def health(store: Store) -> Reply:
    """GET /api/health: the seed client's check_health() wants a 200; the count is for people."""
    return json_reply(200, {"status": "healthy", "service": "minigrpo ratings",
                            "pending": len(store.pending())})


def pending(store: Store) -> Reply:
    """GET /api/queue/pending: every item waiting, the trainer's too, oldest first."""
    rows = [{"request_id": it["id"], "question": it["completion"], "role_context": it["prompt"],
             "role_id": it.get("role_id"), "status": "pending", "criteria": it["criteria"],
             "scale": it["scale"]} for it in store.pending(newest_first=False)]
    return json_reply(200, {"pending": rows, "count": len(rows)})
