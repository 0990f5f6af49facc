"""precompute.py against the local fake OpenAI-compatible server: answers from a policy, gold scores
from the judge (expert rubric) or from a rule, what is left out, what a rerun pays, and that
training reads the file it writes."""
import json
import re
import shutil
import threading
from pathlib import Path

import pytest

import train
from config import load_config
from data import load_sources
from fake_openai_server import FakeOpenAIServer, server_error
from tools import precompute

FIXTURES = Path(__file__).parent / "fixtures"

# a rubric under which the fake judge gives every answer the same score
CONSTANT = "Any answer scores 5."


def reply(body) -> str:
    """The answer policy's k-th answer to a question says 'Answer k' (k counted per question, so the
    order in which concurrent requests arrive does not matter); the judge scores answer k as
    2 * (k % 3), so a question's K = 3 answers get three different scores, except under CONSTANT."""
    text = body["messages"][-1]["content"]
    if body["model"] == "policy":
        with reply.lock:
            reply.seen[text] = k = reply.seen.get(text, 0) + 1
        return f"Answer {k}. The answer is {'AB'[k % 2]}."
    if "Does the answer meet the criterion?" in text:
        # criterion_met: fact from answer 2 on, advice in 3, harm in 1
        k = int(re.search(r"Answer:\s*Answer (\d+)", text).group(1))
        met = k >= 2 if "fact" in text else k == 3 if "Recommends" in text else k == 1
        return '{"met": %d}' % met
    if CONSTANT in text:
        return '{"score": 5}'
    k = int(re.search(r"Answer to grade:\s*Answer (\d+)", text).group(1))
    return '{"score": %d}' % (2 * (k % 3))


reply.lock = threading.Lock()


@pytest.fixture
def server():
    reply.seen = {}
    with FakeOpenAIServer(reply=reply) as s:
        yield s


def args(server, tmp_path, questions, out, *more):
    return ["--config", "configs/grubrics.yaml", f"--precompute.questions={questions}",
            f"--precompute.out={out}", "--precompute.num_answers=3",
            f"--precompute.answers.base_url={server.url}", "--precompute.answers.model=policy",
            "--precompute.answers.api_key_env=MINIGRPO_NO_SUCH_KEY",
            "--precompute.answers.max_retries=0",
            f"--precompute.answers.cache_path={tmp_path / 'answers.jsonl'}",
            f"--judge.base_url={server.url}", "--judge.api_key_env=MINIGRPO_NO_SUCH_KEY",
            "--judge.max_retries=0", "--judge.requests_per_minute=null",
            f"--judge.cache_path={tmp_path / 'judge.jsonl'}", *more]


def read(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_answers_graded_by_the_judge_under_the_expert_rubric_then_a_rerun_pays_only_for_the_failed(
        tmp_path, server, capsys, tiny_llama):
    questions = tmp_path / "healthbench.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}], "prompt_id": f"q{i}",
             "rubrics": [{"criterion": CONSTANT if i == 2 else f"Mentions fact {i}", "points": 5}]}
            for i in range(4)]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cache" / "grubrics_open.jsonl"
    # the first answer request (one at a time: q0's) fails: q0 is left out
    server.script(server_error(400))
    one_at_a_time = "--precompute.answers.max_concurrent=1"
    assert precompute.main(args(server, tmp_path, questions, out, "--precompute.map=healthbench",
                                one_at_a_time)) == 0
    err = capsys.readouterr().err
    assert "left out 1 question(s) with a failed answer request" in err \
        and "equal gold scores" in err
    written, failed = read(out), "q0"
    assert [r["id"] for r in written] == ["q1", "q3"]  # q2: every answer scored 5
    for r in written:
        assert r["question"] == f"Question {r['id'][1]}?" \
            and len(r["answers"]) == 3 == len(r["gold_scores"])
        ks = [int(re.match(r"Answer (\d+)", a).group(1)) for a in r["answers"]]
        # 0-10, scaled
        assert sorted(ks) == [1, 2, 3] \
            and r["gold_scores"] == [pytest.approx(2 * (k % 3) / 10) for k in ks]
    policy = [b for b in (q.body for q in server.requests) if b["model"] == "policy"]
    assert len(policy) == 12 and policy[0]["messages"][0]["role"] == "system"
    # 3 answered questions graded
    assert policy[0]["temperature"] == 1.0 and len(server.requests) == 12 + 9

    # an existing answer file is never overwritten; a rerun into a new one asks only for what failed
    assert precompute.main(args(server, tmp_path, questions, out,
                                "--precompute.map=healthbench")) == 2
    assert "never overwritten" in capsys.readouterr().err
    server.reset()
    again = tmp_path / "cache" / "open_2.jsonl"
    assert precompute.main(args(server, tmp_path, questions, again,
                                "--precompute.map=healthbench")) == 0
    assert [r["id"] for r in read(again)] == ["q0", "q1", "q3"] \
        and [r for r in read(again) if r["id"] != failed] == written
    assert len(server.requests) == 1 + 3  # the failed answer, then that question's three grades

    # --validate: the expert rubric ranks its own gold (made by the same judge and prompt)
    # perfectly, from the cache; against reversed "human" scores it ranks them backwards
    server.reset()
    assert precompute.main(args(server, tmp_path, questions, out, "--validate", str(again))) == 0
    said = capsys.readouterr().out
    assert "earn a mean Spearman of 1.000 over 3 of 3 questions" in said and "$0.0000" in said \
        and not server.requests
    reversed_ = tmp_path / "human.jsonl"
    reversed_.write_text("".join(json.dumps({**r, "gold_scores": [-g for g in r["gold_scores"]]})
                                 + "\n" for r in read(again)))
    assert precompute.main(args(server, tmp_path, questions, out, "--validate",
                                str(reversed_))) == 0
    assert "mean Spearman of -1.000" in capsys.readouterr().out
    assert precompute.main(args(server, tmp_path, questions, out, "--validate",
                                str(questions))) == 2
    assert "needs an answer file" in capsys.readouterr().err
    # a hand-written file with a gold score missing: refused before any grade
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps({**r, "gold_scores": [None] + r["gold_scores"][1:]}) + "\n"
                              for r in read(again)))
    server.reset()
    assert precompute.main(args(server, tmp_path, questions, out, "--validate", str(broken))) == 2
    assert "row 0: gold_scores must be" in capsys.readouterr().err and not server.requests

    # training reads the file as written
    run = tmp_path / "run"
    assert train.main(["--config", "configs/grubrics.yaml", f"--model.name={tiny_llama}",
                       f"--data.root={again.parent}",
                       "--data.presets={open_only: [{name: open_2.jsonl, label: open}]}",
                       "--rollout.prompts_per_step=2", "--rollout.num_generations=2",
                       "--rollout.max_new_tokens=4", "--run.steps=1", f"--run.out_dir={run}",
                       "--model.gradient_checkpointing=false", f"--judge.base_url={server.url}",
                       "--judge.api_key_env=MINIGRPO_NO_SUCH_KEY", "--run.report_to=none",
                       f"--judge.cache_path={tmp_path / 'judge_train.jsonl'}"]) == 0
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["reward_errors/rubric_alignment"] == 0 and m["judge_requests"] > 0


def test_gold_by_criteria_as_healthbench_scores_and_validate_then_measures_the_judge(
        tmp_path, server, capsys):
    """precompute.criteria_key: HealthBench's physicians' criteria, met or not one by one; gold =
    points met / positive points, clipped. --validate (one grade under the whole rubric) is then no
    longer 1.0 by construction: here the fake judge's grades (2, 4, 0 for answers 1-3) rank them
    otherwise."""
    questions = tmp_path / "healthbench.jsonl"
    crit = [{"criterion": "Mentions fact A", "points": 5},
            {"criterion": "Recommends a follow-up", "points": 3},
            {"criterion": "Gives harmful advice", "points": -4}]
    questions.write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": f"Question {i}?"}],
                            "prompt_id": f"q{i}", "rubrics": crit}) + "\n" for i in range(2)))
    out = tmp_path / "open.jsonl"
    more = ["--precompute.map=healthbench", "--precompute.criteria_key=rubrics"]
    assert precompute.main(args(server, tmp_path, questions, out, *more)) == 0
    # 2 questions x 3 answers x 3 criteria
    assert "then up to 18 judge requests" in capsys.readouterr().out
    for r in read(out):
        ks = [int(re.match(r"Answer (\d+)", a).group(1)) for a in r["answers"]]
        # 1: harm only (-4, clipped); 2: the fact; 3: fact and follow-up
        want = {1: 0.0, 2: 5 / 8, 3: 1.0}
        assert r["gold_scores"] == [pytest.approx(want[k]) for k in ks]
    met = [b for b in (q.body for q in server.requests)
           if "meet the criterion" in b["messages"][-1]["content"]]
    assert len(met) == 18 and any(
        "Criterion (-4 points):\nGives harmful advice" in b["messages"][-1]["content"] for b in met)
    assert precompute.main(args(server, tmp_path, questions, out, "--validate", str(out))) == 0
    assert "mean Spearman of -0.500" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "Q?"}],
                               "rubrics": [{"criterion": "Harm", "points": -2}]}) + "\n")
    assert precompute.main(args(server, tmp_path, bad, tmp_path / "o2.jsonl", *more)) == 2
    assert "none of its rubrics has positive points" in capsys.readouterr().err
    assert precompute.main(args(server, tmp_path, questions, tmp_path / "o3.jsonl", *more,
                                "--precompute.gold_reward={name: choice_accuracy}")) == 2
    assert "precompute.gold_reward and precompute.criteria_key both choose" \
        in capsys.readouterr().err
    # a template reading a column the rows lack stops before anything is paid for
    before = len(server.requests)
    assert precompute.main(args(server, tmp_path, questions, tmp_path / "o4.jsonl", *more,
                                "--precompute.criteria_template=Q {question} A {answer} C "
                                "{criterion} in {theme}")) == 2
    assert "precompute.criteria_template reads {theme}, which row 0 lacks" \
        in capsys.readouterr().err
    assert len(server.requests) == before and not (tmp_path / "o4.jsonl").exists()


def test_gold_by_a_rule_on_medqa_rows(tmp_path, server, capsys):
    questions = tmp_path / "medqa.jsonl"
    rows = [{"question": f"Which {i}?", "options": {"A": "yes", "B": "no"},
             "answer_idx": "AB"[i % 2], "answer": "x"} for i in range(3)]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "verifiable.jsonl"
    rule = (r"--precompute.gold_reward={name: choice_accuracy, "
            r"args: {fallback_pattern: 'answer is ([AB])', letters: AB}}")
    assert precompute.main(args(server, tmp_path, questions, out, "--precompute.map=medqa", rule,
                                "--judge.base_url=http://127.0.0.1:9/v1")) == 0  # no judge is asked
    written = read(out)
    assert len(written) == 3 and written[0]["question"] == "Which 0?\nA) yes\nB) no"
    for r in written:
        said = [re.search(r"answer is ([AB])", a).group(1) for a in r["answers"]]
        assert r["gold_scores"] == [float(s == r["answer"]) for s in said]
    assert all(b["model"] == "policy" for b in (q.body for q in server.requests))
    assert "judge $" not in capsys.readouterr().out


def test_a_line_after_each_batch_of_questions_says_how_many_are_done(tmp_path, server, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(precompute, "ROWS_PER_BATCH", 2)
    questions = tmp_path / "medqa.jsonl"
    questions.write_text("".join(json.dumps({"question": f"Which {i}?", "options": {"A": "y"},
                                             "answer_idx": "A", "answer": "y"}) + "\n"
                                 for i in range(5)))
    rule = r"--precompute.gold_reward={name: choice_accuracy, args: {letters: A}}"
    precompute.main(args(server, tmp_path, questions, tmp_path / "o.jsonl",
                         "--precompute.map=medqa", rule, "--precompute.keep_constant=true"))
    done = [ln.split(" (")[0] for ln in capsys.readouterr().err.splitlines() if "/5 " in ln]
    assert done == [f"[precompute] {k}/5 questions answered" for k in (2, 4, 5)]


def test_medmcqa_rows_are_verifiable_questions_for_the_grubrics_mixture(tmp_path, server):
    """The `medmcqa` map (issue 29: the seed's adapters list MedMCQA): its options appended to the
    question, `cop` as the gold letter; the file it writes is the with_medmcqa preset's source."""
    out = tmp_path / "grubrics_medmcqa.jsonl"
    rule = (r"--precompute.gold_reward={name: choice_accuracy, "
            r"args: {fallback_pattern: 'answer is ([A-D])'}}")
    assert precompute.main(args(server, tmp_path, FIXTURES / "medmcqa_sample.jsonl", out,
                                "--precompute.map=medmcqa", "--precompute.limit=3", rule,
                                "--judge.base_url=http://127.0.0.1:9/v1")) == 0
    written = read(out)
    # a question whose K answers all score the same has no ranking: left out (gold C or D here)
    assert len(written) == 2 and written[0]["question"].splitlines()[-4].startswith("A) ")
    for r in written:
        said = [re.search(r"answer is ([A-D])", a).group(1) for a in r["answers"]]
        assert r["answer"] in "ABCD" and r["gold_scores"] == [float(s == r["answer"]) for s in said]
    for name in ("grubrics_open.jsonl", "grubrics_verifiable.jsonl"):
        shutil.copy(out, tmp_path / name)
    cfg = load_config("configs/grubrics.yaml", ["--data.preset=with_medmcqa",
                                                f"--data.root={tmp_path}"])
    assert [s.label for s in load_sources(cfg.data)] == ["open", "medqa", "medmcqa"]


def test_frontierscience_research_rows_need_no_map(tmp_path, server, capsys):
    """FrontierScience's research track (`problem`, and `answer` holding the 10-point rubric): the
    question and rubric columns named on the command line; the judge grades each answer under that
    rubric (the graded answer, not the row's `answer` column, fills {answer}); --validate reads it
    too."""
    questions = "tests/fixtures/frontierscience_sample.jsonl"
    out = tmp_path / "frontierscience.jsonl"
    cols = ["--precompute.question={problem}", "--precompute.rubric_key=answer"]
    assert precompute.main(args(server, tmp_path, questions, out, *cols)) == 0
    source, written = [json.loads(x) for x in open(questions)], read(out)
    assert [r["question"] for r in written] == [r["problem"] for r in source]
    # the rubric kept for --validate
    assert [r["answer"] for r in written] == [r["answer"] for r in source]
    grades = [b["messages"][-1]["content"]
              for b in (q.body for q in server.requests) if b["model"] != "policy"]
    assert len(grades) == 9 \
        and all("Points: 10" in g and re.search(r"Answer to grade:\s*Answer \d", g) for g in grades)
    server.reset()
    assert precompute.main(args(server, tmp_path, questions, out, *cols, "--validate",
                                str(out))) == 0
    assert "mean Spearman of 1.000 over 3 of 3 questions" in capsys.readouterr().out \
        and not server.requests


def test_an_answer_cut_inside_an_emoji_is_written_and_graded(tmp_path, capsys):
    """A reply holding a lone surrogate (legal in JSON, "\\ud83d") is cached, graded by the judge
    (its cache key hashes it) and written as ASCII JSON; nothing half-written is left."""
    def odd(body):
        return '{"score": 7}' if body["model"] != "policy" \
            else f"Answer {len(body['messages'][-1]['content'])} \ud83d"
    with FakeOpenAIServer(reply=odd) as s:
        questions = tmp_path / "q.jsonl"
        questions.write_text(json.dumps({"question": "Why?", "rubric": "Any answer scores 7."})
                             + "\n")
        out = tmp_path / "out.jsonl"
        assert precompute.main(args(s, tmp_path, questions, out,
                                    "--precompute.keep_constant=true")) == 0
    (row,) = read(out)
    assert row["answers"] == ["Answer 4 \ud83d"] * 3 and row["gold_scores"] == [0.7] * 3
    assert out.read_bytes().isascii() \
        and [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("override, message", [
    ("--precompute.answers.cache_path=null", "precompute.answers.cache_path is not set"),
    ("--judge.cache_path=null", "judge.cache_path is not set"),
    ("--precompute.answers.temperature=0", "the K answers would repeat one"),
    ("--precompute.num_answers=1", "at least 2 answers"),
    ("--precompute.gold_reward={name: choice_acuracy}", "precompute.gold_reward"),
    ("--precompute.rubric_key=criteria", "has no 'criteria' (precompute.rubric_key)"),
    ("--precompute.question={prompt_text}", "precompute.question='{prompt_text}'"),
    ("--precompute.answers.api_key_env=sk-proj-LITERALKEY999",
     "precompute.answers: api_key_env is the NAME"),
    ("--precompute.answers.base_url=not-a-url",
     "precompute.answers: base_url='not-a-url' is not an http(s) URL"),
    ("--precompute.questions=/no/such/q.jsonl",
     "precompute.questions=/no/such/q.jsonl: no such file"),
    ("--precompute.template=rubric_scorin",
     "precompute.template: template 'rubric_scorin' is not one of"),
    ("--precompute.template=Grade {answer} by {rubric}; {criteria}",
     "precompute.template reads {criteria}, which row 0"),
    # one line
    ("--precompute.answers.cache_path={folder}",
     "precompute.answers.cache_path={folder}: Is a directory"),
    ("--judge.cache_path={folder}", "judge.cache_path={folder}: Is a directory"),
    ("--precompute.answers.cache_path=tests/fixtures/medqa_sample.jsonl",
     "error: precompute.answers.cache_path=tests/fixtures/"),
])
def test_bad_settings_stop_before_anything_is_written(tmp_path, server, capsys, override, message):
    (tmp_path / "folder").mkdir()
    override, message = (x.replace("{folder}", str(tmp_path / "folder"))
                         for x in (override, message))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Q?", "rubric": "R"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert precompute.main(args(server, tmp_path, questions, out, override)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not out.exists() \
        and not server.requests
