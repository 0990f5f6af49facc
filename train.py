"""Train a policy with GRPO: the command line and the loop. Each step samples B prompts x G
completions, scores them, turns the rewards into group advantages and takes clipped-surrogate
updates (step.train_step); this file logs, checkpoints and stops. run/lifecycle.py builds the run.

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
leaves a half checkpoint). Bad input exits with code 2 and one line saying what to fix.
"""
from __future__ import annotations

import argparse
import sys
import time

STARTED = time.monotonic()  # run.max_minutes counts from the process's start, importing torch too

import torch

import rollout
from api import outage
from api.client import JudgeUnusable
from config import ConfigError
from files import jsonl
from files.jsonl import is_write_error, said_interrupted, sigterm_as_interrupt
from judge import judges_stats
from model import pick_dtype
from modes import dpo, sft
from parallel import distributed
from run import display, lifecycle
from run.checkpoint import save_checkpoint
from sources import overlap
from step import Run, train_step

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


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The CLI; `started`: the job's start (the CLI's: this module's import) for run.max_minutes."""
    started = time.monotonic() if started is None else started  # the limit counts the loading too
    argv = sys.argv[1:] if argv is None else argv
    distributed.quiet_other_ranks()  # torchrun: rank 0 speaks and writes for the run
    args, overrides = parse_args(argv)
    args.argv = argv  # for the --resume command a stopped run gives
    try:
        with sigterm_as_interrupt():  # loading a model can take minutes: if stopped, one line too
            r = lifecycle.setup(args, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return said_interrupted(e)
    if args.dry_run:
        print(lifecycle.dry_run_report(r))
        if not args.resume and any((r.run_dir / n).exists() for n in lifecycle.RUN_FILES):
            print(f"  note: run.out_dir={r.run_dir} already holds a run; the real run refuses it "
                  "without --resume (or set another run.out_dir)")
        return 0
    created = not r.run_dir.exists()  # a stop before the first checkpoint removes only what it made
    r.step, tracker = r.start, None
    try:
        with sigterm_as_interrupt():
            if distributed.rank() == 0:
                tracker = display.open_tracker(r.cfg, r.run_dir, resumed=r.start > 0)
            return run(r, args, created, tracker, started)
    except (KeyboardInterrupt, OSError) as e:  # Ctrl-C or SIGTERM; a full disk (the run's files)
        if isinstance(e, OSError) and not is_write_error(e):
            raise  # a bug's missing file, a reset connection: its traceback; the run's files kept
        return lifecycle.stop_on_error(r, args, e, r.step, created)
    finally:
        if tracker:
            tracker.finish()
        distributed.stop()


def run(r: Run, args, created: bool, tracker, started: float | None = None) -> int:
    """The run's files, then steps start + 1 .. run.steps (logged, saved, shown) -> exit code."""
    cfg, run_dir, start = r.cfg, r.run_dir, r.start
    writes = distributed.rank() == 0  # under torchrun rank 0 alone writes the run's files
    metrics_path, samples_path = lifecycle.open_run_files(r)  # config.yaml, logs as of step start
    n_train = sum(p.numel() for p in r.params)
    epochs = f" ({cfg.run.epochs:g} epochs)" if cfg.run.epochs else ""
    ranks = f" x {distributed.world()} processes" if distributed.world() > 1 else ""  # torchrun
    print(f"[minigrpo] {cfg.model.name} on {r.device}{ranks} "
          f"({pick_dtype(cfg.model.dtype, r.device)}), "
          f"{n_train / 1e6:.2f}M trainable params, {len(r.rows)} {lifecycle.ROW_NAMES[cfg.mode]}, "
          f"steps {start}->{cfg.run.steps}{epochs}", file=sys.stderr)
    if r.engine:
        r.engine.sync(r.model)  # vLLM starts from the policy as loaded (or resumed)
    step_fn = {"sft": sft.sft_step, "dpo": dpo.dpo_step}.get(cfg.mode, train_step)
    flat_steps = display.flat_steps_at_end(metrics_path)  # steps in a row without signal
    recorded, started, step_seconds = None, time.monotonic() if started is None else started, []
    eval_seconds = save_seconds = 0.0  # the last held-out scoring's and save's, for run.max_minutes
    with display.progress_display(cfg.run.steps, start) as show:
        for step in range(start + 1, cfg.run.steps + 1):
            r.step, t_step = step, time.monotonic()
            r.sampler.progress = (step - 1) / max(1, cfg.run.steps - 1)  # mixture curriculum clock
            try:
                r.phase = "training"  # train_step says when it samples
                metrics, shown = step_fn(r)
                evaluated = bool(r.eval_rows) and step % cfg.run.eval_every == 0
                if evaluated:
                    t_eval = time.monotonic()
                    metrics |= held_out_metrics(r)
                    eval_seconds = time.monotonic() - t_eval
                # the step's judge calls (every rank's), held-out too (any mode)
                metrics |= distributed.all_sum(judges_stats(r.judges))
            except (JudgeUnusable, torch.OutOfMemoryError, rollout.NonFiniteLogits) as e:
                # bad key or model name, out of GPU memory, fp16 overflow: later steps won't fix it
                return lifecycle.stop_on_error(r, args, e, step, created)
            metrics = {"step": step, **metrics}
            if writes:
                jsonl.append(metrics_path, [metrics])
            if tracker:
                tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            if writes and cfg.run.sample_every and step % cfg.run.sample_every == 0:
                n = cfg.run.samples_per_log or cfg.rollout.num_generations  # 0: all the first group
                jsonl.append(samples_path, [{"step": step, **s} for s in shown[:n]])
            flat_steps = flat_steps + 1 if metrics.get("frac_reward_zero_std") == 1.0 else 0
            stop = cfg.run.stop_without_signal and flat_steps >= cfg.run.stop_without_signal
            judge_down = distributed.down_anywhere(  # saved before waiting
                outage.down(r.judges, cfg.run.judge_outage_steps), r.judges)
            # the step's own time, without its held-out scoring
            step_seconds.append(time.monotonic() - t_step - (eval_seconds if evaluated else 0.0))
            saving = stop or judge_down or step == cfg.run.steps or (
                cfg.run.save_every and step % cfg.run.save_every == 0) or (cfg.run.max_minutes
                and step == start + 1)  # a time limit: the first checkpoint times the last
            # after the next step: its held-out scoring (if any; the first counts as long as a step)
            # and the checkpoint written when stopping, besides this step's own (if it writes one)
            scoring = eval_seconds or max(step_seconds[-5:])
            extra = (scoring if r.eval_rows and (step + 1) % cfg.run.eval_every == 0
                     else 0.0) + save_seconds * (1 + bool(saving))
            timed_out = not stop and step < cfg.run.steps and distributed.agree(  # any rank's clock
                lifecycle.out_of_time(cfg, started, step_seconds, time.monotonic(), extra))
            if saving or timed_out:
                if recorded is None and writes:  # for eval.py's overlap check, 1st checkpoint
                    recorded = overlap.record(run_dir, r.rows, cfg.model, resumed=start > 0)
                t_save = time.monotonic()
                save_checkpoint(r, step)
                save_seconds = max(save_seconds, time.monotonic() - t_save)
            show(step, metrics)
            warn_at = display.NO_SIGNAL_WARN_AFTER
            if flat_steps == warn_at or (stop and flat_steps < warn_at):
                skipped = metrics.get("frac_reward_skipped", 0.0)
                print(display.NO_SIGNAL.format(n=flat_steps) + (f" This step {skipped:.0%} of the "
                      "completions had no reward (fallback: skip): a judge or rating outage? See "
                      "reward_errors/* and judge_failures." if skipped else ""), file=sys.stderr)
            if judge_down and step < cfg.run.steps and not stop and not timed_out:
                reserve = 1.1 * max(step_seconds[-5:]) + save_seconds  # the next step, its save
                code = lifecycle.judge_outage(r, args, judge_down, step, started, reserve)
                if code is not None:
                    return code
            for judge in judge_down if (stop or timed_out or step == cfg.run.steps) else []:
                print(f"[minigrpo] warning: {outage.what(judge)}", file=sys.stderr)
            if stop:
                print(f"[minigrpo] stopped at step {step} "
                      f"(run.stop_without_signal={cfg.run.stop_without_signal}); "
                      f"checkpoint saved in {run_dir}", file=sys.stderr)
                return 3
            if timed_out:
                print(f"[minigrpo] stopped at step {step} of {cfg.run.steps}: the next step would "
                      f"end past run.max_minutes={cfg.run.max_minutes:g}; checkpoint saved in "
                      f"{run_dir}, go on with --resume", file=sys.stderr)
                return 0
    print(f"[minigrpo] done: {run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
