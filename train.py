"""Train a policy with GRPO: the command line and the loop. Each step samples B prompts x G
completions, scores them, turns the rewards into group advantages and takes clipped-surrogate
updates (step.train_step); this file logs and checkpoints them. run/lifecycle.py builds the run;
run/policy.py decides after each step whether to checkpoint it and whether the run stops.

  python train.py --config configs/quickstart.yaml
  python train.py --config configs/quickstart.yaml --grpo.beta=0.04 --run.out_dir=runs/quickstart_kl
  python train.py --config configs/quickstart.yaml --resume    # continue from the last checkpoint
  python train.py --config configs/quickstart.yaml --dry-run   # check it all, show the first prompt
  python train.py --config configs/quickstart_sft.yaml         # mode: sft, a step is modes/sft.py's
  python train.py --config configs/quickstart_dpo.yaml         # mode: dpo, a step is modes/dpo.py's
  torchrun --nproc_per_node=4 train.py --config x.yaml  # data-parallel GRPO: docs/multi-gpu.md

A run directory (run.out_dir) receives config.yaml, metrics.jsonl (one line per step),
samples.jsonl (completions with their rewards) and checkpoints/step_NNNNNN/ (adapter, optimizer,
scheduler, RNG states, data position; written to a .tmp directory and renamed, so a kill never
leaves a half checkpoint). Bad input exits with code 2 and one line saying what to fix. Ctrl-C or
SIGTERM (exit 130, 143) first checkpoints the last finished step, so --resume loses at most the step
in flight; a stop while the weights update waits for the step's end (run/interrupts.py).
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # run.max_minutes counts from the process's start, importing torch too

import torch

import rollout
from config import ConfigError, JudgeUnusable
from files import command, jsonl
from files.command import is_write_error
from judge import judges_stats
from model import pick_dtype
from modes import dpo, sft
from parallel import distributed
from run import display, folder_lock, health, interrupts, lifecycle, policy
from run.checkpoint import save_checkpoint
from run.state import Run
from scoring import outage
from sources import seen_prompts
from step import train_step

# ----------------------------------------------------------------------------- CLI and loop


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Any config field: --section.key=value")
    ap.add_argument("--config", required=True, help="YAML config file")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in run.out_dir")
    ap.add_argument("--dry-run", action="store_true", help="check config, data, model and judges, "
        "show the first prompt as the model sees it, and exit without training or writing anything")
    return ap.parse_known_args(argv)


def held_out_metrics(r: Run) -> dict:
    """eval/* metrics: the held-out rows decoded as eval.py decodes them (eval.temperature,
    eval.num_samples) by the policy now, scored with the rewards (SFT: eval/loss; DPO: eval/loss,
    eval/rewards/*; and these when it has rewards). The random state is set aside and restored, so
    a run with run.eval_every trains exactly as one without."""
    import eval as ev
    cfg, t0 = r.cfg, time.time()
    r.phase = "scoring the held-out rows"
    loss = {"sft": lambda: {"eval/loss": sft.held_out_loss(r)},
            "dpo": lambda: dpo.held_out_metrics(r)}.get(cfg.mode, dict)()
    if not cfg.rewards:
        return loss | {"eval/seconds": time.time() - t0}
    was_training = r.model.training
    r.model.eval()
    with torch.random.fork_rng(devices=[r.device] if r.device.type == "cuda" else []):
        gen = ev.generate_rows(r.model, r.tokenizer, r.eval_rows, cfg)
    r.model.train(was_training)
    _, _, m = ev.score_rows(gen, r.eval_rows, cfg.eval.num_samples, cfg, rollout.reply_prefix(
        r.tokenizer, cfg.data), r.judges, cfg.data.assistant_prefix)
    m = {f"eval/{k}": v for k, v in m.items() if isinstance(v, (int, float))}
    return loss | m | {"eval/seconds": time.time() - t0}


@folder_lock.released_on_return  # one trainer per run folder (a second exits 2)
@command.one_line(ConfigError)  # loading a model can take minutes: if stopped, one line too
def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The CLI; `started`: the job's start (the CLI's: this module's import) for run.max_minutes."""
    started = time.monotonic() if started is None else started  # the limit counts the loading too
    argv = sys.argv[1:] if argv is None else argv
    distributed.quiet_other_ranks()  # torchrun: rank 0 speaks and writes for the run
    args, overrides = parse_args(argv)
    args.argv = argv  # for the --resume command a stopped run gives
    r = lifecycle.setup(args, overrides)
    if args.dry_run:
        print(lifecycle.dry_run_report(r))
        if not args.resume and any((r.run_dir / n).exists() for n in lifecycle.RUN_FILES):
            print(f"  note: run.out_dir={r.run_dir} already holds a run; the real run refuses it "
                  "without --resume (or set another run.out_dir)")
        return 0
    r.step, tracker, stops = r.start, None, interrupts.Stops(r, args)
    try:
        with stops.caught():  # Ctrl-C, SIGTERM, a notebook's stop button (its SIGINT)
            if distributed.rank() == 0:
                tracker = display.open_tracker(r.cfg, r.run_dir, resumed=r.start > 0)
            return run(r, args, tracker, stops, started)
    except KeyboardInterrupt as e:  # the last finished step kept (run/interrupts.py)
        return stops.stop(e)
    except OSError as e:  # a full disk (the run's files)
        if not is_write_error(e):
            raise  # a bug's missing file, a reset connection: its traceback; the run's files kept
        return lifecycle.stop_on_error(r, args, e, r.step)
    finally:
        if tracker:
            tracker.finish()
        distributed.stop()


def run(r: Run, args, tracker, stops: interrupts.Stops, started: float | None = None) -> int:
    """The run's files, then steps start + 1 .. run.steps (logged, saved, shown) -> exit code.
    A stop (Ctrl-C, SIGTERM) while a step samples drops it; once its updates begin, the stop waits
    for the step to be logged and saved (stops.deferred)."""
    cfg = r.cfg
    metrics_path, samples_path = lifecycle.open_run_files(r)  # config.yaml, logs as of step start
    step_fn, rules, monitor = begin(r, metrics_path, started)
    with display.progress_display(cfg.run.steps, r.start, rules.clock.started,
                                  cfg.run.max_minutes) as show:
        for step in range(r.start + 1, cfg.run.steps + 1):
            r.step, began = step, time.monotonic()
            r.sampler.progress = (step - 1) / max(1, cfg.run.steps - 1)  # mixture curriculum clock
            with stops.deferred():  # a stop: at once while sampling, else at this block's end
                try:
                    metrics, batch = step_metrics(r, step_fn, rules)
                except (JudgeUnusable, torch.OutOfMemoryError, ConfigError) as e:
                    # bad key or model, out of GPU memory, fp16 overflow (NonFiniteLogits, a
                    # ConfigError), an environment's bad get_reward: later steps won't fix it
                    return lifecycle.stop_on_error(r, args, e, step)
                log_step(r, metrics, batch, metrics_path, samples_path, tracker)
                stops.finished(step)  # a stop from here on keeps this step
                down = outage.down(r.judges, cfg.run.judge_outage_steps)  # any rank's, every rank
                decision = rules.after_step(step, metrics, down, began, time.monotonic())
                if decision.save:
                    save(r, step, rules)
            show(step, metrics)
            health.say(monitor.after_step(metrics))
            if monitor.stop:  # a sampler far off the policy (run/health.py STOPS): no step fixes it
                return lifecycle.stop_on_error(r, args, RuntimeError(monitor.stop), step)
            if decision.warn_no_signal:
                print(display.no_signal_warning(rules.flat_steps, metrics), file=sys.stderr)
            if decision.wait_for:  # run.judge_outage: wait for them (None: they answer), or stop
                waited = time.monotonic()
                code = policy.judge_outage(r, args, decision.wait_for, step, rules.clock)
                show.pause(time.monotonic() - waited)  # the pace's eta leaves the wait out
                if code is not None:
                    return code
            for judge in decision.said_down:
                print(f"[minigrpo] warning: {outage.what(judge)}", file=sys.stderr)
            if decision.stop:
                print(policy.stop_line(cfg.run, step, r.run_dir, decision.stop), file=sys.stderr)
                return decision.exit_code
    for line in outage.unusable_summary(r.judges):  # judges whose replies were often no score
        print(line, file=sys.stderr)
    health.say(monitor.summary())
    print(f"[minigrpo] done: {r.run_dir}", file=sys.stderr)
    return 0


def begin(r: Run, metrics_path, started: float | None):
    """The run's first lines and vLLM's first weights -> (the mode's step function, the run's
    rules: run/policy.py, its health checks: run/health.py)."""
    cfg = r.cfg
    print(start_line(r), file=sys.stderr)
    if r.engine:
        r.engine.sync(r.model)  # vLLM starts from the policy as loaded (or resumed)
    step_fn = {"sft": sft.sft_step, "dpo": dpo.dpo_step}.get(cfg.mode, train_step)
    rules = policy.Policy(cfg.run, r.start, held_out=bool(r.eval_rows), clock=policy.Clock(
        time.monotonic() if started is None else started),  # run.max_minutes counts from it
        flat_steps=display.flat_steps_at_end(metrics_path))  # steps in a row without signal
    if r.start < cfg.run.steps:
        print(first_step_line(r), file=sys.stderr, flush=True)
    return step_fn, rules, health.Monitor(cfg.health, cfg.run.steps, metrics_path)


def start_line(r: Run) -> str:
    """The line a run starts with: the model, where it runs, what it trains, which steps."""
    cfg = r.cfg
    n_train = sum(p.numel() for p in r.params)
    epochs = f" ({cfg.run.epochs:g} epochs)" if cfg.run.epochs else ""
    ranks = f" x {distributed.world()} processes" if distributed.world() > 1 else ""  # torchrun
    return (f"[minigrpo] {cfg.model.name} on {r.device}{ranks} "
            f"({pick_dtype(cfg.model.dtype, r.device)}), {n_train / 1e6:.2f}M trainable params, "
            f"{len(r.rows)} {lifecycle.ROW_NAMES[cfg.mode]}, "
            f"steps {r.start}->{cfg.run.steps}{epochs}")


def first_step_line(r: Run) -> str:
    """What the silent minutes before the first step line are: the first step, its warm-up."""
    cfg, ro = r.cfg, r.cfg.rollout
    work = (f"sampling {ro.prompts_per_step} prompts x {ro.num_generations} completions of up to "
            f"{ro.max_new_tokens} tokens, scoring them, updating" if cfg.mode == "grpo"
            else f"{cfg.mode.upper()} updates")
    warm = " and compiles the sampler" if ro.compile and r.device.type == "cuda" else ""
    return (f"[minigrpo] step {r.start + 1}/{cfg.run.steps}: {work}; the first step warms "
            f"up{warm}, so it is the slowest")


def step_metrics(r: Run, step_fn, rules: policy.Policy) -> tuple[dict, object]:
    """Step r.step trained -> its metrics {"step": n, ...}, the held-out rows' when rules say so,
    and the step.Batch it trained on (None: SFT, DPO); the held-out scoring timed for
    run.max_minutes."""
    r.phase, t0 = "training", time.time()  # train_step says when it samples
    if r.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(r.device)
    metrics, batch = step_fn(r)
    metrics |= {"step_time": time.time() - t0, **memory_readings(r.device, r.scaler)}
    if rules.evaluates(r.step):
        t_eval = time.monotonic()
        metrics |= held_out_metrics(r)
        rules.clock.eval_seconds = time.monotonic() - t_eval
    # the step's judge calls (every rank's), held-out too (any mode)
    metrics |= distributed.all_sum(judges_stats(r.judges))
    return {"step": r.step, **metrics}, batch


def memory_readings(device: torch.device, scaler) -> dict:
    """The step's peak: the process's resident set on a CPU; on a GPU torch's allocations and the
    allocator's reserved peak (allocated plus the blocks it caches). Under fp16, on any device, the
    GradScaler's loss scale (halved at each skipped update)."""
    scale = {"loss_scale": scaler.get_scale()} if scaler else {}
    if device.type != "cuda":
        return {"peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024} | scale
    return {"peak_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20} | scale


def log_step(r: Run, metrics: dict, batch, metrics_path: Path, samples_path: Path,
             tracker) -> None:
    """The step's metrics line in metrics.jsonl and the tracker, the completions of its batch
    (step.Batch; None: none) in samples.jsonl every run.sample_every steps; under torchrun rank 0
    alone writes the run's files."""
    cfg, step, writes = r.cfg, metrics["step"], distributed.rank() == 0
    if writes:
        jsonl.append(metrics_path, [metrics])
    if tracker:
        tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
    if batch is not None and cfg.run.sample_every and step % cfg.run.sample_every == 0:
        shown = completions_shown(batch, cfg.run.samples_per_log or cfg.rollout.num_generations)
        if writes:  # 0: all the first group
            jsonl.append(samples_path, [{"step": step, **s} for s in shown])


def completions_shown(batch, n: int) -> list[dict]:
    """The first n completions of a step's batch with their prompt, reward (None: skipped) and
    advantage; under torchrun every process's batch, rank 0's first (a collective: every rank
    calls it)."""
    k = batch.kept
    rows = [{"prompt": s["prompt"], "completion": t, "reward": None if rw.isnan() else float(rw),
             "advantage": float(a)}
            for s, t, rw, a in zip(k.samples, k.rollout.texts, k.total, batch.advantages)]
    return [row for part in distributed.gather(rows[:n]) for row in part][:n]


def save(r: Run, step: int, rules: policy.Policy) -> None:
    """Checkpoint `step`, timed for run.max_minutes. The process's first checkpoint also records
    the prompts trained on (sources/seen_prompts.py, for eval.py's held-out check; rank 0 writes
    it)."""
    if not rules.recorded and distributed.rank() == 0:
        seen_prompts.record(r.run_dir, r.rows, r.cfg.model, resumed=r.start > 0)
        rules.recorded = True
    t_save = time.monotonic()
    save_checkpoint(r, step)
    rules.clock.saved(time.monotonic() - t_save)


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
