"""The run's stop-and-save rules (the run's policy, not the model's): after each step, whether to
checkpoint it, whether the run stops and why (no learning signal, run.max_minutes), and which
judges are down; and when the held-out rows are scored. train.py's loop trains and logs a step,
then asks. These functions decide and print nothing; judge_outage alone acts (it waits for a
judge, or says why the run stops).

    rules = Policy(cfg.run, start, held_out=bool(r.eval_rows), clock=Clock(started),
                   flat_steps=display.flat_steps_at_end(metrics_path))
    for step in ...:
        began = time.monotonic()
        ... the step; if rules.evaluates(step): the held-out scores, rules.clock.eval_seconds = ...
        decision = rules.after_step(step, metrics, judges_down, began, time.monotonic())
        if decision.save: ... checkpoint, rules.clock.saved(seconds)
        if decision.wait_for: judge_outage(r, args, decision.wait_for, step, rules.clock)
        if decision.stop: print(stop_line(cfg.run, step, run_dir, decision.stop)) -> exit_code

The times are seconds on the caller's clock (time.monotonic), passed in, so tests give their own;
judge_outage alone reads the clock, as it waits.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from api.client import Judge
from config import JudgeUnusable, RunConfig
from parallel import distributed
from run import display
from run.lifecycle import resume_command, stop_on_error
from run.state import Run
from scoring import outage

NO_SIGNAL, TIME_LIMIT = "no signal", "time limit"  # why a run stops after a step (Decision.stop)


@dataclass
class Clock:
    """What run.max_minutes counts with: the job's start, each step's own seconds (without its
    held-out scoring), the last held-out scoring's and the longest checkpoint's."""
    started: float
    step_seconds: list[float] = field(default_factory=list)
    eval_seconds: float = 0.0
    save_seconds: float = 0.0

    def saved(self, seconds: float) -> None:
        """A checkpoint took `seconds`: the longest is the one counted."""
        self.save_seconds = max(self.save_seconds, seconds)

    def reserve(self) -> float:
        """The seconds to keep for the next step (as long as the longest of the last 5, plus 10%)
        and its checkpoint: what a judge outage's wait leaves before run.max_minutes."""
        return 1.1 * max(self.step_seconds[-5:]) + self.save_seconds


@dataclass(frozen=True)
class Decision:
    """What follows a step: its checkpoint, the judges down (waited for, or only said because the
    run ends here), the no-signal warning, and why the run stops (NO_SIGNAL, TIME_LIMIT, None)."""
    save: bool
    stop: str | None = None
    warn_no_signal: bool = False
    wait_for: list[Judge] = field(default_factory=list)  # before the next step (run.judge_outage)
    said_down: list[Judge] = field(default_factory=list)  # a warning each: the run ends anyway

    @property
    def exit_code(self) -> int:
        """The run's exit code when it stops here: 3 without signal, 0 for the time limit."""
        return 3 if self.stop == NO_SIGNAL else 0


@dataclass
class Policy:
    """The rules for one process's run of steps start + 1 .. cfg.steps, and what they remember from
    step to step: the steps in a row without signal (counted on from the logs when resumed) and
    the clock. held_out: this rank scores held-out rows (run.eval_every; under torchrun rank 0)."""
    cfg: RunConfig
    start: int
    held_out: bool
    clock: Clock
    flat_steps: int = 0
    recorded: bool = False  # the prompts trained on are recorded (with the first checkpoint)

    def evaluates(self, step: int) -> bool:
        """Does `step` score the held-out rows (every run.eval_every steps)?"""
        return self.held_out and step % self.cfg.eval_every == 0

    def after_step(self, step: int, metrics: dict, down: list[Judge], began: float,
                   now: float) -> Decision:
        """The decision after `step` (begun at `began`; its held-out scoring, if any, timed in
        clock.eval_seconds) with its `metrics` and the judges `down` on any rank. Under torchrun
        every rank decides the same: the time limit is any rank's (distributed.agree)."""
        cfg, clock = self.cfg, self.clock
        self.flat_steps = self.flat_steps + 1 if metrics.get("frac_reward_zero_std") == 1.0 else 0
        no_signal = bool(cfg.stop_without_signal) and self.flat_steps >= cfg.stop_without_signal
        clock.step_seconds.append(  # the step's own time, without its held-out scoring
            now - began - (clock.eval_seconds if self.evaluates(step) else 0.0))
        save = saves(cfg, step, self.start, no_signal, down)
        timed_out = not no_signal and step < cfg.steps and distributed.agree(
            out_of_time(cfg, clock.started, clock.step_seconds, now, self.after_next(step, save)))
        goes_on = step < cfg.steps and not no_signal and not timed_out
        warn_at = display.NO_SIGNAL_WARN_AFTER
        return Decision(
            save=save or timed_out,
            stop=NO_SIGNAL if no_signal else TIME_LIMIT if timed_out else None,
            warn_no_signal=self.flat_steps == warn_at or (no_signal and self.flat_steps < warn_at),
            wait_for=down if goes_on else [], said_down=[] if goes_on else down)

    def after_next(self, step: int, saving: bool) -> float:
        """The seconds that must fit after the next step besides it, for the time limit: its
        held-out scoring (the last one's length; before the first, as long as a step) and the
        checkpoint written when stopping, besides this step's own (`saving`)."""
        clock = self.clock
        scoring = (clock.eval_seconds or max(clock.step_seconds[-5:])
                   if self.evaluates(step + 1) else 0.0)
        return scoring + clock.save_seconds * (1 + bool(saving))


def saves(cfg: RunConfig, step: int, start: int, no_signal: bool, down: list[Judge]) -> bool:
    """Is `step` checkpointed (before any time limit's stop): every run.save_every steps, at the
    last step, before stopping without signal or acting on a judge outage, and, with a time limit,
    the process's first step, whose checkpoint times the last one."""
    return bool(no_signal or down or step == cfg.steps
                or (cfg.save_every and step % cfg.save_every == 0)
                or (cfg.max_minutes and step == start + 1))


def out_of_time(cfg: RunConfig, started: float, step_seconds: list[float], now: float,
                extra: float = 0.0) -> bool:
    """run.max_minutes: would the next step (as long as the longest of the last 5, plus 10%) and
    what must follow it (`extra`: its held-out scoring, the checkpoint written when stopping) end
    past it?

    >>> cfg = RunConfig(max_minutes=10)  # 600 s
    >>> out_of_time(cfg, 0.0, [50.0, 30.0], 550.0)  # at 550 s, a 50 s step (55 with margin) passes
    True
    >>> out_of_time(cfg, 0.0, [30.0], 550.0), out_of_time(RunConfig(), 0.0, [30.0], 1e9)
    (False, False)
    >>> out_of_time(cfg, 0.0, [30.0], 550.0, extra=20.0)  # a 20 s checkpoint after it
    True
    """
    limit = cfg.max_minutes * 60
    return bool(limit) and now - started + 1.1 * max(step_seconds[-5:], default=0.0) + extra > limit


def stop_line(cfg: RunConfig, step: int, run_dir: Path, why: str) -> str:
    """The line a run stopped after `step` (checkpointed) ends with, for NO_SIGNAL or TIME_LIMIT."""
    if why == NO_SIGNAL:
        return (f"[minigrpo] stopped at step {step} (run.stop_without_signal="
                f"{cfg.stop_without_signal}); checkpoint saved in {run_dir}")
    return (f"[minigrpo] stopped at step {step} of {cfg.steps}: the next step would end past "
            f"run.max_minutes={cfg.max_minutes:g}; checkpoint saved in {run_dir}, go on with "
            "--resume")


def judge_outage(r: Run, args, down: list[Judge], step: int, clock: Clock) -> int | None:
    """run.judge_outage, after `step` (checkpointed) with the judges `down`: None when each
    answers again within run.judge_wait_minutes (the run goes on); else the exit code, its line
    said: 4 (stop, or the wait ran out), 0 (run.max_minutes would pass first, keeping
    clock.reserve() seconds for a step and its checkpoint), 2 (the endpoint now refuses the key
    or the model)."""
    cfg = r.cfg.run
    wait = cfg.judge_wait_minutes * 60 or math.inf
    left = (cfg.max_minutes * 60 - (time.monotonic() - clock.started) - clock.reserve()
            if cfg.max_minutes else wait)
    deadline = time.monotonic() + min(wait, left)
    try:
        for judge in down:
            seconds = deadline - time.monotonic()
            waits = cfg.judge_outage == "wait" and distributed.world() == 1  # torchrun: stop
            if waits and seconds > 0 and outage.wait(judge, seconds):
                continue
            if waits and left < wait:  # the time limit, not the judge
                print(f"[minigrpo] stopped at step {step} of {cfg.steps}: run.max_minutes="
                      f"{cfg.max_minutes:g} would pass while waiting ({outage.what(judge)}); "
                      f"checkpoint saved in {r.run_dir}, go on with --resume", file=sys.stderr)
                return 0
            print(outage.stop_line(judge, step, r.run_dir, resume_command(args, r.judges)),
                  file=sys.stderr)
            return 4
    except JudgeUnusable as e:  # it answered the wait's request with a 401, 403, 404 ...
        return stop_on_error(r, args, e, step)
    return None
