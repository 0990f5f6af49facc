"""Tests for rating_page.py through its server's app (Starlette's TestClient): the page shows a
prompt's answers together and escapes them, refuses bad or foreign forms, tells a rater whose group
was taken, keeps its token across a restart, answers only its own host names with its security
headers on every reply, and its JSON API saves all or nothing."""
import io
import json

import pyarrow.parquet as pq

from files import jsonl
from graders import ratings
from rating_client import form, needs_page, page_client, post_form, queue, shown

CRITERIA = ["relevance", "clarity"]
HEADERS = {"x-frame-options": "DENY", "x-content-type-options": "nosniff",
           "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                      "form-action 'self'; frame-ancestors 'none'"}


def test_the_page_shows_a_prompts_answers_together_escapes_them_and_refuses_bad_forms(page):
    client, folder = page
    evil = '<script>alert(1)</script>"'
    queue(folder, "old", 1, "p", "older")
    queue(folder, "new", 2, "<b>p</b>", evil)
    queue(folder, "other", 2, "another prompt", "x")
    queue(folder, "new2", 2, "<b>p</b>", "plain")
    text = client.get("/").text
    ids, answers, token = shown(text)
    # the newest batch first (the trainer waits for it), one prompt's answers together
    assert ids == ["new", "new2"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in text and "<script>" not in text \
        and "<b>p" not in text
    good = [{"relevance": "4", "clarity": "3"}, {"relevance": "2", "clarity": "2"}]
    for scores in ([good[0], {"relevance": "6", "clarity": "3"}],  # out of the scale
                   [good[0], {"relevance": "4"}],  # a criterion missing
                   [good[0], {"relevance": "²", "clarity": "3"}],  # a digit that int() refuses
                   [good[0], {"relevance": "--3", "clarity": "3"}]):
        assert post_form(client, form(ids, scores, token)) == 400
    assert post_form(client, form(["nope"], [good[0]], token)) == 400
    assert post_form(client, {"token": token}) == 400
    assert post_form(client, form(ids, good, "forged")) == 403  # a form posted from another site
    # a refused form writes nothing, not even its good part
    assert not (folder / "ratings.jsonl").exists()
    assert post_form(client, form(ids, good, token)) == 303
    # sent again: not counted again
    assert post_form(client, form(ids + ids, good + good, token)) == 303
    assert shown(client.get("/").text)[0] == ["other"]
    assert [json.loads(ln)["scores"]
            for ln in (folder / "ratings.jsonl").read_text().splitlines()] == \
        [{"relevance": 4, "clarity": 3}, {"relevance": 2, "clarity": 2}]
    assert client.get("/export").text.splitlines()[0] == json.dumps({
        "id": "new", "prompt": "<b>p</b>", "completion": evil, "criteria": CRITERIA,
        "scale": [1, 5], "scores": {"relevance": 4.0, "clarity": 3.0},
        "reward": 0.625})  # ((4-1)/4 + (3-1)/4) / 2


def test_a_rater_whose_group_was_taken_is_told_so_even_when_nothing_is_left_and_not_again(page):
    """Seen in Chromium (review 70): with the queue empty the note was dropped, and the 2 s reload
    kept ?taken= in the address, so the note came back over every later group."""
    client, folder = page
    queue(folder, "a", 1, "p", "\nstarts on a new line")
    queue(folder, "b", 1, "p", "   ")
    ids, answers, token = shown(client.get("/").text)
    # <pre> eats one leading newline: sent two
    assert answers == ["\nstarts on a new line", "<em>(empty answer)</em>"]
    good = [{"relevance": "4", "clarity": "3"}] * 2
    first = client.post("/rate", data=form(ids, good, token), follow_redirects=False)
    assert (first.status_code, first.headers["location"]) == (303, "/")  # the first tab
    # the second tab, same group: redirected to /?taken=2
    second = client.post("/rate", data=form(ids, good, token), follow_redirects=False)
    assert (second.status_code, second.headers["location"]) == (303, "/?taken=2")
    text = client.get("/?taken=2").text
    assert "2 of the answers you rated had been rated by someone else" in text \
        and "Nothing to rate yet" in text
    # read it, then the address loses ?taken=
    assert '<meta http-equiv="refresh" content="15; url=/">' in text
    assert '<meta http-equiv="refresh" content="2; url=/">' in client.get("/").text
    # a phone shows it at its own width
    assert 'name="viewport" content="width=device-width' in text
    r = client.get("/export")  # a download with a name, not "export"
    assert r.headers["content-disposition"] == 'attachment; filename="rated.jsonl"' \
        and len(r.text.splitlines()) == 2
    assert client.get("/export?format=csv").status_code == 400  # not JSON Lines in disguise
    r = client.get("/export?format=Parquet")  # the seed UI's ?format=parquet
    assert r.headers["content-disposition"] == 'attachment; filename="rated.parquet"'
    rows = pq.read_table(io.BytesIO(r.content)).to_pylist()
    assert sorted(x["scores"]["relevance"] for x in rows) == [4.0, 4.0] \
        and rows[0]["criteria"] == ["relevance", "clarity"]


def test_the_seed_uis_api_export_gives_json_or_parquet(page):
    """The seed exported "via /api/export?format=json or ?format=parquet": a JSON list by default,
    Parquet through pyarrow, JSON Lines on request; /export?format=json is a JSON list too."""
    client, folder = page
    for id_, answer in (("a", "first"), ("b", "second")):
        queue(folder, id_, 1, "p", answer)
    ids, _, token = shown(client.get("/").text)
    assert post_form(client, form(ids, [{"relevance": "4", "clarity": "2"}] * 2, token)) == 303
    for url in ("/api/export", "/api/export?format=json", "/export?format=json"):
        r = client.get(url)
        assert r.headers["content-type"] == "application/json" \
            and r.headers["content-disposition"] == 'attachment; filename="rated.json"'
        rows = r.json()
        assert isinstance(rows, list) and sorted(x["completion"] for x in rows) == \
            ["first", "second"] and rows[0]["scores"] == {"relevance": 4.0, "clarity": 2.0}
    r = client.get("/api/export?format=parquet")
    assert pq.read_table(io.BytesIO(r.content)).to_pylist() == client.get("/api/export").json()
    lines = client.get("/api/export?format=jsonl").text.splitlines()
    assert [json.loads(x) for x in lines] == client.get("/api/export").json()
    r = client.get("/api/export?format=csv")
    assert r.status_code == 400 and r.text == "format=csv: one of jsonl, json, parquet"


def test_a_page_open_across_a_server_restart_still_saves_its_form(tmp_path):
    """The token lives in the folder: a server killed and started again (helper-43's kill tests lost
    every open form to a 403) takes the forms of the pages it showed before."""
    needs_page()
    ratings._STORES.clear()
    folder = tmp_path / "ratings"
    queue(folder, "a", 1, "p", "x")
    tokens = [shown(page_client(folder).get("/").text)[2] for _ in range(2)]
    # the form of the page the first server showed
    assert post_form(page_client(folder), form(["a"], [{"relevance": "4", "clarity": "3"}],
                                               tokens[0])) == 303
    assert tokens[0] == tokens[1] and len(tokens[0]) >= 16
    assert (folder / "page_token").stat().st_mode & 0o777 == 0o600  # the owner's alone
    assert [json.loads(ln)["id"]
            for ln in (folder / "ratings.jsonl").read_text().splitlines()] == ["a"]
    ratings._STORES.clear()


def test_the_page_refuses_other_hosts_and_bad_bodies_and_every_reply_has_its_headers(page):
    client, folder = page

    def status(method, path, host="127.0.0.1:8000", **kw):
        r = client.request(method, path, headers={"Host": host, **kw.pop("headers", {})}, **kw)
        assert {k: r.headers.get(k) for k in HEADERS} == HEADERS, (path, r.status_code)
        return r.status_code
    assert status("GET", "/export", "localhost:8000") == 200
    # DNS rebinding: another site's name for 127.0.0.1; no Host at all
    assert status("GET", "/export", "evil.example:8000") == 403
    assert status("POST", "/rate", "evil.example:8000", content=b"x") == 403
    assert status("GET", "/export", "") == 403
    assert status("GET", "/nowhere") == 404 and status("GET", "/rate") == 405
    for headers in ({"Content-Length": "-1"}, {"Content-Length": str(2 << 20)}):
        assert status("POST", "/rate", content=b"x", headers=headers) == 400
    assert status("POST", "/rate", content=iter([b"x"])) == 400  # chunked: no Content-Length
    assert status("POST", "/rate", content=b"\xff\xfe") == 400  # not UTF-8
    # a token that is not ASCII: a 403, not a crash
    assert status("POST", "/rate", content=b"token=%C3%A9&ids=x",
                  headers={"Content-Type": "application/x-www-form-urlencoded"}) == 403
    nested = b'{"ratings": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert status("POST", "/api/rate", content=nested,
                  headers={"Content-Type": "application/json"}) == 400
    # Starlette's test client names its server "testserver": not a name the page was given
    from starlette.testclient import TestClient
    assert TestClient(client.app).get("/").status_code == 403
    assert not (folder / "ratings.jsonl").exists()


def test_an_address_or_an_allowed_name_reaches_the_page_bound_beyond_loopback(tmp_path):
    """Bound beyond loopback, the page still refuses names it was not given (rebinding works through
    names, not addresses)."""
    needs_page()
    client = page_client(tmp_path / "r", host="0.0.0.0", allow_hosts=("gpu-box",))
    assert [client.get("/stats", headers={"Host": h}).status_code
            for h in ("10.1.2.3:8000", "[::1]:8000", "gpu-box:8000", "GPU-BOX", "0.0.0.0:8000",
                      "evil.example:8000", "gpu-box.evil.example")] == \
        [200, 200, 200, 200, 200, 403, 403]
    ratings._STORES.clear()


def test_a_lone_surrogate_in_model_output_is_shown_not_a_crash(page):
    client, folder = page
    (folder / "queue.jsonl").parent.mkdir(parents=True, exist_ok=True)
    with open(folder / "queue.jsonl", "a") as f:  # as json.dumps writes a lone surrogate
        f.write(json.dumps({"id": "s", "batch": 1, "prompt": "p", "completion": "a\ud800b",
                            "criteria": CRITERIA, "scale": [1, 5], "time": 0}) + "\n")
    r = client.get("/")
    assert r.status_code == 200 and "a?b" in r.text
    assert client.get("/api/pending").json()["pending"][0]["completion"] == "a\ud800b"


def test_a_rating_tool_of_ones_own_reads_the_pending_items_and_rates_them_in_json(page):
    """/api/pending in the page's order; /api/rate saves all or nothing, checked as the form is,
    only as application/json (another site's page cannot send that without asking), not twice."""
    client, folder = page
    queue(folder, "old", 1, "p", "older")
    queue(folder, "a", 2, "q", "first")
    queue(folder, "b", 2, "q", "second")
    pending = client.get("/api/pending").json()["pending"]
    assert [it["id"] for it in pending] == ["a", "b", "old"]
    assert pending[0] == {"id": "a", "batch": 2, "prompt": "q", "completion": "first",
                          "criteria": CRITERIA, "scale": [1, 5]}

    def rate(body, ctype="application/json"):
        r = client.post("/api/rate", content=body if isinstance(body, bytes)
                        else json.dumps(body).encode(), headers={"Content-Type": ctype})
        return r.status_code, r.json()
    good = {"ratings": [{"id": "a", "scores": {"relevance": 5, "clarity": 4}},
                        {"id": "b", "scores": {"relevance": 1, "clarity": 2}}]}
    assert rate(good, "text/plain")[0] == 415  # what a cross-site form could send
    for bad in ({"ratings": [good["ratings"][0],  # not a whole number
                             {"id": "b", "scores": {"relevance": 4.0, "clarity": 2}}]},
                {"ratings": [good["ratings"][0],
                             {"id": "b", "scores": {"relevance": "4", "clarity": 2}}]},
                {"ratings": [good["ratings"][0],
                             {"id": "b", "scores": {"relevance": 9, "clarity": 2}}]},
                {"ratings": [good["ratings"][0], {"id": "b", "scores": {"relevance": 4}}]},
                {"ratings": [{"id": "nope", "scores": {"relevance": 4, "clarity": 4}}]}):
        code, reply = rate(bad)
        assert code == 400 and reply["error"], bad
    assert rate(b"not json")[0] == 400 and rate({"ratings": [{"id": 3}]})[0] == 400
    assert not (folder / "ratings.jsonl").exists()  # nothing of a refused request is written
    for bad, why in (({"ratings": [good["ratings"][0], {**good["ratings"][0],
                                                        "scores": {"relevance": 1, "clarity": 1}}]},
                      "rated twice in this request"),
                     ({"ratings": [{"id": "a", "scores": {"relevance": 5, "clarity": 4,
                                                          "clarty": 3}}]}, "not 'clarty'")):
        code, reply = rate(bad)
        assert code == 400 and why in reply["error"], reply
    assert not (folder / "ratings.jsonl").exists()
    real_append = jsonl.append

    def trainer_queues_meanwhile(path, records):
        # the trainer appends to the queue while the rating is written
        out = real_append(path, records)
        if path.name == "ratings.jsonl":
            queue(folder, "c", 3, "r", "third")
        return out
    ratings.jsonl.append = trainer_queues_meanwhile
    try:
        assert rate(good) == (200, {"saved": 2})
    finally:
        ratings.jsonl.append = real_append
    assert rate(good) == (200, {"saved": 0})  # sent again: not counted again
    assert [it["id"] for it in client.get("/api/pending").json()["pending"]] == ["c", "old"]
    assert [json.loads(x)["reward"] for x in client.get("/export").text.splitlines()] == \
        [0.875, 0.125]


def test_a_full_disk_is_told_to_the_rater_not_a_dropped_connection(page, monkeypatch):
    client, folder = page
    queue(folder, "a", 1, "p", "x")
    ids, _, token = shown(client.get("/").text)

    def full(path, records):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ratings.jsonl, "append", full)
    r = client.post("/rate", data=form(ids, [{"relevance": "4", "clarity": "3"}], token))
    assert r.status_code == 507 and "cannot be written (No space left on device)" in r.text
    r = client.post("/api/rate", json={"ratings": [{"id": "a", "scores": {"relevance": 4,
                                                                          "clarity": 3}}]})
    assert r.status_code == 507 and "nothing saved" in r.json()["error"]


def test_a_post_is_logged_in_one_line_with_control_characters_escaped_and_no_token(page, capsys):
    client, folder = page
    queue(folder, "a", 1, "p", "x")
    token = shown(client.get("/").text)[2]
    client.get("/stats")  # a page view: no line
    post_form(client, form(["a"], [{"relevance": "4", "clarity": "3"}], token))
    client.post("/%1b[31mred", content=b"x")  # a terminal escape in the path: shown, not run
    lines = [ln.split("] ", 1)[1] for ln in capsys.readouterr().err.splitlines()]
    assert lines == ["testclient POST /rate 303", "testclient POST /\\x1b[31mred 404"]
    assert token not in capsys.readouterr().err
