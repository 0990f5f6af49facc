"""Tests for graders/ratings.py and tools/ratings.py: the human reward waits for ratings given on
the page (a rater thread standing in for a person), the files survive a torn line, unrated items
time out to the reward's fallback, and the commands print, export and refuse what they cannot use.
The page itself is tested in test_rating_page.py, its server in test_rating_server.py."""
import json
import math
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from config import RewardSpec
from files import jsonl
from graders import rating_page, ratings
from graders.ratings import Store, human, item_id
from rating_client import needs_page, queue, rater
from rewards import compute_rewards
from scoring.checks import check_specs
from tools import ratings as ratings_cmd

CRITERIA = ["relevance", "clarity"]


@pytest.fixture(autouse=True)
def fresh_stores():
    """One Store per folder per process: each test starts from the files."""
    ratings._STORES.clear()
    yield
    ratings._STORES.clear()


def test_the_reward_waits_for_people_and_rescales_their_scores(page):
    client, folder = page
    stop = threading.Event()
    # "a" -> 1, "bbb" -> 3
    rater(client, lambda c: {"relevance": str(len(c)), "clarity": "5"}, stop)
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
    stats = client.get("/stats").json()
    assert stats == {"queued": 2, "rated": 2, "pending": 0,
                     "mean_scores": {"clarity": 5.0, "relevance": 2.0}}


def test_ratings_answer_later_runs_two_in_the_file_are_averaged_and_a_new_scale_asks_again(
        tmp_path):
    needs_page()  # the human reward stops where the page cannot run
    folder = tmp_path / "r"
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
    needs_page()  # the human reward stops where the page cannot run
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
    needs_page()  # the human reward stops where the page cannot run
    """The queue keeps data.assistant_prefix + the completion: its export becomes DPO pairs that the
    same template renders again, so a block the template opens (R1's <think>) must not be in
    them."""
    from rewards import reward_context
    spec = RewardSpec("human", args={"dir": str(tmp_path / "r"), "timeout_s": 0.05, "poll_s": 0.01})
    compute_rewards(["x"], [{"prompt": "p"}], [spec],
                    context=reward_context("<think>\nokay", {}, "okay"))
    (item,) = [json.loads(ln) for ln in (tmp_path / "r" / "queue.jsonl").read_text().splitlines()]
    assert item["completion"] == "okayx"


def test_unrated_completions_time_out_once_to_the_fallback_and_are_counted(tmp_path):
    needs_page()  # the human reward stops where the page cannot run
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
    needs_page()  # the human reward stops where the page cannot run
    for args, match in [
            ({}, "needs args.dir"), ({"dir": "r", "criteria": "overall"}, "list of names"),
            ({"dir": "r", "criterion": "tone"}, "one of the criteria"),
            ({"dir": "r", "scale": [5, 1]}, "scale"), ({"dir": "r", "scale": [1, 2, 3]}, "scale"),
            ({"dir": "r", "timeout_s": -1}, "timeout_s")]:
        with pytest.raises(ValueError, match=match):
            check_specs([RewardSpec("human", args=args)])
    check_specs([RewardSpec("human", args={"dir": "r", "criteria": CRITERIA,
                                           "criterion": "clarity"})])


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


def test_bad_lines_written_by_hand_are_skipped_not_fatal(tmp_path, capsys):
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


def test_a_rating_off_the_scale_never_makes_the_reward_leave_0_1_even_when_read_before_its_item(
        tmp_path):
    needs_page()  # the human reward stops where the page cannot run
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


def test_without_the_ratings_extra_serve_and_the_human_reward_say_what_to_install(
        tmp_path, monkeypatch, capsys):
    """Starlette and uvicorn are an optional extra: a run needing the page stops before any model
    loads, and `serve` before it makes a folder, each with one line naming the pip command."""
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: find_spec gives None
    assert ratings_cmd.main(["serve", "--dir", str(tmp_path / "r"), "--port", "0"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    # "starlette and uvicorn" where neither is installed
    assert line.startswith("error: the rating page needs ") and line.endswith(
        "uvicorn (the `ratings` extra): pip install starlette==1.10.0 uvicorn==0.54.0")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match=r"needs .*uvicorn .*: pip install starlette==1\.10\.0 "):
        check_specs([RewardSpec("human", args={"dir": str(tmp_path / "r")})])
    assert ratings_cmd.main(["stats", "--dir", str(tmp_path)]) == 0  # stats and export need none


def test_the_pinned_extra_is_the_one_the_makefile_installs_and_pyproject_declares():
    """PAGE_EXTRA (what the one line says to install) is what `make setup` installs and tests."""
    root = Path(__file__).resolve().parents[1]
    makefile, pyproject = (root / "Makefile").read_text(), (root / "pyproject.toml").read_text()
    assert all(pin in makefile for pin in ratings.PAGE_EXTRA)
    assert 'ratings = ["starlette", "uvicorn"]' in pyproject
