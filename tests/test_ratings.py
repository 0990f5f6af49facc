"""Tests for ratings.py: the human reward waits for ratings given on the real page (over HTTP, a
rater thread standing in for a person), the page escapes model output and refuses bad forms,
the files survive a torn line, and unrated items time out to the reward's fallback."""
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

import ratings
from ratings import Store, append_line, human, item_id, make_server
from rewards import RewardSpec, compute_rewards

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
    req = urllib.request.Request(url + "/rate", data=urllib.parse.urlencode(form).encode(), method="POST")
    try:
        return urllib.request.build_opener(NoRedirect).open(req, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def shown(text: str) -> tuple[list[str], list[str]]:
    """The ids and the (escaped) answers of the group the page shows."""
    m = re.search(r'name="ids" value="([\w,]+)"', text)
    return (m.group(1).split(",") if m else []), re.findall(r"<h3>Answer \d+</h3><pre>(.*?)</pre>", text, re.S)


def form(ids: list[str], scores: list[dict]) -> dict:
    return {"ids": ",".join(ids), **{f"{i}.{c}": v for i, s in zip(ids, scores) for c, v in s.items()}}


def rater(url: str, scores_for, stop: threading.Event) -> threading.Thread:
    """A person at the page: reads the answers shown, rates each with scores_for(answer), repeats."""
    def run():
        while not stop.is_set():
            try:
                ids, answers = shown(get(url + "/"))
            except OSError:  # the page is shutting down at the end of a test
                return
            if not ids:
                stop.wait(0.01)
                continue
            post(url, form(ids, [scores_for(a) for a in answers]))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_reward_waits_for_people_and_rescales_their_scores(page):
    url, folder = page
    stop = threading.Event()
    rater(url, lambda c: {"relevance": str(len(c)), "clarity": "5"}, stop)  # "a" -> 1, "bbb" -> 3
    samples = [{"prompt": "Ask about Kafka"}] * 3
    try:
        kw = dict(dir=str(folder), criteria=CRITERIA, scale=[1, 5], poll_s=0.01, timeout_s=30)  # NaN, not a hang
        got = human(["a", "bbb", "a"], samples, **kw)
        clarity = human(["a", "bbb", "a"], samples, criterion="clarity", **kw)
    finally:
        stop.set()
    # mean over criteria of (score - 1) / 4: "a" (1, 5) -> 0.5, "bbb" (3, 5) -> 0.75
    assert got == pytest.approx([0.5, 0.75, 0.5])
    assert clarity == pytest.approx([1.0, 1.0, 1.0])
    queued = [json.loads(ln) for ln in (folder / "queue.jsonl").read_text().splitlines()]
    assert len(queued) == 2  # the repeated completion is one item; the criterion call queued nothing new
    assert len((folder / "ratings.jsonl").read_text().splitlines()) == 2
    stats = json.loads(get(url + "/stats"))
    assert stats == {"queued": 2, "rated": 2, "pending": 0, "mean_scores": {"clarity": 5.0, "relevance": 2.0}}


def test_ratings_answer_later_runs_and_two_ratings_are_averaged(tmp_path):
    folder = tmp_path / "r"
    ratings._STORES.clear()
    i = item_id("p", "q?")
    append_line(folder / "queue.jsonl", {"id": i, "batch": 1, "prompt": "p", "completion": "q?",
                                         "criteria": ["overall"], "scale": [1, 5], "time": 0})
    append_line(folder / "ratings.jsonl", {"id": i, "scores": {"overall": 2}, "time": 0})
    append_line(folder / "ratings.jsonl", {"id": i, "scores": {"overall": 5}, "time": 0})
    ratings._STORES.clear()  # a new process: nothing in memory
    assert human(["q?"], [{"prompt": "p"}], dir=str(folder), timeout_s=0.5) == [pytest.approx(0.625)]  # (3.5-1)/4
    assert len((folder / "queue.jsonl").read_text().splitlines()) == 1


def test_unrated_completions_time_out_to_the_fallback_and_are_counted(tmp_path):
    ratings._STORES.clear()
    spec = RewardSpec("human", fallback=-1.0, args={"dir": str(tmp_path / "r"), "timeout_s": 0.05, "poll_s": 0.01})
    res = compute_rewards(["x", "y"], [{"prompt": "p"}] * 2, [spec])
    assert res.total == [-1.0, -1.0] and res.errors == {"human": 2}
    assert len((tmp_path / "r/queue.jsonl").read_text().splitlines()) == 2  # still there for a person to rate


def test_the_page_shows_a_prompts_answers_together_escapes_them_and_refuses_bad_forms(page):
    url, folder = page
    evil = '<script>alert(1)</script>"'

    def queue(id_, batch, prompt, completion):
        append_line(folder / "queue.jsonl", {"id": id_, "batch": batch, "prompt": prompt, "completion": completion,
                                             "criteria": CRITERIA, "scale": [1, 5], "time": 0})
    queue("old", 1, "p", "older")
    queue("new", 2, "<b>p</b>", evil)
    queue("other", 2, "another prompt", "x")
    queue("new2", 2, "<b>p</b>", "plain")
    ids, answers = shown(get(url + "/"))
    assert ids == ["new", "new2"]  # the newest batch first (the trainer waits for it), one prompt's answers together
    text = get(url + "/")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in text and "<script>" not in text and "<b>p" not in text
    good = [{"relevance": "4", "clarity": "3"}, {"relevance": "2", "clarity": "2"}]
    assert post(url, form(ids, [good[0], {"relevance": "6", "clarity": "3"}])) == 400  # out of the scale
    assert post(url, form(ids, [good[0], {"relevance": "4"}])) == 400  # a criterion missing
    assert post(url, form(["nope"], [good[0]])) == 400
    assert post(url, {}) == 400
    assert not (folder / "ratings.jsonl").exists()  # a refused form writes nothing, not even its good part
    assert post(url, form(ids, good)) == 303
    assert shown(get(url + "/"))[0] == ["other"]
    assert [json.loads(ln)["scores"] for ln in (folder / "ratings.jsonl").read_text().splitlines()] == \
        [{"relevance": 4, "clarity": 3}, {"relevance": 2, "clarity": 2}]
    assert get(url + "/export").splitlines()[0] == json.dumps({"id": "new", "prompt": "<b>p</b>", "completion": evil,
                                                               "scores": {"relevance": 4.0, "clarity": 3.0}})


def test_a_line_torn_by_a_kill_is_skipped_and_the_next_write_starts_a_fresh_line(tmp_path):
    path = tmp_path / "ratings.jsonl"
    path.write_text(json.dumps({"id": "a", "scores": {"overall": 4}}) + '\n{"id": "b", "sco')
    store = Store(tmp_path)
    store.refresh()
    assert store.rated("a", ["overall"]) == {"overall": 4.0}
    append_line(path, {"id": "c", "scores": {"overall": 2}})
    store.refresh()
    assert store.rated("c", ["overall"]) == {"overall": 2.0} and store.rated("b", ["overall"]) is None
    assert path.read_text().splitlines()[1] == '{"id": "b", "sco'  # kept as it was, not glued to the next record


def test_the_command_line_prints_stats_and_exports_and_refuses_a_missing_folder(tmp_path, capsys):
    ratings._STORES.clear()
    append_line(tmp_path / "queue.jsonl", {"id": "a", "batch": 1, "prompt": "p", "completion": "c",
                                           "criteria": ["overall"], "scale": [1, 5], "time": 0})
    append_line(tmp_path / "ratings.jsonl", {"id": "a", "scores": {"overall": 4}, "time": 0})
    assert ratings.main(["stats", "--dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["rated"] == 1
    assert ratings.main(["export", "--dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["scores"] == {"overall": 4.0}
    assert ratings.main(["stats", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    ratings._STORES.clear()


def test_a_bad_criterion_or_scale_is_refused():
    with pytest.raises(ValueError, match="criterion"):
        human([], [], dir="unused", criteria=["clarity"], criterion="relevance")
    with pytest.raises(ValueError, match="scale"):
        human([], [], dir="unused", scale=[5, 1])
