"""The helpers of notebooks/grpo_colab_t4.ipynb, kept out of its cells so that each cell is one
call that works after the parameter cell alone (a fresh runtime's resume cell too), and so that
tests/test_notebook.py runs the same code on a CPU.

    from notebooks import colab
    colab.train(CONFIG, MODEL, RUN_DIR, STEPS, MAX_MINUTES, EXTRA, every_s=30)  # live log, curves
    colab.child(["eval.py", ...], RUN_DIR, "eval")       # a child process, its lines shown
    print("\\n".join(colab.record(RUN_DIR)))              # what a T4 run must report

Each child (train.py, eval.py, tools.export) writes RUN_DIR/<name>.log, which the cell shows as it
grows; a failed child's last lines, and a failed pip's output, are printed before the error, as a
Colab cell may show nothing else. The stop button sends the child SIGINT and waits for it to exit
(train.py then says where to --resume from), so no trainer is left running behind the cell; a
second one on the same folder would exit 2 anyway (run/folder_lock.py). Each child's wall time is
appended to RUN_DIR/notebook.jsonl, which record() reads with metrics.jsonl and eval/results.json.
The GPU check and the clone are the notebook's first cell: they run before this file exists.
"""
from __future__ import annotations

import glob
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from files import jsonl

CURVES = ["reward", "rewards/answer_match/mean", "completions/mean_length"]
# in requirements-gpu.txt but not needed by a notebook run: the tests, the linter, and gguf, which
# only the built-in GGUF model (smollm2-135m) loads through; the notebook trains a hub model
NOT_FOR_A_RUN = {"pytest", "ruff", "gguf"}
FAILED_LINES = 20  # of a failed child's log, printed with its error (the reason is near the end)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout this runs from


def install(requirements: str = "requirements-gpu.txt", pip=subprocess.run) -> dict:
    """pip install what a run needs from `requirements` (and matplotlib, for the curves), the
    installed torch held where it is by a pip constraint, whatever its version (no multi-GB CUDA
    wheel over Colab's, no torchvision left unmatched); one line when that torch is outside the
    range the project tests. -> {seconds, torch_before, torch_after}, kept in the environment
    for record()."""
    began, before = time.time(), installed("torch")
    with open(requirements) as f:
        lines = [ln.split("#")[0].strip() for ln in f]
    wanted = {re.split(r"[<>=!~; ]", ln)[0].lower(): ln for ln in lines if ln}
    tested = wanted["torch"][len("torch"):]
    skip = NOT_FOR_A_RUN | ({"torch"} if before else set())  # no torch at all: the tested one
    constraint = os.path.join(tempfile.mkdtemp(), "keep-torch.txt")
    with open(constraint, "w") as f:
        f.write(f"torch=={before}\n" if before else "")
    got = pip([sys.executable, "-m", "pip", "install", "-q", "-c", constraint, "matplotlib",
               *(ln for name, ln in wanted.items() if name not in skip)],
              capture_output=True, text=True)
    if got.returncode != 0:
        print((got.stdout + got.stderr).rstrip(), flush=True)
        raise RuntimeError(f"pip could not install minigrpo's requirements beside torch {before} "
                           "(pip's output is printed above); a runtime with another torch may "
                           "work")
    after = installed("torch")
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    if after and Version(Version(after).base_version) not in SpecifierSet(tested):
        print(f"warning: torch {after} is outside the range tested (torch{tested}); it is kept "
              "(the machine's CUDA build): if a cell fails, say which torch it was", flush=True)
    done = {"seconds": round(time.time() - began, 1), "torch_before": before,
            "torch_after": after}
    os.environ["MINIGRPO_INSTALL"] = json.dumps(done)
    return done


def installed(package: str) -> str | None:
    """The installed version of `package` as pip sees it now (not a stale import's), or None."""
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def train(config: str, model: str, run_dir: str, steps: int, max_minutes: float,
          extra: list[str] = (), resume: bool = False, every_s: float = 30) -> None:
    """train.py on the notebook's parameters, the last log lines and the curves redrawn every
    `every_s` seconds; `resume`: from the newest checkpoint in run_dir, which must hold one."""
    if resume:
        require_checkpoint(run_dir)
    args = ["train.py", "--config", config, f"--model.name={model}", f"--run.steps={steps}",
            f"--run.max_minutes={max_minutes}", f"--run.out_dir={run_dir}", *extra]
    child(args + (["--resume"] if resume else []), run_dir, "train", every_s,
          show=lambda log: show_progress(log, run_dir), note=lambda: {"last_step": last_step(
              os.path.join(run_dir, "metrics.jsonl"))})


def require_checkpoint(run_dir: str) -> None:
    """Stop a resume that has nothing to resume, before train.py starts: train.py --resume on a
    folder without a checkpoint trains from step 0 with one log line, which a cell would bury
    (a fresh runtime's RUN_DIR is empty unless it is on a mounted Drive)."""
    from pathlib import Path

    from run.checkpoint import checkpoints
    if not checkpoints(Path(run_dir)):
        raise RuntimeError(f"RESUME is True but RUN_DIR={run_dir} holds no checkpoint "
                           "(checkpoints/step_*/trainer_state.pt): is Google Drive mounted "
                           "(USE_DRIVE = True in section 2) and RUN_DIR the folder of the first "
                           "run?")


def last_step(metrics_path: str) -> int:
    """The last step metrics.jsonl logged, 0 before any."""
    metrics = jsonl.records(metrics_path)
    return metrics[-1]["step"] if metrics else 0


def show_progress(log_path: str, run_dir: str) -> None:
    """The cell's view of a training run: its log's last 8 lines and the curves so far."""
    from IPython.display import Image, clear_output, display
    clear_output(wait=True)
    with open(log_path) as log:
        print("".join(log.readlines()[-8:]), flush=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics) or os.path.getsize(metrics) == 0:
        return
    subprocess.run([sys.executable, "-m", "tools.plots", run_dir, "--metrics", *CURVES,
                    "--smooth", "0.7", "--out", os.path.join(run_dir, "plots")],
                   capture_output=True)
    for png in sorted(glob.glob(os.path.join(run_dir, "plots", "*.png"))):
        display(Image(filename=png, width=420))


def child(args: list[str], run_dir: str, name: str, every_s: float = 1, show=None,
          note=dict) -> None:
    """`python *args` with its output in run_dir/<name>.log, shown by show(log_path) every
    `every_s` seconds (default: its new lines). The stop button (KeyboardInterrupt) sends it SIGINT
    and waits for it to exit; a non-zero exit prints the log's last `FAILED_LINES` lines and
    raises, naming the log. Its line in notebook.jsonl holds its wall time, exit code, arguments
    and note()."""
    os.makedirs(run_dir, exist_ok=True)
    log_path, began = os.path.join(run_dir, f"{name}.log"), time.time()
    with open(log_path, "a") as log, open(log_path) as tail:
        tail.seek(0, os.SEEK_END)
        show = show or (lambda _: print(tail.read(), end="", flush=True))
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            while proc.poll() is None:
                try:
                    proc.wait(timeout=every_s)
                except subprocess.TimeoutExpired:
                    pass
                show(log_path)
        except KeyboardInterrupt:
            print(f"\nstopping {name} (SIGINT) and waiting for it to exit", flush=True)
            proc.send_signal(signal.SIGINT)
            proc.wait()
            show(log_path)
            raise
        finally:
            jsonl.append(os.path.join(run_dir, "notebook.jsonl"),
                         [{"phase": name, "seconds": round(time.time() - began, 1),
                           "exit": proc.returncode, "args": args[1:], **note()}])
    if proc.returncode != 0:
        with open(log_path) as log:
            last = log.readlines()[-FAILED_LINES:]
        print(f"--- the last {len(last)} lines of {log_path} ---\n" + "".join(last), end="",
              flush=True)
        raise RuntimeError(f"{name} exited with {proc.returncode}: its last lines are printed "
                           f"above, all of them in {log_path}")


# ---------------------------------------------------------------- what a T4 run must report


def record(run_dir: str, eval_dir: str | None = None) -> list[str]:
    """The figures a first T4 run should paste back (docs/recipes/t4.md), from this runtime and
    the run's files: versions, the install, the step time split into rollout and update, steps
    done, peak memory, fp16's loss scale and skipped updates, clipped and zero-std shares, the
    held-out accuracies with their standard error, the wall times."""
    metrics = jsonl.records(os.path.join(run_dir, "metrics.jsonl"))
    phases = jsonl.records(os.path.join(run_dir, "notebook.jsonl"))
    results = os.path.join(eval_dir or os.path.join(run_dir, "eval"), "results.json")
    return (versions() + install_lines() + training_lines(metrics, phases)
            + eval_lines(results) + wall_lines(phases))


def versions() -> list[str]:
    """The runtime's versions, its GPU and the commit of minigrpo that ran."""
    import peft
    import torch
    import transformers
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [f"python {platform.python_version()} | torch {torch.__version__} | CUDA "
            f"{torch.version.cuda} | transformers {transformers.__version__} | peft "
            f"{peft.__version__} | GPU {gpu} | minigrpo {commit()}"]


def commit(repo: str = REPO) -> str:
    """`git rev-parse HEAD` of the checkout `repo`, "unknown" when it is not one (an unpacked
    archive, or a folder inside another repository)."""
    try:
        got = subprocess.run(["git", "-C", repo, "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True)
    except FileNotFoundError:  # no git
        return "unknown"
    lines = got.stdout.splitlines()
    if got.returncode != 0 or len(lines) != 2 or \
            os.path.realpath(lines[0]) != os.path.realpath(repo):
        return "unknown"
    return lines[1]


def install_lines() -> list[str]:
    """The install cell leaves MINIGRPO_INSTALL: its seconds, torch before and after pip."""
    said = os.environ.get("MINIGRPO_INSTALL")
    if not said:
        return ["install: not recorded (the install cell did not run in this runtime)"]
    got = json.loads(said)
    changed = "pip CHANGED torch" if got["torch_before"] != got["torch_after"] else \
        "pip kept torch"
    return [f"install: {got['seconds']:.0f} s; torch {got['torch_before']} -> "
            f"{got['torch_after']} ({changed})"]


def training_lines(metrics: list[dict], phases: list[dict]) -> list[str]:
    """Steps and their time, memory, fp16 and the learning signal, from metrics.jsonl."""
    if not metrics:
        return ["training: no metrics.jsonl lines"]
    later = metrics[1:] or metrics  # the first step warms up (and compiles, where it does)
    step = statistics.median(m["step_time"] for m in later)
    rollout = statistics.median(m["rollout_time"] for m in later)
    scales = [m["loss_scale"] for m in metrics if "loss_scale" in m]
    skipped = sum(m.get("skipped_updates", 0) for m in metrics)
    return [steps_line(metrics[-1]["step"], [p for p in phases if p["phase"] == "train"]),
            f"step time (median of steps {later[0]['step']}-{later[-1]['step']}): {step:.1f} s ="
            f" rollout (sampling, scoring) {rollout:.1f} s + update {step - rollout:.1f} s; the "
            f"first step {metrics[0]['step_time']:.1f} s",
            f"peak GPU memory: allocated {max_of(metrics, 'peak_memory_mb')}, reserved "
            f"{max_of(metrics, 'peak_reserved_mb')}" if "peak_reserved_mb" in metrics[-1] else
            f"peak memory: {max_of(metrics, 'peak_memory_mb')} RSS (not on a GPU)",
            (f"fp16 loss scale: {scales[-1]:g} at the end, lowest {min(scales):g}" if scales
             else "fp16 loss scale: not logged (no GradScaler: not float16)")
            + f"; skipped updates: {skipped}",
            f"clipped share (completions cut at max_new_tokens): "
            f"{mean_of(metrics, 'completions/clipped_ratio')}; zero-std share (groups without "
            f"signal): {mean_of(metrics, 'frac_reward_zero_std')}"]


def steps_line(last: int, runs: list[dict]) -> str:
    """The steps logged, and those the first train.py run did within its run.max_minutes."""
    first = next((p for p in runs if "--resume" not in p["args"]), None)
    if first is None:
        return f"steps: {last} logged over {len(runs)} train.py run(s)"
    limit = next((a.split("=", 1)[1] for a in first["args"]
                  if a.startswith("--run.max_minutes=")), "?")
    return (f"steps: {last} logged over {len(runs)} train.py run(s); the first run did "
            f"{first.get('last_step', '?')} in {first['seconds'] / 60:.1f} min "
            f"(run.max_minutes={limit}, loading included)")


def max_of(metrics: list[dict], key: str) -> str:
    """The largest of a *_mb metric, in GiB."""
    values = [m[key] for m in metrics if key in m]
    return f"{max(values) / 1024:.2f} GiB" if values else "not logged"


def mean_of(metrics: list[dict], key: str) -> str:
    values = [m[key] for m in metrics if key in m]
    if not values:
        return "not logged"
    return f"{statistics.mean(values):.3f} mean, {values[0]:.3f} first, {values[-1]:.3f} last"


def eval_lines(results_path: str) -> list[str]:
    """Each model's held-out accuracy with its standard error, sqrt(p (1 - p) / n)."""
    if not os.path.exists(results_path):
        return ["eval: no results.json"]
    with open(results_path) as f:
        models = json.load(f)["models"]
    lines = []
    for name, result in models.items():
        m = result["metrics"]
        p, n = m.get("accuracy"), m.get("n", 0)
        lines.append(f"eval {name}: accuracy {p:.3f} +- {math.sqrt(p * (1 - p) / n):.3f} "
                     f"(standard error, n={n})" if p is not None and n else
                     f"eval {name}: no accuracy (n={n})")
    return lines


def wall_lines(phases: list[dict]) -> list[str]:
    """Each phase's minutes and their total with the install's: the notebook's wall time."""
    said = os.environ.get("MINIGRPO_INSTALL")
    install = json.loads(said)["seconds"] if said else 0.0
    by_phase: dict[str, float] = {}
    for p in phases:
        by_phase[p["phase"]] = by_phase.get(p["phase"], 0.0) + p["seconds"]
    parts = ", ".join(f"{name} {s / 60:.1f}" for name, s in by_phase.items())
    started = os.environ.get("MINIGRPO_STARTED")
    since = (f"; {(time.time() - float(started)) / 60:.1f} min since the install cell started"
             if started else "")
    return [f"wall time: {(install + sum(by_phase.values())) / 60:.1f} min in the cells' children"
            f" and the install ({parts}){since}"]
