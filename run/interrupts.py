"""Ctrl-C, SIGTERM and a notebook's stop button (it sends train.py SIGINT): the run keeps its last
finished step (the one whose metrics line was logged), then ends with one line naming the --resume
command. train.py's loop enters it here:

    stops = Stops(r, args)
    try:
        with stops.caught():                  # SIGINT, SIGTERM -> KeyboardInterrupt, Terminated
            for step in ...:
                with stops.deferred():        # at once while sampling, else at the block's end
                    ... the step, its metrics line
                    stops.finished(step)      # a stop from here on keeps this step
                    ... its checkpoint, when due
    except KeyboardInterrupt as e:
        return stops.stop(e)                  # the last finished step saved -> 130 (143)

A stop while the step samples and scores (most of its time: r.phase "sampling") raises at once and
drops the step: nothing the checkpoint holds has changed yet but the RNG states, the data position
and the judges' totals. So the state that finished() takes as each step ends (rank_state, a few KB)
is what the stop's checkpoint holds, with the weights, optimizer, schedule and scaler as they stand.
From the moment the step leaves sampling, its updates change the weights: the signal then waits
until the step is logged (and saved, when due), and is raised there. A second signal while one
waits stops at once, from the last checkpoint (the weights may be half updated); one while the
stop's own checkpoint is written leaves the checkpoint before it whole (save_checkpoint's .tmp and
rename), and the line says which one --resume takes.

Under torchrun (world > 1) each process meets the signal at its own point of the step, and a save
needs every process in its gather, so there a stop is what any other error is: the last checkpoint
(lifecycle.stop_on_error).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

from files.command import Terminated, interrupted, is_write_error, sigterm_as_interrupt
from parallel import distributed
from run.checkpoint import checkpoints, rank_state, save_checkpoint
from run.lifecycle import resume_command, stop_on_error
from run.state import Run
from sources import seen_prompts


class Stops:
    """One process's run: its last finished step with the state it ended in, and a signal held
    while a step's updates run."""

    def __init__(self, r: Run, args):
        self.r, self.args = r, args
        self.active = (distributed.world() == 1  # torchrun: as any other error (see above)
                       and threading.current_thread() is threading.main_thread())
        self.last, self.own = r.start, None  # the last finished step, rank_state(r) as it ended
        self.open = self.kept = False  # inside deferred(); its step finished
        self.held: KeyboardInterrupt | None = None  # the signal that waits for the step's end
        self.again = self.torn = False  # a second signal came; it stopped a step mid-update

    @contextlib.contextmanager
    def caught(self):
        """While inside: SIGINT raises KeyboardInterrupt, SIGTERM Terminated, each held while a
        step's updates run (deferred). SIGINT is left ignored where it is (a background job)."""
        if not self.active:
            with sigterm_as_interrupt():
                yield
            return
        caught = [s for s in (signal.SIGINT, signal.SIGTERM)
                  if s == signal.SIGTERM or signal.getsignal(s) is not signal.SIG_IGN]
        old = {s: signal.signal(s, self._on_signal) for s in caught}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame) -> None:
        e = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        waits = self.open and (self.kept or self.r.phase != "sampling")  # the weights may move
        if waits and self.held is None:
            self.held, name = e, interrupted(e)[0]
            say(f"\n[minigrpo] {name}: the run stops once step {self.r.step} is logged and saved; "
                f"{name} again stops at once, from the last checkpoint")
            return
        self.again, self.torn = self.held is not None, waits and not self.kept
        raise e

    @contextlib.contextmanager
    def deferred(self):
        """One step: a stop while it samples and scores raises at once (the step is dropped); after
        that it waits for the block's end, and is raised there once the step has finished."""
        self.open, self.kept, self.held = True, False, None
        try:
            yield
        finally:
            self.open = False
        if self.held is not None and self.kept:  # else the step stopped on an error: said already
            raise self.held

    def finished(self, step: int) -> None:
        """`step` ended and its metrics line is logged: a stop from here on keeps it, with the RNG
        states, data position and judge totals as they are now (the next step's sampling moves
        them)."""
        self.kept, self.last = True, step
        self.own = rank_state(self.r) if self.active else None

    def stop(self, e: KeyboardInterrupt) -> int:
        """After a stop `e`: the last finished step checkpointed (unless it is already, or a second
        stop came), one line ending in the --resume command -> 130 (Ctrl-C), 143 (SIGTERM). No step
        finished in this process, or under torchrun: lifecycle.stop_on_error, as for any error."""
        r, (name, code) = self.r, interrupted(e)
        if self.active and self.torn:
            return stop_on_error(r, self.args, e, r.step, f"interrupted ({name}) twice, the second "
                                 f"while step {r.step} updated the weights")
        if not self.active or self.last == r.start:
            return stop_on_error(r, self.args, e, r.step)
        ckpt = r.run_dir / "checkpoints" / f"step_{self.last:06d}"
        head = (f"\n[minigrpo] interrupted ({name}) "
                + (f"during step {r.step} (dropped)" if r.step > self.last
                   else f"after step {self.last}"))
        if ckpt in checkpoints(r.run_dir):
            kept = f"step {self.last} is saved in {ckpt}"
        elif self.again:  # the second stop cut the step's own checkpoint short
            return self.unsaved(e, head)
        else:
            try:
                with sigterm_as_interrupt():
                    self.save()
            except KeyboardInterrupt:
                return self.unsaved(e, head)
            except OSError as err:  # a full disk: as any error
                if not is_write_error(err):
                    raise
                return stop_on_error(r, self.args, err, r.step)
            kept = f"step {self.last}, the last finished, saved in {ckpt}"
        print(f"{head}; {kept}: go on with: {resume_command(self.args, r.judges)}",
              file=sys.stderr)
        return code

    def save(self) -> None:
        """The last finished step's checkpoint, with the state it ended in; the prompts trained on
        recorded as train.save records them with a process's first checkpoint."""
        r = self.r
        if not any(int(p.name[len("step_"):]) > r.start for p in checkpoints(r.run_dir)):
            seen_prompts.record(r.run_dir, r.rows, r.cfg.model, resumed=r.start > 0)
        save_checkpoint(r, self.last, self.own)

    def unsaved(self, e: KeyboardInterrupt, head: str) -> int:
        """A second stop while the last finished step was being saved: its .tmp is gone, the
        checkpoint before it whole; the line names the one --resume takes."""
        r, (name, code) = self.r, interrupted(e)
        older = checkpoints(r.run_dir)
        if not older:
            return stop_on_error(r, self.args, e, r.step, f"interrupted ({name}), and again while "
                                 f"saving step {self.last}")
        print(f"{head}, and again while saving step {self.last} (not saved); --resume goes on from "
              f"{older[-1]}: go on with: {resume_command(self.args, r.judges)}", file=sys.stderr)
        return code


def say(line: str) -> None:
    """A line from a signal handler: stderr may be mid-write there (its buffer is not reentrant)."""
    with contextlib.suppress(RuntimeError):
        print(line, file=sys.stderr, flush=True)
