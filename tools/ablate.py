"""Ablations in one command: a config's arms x seeds, each a train.py process, and one report with
every arm's mean and 95% confidence interval over seeds and its paired difference from the first.

    python -m tools.ablate --config configs/quickstart.yaml \\
        --arm "group: grpo.scale_rewards=group" --arm "none: grpo.scale_rewards=none" \\
        --seeds 4 --out runs/ablate_scale [--set run.steps=20 ...] [--eval] [--vary-data] \\
        [--max-minutes 60] [--jobs N] [--plot reward entropy ...] [--plan [METRIC=DIFF ...]]

Run K of arm NAME is `python train.py --config X --run.out_dir=OUT/NAME/seed_K --run.seed=K
[--set's] [the arm's]` in its own process (a crash stays in it), its output in train.log beside its
files and its outcome in ablate.json. Pairing: seed K is run.seed=K in every arm, so every arm's
first step samples the same completions; the data order is data.shuffle_seed's, the same for every
seed unless --vary-data sets data.shuffle_seed=K too.
Resuming: the same command again skips the finished runs (exit 0 at run.steps; exit 3, stopped
without signal) and resumes the others from their last checkpoint (train.py --resume); a failed run
is reported and the others go on. On CPU the runs go in parallel, one per core (--jobs), with the
cores split between them (run.threads): two runs of torch's default threads on 2 cores took 19x as
long a step as one, two of one thread each 0.08x that (bench/two_runs_one_cpu/cpu_threads.log). On a
GPU they run one after another. --max-minutes bounds the whole ablation: a run gets run.max_minutes
= the time left when it starts, so it checkpoints and stops cleanly; run the command again to go on.
--eval: eval.py once per finished run, greedy, on the config's eval.select (OUT/NAME/seed_K/eval/).
The report (OUT/report.md, report.json, plots/) is tools/ablate_report.py's.
--plan (after a pilot of 2-3 seeds, or with the runs already there: finished runs are skipped):
the seeds each paired difference needs at 80% power and the hours they take at the pilot's pace,
printed and in the report (tools/ablate_plan.py); METRIC=DIFF plans for that difference (e.g.
heldout/accuracy=0.05 reward=0.1), else for the difference the pilot measured.
Exit code: 0 every run finished (and was scored), 1 a run or its eval failed or was left for the
next invocation, 2 bad input.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from config import ConfigError, load_config
from files import command
from run import health
from settings.typed_config import check_writable
from tools import ablate_plan, ablate_report

ROOT = Path(__file__).resolve().parents[1]  # train.py and eval.py
MIN_RUN_MINUTES = 1.0  # --max-minutes: with less left, a run is not started
KILL_GRACE_S = 120  # past --max-minutes by this, a run still going is stopped (SIGTERM)
FINAL_EXITS = {0: "finished", 3: "stopped without signal"}  # exit codes the next call skips


@dataclasses.dataclass
class Arm:
    name: str
    overrides: list[str]  # --section.key=value


@dataclasses.dataclass
class RunSpec:
    arm: Arm
    seed: int
    dir: Path
    status: str = "pending"  # finished | stopped without signal | failed | left | not started
    exit_code: int | None = None
    seconds: float = 0.0
    eval_exit: int | None = None


def parse_arm(text: str) -> Arm:
    """"NAME: key=value ..." -> Arm; ValueError naming what to fix.

    >>> parse_arm("none: grpo.scale_rewards=none --grpo.beta=0.04")
    Arm(name='none', overrides=['--grpo.scale_rewards=none', '--grpo.beta=0.04'])
    """
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f'--arm {text!r}: write "NAME: section.key=value ...", NAME of letters, '
                         "digits, _ . -")
    return Arm(name, [as_override(t, f"--arm {name}") for t in shlex.split(rest)])


def as_override(token: str, where: str) -> str:
    key, sep, _ = token.removeprefix("--").partition("=")
    if not sep or not re.fullmatch(r"\w+(\.\w+)+", key):
        raise ValueError(f"{where}: {token!r} is not section.key=value (e.g. grpo.beta=0.04)")
    return "--" + token.removeprefix("--")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.ablate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the YAML config every arm starts from")
    ap.add_argument("--arm", action="append", required=True, metavar='"NAME: KEY=VALUE ..."',
                    help="one arm (give two or more); the first is the baseline")
    ap.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per arm")
    ap.add_argument("--out", required=True, help="folder for every run and the report")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="overrides for every arm (an arm's own win)")
    ap.add_argument("--eval", action="store_true", help="eval.py on each finished run (greedy)")
    ap.add_argument("--vary-data", action="store_true",
                    help="data.shuffle_seed = the seed too (else every seed sees one data order)")
    ap.add_argument("--max-minutes", type=float, default=0.0, help="for the whole ablation")
    ap.add_argument("--jobs", type=int, default=0, help="runs at once (CPU; 0: one per core)")
    ap.add_argument("--plot", nargs="+", metavar="METRIC",
                    help="curves to draw (default: reward and each rewards/NAME/mean)")
    ap.add_argument("--plan", nargs="*", metavar="METRIC=DIFF",
                    help="seeds needed at 80%% power for each difference (default: the pilot's)")
    return ap.parse_args(argv)


def parse_plan(items: list[str] | None) -> list[tuple[str, float]] | None:
    """--plan's METRIC=DIFF items -> [(metric, diff)]; None without --plan; ValueError naming
    the item to fix.

    >>> parse_plan(["heldout/accuracy=0.05"]), parse_plan([]), parse_plan(None)
    ([('heldout/accuracy', 0.05)], [], None)
    """
    if items is None:
        return None
    out = []
    for item in items:
        metric, _, diff = item.partition("=")
        try:
            value = float(diff)
        except ValueError:
            value = math.nan
        if not metric or not math.isfinite(value) or value == 0:
            raise ValueError(f"--plan {item!r}: write METRIC=DIFF with a non-zero number, e.g. "
                             "heldout/accuracy=0.05 (the metric as report.json names it)")
        out.append((metric, value))
    return out


def plan(args: argparse.Namespace) -> tuple[list[RunSpec], object]:
    """The runs, seed by seed (a budget cut leaves whole pairs), and the first arm's config;
    ValueError / ConfigError on bad input, before anything runs."""
    arms = [parse_arm(a) for a in args.arm]
    names = [a.name for a in arms]
    if len(arms) < 2 or len(set(names)) < len(names):
        raise ValueError(f"give two or more --arm with different names (got {', '.join(names)})")
    if args.seeds < 1 or args.jobs < 0 or args.max_minutes < 0:
        raise ValueError("--seeds must be >= 1, --jobs and --max-minutes >= 0")
    args.plan = parse_plan(args.plan)
    common = [as_override(t, "--set") for t in args.set]
    if bad := [o for o in common + [o for a in arms for o in a.overrides]
               if o.startswith(("--run.out_dir=", "--run.seed="))]:
        raise ValueError(f"{bad[0]}: the ablation sets run.out_dir and run.seed itself (--out, "
                         "--seeds)")
    check_writable(args.out, "--out")
    cfgs = [load_with(args, arm, common) for arm in arms]  # every arm's settings checked now
    if cfgs[0].mode != "grpo":
        raise ValueError(f"{args.config}: mode {cfgs[0].mode}; the ablation compares GRPO runs")
    for arm in arms:
        arm.overrides = common + arm.overrides
    runs = [RunSpec(arm, seed, Path(args.out) / arm.name / f"seed_{seed}")
            for seed in range(args.seeds) for arm in arms]
    return runs, cfgs[0]


def load_with(args, arm: Arm, common: list[str]):
    try:
        return load_config(args.config, common + arm.overrides)
    except ConfigError as e:
        raise ConfigError(f"arm {arm.name}: {e}") from None


def placement(cfg, n_runs: int, jobs: int) -> tuple[int, int]:
    """-> (runs at once, run.threads each; 0: torch's default). A GPU: one run at a time."""
    import torch
    device = cfg.run.device
    if device != "cpu" and (device != "auto" or torch.cuda.is_available()):
        return 1, 0
    cores = len(os.sched_getaffinity(0))
    jobs = min(jobs or cores, n_runs)
    return jobs, max(1, cores // jobs)


def outcome(run: RunSpec) -> dict:
    path = run.dir / "ablate.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def is_done(run: RunSpec) -> bool:
    """Finished by an earlier invocation: exit 3, or exit 0 with metrics up to the run's steps."""
    code = outcome(run).get("exit_code")
    if code == 3:
        return True
    if code != 0:
        return False
    try:  # the run's resolved config (run.epochs turned into run.steps), as last resumed
        steps = yaml.safe_load(health.run_config(run.dir).read_text())["run"]["steps"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return False
    return ablate_report.last_step(run.dir) >= steps


def train_command(args, run: RunSpec, threads: int, minutes: float) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", args.config,
           f"--run.out_dir={run.dir}", f"--run.seed={run.seed}"]
    cmd += [f"--data.shuffle_seed={run.seed}"] if args.vary_data else []
    cmd += [f"--run.threads={threads}"] if threads else []  # before --set: a user's own wins
    cmd += run.arm.overrides
    cmd += [f"--run.max_minutes={minutes:.2f}"] if minutes else []
    holds = any((run.dir / n).exists() for n in ("config.yaml", "metrics.jsonl", "checkpoints"))
    return cmd + (["--resume"] if holds else [])  # killed before its first checkpoint: step 0


def eval_command(args, run: RunSpec, threads: int) -> list[str]:
    return [sys.executable, str(ROOT / "eval.py"), "--config", args.config,
            "--models", f"{run.arm.name}={run.dir}", f"--eval.out_dir={run.dir / 'eval'}",
            "--eval.temperature=0", "--eval.num_samples=1", "--eval.pass_k=[1]",
            f"--run.seed={run.seed}", *([f"--run.threads={threads}"] if threads else []),
            *run.arm.overrides]  # results.json is not there: eval.py refuses to replace one


def execute(cmd: list[str], log: Path, deadline: float | None) -> int:
    """Run cmd, its output appended to log -> exit code; stopped (SIGTERM) well past deadline."""
    with log.open("a") as out:
        out.write(f"\n$ {shlex.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            return proc.wait(None if deadline is None
                             else max(1.0, deadline + KILL_GRACE_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()  # train.py stops on SIGTERM, its checkpoints kept for --resume
            try:
                return proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()
        except BaseException:  # Ctrl-C: the run stops with us
            proc.terminate()
            proc.wait()
            raise


def run_one(args, run: RunSpec, threads: int, deadline: float | None) -> RunSpec:
    """Train (or resume) one run, then eval it (--eval); its outcome in ablate.json."""
    if is_done(run):
        run.exit_code = outcome(run)["exit_code"]
        run.status = FINAL_EXITS[run.exit_code]
    else:
        left = None if deadline is None else (deadline - time.monotonic()) / 60
        if left is not None and left < MIN_RUN_MINUTES:
            run.status = "not started"
            return run
        run.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        run.exit_code = execute(train_command(args, run, threads, left or 0.0),
                                run.dir / "train.log", deadline)
        run.seconds = time.monotonic() - t0
        (run.dir / "ablate.json").write_text(json.dumps(
            {"arm": run.arm.name, "seed": run.seed, "exit_code": run.exit_code,
             "seconds": round(run.seconds, 1), "overrides": run.arm.overrides}) + "\n")
        run.status = (FINAL_EXITS[run.exit_code] if is_done(run)
                      else "left" if run.exit_code == 0 else "failed")  # 0 early: time limit
    results = run.dir / "eval" / "results.json"
    if args.eval and run.status == "finished" and not results.is_file():
        if deadline is not None and time.monotonic() > deadline:
            return run
        t0 = time.monotonic()
        run.eval_exit = execute(eval_command(args, run, threads), run.dir / "eval.log", deadline)
        done = outcome(run) | {"eval_seconds": round(time.monotonic() - t0, 1)}
        (run.dir / "ablate.json").write_text(json.dumps(done) + "\n")  # the planner's pace
    return run


def pace(runs: list[RunSpec]) -> float:
    """A finished run's mean wall seconds, training and eval, as ablate.json recorded them (a run
    resumed across invocations: its last part only); 0 when none was timed."""
    times = [o.get("seconds", 0.0) + o.get("eval_seconds", 0.0)
             for r in runs if r.status == "finished" and (o := outcome(r))]
    return sum(times) / len(times) if times else 0.0


@command.one_line(ValueError, ConfigError,
                  stopped="before every run ended; run the same command again to go on")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = argv  # for the report
    runs, cfg = plan(args)
    started = time.monotonic()
    deadline = started + 60 * args.max_minutes if args.max_minutes else None
    jobs, threads = placement(cfg, len(runs), args.jobs)
    print(f"[ablate] {len(runs)} runs ({len(runs) // args.seeds} arms x {args.seeds} seeds), "
          f"{jobs} at a time" + (f", run.threads={threads}" if threads else ""), file=sys.stderr)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_one, args, run, threads, deadline) for run in runs]
        try:
            for future in concurrent.futures.as_completed(futures):
                run = future.result()
                code = "" if run.exit_code is None else f" (exit {run.exit_code})"
                print(f"[ablate] {run.arm.name} seed {run.seed}: {run.status}{code}"
                      + (f", eval exit {run.eval_exit}" if run.eval_exit else ""), file=sys.stderr)
        except KeyboardInterrupt:  # stopped: no queued run starts; the pool waits for those going
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    report = ablate_report.write(Path(args.out), runs, args, time.monotonic() - started,
                                 (pace(runs), jobs))
    print(f"[ablate] wrote {report}", file=sys.stderr)
    if args.plan is not None:  # the answer: on stdout
        rows = json.loads((Path(args.out) / "report.json").read_text()).get("plan", [])
        print("\n".join(ablate_plan.lines(rows, ablate_report.label))
              or "no paired metric with two or more finished seeds to plan from")
    for run in runs:
        if run.status in ("failed", "left", "not started"):
            print(f"[ablate] {run.arm.name} seed {run.seed}: {run.status}"
                  + (f", see {run.dir / 'train.log'}" if run.status == "failed" else
                     "; run the same command again to go on"), file=sys.stderr)
        elif run.eval_exit:
            print(f"[ablate] {run.arm.name} seed {run.seed}: eval.py failed, see "
                  f"{run.dir / 'eval.log'}", file=sys.stderr)
    return int(any(run.status in ("failed", "left", "not started") or run.eval_exit
                   for run in runs))


if __name__ == "__main__":
    sys.exit(main())
