"""What a run shows its user: the step line and the progress bar, the tracker (wandb or trackio),
the advice for a step that ran out of GPU memory, and the warning for steps without a learning
signal. train.py calls these; nothing here changes what is trained.

    python -m pytest run/display.py      # its examples; train.py is what runs it
"""
from __future__ import annotations

import hashlib
import importlib
import sys
import time
from pathlib import Path

import torch

from config import Config, saved_dict
from files import jsonl

SHOWN = [("reward", "reward {:.3f}"), ("reward_std", "± {:.3f}"), ("eval/reward", "eval {:.3f}"),
         ("loss", "loss {:+.4f}"), ("kl", "kl {:.4f}"), ("rewards/margins", "margin {:+.3f}"),
         ("rewards/accuracies", "acc {:.2f}"), ("eval/rewards/accuracies", "eval acc {:.2f}"),
         ("entropy", "ent {:.2f}"), ("completions/mean_length", "len {:.1f}"),
         ("frac_reward_zero_std", "zero_std {:.2f}"), ("epoch", "epoch {:.2f}"),
         ("skipped_updates", "skipped {:.0f}"), ("learning_rate", "lr {:.2e}"),
         ("step_time", "{:.1f}s")]


def format_line(step: int, total: int, m: dict, keys: tuple = ()) -> str:
    """One plain line per step; with `keys`, only those metrics (the progress bar's short form).

    >>> format_line(3, 10, {"reward": 0.5, "reward_std": 0.1, "loss": 0.0, "step_time": 2.25})
    'step 3/10 | reward 0.500 ± 0.100 | loss +0.0000 | 2.2s'
    """
    shown = [(k, fmt) for k, fmt in SHOWN
             if k in m and (not keys or k in keys) and (k != "reward_std" or "reward" in m)]
    parts = [f"step {step}/{total}"] + [fmt.format(m[k]) for k, fmt in shown]
    return " | ".join(parts).replace(" | ±", " ±")


def open_tracker(cfg: Config, run_dir: Path, resumed: bool):
    """run.report_to: the wandb or trackio module, initialised (the same run again on --resume), or
    None. Both take init(project, name, config, resume) and log(metrics, step); the config sent is
    the one saved to config.yaml, with extra_headers masked (keys live in env vars, never in it)."""
    if cfg.run.report_to == "none":
        return None
    tracker = importlib.import_module(cfg.run.report_to)
    options = {"project": cfg.run.project, "name": run_dir.name, "config": saved_dict(cfg),
               "resume": "allow" if resumed else "never"}
    if cfg.run.report_to == "wandb":  # wandb resumes by id: one per run directory
        options["id"] = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        options["resume"] = "allow"
    tracker.init(**options)
    return tracker


def out_of_memory(cfg: Config, phase: str, device: torch.device, config_path: str = "<your config>",
                  err: BaseException | None = None) -> str:
    """One line for a step that ran out of GPU memory: how much, while doing what, and the settings
    that lower that phase's peak, each with its value now (those already at their leanest left out).
    A reward model's own message (graders/reward_model.py) says what to lower in its args."""
    where = ""
    if device.type == "cuda":
        where = (
            f" ({torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated at the peak, "
            f"of {torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB)")
    if err is not None and str(err).startswith("reward_model:"):
        return f"{err}{where}"
    o, ro, g, m = cfg.optim, cfg.rollout, cfg.grpo, cfg.model
    training = [f"optim.micro_batch_size (now {o.micro_batch_size})" if o.micro_batch_size != 1
                else "",
                "optim.micro_batch_tokens (a cap on a micro-batch's padded tokens)"
                if not o.micro_batch_tokens else
                f"optim.micro_batch_tokens (now {o.micro_batch_tokens})",
                "" if m.gradient_checkpointing is True else "model.gradient_checkpointing: true",
                "" if g.fused_lm_head or cfg.mode != "grpo" else "grpo.fused_lm_head: true",
                "" if (m.quant == "4bit" or not cfg.lora.enabled or ro.engine != "hf"
                       or ro.merged_sampling is True or ro.compile is True)
                else "model.quant: 4bit (QLoRA)"]  # refused with those (config.py, vllm_engine.py)
    if ro.engine == "vllm" and phase in ("sampling", "syncing the weights to vLLM"):
        tips = [f"rollout.vllm_gpu_memory_utilization (now {ro.vllm_gpu_memory_utilization}: "
                "vLLM's share; the trainer gets the rest)",
                f"rollout.max_new_tokens (now {ro.max_new_tokens})"]
    elif phase == "sampling":
        tips = [f"rollout.prompts_per_generate (now {ro.prompts_per_generate or 'all'} prompts a "
                "generate call; fewer hold a smaller KV cache)" if ro.prompts_per_generate != 1
                else "",
                f"rollout.max_new_tokens (now {ro.max_new_tokens})",
                f"rollout.num_generations (now {ro.num_generations})"]
    elif phase == "scoring the held-out rows":
        # SFT's and DPO's held-out loss batch as training does; then generation
        tips = (training[:2] if cfg.mode != "grpo" else []) + [
            f"eval.batch_size (now {cfg.eval.batch_size})",
            f"eval.max_new_tokens (now {cfg.eval.max_new_tokens})"]
    else:
        tips = training
    return (f"out of GPU memory while {phase}{where}; lower it with "
            + ", ".join(t for t in tips if t) + f"; python bench/memory_estimate.py --config "
            f"{config_path} estimates a setting's peak on a CPU")


NO_SIGNAL_WARN_AFTER = 5
NO_SIGNAL = ("[minigrpo] warning: in the last {n} steps no group's rewards differed "
             "(frac_reward_zero_std = 1), so every advantage was 0 and nothing was learned. "
             "Usually the model never earns the reward (a format it does not produce, say): give "
             "partial credit (a graded reward), force the reply's start (data.assistant_prefix), "
             "raise rollout.num_generations or temperature, or set rollout.resample_zero_std. "
             "run.stop_without_signal: N stops such a run.")


def no_signal_warning(flat_steps: int, metrics: dict) -> str:
    """NO_SIGNAL for the last `flat_steps` steps; when the step's completions went unrewarded
    (frac_reward_skipped), a word on the outage that may be behind it."""
    skipped = metrics.get("frac_reward_skipped", 0.0)
    return NO_SIGNAL.format(n=flat_steps) + (
        f" This step {skipped:.0%} of the completions had no reward (fallback: skip): a judge or "
        "rating outage? See reward_errors/* and judge_failures." if skipped else "")


def flat_steps_at_end(metrics_path: Path) -> int:
    """How many of the logged steps, counted back from the last, had no learning signal
    (frac_reward_zero_std = 1)."""
    flags = [rec.get("frac_reward_zero_std") == 1.0
             for _, _, rec in jsonl.read(metrics_path) if rec]
    return next((i for i, flat in enumerate(reversed(flags)) if not flat), len(flags))


def duration(seconds: float) -> str:
    """Seconds as a person reads them.

    >>> duration(42.4), duration(754), duration(3 * 3600 + 125)
    ('42s', '12m34s', '3h02m')
    """
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else \
        f"{s // 3600}h{s % 3600 // 60:02d}m"


PACE_EVERY_S = 30.0  # outside a terminal, a pace line after the first step, then every 30 s


class Pace:
    """Where a run stands in time, for logs and notebooks (no progress bar there): steps done, time
    since the job started, seconds a step and the time left, after the first step (the slowest:
    warm-up, compilation) and then at most every `every_s` seconds. The seconds a step, and so the
    time left, leave out the first step and the time paused (pause(): waiting for a judge that is
    down); after the first step alone there is no estimate yet. max_minutes: run.max_minutes, whose
    stop the line announces when it comes before the last step.

    >>> t = iter([0.0, 40.0, 50.0, 60.0, 90.0, 200.0])
    >>> pace = Pace(10, 0, started=0.0, clock=lambda: next(t))   # the loop starts at 0 s
    >>> pace.line(1)
    '[minigrpo] step 1/10 | 40s elapsed | the first step took 40.0 s (warm-up): eta after the next'
    >>> pace.line(2) is None, pace.line(3)                        # 50 s, 60 s: not 30 s yet
    (True, None)
    >>> pace.line(4)
    '[minigrpo] step 4/10 | 1m30s elapsed | 16.7 s/step | eta 1m40s | first step +23s (warm-up)'
    >>> pace.pause(100.0)                                          # a judge was waited for
    >>> pace.line(5)
    '[minigrpo] step 5/10 | 3m20s elapsed | 15.0 s/step | eta 1m15s | first step +25s (warm-up)'

    The last part is the one-time cost: the first step's time beyond a later step's (with the
    compiled sampler, mostly its compilation), once a later step has shown what a step costs.
    """

    def __init__(self, total: int, start: int, started: float, max_minutes: float = 0.0,
                 every_s: float | None = None, clock=time.monotonic):
        self.total, self.start, self.started = total, start, started
        self.max_minutes, self.clock = max_minutes, clock
        self.every_s = PACE_EVERY_S if every_s is None else every_s
        self.began = clock()  # the loop's start: the first step is timed from here
        self.first_done = self.said = self.once = None  # once: the first step's extra seconds
        self.paused = 0.0  # seconds since the first step that were no step's (pause)
        self.eta: float | None = None  # seconds left at the pace so far (None: after the warm-up)

    def pause(self, seconds: float) -> None:
        """`seconds` after a step that were no step's (a judge waited for): out of the pace."""
        if self.first_done is not None:
            self.paused += seconds

    def line(self, step: int) -> str | None:
        """The line for `step` just done, or None when one was printed under every_s ago (or this
        was the last step: the run's own end line follows)."""
        now, done = self.clock(), step - self.start
        if self.first_done is None:
            self.first_done = now
        per_step = (now - self.first_done - self.paused) / (done - 1) if done > 1 else None
        self.eta = None if per_step is None else per_step * (self.total - step)
        if done > 1:  # what a step costs is known: the first step's extra, so far
            self.once = self.first_done - self.began - per_step
        if step >= self.total or (self.said is not None and now - self.said < self.every_s):
            return None
        self.said = now
        text = f"[minigrpo] step {step}/{self.total} | {duration(now - self.started)} elapsed | "
        if per_step is None:  # the warm-up alone: no step's pace yet
            return text + (f"the first step took {now - self.began:.1f} s (warm-up): eta after "
                           "the next")
        eta = self.eta
        text += f"{per_step:.1f} s/step | eta {duration(eta)}"
        if self.once >= 1:
            text += f" | first step +{duration(self.once)} (warm-up)"
        left = self.max_minutes * 60 - (now - self.started)
        if self.max_minutes and left < eta:
            text += (f"; run.max_minutes={self.max_minutes:g} stops it in about "
                     f"{duration(max(left, 0))}, near step {step + int(max(left, 0) // per_step)} "
                     "(--resume continues)")
        return text


class progress_display:
    """A rich progress bar with ETA and a live metrics line on a terminal; plain lines otherwise:
    one per step on stdout, and Pace's on stderr. Both ETAs are Pace's: without the warm-up step
    and the judge waits."""

    def __init__(self, total: int, start: int, started: float | None = None,
                 max_minutes: float = 0.0):
        self.total, self.start = total, start
        self.started, self.max_minutes = started, max_minutes
        self.progress = self.pace = None
        if sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"), BarColumn(bar_width=20),
                TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"),
                TextColumn("{task.description}"))

    def __enter__(self):
        now = time.monotonic()
        self.pace = Pace(self.total, self.start, now if self.started is None else self.started,
                         self.max_minutes)
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total, completed=self.start, eta="-")
        return self

    def __call__(self, step: int, m: dict) -> None:
        self.show(step, m)

    def pause(self, seconds: float) -> None:
        """`seconds` after a step that were no step's (a judge waited for): out of the pace."""
        self.pace.pause(seconds)

    def show(self, step: int, m: dict) -> None:
        if self.progress:
            keys = (("reward", "reward_std", "eval/reward", "kl", "completions/mean_length")
                    if "reward_std" in m else ("loss", "rewards/margins", "rewards/accuracies",
                                               "eval/rewards/accuracies", "epoch"))
            short = format_line(step, self.total, m, keys).split(" | ", 1)[1].replace(" | ", "  ")
            self.pace.line(step)  # keeps the time a step takes; its text is for logs, not here
            self.progress.update(self.task, completed=step, description=short,
                                 eta="-" if self.pace.eta is None else duration(self.pace.eta))
            if step == self.start + 2 and self.pace.once >= 1:  # known once a second step is done
                self.progress.console.print(f"[minigrpo] the first step took "
                                            f"{duration(self.pace.once)} more than a step since "
                                            "(warm-up, compilation)", markup=False)
        else:
            print(format_line(step, self.total, m), flush=True)
            if line := self.pace.line(step):
                print(line, file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()
