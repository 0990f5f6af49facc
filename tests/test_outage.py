"""scoring/outage.py's step checks against the fake server, without a model: a step whose judge
failed too many calls is not trained on, a judge whose replies are mostly unusable stops the run,
and the run's end names a judge that was often unusable. (Waiting for a judge that is down:
tests/test_policy.py; end to end: tests/test_train.py.)"""
import types

import pytest
import torch

from api.client import Judge, JudgeConfig
from config import Config, JudgeUnusable
from fake_openai_server import Behaviour, FakeOpenAIServer, dropped, ok
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


# --- issue 47: a reward that failed on every completion stops the run ----------------------------
def test_a_reward_that_failed_on_every_completion_stops_the_run_with_one_line(server):
    """Issue 47: a judge whose requests could not even be built trained to the end on nothing:
    judge_calls 0, reward_errors/judge 32, exit 0. Whatever the reason, a reward that failed on
    all of a step's completions stops it (train.py: exit 2, as JudgeUnusable)."""
    run = fake_run(server)
    with pytest.raises(outage.RewardFailed) as err:
        outage.minis_to_train(run, ["mb"], errors={"answer_match": 0, "judge": 32}, scored=32)
    assert str(err.value) == (
        "reward 'judge' failed on all 32 completions of step 2 (reward_errors/judge; its first "
        "failure is logged above): a step scored by nothing learns nothing")
    assert isinstance(err.value, JudgeUnusable) and "\n" not in str(err.value)
    # some completions scored: the step trains on them
    assert outage.minis_to_train(run, ["mb"], errors={"judge": 31}, scored=32) == ["mb"]
    assert outage.minis_to_train(run, ["mb"], errors={}, scored=0) == ["mb"]
    # a reward of weight 0 is logged, not trained on: its failures stop nothing
    from config import RewardSpec
    run.cfg.rewards = [RewardSpec(name="answer_match"), RewardSpec(name="judge", weight=0.0)]
    assert outage.minis_to_train(run, ["mb"], errors={"judge": 32}, scored=32) == ["mb"]


def test_a_judge_that_refused_every_call_stops_the_run_naming_its_last_failure(server):
    """A reply is not an outage: a 400 to every call (a prompt past the judge's context, say)
    would skip every step for ever (more than judge_max_failed_share failed) and end `done`."""
    run = fake_run(server)
    server.default = Behaviour(status=400, message="prompt too long")
    assert all(v != v for v in judged(run))
    with pytest.raises(outage.RewardFailed) as err:
        outage.minis_to_train(run, ["mb"], errors={"judge": 8}, scored=8)
    assert str(err.value).startswith("reward 'judge' failed on all 8 completions of step 2 "
                                     "(reward_errors/judge; its first failure is logged above; "
                                     f"judge: HTTP 400 from {server.url}, not retried: Error code: "
                                     "400 - prompt too long): a step")


def test_a_judge_that_answered_before_and_now_gets_no_reply_is_an_outage_not_a_stop(server):
    """Every call failing because the judge went down is run.judge_outage's to wait for: the step
    is not trained on, and the run does not stop."""
    run = fake_run(server)
    judged(run, 4, tag="up")
    run.judges["judge"].pop_step_stats()
    server.default = dropped()
    assert all(v != v for v in judged(run, 8, tag="down"))
    assert outage.minis_to_train(run, ["mb"], errors={"judge": 8}, scored=8) == []
    # never answered: not down but wrong (client.FAILED_LIMIT's case, at once here)
    fresh = fake_run(server)
    judged(fresh, 8, tag="never")
    with pytest.raises(outage.RewardFailed, match="judge: 1 try, the last APIConnectionError"):
        outage.minis_to_train(fresh, ["mb"], errors={"judge": 8}, scored=8)


def test_a_rule_reward_that_failed_on_every_completion_stops_a_run_without_a_judge():
    run = types.SimpleNamespace(judges={}, cfg=Config(), scheduler=None, step=5, world=1)
    with pytest.raises(outage.RewardFailed, match="reward 'my_rule' failed on all 8 completions "
                       r"of step 5 \(reward_errors/my_rule; its first failure is logged above\)"):
        outage.minis_to_train(run, ["mb"], errors={"my_rule": 8}, scored=8)
