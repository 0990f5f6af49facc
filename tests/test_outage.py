"""scoring/outage.py's step checks against the fake server, without a model: a step whose judge
failed too many calls is not trained on, a judge whose replies are mostly unusable stops the run,
and the run's end names a judge that was often unusable. (Waiting for a judge that is down:
tests/test_policy.py; end to end: tests/test_train.py.)"""
import types

import pytest
import torch

from api.client import Judge, JudgeConfig, JudgeUnusable
from config import Config
from fake_openai_server import FakeOpenAIServer, dropped, ok
from judge import judge_reward
from scoring import outage

TEMPLATE = "Rate {completion}"


@pytest.fixture
def server():
    with FakeOpenAIServer(reply=lambda body: "Score: 7") as s:
        yield s


def fake_run(server, **run_cfg) -> types.SimpleNamespace:
    """What minis_to_train reads of a Run: its judges, config, schedule, step and world."""
    cfg = Config()
    for k, v in run_cfg.items():
        setattr(cfg.run, k, v)
    judge = Judge(JudgeConfig(base_url=server.url, model="fake-judge", max_retries=0))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (u + 1))
    return types.SimpleNamespace(judges={"judge": judge}, cfg=cfg, scheduler=schedule, step=2,
                                 world=1)


def judged(run, n: int = 8, tag: str = "") -> list[float]:
    """One step's judge calls: n different completions scored."""
    return judge_reward([f"answer {tag}{i}" for i in range(n)], [{}] * n, judge=run.judges["judge"],
                        template=TEMPLATE, criteria=[])


def test_a_step_whose_judge_mostly_got_no_reply_trains_nothing_and_says_so(server, capsys):
    """Issue 39: a judge killed mid-step (5 of 8 calls unanswered) is not trained on: no
    mini-batch, the schedule moved on as if updated, judge_steps_skipped counted, one line."""
    run = fake_run(server)
    server.script(*[ok()] * 3)
    server.default = dropped()
    assert sum(v != v for v in judged(run)) == 5  # NaN: no reply
    assert outage.minis_to_train(run, ["mb1", "mb2"]) == []
    assert run.scheduler.last_epoch == 2  # two updates skipped, the schedule as if made
    stats = run.judges["judge"].pop_step_stats()
    assert stats["judge_steps_skipped"] == 1 and stats["judge_steps_skipped_total"] == 1
    port = server.url.split(":")[2].split("/")[0]
    err = capsys.readouterr().err.strip()
    assert err.startswith("[minigrpo] step 2 is not trained on: judge got no reply to 5 of 8 "
                          f"calls (1 try, the last APIConnectionError for 127.0.0.1:{port} (")
    assert "\n" not in err and err.endswith("run.judge_max_failed_share=0.5, so its update is "
                                            "skipped (judge_steps_skipped)")


def test_a_step_with_a_few_failed_calls_trains_as_before(server, capsys):
    run = fake_run(server)
    server.script(*[ok()] * 5)
    server.default = dropped()
    judged(run)  # 3 of 8 unanswered: at most half
    assert outage.minis_to_train(run, ["mb"]) == ["mb"] and run.scheduler.last_epoch == 0
    assert run.judges["judge"].pop_step_stats()["judge_steps_skipped"] == 0
    assert capsys.readouterr().err == ""


def test_a_failed_share_of_one_never_skips_a_step(server):
    run = fake_run(server, judge_max_failed_share=1.0)
    server.default = dropped()
    judged(run)
    assert outage.minis_to_train(run, ["mb"]) == ["mb"]


def garbage_mostly(body) -> str:
    """A score only for a completion ending in 0 (one of 4, of 8); else prose without one."""
    return "Score: 7" if body["messages"][-1]["content"].endswith("0") else \
        "The answer seems reasonable and well written overall."


def test_a_judge_mostly_unusable_for_three_steps_stops_with_a_reply_and_what_to_fix(server):
    server.reply = garbage_mostly
    run = fake_run(server)
    for step in range(2):
        judged(run, 4, tag=f"s{step}-")  # 3 of 4 replies unusable
        assert outage.minis_to_train(run, ["mb"]) == ["mb"]  # trained: on the usable one
        run.judges["judge"].pop_step_stats()
    judged(run, 4, tag="s2-")
    with pytest.raises(JudgeUnusable) as err:
        outage.minis_to_train(run, ["mb"])
    assert str(err.value) == (
        "judge: 3 of 4 replies held no usable score this step, more than "
        "run.judge_max_unusable_share=0.5 for 3 steps in a row; one was 'The answer seems "
        "reasonable and well written overall.'; fix its template (ask for 'Score: <n>' and "
        "nothing else), constrain its replies with a grammar through judge.extra_body "
        "(docs/rewards-and-judges.md, small local judges), or use a larger judge")


def test_a_mostly_usable_step_in_between_starts_the_count_again(server):
    server.reply = garbage_mostly
    run = fake_run(server, judge_unusable_steps=2)
    judged(run, 4, tag="a")
    outage.minis_to_train(run, [])
    run.judges["judge"].pop_step_stats()
    server.reply = lambda body: "Score: 7"
    judged(run, 4, tag="b")
    outage.minis_to_train(run, [])
    run.judges["judge"].pop_step_stats()
    server.reply = garbage_mostly
    judged(run, 4, tag="c")
    assert outage.minis_to_train(run, ["mb"]) == ["mb"]  # 1 step in a row, not 2


def test_the_run_s_end_names_a_judge_unusable_more_than_a_tenth_of_the_time(server):
    server.reply = garbage_mostly
    run = fake_run(server)
    judge = run.judges["judge"]
    assert outage.unusable_summary(run.judges) == []
    judged(run, 8)
    (line,) = outage.unusable_summary(run.judges)
    assert line.startswith("[minigrpo] warning: judge: 7 of 8 replies (88%) held no usable score "
                           "over the run, each left to the reward's fallback")
    assert "'The answer seems reasonable" in line and "extra_body" in line
    judge.totals["unusable"] = 0.0  # every reply usable: nothing to say
    judge.totals["failures"] -= 7
    assert outage.unusable_summary(run.judges) == []
