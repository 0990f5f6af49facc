"""Tests for ratings.py: the human reward waits for ratings given on the real page (over HTTP, a
rater thread standing in for a person), the page escapes model output and refuses bad or foreign
forms, the files survive a torn line, and unrated items time out to the reward's fallback."""
import http.client
import io
import json
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pyarrow.parquet as pq
import pytest

from config import RewardSpec
from graders import rating_page, ratings
from graders.rating_page import make_server
from graders.ratings import Store, human, item_id
from plumbing import jsonl
from plumbing.scoring import check_specs, compute_rewards
from tools import ratings as ratings_cmd

CRITERIA = ["relevance", "clarity"]


@pytest.fixture
def page(tmp_path):
    """The rating page on a free port, serving tmp_path/ratings."""
    ratings._STORES.clear()  # one Store per folder per process: start each test from the files
    server = make_server(tmp_path / "ratings", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", tmp_path / "ratings"
    server.shutdown()
    server.server_close()
    ratings._STORES.clear()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def post(url: str, form: dict) -> int:
    """POST the form; the status code (303 is the redirect to the next item)."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None
    req = urllib.request.Request(url + "/rate", data=urllib.parse.urlencode(form).encode(),
                                 method="POST")
    try:
        return urllib.request.build_opener(NoRedirect).open(req, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def shown(text: str) -> tuple[list[str], list[str], str]:
    """The ids, the (escaped) answers and the form token of the group the page shows."""
    ids = re.search(r'name="ids" value="([\w,]+)"', text)
    token = re.search(r'name="token" value="([\w-]+)"', text)
    return ((ids.group(1).split(",") if ids else []),
            re.findall(r"<h3>Answer \d+</h3><pre>\n?(.*?)</pre>", text, re.S),
            token.group(1) if token else "")


def form(ids: list[str], scores: list[dict], token: str) -> dict:
    return {"token": token, "ids": ",".join(ids),
            **{f"{i}.{c}": v for i, s in zip(ids, scores) for c, v in s.items()}}


def rater(url: str, scores_for, stop: threading.Event) -> threading.Thread:
    """A person at the page: reads the answers shown, rates each by scores_for(answer), repeats."""
    def run():
        while not stop.is_set():
            try:
                ids, answers, token = shown(get(url + "/"))
            except OSError:  # the page is shutting down at the end of a test
                return
            if not ids:
                stop.wait(0.01)
                continue
            post(url, form(ids, [scores_for(a) for a in answers], token))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def queue(folder, id_, batch, prompt, completion, criteria=CRITERIA):
    jsonl.append(folder / "queue.jsonl", [{"id": id_, "batch": batch, "prompt": prompt,
                                           "completion": completion, "criteria": criteria,
                                           "scale": [1, 5], "time": 0}])


def test_the_reward_waits_for_people_and_rescales_their_scores(page):
    url, folder = page
    stop = threading.Event()
    rater(url, lambda c: {"relevance": str(len(c)), "clarity": "5"}, stop)  # "a" -> 1, "bbb" -> 3
    samples = [{"prompt": "Ask about Kafka"}] * 3
    try:
        # NaN, not a hang
        kw = dict(dir=str(folder), criteria=CRITERIA, scale=[1, 5], poll_s=0.01, timeout_s=30)
        got = human(["a", "bbb", "a"], samples, **kw)
        clarity = human(["a", "bbb", "a"], samples, criterion="clarity", **kw)
    finally:
        stop.set()
    # mean over criteria of (score - 1) / 4: "a" (1, 5) -> 0.5, "bbb" (3, 5) -> 0.75
    assert got == pytest.approx([0.5, 0.75, 0.5])
    assert clarity == pytest.approx([1.0, 1.0, 1.0])
    queued = [json.loads(ln) for ln in (folder / "queue.jsonl").read_text().splitlines()]
    # the repeated completion is one item; the criterion call queued nothing new
    assert len(queued) == 2
    assert len((folder / "ratings.jsonl").read_text().splitlines()) == 2
    stats = json.loads(get(url + "/stats"))
    assert stats == {"queued": 2, "rated": 2, "pending": 0,
                     "mean_scores": {"clarity": 5.0, "relevance": 2.0}}


def test_ratings_answer_later_runs_two_in_the_file_are_averaged_and_a_new_scale_asks_again(
        tmp_path):
    folder = tmp_path / "r"
    ratings._STORES.clear()
    i = item_id("p", "q?", [1, 5])
    queue(folder, i, 1, "p", "q?", ["overall"])
    jsonl.append(folder / "ratings.jsonl",
                 [{"id": i, "scores": {"overall": 2}}, {"id": i, "scores": {"overall": 5}}])
    ratings._STORES.clear()  # a new process: nothing in memory
    # (3.5-1)/4
    assert human(["q?"], [{"prompt": "p"}], dir=str(folder), timeout_s=0.5) == \
        [pytest.approx(0.625)]
    assert len((folder / "queue.jsonl").read_text().splitlines()) == 1
    assert human(["q?"], [{"prompt": "p"}], dir=str(folder), scale=[1, 10], timeout_s=0.05,
                 poll_s=0.01) == \
        [pytest.approx(float("nan"), nan_ok=True)]  # a 1-5 rating does not answer a 1-10 question
    assert len((folder / "queue.jsonl").read_text().splitlines()) == 2



def test_a_chat_message_prompt_is_shown_to_raters_as_text(tmp_path):
    ratings._STORES.clear()
    folder = tmp_path / "r"
    prompt = [{"role": "system", "content": "Be a recruiter."},
              {"role": "user", "content": "A Go question?"}]
    assert math.isnan(human(["q?"], [{"prompt": prompt}], dir=str(folder), timeout_s=0.05,
                            poll_s=0.01)[0])
    (item,) = [json.loads(ln) for ln in (folder / "queue.jsonl").read_text().splitlines()]
    assert item["prompt"] == "system: Be a recruiter.\n\nuser: A Go question?"
    # it used to crash here
    assert "user: A Go question?" in rating_page.render_page(ratings.store_for(folder), "tok")
    jsonl.append(folder / "ratings.jsonl", [{"id": item["id"], "scores": {"overall": 4}}])
    (rated,) = ratings.store_for(folder).refresh() or ratings.store_for(folder).rated_items()
    # exported as the chat prompt it was, for DPO to render as training did
    assert rated["prompt"] == prompt


def test_raters_see_the_forced_prefix_not_a_think_block_the_template_opens(tmp_path):
    """The queue keeps data.assistant_prefix + the completion: its export becomes DPO pairs that the
    same template renders again, so a block the template opens (R1's <think>) must not be in
    them."""
    from plumbing.scoring import reward_context
    ratings._STORES.clear()
    spec = RewardSpec("human", args={"dir": str(tmp_path / "r"), "timeout_s": 0.05, "poll_s": 0.01})
    compute_rewards(["x"], [{"prompt": "p"}], [spec],
                    context=reward_context("<think>\nokay", {}, "okay"))
    (item,) = [json.loads(ln) for ln in (tmp_path / "r" / "queue.jsonl").read_text().splitlines()]
    assert item["completion"] == "okayx"


def test_unrated_completions_time_out_once_to_the_fallback_and_are_counted(tmp_path):
    ratings._STORES.clear()
    args = {"dir": str(tmp_path / "r"), "timeout_s": 0.3, "poll_s": 0.01, "criteria": CRITERIA}
    specs = [RewardSpec("human", fallback=-1.0, args=args),
             RewardSpec("human", weight=0.0, label="clarity",
                        args={**args, "criterion": "clarity"})]
    start = time.monotonic()
    res = compute_rewards(["x", "y"], [{"prompt": "p"}] * 2, specs)
    # the criterion entry waits out the same deadline, not a second one
    assert time.monotonic() - start < 0.55
    assert res.total == [-1.0, -1.0] and res.errors == {"human": 2, "clarity": 2}
    # still there for a person to rate
    assert len((tmp_path / "r/queue.jsonl").read_text().splitlines()) == 2


def test_bad_args_are_refused_before_any_model_loads():
    for args, match in [
            ({}, "needs args.dir"), ({"dir": "r", "criteria": "overall"}, "list of names"),
            ({"dir": "r", "criterion": "tone"}, "one of the criteria"),
            ({"dir": "r", "scale": [5, 1]}, "scale"), ({"dir": "r", "scale": [1, 2, 3]}, "scale"),
            ({"dir": "r", "timeout_s": -1}, "timeout_s")]:
        with pytest.raises(ValueError, match=match):
            check_specs([RewardSpec("human", args=args)])
    check_specs([RewardSpec("human", args={"dir": "r", "criteria": CRITERIA,
                                           "criterion": "clarity"})])


def test_the_page_shows_a_prompts_answers_together_escapes_them_and_refuses_bad_forms(page):
    url, folder = page
    evil = '<script>alert(1)</script>"'
    queue(folder, "old", 1, "p", "older")
    queue(folder, "new", 2, "<b>p</b>", evil)
    queue(folder, "other", 2, "another prompt", "x")
    queue(folder, "new2", 2, "<b>p</b>", "plain")
    text = get(url + "/")
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
        assert post(url, form(ids, scores, token)) == 400
    assert post(url, form(["nope"], [good[0]], token)) == 400
    assert post(url, {"token": token}) == 400
    assert post(url, form(ids, good, "forged")) == 403  # a form posted from another site
    # a refused form writes nothing, not even its good part
    assert not (folder / "ratings.jsonl").exists()
    assert post(url, form(ids, good, token)) == 303
    assert post(url, form(ids + ids, good + good, token)) == 303  # sent again: not counted again
    assert shown(get(url + "/"))[0] == ["other"]
    assert [json.loads(ln)["scores"]
            for ln in (folder / "ratings.jsonl").read_text().splitlines()] == \
        [{"relevance": 4, "clarity": 3}, {"relevance": 2, "clarity": 2}]
    assert get(url + "/export").splitlines()[0] == json.dumps({
        "id": "new", "prompt": "<b>p</b>", "completion": evil, "criteria": CRITERIA,
        "scale": [1, 5], "scores": {"relevance": 4.0, "clarity": 3.0},
        "reward": 0.625})  # ((4-1)/4 + (3-1)/4) / 2


def test_a_rater_whose_group_was_taken_is_told_so_even_when_nothing_is_left_and_not_again(page):
    """Seen in Chromium (review 70): with the queue empty the note was dropped, and the 2 s reload
    kept ?taken= in the address, so the note came back over every later group."""
    url, folder = page
    queue(folder, "a", 1, "p", "\nstarts on a new line")
    queue(folder, "b", 1, "p", "   ")
    ids, answers, token = shown(get(url + "/"))
    # <pre> eats one leading newline: sent two
    assert answers == ["\nstarts on a new line", "<em>(empty answer)</em>"]
    good = [{"relevance": "4", "clarity": "3"}] * 2
    assert post(url, form(ids, good, token)) == 303  # the first tab
    # the second tab, same group: redirected to /?taken=2
    assert post(url, form(ids, good, token)) == 303
    text = get(url + "/?taken=2")
    assert "2 of the answers you rated had been rated by someone else" in text \
        and "Nothing to rate yet" in text
    # read it, then the address loses ?taken=
    assert '<meta http-equiv="refresh" content="15; url=/">' in text
    assert '<meta http-equiv="refresh" content="2; url=/">' in get(url + "/")
    # a phone shows it at its own width
    assert 'name="viewport" content="width=device-width' in text
    with urllib.request.urlopen(url + "/export", timeout=10) as r:
        # a download with a name, not "export"
        assert r.headers["Content-Disposition"] == 'attachment; filename="rated.jsonl"' \
            and len(r.read().splitlines()) == 2
    with pytest.raises(urllib.error.HTTPError, match="400"):  # not JSON Lines in disguise
        urllib.request.urlopen(url + "/export?format=csv", timeout=10)
    with urllib.request.urlopen(url + "/export?format=Parquet", timeout=10) as r:
        # the seed UI's ?format=parquet
        assert r.headers["Content-Disposition"] == 'attachment; filename="rated.parquet"'
        rows = pq.read_table(io.BytesIO(r.read())).to_pylist()
    assert sorted(x["scores"]["relevance"] for x in rows) == [4.0, 4.0] \
        and rows[0]["criteria"] == ["relevance", "clarity"]


def test_a_page_open_across_a_server_restart_still_saves_its_form(tmp_path):
    """The token lives in the folder: a server killed and started again (helper-43's kill tests lost
    every open form to a 403) takes the forms of the pages it showed before."""
    ratings._STORES.clear()
    folder = tmp_path / "ratings"
    queue(folder, "a", 1, "p", "x")
    tokens = []
    for _ in range(2):
        server = make_server(folder, port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}"
        tokens.append(shown(get(url + "/"))[2])
        if len(tokens) == 2:  # the form of the page the first server showed
            assert post(url, form(["a"], [{"relevance": "4", "clarity": "3"}], tokens[0])) == 303
        server.shutdown()
        server.server_close()
    assert tokens[0] == tokens[1] and len(tokens[0]) >= 16
    assert [json.loads(ln)["id"]
            for ln in (folder / "ratings.jsonl").read_text().splitlines()] == ["a"]


def test_the_page_refuses_requests_for_other_hosts_and_bad_bodies(page):
    url, _ = page
    port = int(url.rsplit(":", 1)[1])

    def status(method, host, body=None, headers=(), path=None):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.putrequest(method, path or ("/export" if method == "GET" else "/rate"), skip_host=True)
        c.putheader("Host", host)
        for k, v in headers:
            c.putheader(k, v)
        c.endheaders(body)
        code = c.getresponse().status
        c.close()
        return code
    assert status("GET", f"localhost:{port}") == 200
    # DNS rebinding: another site's name for 127.0.0.1
    assert status("GET", f"evil.example:{port}") == 403
    assert status("POST", f"127.0.0.1:{port}", b"x", [("Content-Length", "-1")]) == 400
    assert status("POST", f"127.0.0.1:{port}", b"\xff\xfe", [("Content-Length", "2")]) == 400
    # not a crash
    assert status("POST", f"127.0.0.1:{port}", b"token=%C3%A9&ids=x",
                  [("Content-Length", "18")]) == 403
    nested = b'{"ratings": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert status("POST", f"127.0.0.1:{port}", nested,
                  [("Content-Length", str(len(nested))), ("Content-Type", "application/json")],
                  "/api/rate") == 400
    with urllib.request.urlopen(url + "/", timeout=10) as r:
        # no framing by other sites, no sniffing
        assert r.headers["X-Frame-Options"] == "DENY" \
            and "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]


def test_an_address_or_an_allowed_name_reaches_the_page_and_a_slow_reader_blocks_no_one(tmp_path):
    """Bound beyond loopback, the page still refuses names it was not given (rebinding works through
    names, not addresses); a client that stops reading holds only its own thread."""
    ratings._STORES.clear()
    server = make_server(tmp_path / "r", host="0.0.0.0", port=0, allow_hosts=("gpu-box",))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    # big enough that /export fills the socket's buffers (about 12 MB)
    jsonl.append(tmp_path / "r" / "queue.jsonl", [
        {"id": f"i{i}", "batch": 1, "prompt": "p" * 2000, "completion": "c" * 2000,
         "criteria": CRITERIA, "scale": [1, 5], "time": 0} for i in range(3000)])
    jsonl.append(tmp_path / "r" / "ratings.jsonl",
                 [{"id": f"i{i}", "scores": {c: 3 for c in CRITERIA}} for i in range(3000)])
    try:
        def code(host):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.putrequest("GET", "/stats", skip_host=True)
            c.putheader("Host", host)
            c.endheaders()
            out = c.getresponse().status
            c.close()
            return out
        assert [code(h) for h in (f"10.1.2.3:{port}", f"[::1]:{port}", f"gpu-box:{port}",
                                  f"evil.example:{port}")] == [200, 200, 200, 403]
        stalled = socket.create_connection(("127.0.0.1", port))
        # and never reads
        stalled.sendall(f"GET /export HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        time.sleep(1)
        t0 = time.monotonic()
        assert code(f"127.0.0.1:{port}") == 200 and time.monotonic() - t0 < 5
        stalled.close()
    finally:
        server.shutdown()
        server.server_close()
        ratings._STORES.clear()


def test_a_second_server_on_one_folder_is_refused(tmp_path, capsys):
    """Two servers would each skip only the items rated through themselves: one item rated twice."""
    import fcntl
    (tmp_path / "r").mkdir()
    with open(tmp_path / "r" / "serve.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "r"), "--port", "0"]) == 2
    assert "another `python -m tools.ratings serve` is using" in capsys.readouterr().err


def test_a_line_torn_by_a_kill_is_skipped_and_the_next_write_starts_a_fresh_line(tmp_path):
    path = tmp_path / "ratings.jsonl"
    path.write_text(json.dumps({"id": "a", "scores": {"overall": 4}}) + '\n{"id": "b", "sco')
    store = Store(tmp_path)
    store.refresh()
    assert store.rated("a", ["overall"]) == {"overall": 4.0}
    jsonl.append(path, [{"id": "c", "scores": {"overall": 2}}])
    store.refresh()
    assert store.rated("c", ["overall"]) == {"overall": 2.0} \
        and store.rated("b", ["overall"]) is None
    # kept as it was, not glued to the next record
    assert path.read_text().splitlines()[1] == '{"id": "b", "sco'


def test_a_ratings_file_replaced_by_a_longer_one_is_read_again_from_the_start(tmp_path):
    path = tmp_path / "ratings.jsonl"
    jsonl.append(path, [{"id": "a", "scores": {"overall": 4}}])
    store = Store(tmp_path)
    store.refresh()
    # e.g. restored from a backup, or edited and saved by a tool: a new file
    other = tmp_path / "new.jsonl"
    jsonl.append(other,
                 [{"id": "b", "scores": {"overall": 1}}, {"id": "c", "scores": {"overall": 5}}])
    other.replace(path)
    store.refresh()
    assert store.rated("a", ["overall"]) is None  # gone with the old file
    assert store.rated("b", ["overall"]) == {"overall": 1.0} \
        and store.rated("c", ["overall"]) == {"overall": 5.0}
    # copied over in place (the inode stays): the first bytes differ
    path.write_bytes(b"".join(json.dumps({"id": i, "scores": {"overall": 3}}).encode() + b"\n"
                              for i in "dbe"))
    store.refresh()
    assert [store.rated(i, ["overall"]) for i in "bcde"] == [{"overall": 3.0}, None,
                                                             {"overall": 3.0}, {"overall": 3.0}]


def test_the_command_line_prints_stats_and_exports_and_refuses_a_missing_folder(tmp_path, capsys):
    ratings._STORES.clear()
    queue(tmp_path, "a", 1, "p", "c", ["overall"])
    jsonl.append(tmp_path / "ratings.jsonl", [{"id": "a", "scores": {"overall": 4}}])
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["rated"] == 1
    assert ratings_cmd.main(["export", "--dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["scores"] == {"overall": 4.0}
    # another criterion: null for "a" in the table
    queue(tmp_path, "b", 1, "p", "d", ["overall", "clarity"])
    jsonl.append(tmp_path / "ratings.jsonl", [{"id": "b", "scores": {"overall": 2, "clarity": 5}}])
    for out in ("rated.parquet", "rated.jsonl"):
        assert ratings_cmd.main(["export", "--dir", str(tmp_path), "--out",
                                 str(tmp_path / "x" / out)]) == 0
    rows = pq.read_table(tmp_path / "x" / "rated.parquet").to_pylist()
    assert [(r["id"], r["scores"], r["reward"]) for r in rows] == \
        [("a", {"overall": 4.0, "clarity": None}, 0.75),
         ("b", {"overall": 2.0, "clarity": 5.0}, 0.625)]
    assert [json.loads(x)["id"]
            for x in (tmp_path / "x" / "rated.jsonl").read_text().splitlines()] == ["a", "b"]
    # bestofn reads it
    assert ratings_cmd.main(["export", "--dir", str(tmp_path), "--out",
                             str(tmp_path / "x" / "R.PQ")]) == 0
    assert pq.read_table(tmp_path / "x" / "R.PQ").num_rows == 2
    # not silently ignored
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path), "--out",
                             str(tmp_path / "s.jsonl")]) == 2
    assert "--out is for export, not stats" in capsys.readouterr().err
    for out, says in (("rated.parquet", "exists and is never overwritten"),
                      ("rated.csv", "give a .jsonl or a .parquet")):
        assert ratings_cmd.main(["export", "--dir", str(tmp_path), "--out",
                                 str(tmp_path / "x" / out)]) == 2
        assert says in capsys.readouterr().err
    jsonl.append(tmp_path / "queue.jsonl", [  # a chat prompt beside text
        {"id": "c", "batch": 1, "prompt": "user: chat", "completion": "e", "criteria": ["overall"],
         "scale": [1, 5], "time": 0, "messages": [{"role": "user", "content": "chat"}]}])
    jsonl.append(tmp_path / "ratings.jsonl", [{"id": "c", "scores": {"overall": 3}}])
    assert ratings_cmd.main(["export", "--dir", str(tmp_path), "--out",
                             str(tmp_path / "y.parquet")]) == 2
    assert "do not fit one Parquet table" in capsys.readouterr().err \
        and not (tmp_path / "y.parquet").exists()
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "run").mkdir()  # empty: `serve` made it, nothing queued yet
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path / "run")]) == 0 \
        and json.loads(capsys.readouterr().out)["queued"] == 0
    rating_page.page_token(tmp_path / "run")  # `serve` also keeps its form token there
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path / "run")]) == 0 \
        and json.loads(capsys.readouterr().out)["queued"] == 0
    # a folder of something else: not "0 rated"
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert ratings_cmd.main(["export", "--dir", str(tmp_path / "run")]) == 2
    assert "holds no queue.jsonl or ratings.jsonl" in capsys.readouterr().err
    # a file, not a folder
    assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "queue.jsonl"), "--port", "0"]) == 2
    assert "cannot use" in capsys.readouterr().err
    for argv, says in ((["--port", "99999"], "is not a port"),
                       (["--host", "no.such.host.invalid"], "check --host")):
        assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "new" / "deeper"), *argv]) == 2
        # nothing left behind
        assert says in capsys.readouterr().err and not (tmp_path / "new").exists()
    ratings._STORES.clear()


def test_bad_lines_written_by_hand_are_skipped_not_fatal(tmp_path, capsys):
    ratings._STORES.clear()
    queue(tmp_path, "a", 1, "p", "c", ["overall"])
    jsonl.append(tmp_path / "queue.jsonl", [
        {"id": "b", "batch": "x", "prompt": "p", "completion": "d", "criteria": ["overall"],
         "scale": [1, 5]},
        # no criteria, and below a scale of one point: neither can be rated
        {"id": "e", "batch": 1, "prompt": "p", "completion": "e", "criteria": [], "scale": [1, 5]},
        {"id": "f", "batch": 1, "prompt": "p", "completion": "f", "criteria": ["overall"],
         "scale": [3, 3]}])
    (tmp_path / "ratings.jsonl").write_text('{"id": "a", "scores": {"overall": 1e400}}\n' + "".join(
        # off the scale: not counted
        json.dumps({"id": "a", "scores": {"overall": v}}) + "\n" for v in (4.6, 9, 0, 4)))
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == {"queued": 1, "rated": 1, "pending": 0,
                                   "mean_scores": {"overall": 4.0}}
    assert out.err.count("skipped an unreadable line") == 3 \
        and out.err.count("skipped a rating of 'a'") == 4
    assert "outside the item's scale [1, 5]" in out.err and "must be whole numbers" in out.err
    assert ratings_cmd.main(["export", "--dir", str(tmp_path)]) == 0 \
        and json.loads(capsys.readouterr().out)["reward"] == 0.75
    ratings._STORES.clear()


def test_a_rating_off_the_scale_never_makes_the_reward_leave_0_1_even_when_read_before_its_item(
        tmp_path):
    ratings._STORES.clear()
    i = item_id("p", "q?", [1, 5])
    # a script on a 1-10 sheet, first
    jsonl.append(tmp_path / "ratings.jsonl", [{"id": i, "scores": {"overall": 9}}])
    jsonl.append(tmp_path / "queue.jsonl", [{"id": i, "batch": 1, "prompt": "p", "completion": "q?",
                                             "criteria": ["overall"], "scale": [1, 5], "time": 0}])
    # not rated
    assert math.isnan(human(["q?"], [{"prompt": "p"}], dir=str(tmp_path), timeout_s=0.05,
                            poll_s=0.01)[0])
    jsonl.append(tmp_path / "ratings.jsonl", [{"id": i, "scores": {"overall": 5}}])
    assert human(["q?"], [{"prompt": "p"}], dir=str(tmp_path), timeout_s=0.05, poll_s=0.01) == [1.0]
    ratings._STORES.clear()
    early = tmp_path / "early"  # the rating read before its item: kept, but never counted
    jsonl.append(early / "ratings.jsonl", [{"id": i, "scores": {"overall": 9}}])
    store = Store(early)
    store.refresh()
    jsonl.append(early / "queue.jsonl", [{"id": i, "batch": 1, "prompt": "p", "completion": "q?",
                                         "criteria": ["overall"], "scale": [1, 5], "time": 0}])
    store.refresh()
    assert store.rated(i, ["overall"]) is None and [it["id"] for it in store.pending()] == [i]


def test_exported_ratings_become_preference_pairs_and_train_with_dpo(tmp_path, tiny_llama, capsys):
    """People's ratings are paid for: ratings.py export gives each rated reply its reward,
    bestofn.py pairs each prompt's best- and worst-rated replies, and train.py's DPO mode trains on
    them."""
    import train
    from tools import bestofn
    ratings._STORES.clear()
    folder = tmp_path / "ratings"
    folder.mkdir()
    for i, (prompt, reply, scores) in enumerate([
            ("Ask about Go.", "<q>What is a goroutine?</q>", (5, 4)),
            ("Ask about Go.", "<q>Hi.</q>", (1, 2)),
            ("Ask about SQL.", "<q>What does an index cost?</q>", (4, 4)),
            ("Ask about SQL.", "<q>Why?</q>", (2, 1)),
            ("Ask about Rust.", "<q>What is borrowing?</q>", (3, 3))]):  # one reply: no pair
        queue(folder, f"i{i}", 1, prompt, reply)
        jsonl.append(folder / "ratings.jsonl",
                     [{"id": f"i{i}", "scores": dict(zip(CRITERIA, scores))}])
    assert ratings_cmd.main(["export", "--dir", str(folder)]) == 0
    rated = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    # ((5-1)/4 + (4-1)/4) / 2
    assert [r["reward"] for r in rated[:2]] == [pytest.approx(0.875), pytest.approx(0.125)]
    (tmp_path / "rated.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rated))
    pairs = tmp_path / "pairs.jsonl"
    assert bestofn.main([str(tmp_path / "rated.jsonl"), "--pairs", str(pairs)]) == 0
    made = [json.loads(x) for x in pairs.read_text().splitlines()]
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in made] == [
        ("Ask about Go.", "<q>What is a goroutine?</q>", "<q>Hi.</q>"),
        ("Ask about SQL.", "<q>What does an index cost?</q>", "<q>Why?</q>")]
    assert "row" not in made[0]
    # or as Parquet
    assert ratings_cmd.main(["export", "--dir", str(folder), "--out",
                             str(tmp_path / "rated.parquet")]) == 0
    assert bestofn.main([str(tmp_path / "rated.parquet"), "--pairs",
                         str(tmp_path / "pq_pairs.jsonl")]) == 0
    assert (tmp_path / "pq_pairs.jsonl").read_text() == pairs.read_text()
    # a reply rated on another scale is never compared with these, nor paired with itself
    queue(folder, "other", 2, "Ask about Go.", "<q>Hi.</q>", ["overall"])
    jsonl.append(folder / "ratings.jsonl", [{"id": "other", "scores": {"overall": 5}}])
    ratings._STORES.clear()
    capsys.readouterr()
    assert ratings_cmd.main(["export", "--dir", str(folder)]) == 0
    (tmp_path / "rated2.jsonl").write_text(capsys.readouterr().out)
    pairs2 = tmp_path / "pairs2.jsonl"
    assert bestofn.main([str(tmp_path / "rated2.jsonl"), "--pairs", str(pairs2)]) == 0
    assert pairs2.read_text() == pairs.read_text()
    old = tmp_path / "old.jsonl"  # an export from before rewards were exported
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "reward"}) + "\n"
                           for r in rated))
    assert bestofn.main([str(old), "--pairs", str(tmp_path / "p3.jsonl")]) == 2
    assert "export them again" in capsys.readouterr().err
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(
        json.dumps({"mode": "dpo", "model": {"name": str(tiny_llama)}, "lora": {"r": 4, "alpha": 8},
                    "data": {"name": str(pairs), "chosen": "chosen", "rejected": "rejected",
                             "answer_key": None}, "dpo": {"batch_size": 2},
                    "run": {"steps": 1, "out_dir": str(tmp_path / "dpo")}}))
    assert train.main(["--config", str(cfg)]) == 0
    ratings._STORES.clear()


def test_a_rating_tool_of_ones_own_reads_the_pending_items_and_rates_them_in_json(page):
    """/api/pending in the page's order; /api/rate saves all or nothing, checked as the form is,
    only as application/json (another site's page cannot send that without asking), not twice."""
    url, folder = page
    queue(folder, "old", 1, "p", "older")
    queue(folder, "a", 2, "q", "first")
    queue(folder, "b", 2, "q", "second")
    pending = json.loads(get(url + "/api/pending"))["pending"]
    assert [it["id"] for it in pending] == ["a", "b", "old"]
    assert pending[0] == {"id": "a", "batch": 2, "prompt": "q", "completion": "first",
                          "criteria": CRITERIA, "scale": [1, 5]}

    def rate(body, ctype="application/json"):
        req = urllib.request.Request(url + "/api/rate", data=body if isinstance(body, bytes)
                                     else json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": ctype})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
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
    assert [it["id"] for it in json.loads(get(url + "/api/pending"))["pending"]] == ["c", "old"]
    assert [json.loads(x)["reward"] for x in get(url + "/export").splitlines()] == [0.875, 0.125]
