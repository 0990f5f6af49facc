"""run/policy.py's decisions, each on its own and without a model: when a step is checkpointed,
when a run stops without a learning signal or for its time limit, what a judge outage does, and
when the held-out rows are scored. tests/test_train.py runs them end to end."""
import sys
import types

import pytest

from config import Config, JudgeUnusable, RunConfig
from run import display, policy
from run.policy import NO_SIGNAL, TIME_LIMIT, Clock, Policy
from scoring import outage

FLAT, LEARNING = {"frac_reward_zero_std": 1.0}, {"frac_reward_zero_std": 0.5}


def rules(start: int = 0, held_out: bool = False, flat_steps: int = 0, **run) -> Policy:
    """A Policy for run.steps=10 and nothing else set, unless `run` says otherwise."""
    return Policy(RunConfig(**{"steps": 10, "save_every": 0} | run), start, held_out,
                  Clock(started=0.0), flat_steps)


def steps(p: Policy, metrics: list[dict], seconds: float = 10.0, down=()) -> list:
    """The decisions after the steps p.start + 1, ..., each `seconds` long, back to back."""
    out, now = [], seconds * len(p.clock.step_seconds)
    for i, m in enumerate(metrics):
        now += seconds
        out.append(p.after_step(p.start + 1 + i, m, list(down), now - seconds, now))
    return out


class DownJudge:
    """A judge that got no reply for a step: `back` says which of the wait's tries it answers."""
    label, down_steps, last_failure = "judge", 1, "1 try, the last APIConnectionError"

    def __init__(self, back=lambda tries: False):
        self.back, self.tries = back, 0

    def masked(self, text: str) -> str:
        return text

    def probe(self, timeout_s: float) -> bool:
        self.tries += 1
        return self.back(self.tries)


# ------------------------------------------------------------------------ no learning signal


def test_a_run_stops_without_signal_after_n_flat_steps_in_a_row_with_a_checkpoint():
    *going, stopped = steps(rules(stop_without_signal=3), [FLAT, FLAT, FLAT])
    assert [d.stop for d in going] == [None, None] and not any(d.save for d in going)
    assert stopped.stop == NO_SIGNAL and stopped.save and stopped.exit_code == 3


def test_a_step_with_signal_starts_the_flat_count_again():
    p = rules(stop_without_signal=2)
    assert [d.stop for d in steps(p, [FLAT, LEARNING, FLAT])] == [None, None, None]
    assert p.flat_steps == 1


def test_a_resumed_run_counts_the_flat_steps_logged_before_it():
    (decision,) = steps(rules(start=4, flat_steps=2, stop_without_signal=3), [FLAT])
    assert decision.stop == NO_SIGNAL


def test_without_stop_without_signal_flat_steps_only_warn_once_after_five():
    decisions = steps(rules(), [FLAT] * 7)
    assert [d.warn_no_signal for d in decisions] == [False] * 4 + [True, False, False]
    assert not any(d.stop for d in decisions)


def test_a_stop_without_signal_before_five_flat_steps_warns_as_it_stops():
    assert [d.warn_no_signal for d in steps(rules(stop_without_signal=2), [FLAT, FLAT])] \
        == [False, True]


def test_the_no_signal_warning_names_skipped_rewards_as_a_possible_outage():
    plain = display.no_signal_warning(5, FLAT)
    assert plain == display.NO_SIGNAL.format(n=5)
    assert display.no_signal_warning(2, {"frac_reward_skipped": 0.25}) == (
        display.NO_SIGNAL.format(n=2) + " This step 25% of the completions had no reward "
        "(fallback: skip): a judge or rating outage? See reward_errors/* and judge_failures.")


# ------------------------------------------------------------------------------ checkpoints


def test_steps_are_checkpointed_every_save_every_and_at_the_last():
    saved = [d.save for d in steps(rules(save_every=4), [LEARNING] * 10)]
    assert [i + 1 for i, s in enumerate(saved) if s] == [4, 8, 10]


def test_under_a_time_limit_the_first_step_of_the_process_is_checkpointed_to_time_it():
    assert steps(rules(max_minutes=60), [LEARNING])[0].save
    assert not steps(rules(), [LEARNING])[0].save
    resumed = steps(rules(start=4, max_minutes=60), [LEARNING, LEARNING])
    assert [d.save for d in resumed] == [True, False]  # step 5 of this process, not step 1


def test_a_step_with_a_judge_down_is_checkpointed_before_the_wait():
    (decision,) = steps(rules(), [LEARNING], down=[DownJudge()])
    assert decision.save and decision.stop is None


# ------------------------------------------------------------------------------ time limit


def test_the_time_limit_stops_after_the_step_past_which_the_next_would_end_too_late():
    # 10 s steps, 60 s: after step 4 (40 s) the next ends at 40 + 11 < 60; after 5, 50 + 11 > 60
    decisions = steps(rules(max_minutes=1), [LEARNING] * 5)
    assert [d.stop for d in decisions] == [None] * 4 + [TIME_LIMIT]
    assert decisions[4].save and decisions[4].exit_code == 0


def test_the_time_limit_counts_the_next_steps_held_out_scoring():
    """At 20 s, a 10 s step (11 with margin) fits 60 s; a 30 s scoring after it does not."""
    scored_next = rules(held_out=True, eval_every=3, max_minutes=1)
    scored_next.clock.eval_seconds = 30.0
    assert [d.stop for d in steps(scored_next, [LEARNING, LEARNING])] == [None, TIME_LIMIT]
    scored_later = rules(held_out=True, eval_every=4, max_minutes=1)
    scored_later.clock.eval_seconds = 30.0
    assert [d.stop for d in steps(scored_later, [LEARNING, LEARNING])] == [None, None]


def test_before_the_first_held_out_scoring_the_limit_counts_it_as_long_as_a_step():
    p = rules(held_out=True, eval_every=2, max_minutes=0.5)  # 30 s
    p.clock.step_seconds.append(10.0)
    assert p.after_next(1, saving=False) == 10.0 and p.after_next(2, saving=False) == 0.0
    # at 10 s: 10 + 11 + 10 = 31 > 30
    assert steps(rules(held_out=True, eval_every=2, max_minutes=0.5), [LEARNING])[0].stop \
        == TIME_LIMIT


def test_the_time_limit_counts_the_stopping_checkpoint_and_this_steps_own():
    p = rules(max_minutes=1)
    p.clock.saved(15.0)
    assert p.after_next(3, saving=False) == 15.0  # the checkpoint written when stopping
    assert p.after_next(3, saving=True) == 30.0  # and the one this step writes first
    # at 20 s: 20 + 11 + 15 = 46 fits 60 s; at 30 s, 30 + 11 + 15 = 56 too; at 40 s no more
    assert [d.stop for d in steps(p, [LEARNING] * 4)] == [None, None, None, TIME_LIMIT]
    # the first step's own checkpoint (a time limit's) and the stopping one: 10 + 11 + 2 x 20 > 60
    slow_saves = rules(max_minutes=1)
    slow_saves.clock.saved(20.0)
    assert steps(slow_saves, [LEARNING])[0].stop == TIME_LIMIT


def test_the_time_limit_never_stops_the_last_step_and_a_no_signal_stop_comes_first():
    last = rules(steps=2, max_minutes=0.01)
    assert [d.stop for d in steps(last, [LEARNING, LEARNING])] == [TIME_LIMIT, None]
    p = rules(max_minutes=0.01, stop_without_signal=1)
    assert steps(p, [FLAT])[0].stop == NO_SIGNAL


def test_a_steps_own_time_leaves_its_held_out_scoring_out():
    p = rules(held_out=True, eval_every=2)
    p.clock.eval_seconds = 25.0
    p.after_step(1, LEARNING, [], began=0.0, now=40.0)
    p.after_step(2, LEARNING, [], began=40.0, now=80.0)
    assert p.clock.step_seconds == [40.0, 15.0]


def test_out_of_time_counts_the_next_step_as_the_longest_of_the_last_five_plus_ten_percent():
    cfg = RunConfig(max_minutes=1)
    assert not policy.out_of_time(cfg, 0.0, [30.0, 1, 1, 1, 1, 1], now=48.0)  # 30 s is 6 back
    assert policy.out_of_time(cfg, 0.0, [30.0, 1, 1, 1, 1], now=28.0)  # 28 + 33 > 60
    assert not policy.out_of_time(cfg, 0.0, [30.0, 1, 1, 1, 1], now=26.0)


def test_the_clock_keeps_the_longest_checkpoint_and_reserves_a_step_and_a_save():
    clock = Clock(started=0.0, step_seconds=[10.0, 20.0])
    clock.saved(5.0)
    clock.saved(3.0)
    assert clock.save_seconds == 5.0 and clock.reserve() == pytest.approx(27.0)


# ------------------------------------------------------------------- judge outage decisions


def test_judges_down_are_waited_for_when_the_run_goes_on_and_only_said_when_it_ends():
    judge = DownJudge()
    going, last = steps(rules(steps=2), [LEARNING, LEARNING], down=[judge])
    assert (going.wait_for, going.said_down) == ([judge], [])
    assert (last.wait_for, last.said_down) == ([], [judge])
    (stopping,) = steps(rules(stop_without_signal=1), [FLAT], down=[judge])
    assert (stopping.wait_for, stopping.said_down) == ([], [judge])


def _outage_run(tmp_path, **run):
    cfg = Config()
    cfg.run = RunConfig(**{"steps": 4} | run)
    r = types.SimpleNamespace(cfg=cfg, run_dir=tmp_path, judges={}, device=None)
    args = types.SimpleNamespace(argv=["--config", "c.yaml"], resume=False, config="c.yaml")
    return r, args


@pytest.fixture
def fake_clock(monkeypatch):
    """outage.wait's pauses advance a clock instead of sleeping; -> the pauses taken."""
    now, pauses = [0.0], []

    def sleep(seconds):
        pauses.append(seconds)
        now[0] += seconds
    monkeypatch.setattr(outage, "clock", lambda: now[0])
    monkeypatch.setattr(outage, "sleep", sleep)
    return pauses


def test_judge_outage_stop_stops_with_4_and_the_resume_command_at_once(tmp_path, fake_clock,
                                                                       capsys):
    r, args = _outage_run(tmp_path, judge_outage="stop")
    assert policy.judge_outage(r, args, [DownJudge()], 2, Clock(0.0, [10.0])) == 4
    assert fake_clock == []
    assert capsys.readouterr().err.strip() == (
        "error: judge got no reply to its calls for 1 step(s) in a row (the last: 1 try, the "
        f"last APIConnectionError); checkpoint saved at step 2 in {tmp_path}; once it answers, "
        f"go on with: {sys.executable} train.py --config c.yaml --resume")


def test_judge_outage_wait_goes_on_when_the_judge_answers_again(tmp_path, fake_clock):
    r, args = _outage_run(tmp_path)
    judge = DownJudge(back=lambda tries: tries == 2)
    assert policy.judge_outage(r, args, [judge], 2, Clock(0.0, [10.0])) is None
    assert fake_clock == [10.0, 20.0] and judge.down_steps == 0


def test_judge_outage_wait_stops_with_4_when_judge_wait_minutes_run_out(tmp_path, fake_clock):
    r, args = _outage_run(tmp_path, judge_wait_minutes=1)
    assert policy.judge_outage(r, args, [DownJudge()], 2, Clock(0.0, [10.0])) == 4
    assert sum(fake_clock) == pytest.approx(60.0, abs=1.0)


def test_judge_outage_wait_stops_with_0_when_the_time_limit_would_pass_first(
        tmp_path, fake_clock, capsys):
    import time
    r, args = _outage_run(tmp_path, max_minutes=2)
    # 120 s from now, less a 10 s step (11 with margin) and a 9 s save: about 100 s to wait
    clock = Clock(started=time.monotonic(), step_seconds=[10.0], save_seconds=9.0)
    assert policy.judge_outage(r, args, [DownJudge()], 2, clock) == 0
    assert sum(fake_clock) == pytest.approx(100.0, abs=1.0)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "[minigrpo] stopped at step 2 of 4: run.max_minutes=2 would pass while waiting (judge got "
        "no reply to its calls for 1 step(s) in a row (the last: 1 try, the last "
        f"APIConnectionError)); checkpoint saved in {tmp_path}, go on with --resume")


def test_judge_outage_refused_while_waiting_stops_with_2_as_an_error(tmp_path, fake_clock, capsys):
    r, args = _outage_run(tmp_path)
    args.resume = True  # the run's files were there before: kept

    def refused(tries):
        raise JudgeUnusable("judge: HTTP 401")
    assert policy.judge_outage(r, args, [DownJudge(back=refused)], 2, Clock(0.0, [10.0])) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] \
        == "error: judge: HTTP 401; stopped at step 2, before any checkpoint"


# ----------------------------------------------------------------- held-out rows, last lines


def test_the_held_out_rows_are_scored_every_eval_every_steps_and_only_where_there_are_some():
    assert [s for s in range(1, 10) if rules(held_out=True, eval_every=3).evaluates(s)] == [3, 6, 9]
    assert not any(rules(held_out=False, eval_every=3).evaluates(s) for s in range(1, 10))


def test_the_stop_lines_say_why_where_the_checkpoint_is_and_how_to_go_on():
    cfg = RunConfig(steps=40, stop_without_signal=3, max_minutes=0.5)
    assert policy.stop_line(cfg, 7, "runs/x", NO_SIGNAL) == (
        "[minigrpo] stopped at step 7 (run.stop_without_signal=3); checkpoint saved in runs/x")
    assert policy.stop_line(cfg, 7, "runs/x", TIME_LIMIT) == (
        "[minigrpo] stopped at step 7 of 40: the next step would end past run.max_minutes=0.5; "
        "checkpoint saved in runs/x, go on with --resume")
