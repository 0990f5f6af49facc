"""A run built and wound down: everything train.py does before its first step and after its last,
kept out of the loop. setup() checks the config, data, judges, model and run directory (all as
ConfigError, before anything is written) and builds the Run: the policy, optimizer, schedule, data
order, resume state; stop_on_error() ends a run one line at a time.

    r = setup(args, overrides)            # a run/state.Run (prepared), or ConfigError: what to fix
    print(dry_run_report(r))              # --dry-run: the first row as the model sees it
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import json
import math
import shlex
import sys
from pathlib import Path

import torch

import grpo
import rollout
from api.client import Judge
from config import (
    Config,
    ConfigError,
    config_to_dict,
    length_limit,
    load_config,
    redacted,
    save_config,
)
from data import PromptSampler, load_sources
from engines import environments, episodes, vllm_engine, vllm_startup
from files.command import interrupted
from gpu import auto
from model import (
    MergedSampler,
    is_peft,
    load_policy,
    load_tokenizer,
    pick_device,
    pick_dtype,
    trainable_parameters,
)
from parallel import distributed
from parallel.seeds import seed_everything
from rewards import prepare_rewards, reward_context
from run import folder_lock
from run.checkpoint import checkpoints, keep_lines_up_to, load_checkpoint
from run.display import out_of_memory
from run.state import Run
from scoring import dynamic_sampling, pipelined
from scoring.checks import check_rows, open_rewards, open_scoring
from settings.typed_config import check_writable
from sources import seen_prompts
from sources.adapters import PROVENANCE, same_base
from sources.hub import resolve_model_path
from step import lr_lambda


def flat(d: dict, prefix: str = "") -> dict:
    return {k2: v2 for k, v in d.items() for k2, v2 in
            (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])}


REPLIES = {"grpo": (), "sft": ("target",), "dpo": ("chosen", "rejected")}  # a mode's reply columns


ROW_NAMES = {"grpo": "prompts", "sft": "examples", "dpo": "pairs"}  # what a mode's rows are


def updates_per_step(cfg: Config) -> int:
    """Optimizer updates a step takes: num_iterations x num_mini_batches (GRPO), 1 (SFT, DPO)."""
    return cfg.grpo.num_iterations * cfg.grpo.num_mini_batches if cfg.mode == "grpo" else 1


def with_epochs(cfg: Config, n_rows: int) -> Config:
    """run.epochs > 0: the config with run.steps = ceil(epochs x rows / rows a step); else cfg.

    >>> c = Config(mode="dpo"); c.run.epochs = 3; c.dpo.batch_size = 8
    >>> with_epochs(c, 280).run.steps  # bioreasoner_dpo.yaml's 105 steps, without the arithmetic
    105
    """
    if not cfg.run.epochs:
        return cfg
    per_step = {"grpo": cfg.rollout.prompts_per_step, "sft": cfg.sft.batch_size,
                "dpo": cfg.dpo.batch_size}[cfg.mode]
    steps = max(1, math.ceil(cfg.run.epochs * n_rows / per_step - 1e-9))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=steps))


def reference_beta(cfg: Config) -> float:
    """The weight on the reference policy: grpo.beta (GRPO), dpo.beta (DPO), 0 (SFT has none)."""
    return {"grpo": cfg.grpo.beta, "dpo": cfg.dpo.beta}.get(cfg.mode, 0.0)


def row_lengths(cfg: Config, rows: list[dict], tokenizer,
                what: str = "row") -> tuple[list[int], str, int]:
    """Each row's tokens as the batches count them (the prompt and the reply + EOS tokenized apart;
    DPO: its longer reply), and the limit they must fit -> (lengths, its config key, the limit)."""
    def count(texts: list[str]) -> list[int]:
        return [len(x) for x in tokenizer(texts, add_special_tokens=False).input_ids]
    # one list a reply column
    replies = [count([rollout.with_eos(tokenizer, r[k]) for r in rows]) for k in REPLIES[cfg.mode]]
    lengths = [p + max((c[i] for c in replies), default=0)  # the prompt and its longest reply
               for i, p in enumerate(
                   count(rollout.render_rows(tokenizer, rows, cfg.data, what=what)))]
    return (lengths, *length_limit(cfg))


def without_long_rows(cfg: Config, sources: list, tokenizer, what: str = "rows") -> list:
    """data.skip_long: each source without its rows over the length limit (printing how many)."""
    out, dropped, total = [], 0, 0
    for s in sources:
        lengths, key, limit = row_lengths(cfg, s.rows, tokenizer,
                                          f"data source {s.label}, {what[:-1]}")
        fits = [n <= limit for n in lengths]
        dropped, total = dropped + fits.count(False), total + len(fits)
        out.append(dataclasses.replace(s, rows=[r for r, ok in zip(s.rows, fits) if ok],
                                       positions=[p for p, ok in zip(s.positions, fits) if ok]))
    if empty := [s.label for s in out if not s.rows]:
        raise ConfigError(f"data.skip_long: every one of the {what} of {empty[0]} is over "
                          f"{key}={limit}; raise the limit")
    if dropped:
        print(f"[minigrpo] data.skip_long: left out {dropped} of the {total} {what}, "
              f"over {key}={limit}", file=sys.stderr)
    return out


def check_lengths(cfg: Config, rows: list[dict], tokenizer, what: str = "row") -> str:
    """Every prompt fits rollout.max_prompt_tokens (GRPO), every prompt + reply sft.max_length (SFT)
    or dpo.max_length (DPO, each reply) (row_lengths); -> the longest row, for --dry-run."""
    lengths, key, limit = row_lengths(cfg, rows, tokenizer, what)
    longest = max(range(len(rows)), key=lengths.__getitem__)
    if lengths[longest] > limit:
        raise ConfigError(f"{what} {longest} renders to {lengths[longest]} tokens > {key}={limit}; "
                          "raise the limit or shorten it; "
                          "data.skip_long: true leaves such rows out")
    return f"{what} {longest}, {lengths[longest]} tokens ({key} {limit})"


# what makes run.out_dir a run
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "checkpoints")


def setup(args, overrides: list[str]) -> Run:
    """Everything that can fail on bad input, as ConfigError, before the run folder is touched, in
    phases that each read alone: the config, the run folder, the data, the model (last of the
    checks: the slowest), the training's parts, the resumed state, the sampler's engine."""
    cfg = load_config(args.config, overrides)
    check_home(args.config, cfg, overrides)
    vllm_engine.check_config(cfg)
    distributed.check_config(cfg)
    judges = open_scoring(cfg, check_rewards=bool(cfg.rewards) or cfg.mode == "grpo")
    run_dir = claim_run_dir(cfg, args)
    ckpts = checkpoints(run_dir) if args.resume else []
    data = load_data(cfg)
    cfg = with_epochs(cfg, len(data.rows))
    changed = resume_changes(cfg, ckpts, len(data.rows))
    check_run_extras(cfg, data)
    model, tokenizer, device = load_model(cfg, ckpts)
    check_fits(cfg, data, tokenizer)
    ref_copy, params, optimizer, scaler = training_parts(cfg, model, device)
    sampler = PromptSampler([len(s.rows) for s in data.sources], cfg.data.shuffle_seed,
                            [(s.weight, s.weight_end) for s in data.sources], distributed.rank(),
                            distributed.world())
    start = resume(ckpts, model, optimizer, scaler, sampler, judges, cfg, ref_copy) if ckpts else 0
    if args.resume and not ckpts:
        print(f"[minigrpo] no checkpoint in {run_dir}; starting from step 0", file=sys.stderr)
    # resumed: the schedule continues from the updates done, on the config's peak lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg, cfg.run.steps * updates_per_step(cfg)),
        last_epoch=start * updates_per_step(cfg) - 1)
    engine = vllm_engine_for(cfg, model, run_dir, device, start, args.dry_run)
    # "auto" settings: as before on a CPU; on a GPU the fast sampler and the memory levers that fit
    cfg, chosen = auto.resolve(cfg, model, device,
                               lambda: max(row_lengths(cfg, data.rows, tokenizer)[0]))
    if chosen:
        print(chosen, file=sys.stderr)
    r = Run(cfg, run_dir, data.rows, [s.label for s in data.sources], device, model, tokenizer,
            ref_copy, params, optimizer, scheduler, scaler, sampler, judges, start, engine,
            world=distributed.world(),
            eval_rows=data.eval_rows if distributed.rank() == 0 else None,  # torchrun: rank 0's
            changed=changed)
    if cfg.mode == "grpo":
        prepare(r)
    return r


def check_home(config: str, cfg: Config, overrides: list[str]) -> None:
    """A copied or moved run's own config.yaml names the old folder as run.out_dir: refused, naming
    both, unless --run.out_dir says which."""
    home = Path(config).parent
    if Path(config).name == "config.yaml" and (home / "metrics.jsonl").is_file() and \
            home.resolve() != Path(cfg.run.out_dir).resolve() and \
            not any(o.startswith("--run.out_dir=") for o in overrides):
        raise ConfigError(f"{config} is the config of the run in {home}, but its run.out_dir "
                          f"is {cfg.run.out_dir} (a copied or moved run?): add "
                          f"--run.out_dir={home} to use this one, or "
                          f"--run.out_dir={cfg.run.out_dir}")


def claim_run_dir(cfg: Config, args) -> Path:
    """run.out_dir checked (writable, a folder, a run only with --resume) and locked -> its path."""
    run_dir = Path(cfg.run.out_dir)
    check_writable(cfg.run.out_dir, "run.out_dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.out_dir={run_dir} is a file; give a directory")
    # other files (a ratings/ queue, notes) are not a run
    holds_run = any((run_dir / n).exists() for n in RUN_FILES)
    if holds_run and not args.resume and not args.dry_run:
        raise ConfigError(f"run.out_dir={run_dir} already holds a run; pass --resume to continue "
                          "it or set another run.out_dir")
    if args.resume and not run_dir.is_dir():
        raise ConfigError(f"--resume: run.out_dir={run_dir} does not exist, so there is no run to "
                          "continue; check the path, or drop --resume to start one")
    folder_lock.take(run_dir, "run.out_dir", dry_run=args.dry_run)  # one trainer a folder
    return run_dir


@dataclasses.dataclass
class Data:
    """The run's rows: its sources, the rows trained on, the held-out rows (run.eval_every), and
    the tokenizer that measured them when data.skip_long left long rows out (None: not measured)."""
    sources: list
    rows: list[dict]
    eval_rows: list[dict] | None
    measured_by: object = None


def load_data(cfg: Config) -> Data:
    """The training rows (data.skip_long: those that fit) and the held-out ones, checked."""
    sources = load_sources(cfg.data)
    short = load_tokenizer(cfg.model, resolve_model_path(cfg.model)) if cfg.data.skip_long else None
    if short:  # before the epochs count the rows
        sources = without_long_rows(cfg, sources, short)
    rows = [row for s in sources for row in s.rows]
    if cfg.rewards and cfg.mode == "grpo":  # SFT scores only held-out rows (checked below)
        check_rows(cfg.rewards, rows)
        environments.check_rows(cfg, rows)  # env.names: each row's `environment` names one
    return Data(sources, rows, held_out_rows(cfg, rows, short) if cfg.run.eval_every else None,
                short)


def held_out_rows(cfg: Config, rows: list[dict], short) -> list[dict]:
    """run.eval_every's held-out rows, checked, with a warning when some are trained on."""
    import eval as ev
    ev.check_eval_config(cfg)
    held_out = ev.held_out_sources(cfg)
    if short and cfg.mode != "grpo":  # SFT, DPO: held-out rows go through the training batches
        held_out = without_long_rows(cfg, held_out, short, "held-out rows")
    eval_rows = [row for s in held_out for row in s.rows]
    if cfg.rewards:
        check_rows(cfg.rewards, eval_rows, "held-out")
    seen = {seen_prompts.prompt_hash(r) for r in rows} | seen_prompts.seen_before(cfg.model)
    if k := seen_prompts.count(eval_rows, seen):
        print(f"[minigrpo] warning: {k} of the {len(eval_rows)} held-out rows have the prompt "
              "of a row this run (or the runs behind its model) trains on: eval/* will "
              "overstate what it learned; check data.select, eval.select, split_seed and "
              "duplicates in the data", file=sys.stderr)
    return eval_rows


def resume_changes(cfg: Config, ckpts: list[Path], n_rows: int) -> list[str]:
    """--resume: the settings unlike the last checkpoint's (printed); a different mode, model or
    LoRA setup is refused."""
    if not ckpts:
        return []
    before = flat(config_to_dict(with_epochs(load_config(ckpts[-1] / "config.yaml"), n_rows)))
    changed = sorted(k for k, v in flat(redacted(config_to_dict(cfg))).items()  # as saved
                     if before.get(k) != v and v != "auto")  # auto: chosen again
    if any(k.startswith(("model.", "lora.")) or k == "mode" for k in changed):
        raise ConfigError("--resume with a different mode, model or LoRA setup than "
                          f"{ckpts[-1]} ({', '.join(changed)}); resume with the run's own "
                          "config.yaml, or start a new run.out_dir")
    if changed:
        print(f"[minigrpo] resuming with changed settings: {', '.join(changed)}", file=sys.stderr)
    return changed


def check_run_extras(cfg: Config, data: Data) -> None:
    """The tracker installed, the threads set, a reward model loaded (once everything cheaper is
    checked), the run's seed set."""
    if cfg.run.report_to != "none" and importlib.util.find_spec(cfg.run.report_to) is None:
        raise ConfigError(f"run.report_to: {cfg.run.report_to} is not installed; "
                          f"pip install {cfg.run.report_to}, or --run.report_to=none")
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if cfg.mode == "grpo" or data.eval_rows:
        open_rewards(cfg.rewards)
    seed_everything(cfg.run.seed)


def load_model(cfg: Config, ckpts: list[Path]) -> tuple[torch.nn.Module, object, torch.device]:
    """The policy and tokenizer on this process's device; --resume: on the base its checkpoint
    was trained on."""
    device = distributed.start(pick_device(cfg.run.device))  # torchrun: this rank's GPU
    quant = ", 4-bit base" if cfg.model.quant == "4bit" else ""
    print(f"[minigrpo] loading {cfg.model.name} on {device} ({pick_dtype(cfg.model.dtype, device)}"
          f"{quant}): a hub model is downloaded once, then loaded from its cache", file=sys.stderr,
          flush=True)
    model, tokenizer = load_policy(cfg.model, cfg.lora, device, dropout=cfg.mode == "sft",
                                   beta=reference_beta(cfg), beta_key=f"{cfg.mode}.beta")
    distributed.same_start(trainable_parameters(model), cfg.run.seed)
    kept = next((ckpts[-1] / d / PROVENANCE for d in ("adapter", "model")
                 if ckpts and (ckpts[-1] / d / PROVENANCE).is_file()), None)
    if kept is not None:  # the LoRA adapter's, or full fine-tuning's whole model's
        saved = json.loads(kept.read_text())
        # e.g. init_adapter names a run whose newest checkpoint has changed since
        if not same_base(saved, model.minigrpo_base):
            raise ConfigError(f"--resume: the base now built ({model.minigrpo_base}) differs from "
                              f"the one {ckpts[-1]} was trained on ({saved}); point "
                              "model.init_adapter at the checkpoint it used")
    return model, tokenizer, device


def check_fits(cfg: Config, data: Data, tokenizer) -> None:
    """Every row fits its length limit (unless data.skip_long measured them); the held-out rows
    too, or, GRPO's (only sampled from), render; DPO pairs that teach nothing are counted."""
    rows, eval_rows = data.rows, data.eval_rows
    if not data.measured_by:  # data.skip_long measured them already: every row left fits
        check_lengths(cfg, rows, tokenizer)
    if cfg.mode == "dpo" and (same := sum(r["chosen"] == r["rejected"] for r in rows)):
        print(f"[minigrpo] warning: {same} of {len(rows)} pairs have the same chosen and rejected "
              "reply; they teach nothing (their loss stays at its first step's value)",
              file=sys.stderr)
    if eval_rows and cfg.mode != "grpo":  # eval/loss runs them through the same batches
        check_lengths(cfg, eval_rows, tokenizer, "held-out row")
    elif eval_rows:
        # GRPO's are only sampled from: rendered now, so a template refusing one stops the run here
        rollout.render_rows(tokenizer, eval_rows, cfg.data, what="held-out row")


def training_parts(cfg: Config, model, device: torch.device) -> tuple:
    """-> (the reference's own copy or None, the trainable parameters, AdamW, a GradScaler or
    None)."""
    ref_copy = None
    if reference_beta(cfg) > 0 and not is_peft(model):  # full fine-tuning: the reference's own copy
        ref_copy = copy.deepcopy(model).eval().requires_grad_(False)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    # fp16 gradients underflow unscaled: the loss is scaled wherever the model computes in fp16 (a
    # T4's path runs on a CPU too: torch's GradScaler takes either device)
    fp16 = pick_dtype(cfg.model.dtype, device) == torch.float16
    return ref_copy, params, optimizer, torch.amp.GradScaler(device.type) if fp16 else None


def resume(ckpts: list[Path], model, optimizer, scaler, sampler: PromptSampler,
           judges: dict[str, Judge], cfg: Config, ref_copy=None) -> int:
    """The last checkpoint's weights, optimizer moments (with the config's settings), RNG, data
    position and judges' totals back in place, and TR-DPO's moved reference -> its step."""
    state = load_checkpoint(ckpts[-1], model, optimizer, scaler)
    if cfg.mode == "grpo" and cfg.grpo.sync_ref_model:  # grpo.sync_ref_model: full fine-tuning
        saved = ckpts[-1] / "reference.pt"
        if not saved.is_file():
            raise ConfigError(f"{saved}: grpo.sync_ref_model needs the reference the run had "
                              "moved, which this checkpoint did not save; resume without it")
        ref_copy.load_state_dict(torch.load(saved, map_location=next(ref_copy.parameters()).device))
    for group in optimizer.param_groups:  # the checkpoint's moments, the config's settings
        group.update(lr=cfg.optim.lr, initial_lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                     weight_decay=cfg.optim.weight_decay)
    sampler.load_state(state["data_position"])
    for name, judge in judges.items():  # judge_*_total (cost included) go on from the checkpoint
        judge.totals.update({k: v for k, v in state["judge_totals"].get(name, {}).items()
                             if k in judge.totals})
        if state["judge_answered"].get(name):  # no reply now: down, not wrong
            judge.answered_before()
    print(f"[minigrpo] resumed from {ckpts[-1]} (step {state['step']})", file=sys.stderr)
    return state["step"]


def vllm_engine_for(cfg: Config, model, run_dir: Path, device: torch.device, start: int,
                    dry_run: bool):
    """rollout.engine: vllm (GRPO): the policy checked for it, and (not in a dry run) the engine
    started -> the engine, or None."""
    if cfg.rollout.engine != "vllm" or cfg.mode != "grpo":
        return None
    vllm_startup.check_policy(model, vllm_startup.check_install(model.peft_config["default"].r))
    if dry_run:  # a dry run checks, starts nothing
        return None
    return vllm_engine.VllmEngine(cfg, resolve_model_path(cfg.model), run_dir,
                                  pick_dtype(cfg.model.dtype, device), model, device=device,
                                  start=start)


def prepare(r: Run) -> None:
    """What a GRPO step uses that depends only on the run, resolved once (again after a test
    changes r.cfg): the rewards with their functions, arguments and keys, and the reply prefix they
    see (rollout.reply_prefix, a chat-template probe); the sampler chosen, with its EOS ids; the
    seam that samples and scores together (episodes, the reward overlap); the loss settings."""
    cfg = r.cfg
    context = reward_context(rollout.reply_prefix(r.tokenizer, cfg.data), r.judges,
                             cfg.data.assistant_prefix, cfg.rollout.num_generations)
    multi_turn = bool(cfg.env or cfg.tools)
    try:
        r.rewards = prepare_rewards(cfg.rewards, context,
                                    ("num_tokens", "episode") if multi_turn else ("num_tokens",))
    except ValueError as e:
        raise ConfigError(f"rewards: {e}") from None
    r.sample = sampler(r)
    r.prompts_per_step = cfg.rollout.prompts_per_step // r.world
    r.resample = dynamic_sampling.until_signal if cfg.rollout.resample_zero_std else None
    r.sample_and_score = None
    if multi_turn:  # G episodes a prompt, each scored whole
        r.sample_and_score = functools.partial(episodes.sample_and_score, cfg, r.model,
                                               r.tokenizer, r.rewards,
                                               environments.open_environments(cfg, r.tokenizer))
    elif cfg.rollout.overlap_rewards and cfg.rollout.prompts_per_generate:
        r.sample_and_score = functools.partial(pipelined.sample_and_score, r.sample, r.rewards,
                                               r.tokenizer, cfg)
    r.loss = grpo.LossSettings.of(cfg.grpo)


def sampler(r: Run):
    """The sampler the step calls, sample(prompts) -> rollout.Rollout: vLLM's, HF generate merged
    (rollout.merged_sampling), or HF generate (compiled under rollout.compile: its static cache)."""
    if r.engine:
        return functools.partial(r.engine.generate, r.tokenizer,
                                 eos_ids=rollout.eos_token_ids(r.tokenizer, r.model),
                                 device=next(r.model.parameters()).device)
    sample = rollout.Sampler.of(r.model, r.tokenizer, r.cfg)
    return MergedSampler(sample) if r.cfg.rollout.merged_sampling else sample


def open_run_files(r: Run) -> tuple[Path, Path]:
    """The run directory as a (re)start leaves it -> (metrics.jsonl, samples.jsonl): config.yaml at
    the first start (a resume that changes settings adds its own), the logs kept up to the resumed
    step. Under torchrun rank 0 writes them and every rank waits until it has."""
    cfg, run_dir, start = r.cfg, r.run_dir, r.start
    metrics_path, samples_path = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
    if distributed.rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not start:
            save_config(cfg, run_dir / "config.yaml")
        elif r.changed:
            save_config(cfg, run_dir / f"config_resumed_step_{start:06d}.yaml")
        for p in (metrics_path, samples_path):
            keep_lines_up_to(p, start) if start else p.unlink(missing_ok=True)
    distributed.barrier()  # every rank reads the logs as trimmed
    return metrics_path, samples_path


def dry_run_report(r: Run) -> str:
    """What --dry-run prints: the data as loaded and the first row exactly as the model sees it."""
    cfg, row = r.cfg, r.rows[0]
    sources = ", ".join(f"{label} {n}" for label, n in zip(r.source_labels, r.sampler.sizes))
    prompt = rollout.render_rows(r.tokenizer, [row], cfg.data)[0]
    if cfg.env or cfg.tools:  # multi-turn: the first turn as episodes.py renders it (its tools)
        first = episodes.open_episodes(cfg, r.tokenizer, [row], 1)[0]
        prompt = r.tokenizer.decode(first.prompt_ids)
    shown = prompt + (rollout.with_eos(r.tokenizer, row["target"]) if cfg.mode == "sft" else "")
    lines = [f"[dry-run] config, data, model and judges check out ({cfg.mode}); "
             "nothing was trained or written",
             f"  rows: {len(r.rows)} ({sources})",
             f"  longest: {check_lengths(cfg, r.rows, r.tokenizer)}",
             f"  trainable parameters: {sum(p.numel() for p in r.params) / 1e6:.2f}M on {r.device}",
             f"  steps: {cfg.run.steps}"
             + (f" ({cfg.run.epochs:g} epochs)" if cfg.run.epochs else "")
             + f", {updates_per_step(cfg)} optimizer update(s) each"]
    lines += [f"  rewards: {', '.join(f'{s.name} x {s.weight:g}' for s in cfg.rewards)}"
              + ("" if cfg.mode == "grpo" else " (not trained on: they score held-out "
                 "generations, run.eval_every)")] if cfg.rewards else []
    lines += [f"  judges: {', '.join(r.judges)} (not called)"] if r.judges else []
    lines += [f"  warning: {n}'s key ${j.cfg.api_key_env} is not set"
              for n, j in r.judges.items() if j.key_missing]
    lines += [f"  held-out rows for run.eval_every: {len(r.eval_rows)}"] if r.eval_rows else []
    lines += ([f"  gold ({cfg.data.answer_key}): {row.get(cfg.data.answer_key)!r}"]
              if cfg.data.answer_key and cfg.mode == "grpo" else [])
    if cfg.mode == "dpo":
        return "\n".join(lines + [
            "  row 0 as the model sees it (prompt):", prompt,
            "  chosen reply:", rollout.with_eos(r.tokenizer, row["chosen"]),
            "  rejected reply:", rollout.with_eos(r.tokenizer, row["rejected"])])
    return "\n".join(lines + ["  row 0 as the model sees it"
                              + (" (prompt, then the reply trained on):" if cfg.mode == "sft"
                                 else " (the completion follows):"), shown])


def stop_on_error(r: Run, args, e: BaseException, step: int, what: str | None = None) -> int:
    """A step failed in a way no later step fixes (or Ctrl-C, SIGTERM where run/interrupts.py keeps
    no step): one line saying what (`what`, else e's own account) and how to go on, exit code 2
    (130, 143). With a checkpoint, the run is left to --resume (the line ends with the command:
    resume_command); without one, this command's files are removed (a folder it created goes with
    its lock: folder_lock.release), so the same command runs again once the cause is fixed."""
    code, fix, told = 2, "fix it, then ", what
    distributed.speak(e)  # torchrun: a rank > 0 that failed on its own
    if isinstance(e, KeyboardInterrupt):
        (signame, code), fix = interrupted(e), ""
        what = f"interrupted ({signame})"
    elif isinstance(e, torch.OutOfMemoryError):
        what = out_of_memory(r.cfg, r.phase, r.device, args.config, e)
    elif isinstance(e, OSError):  # a full disk, a folder made read-only meanwhile
        what = e.strerror if (e.strerror or "").startswith("cannot write") else (
            f"cannot write in {r.run_dir}: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename else ""))
    else:
        what = str(e)
    what, run_dir = told or what, r.run_dir
    if any(checkpoints(run_dir)):
        print(f"\nerror: {what}; stopped at step {step}, the last checkpoint in {run_dir}: "
              f"{fix}go on with: {resume_command(args, r.judges)}", file=sys.stderr)
        return code
    if args.resume or distributed.rank() > 0:  # files that were there before, or rank 0's
        print(f"\nerror: {what}; stopped at step {step}, before any checkpoint", file=sys.stderr)
        return code
    # this run's (the folder held no run): nothing to resume, so no half run is left behind
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", seen_prompts.FILE):
        (run_dir / name).unlink(missing_ok=True)
    # empty: its first checkpoint was interrupted (a run's files, RUN_FILES)
    with contextlib.suppress(OSError):
        (run_dir / "checkpoints").rmdir()
    print(f"\nerror: {what}; stopped at step {step}, before any checkpoint (nothing of the run "
          "was kept): " + (f"{fix}run the same command again" if fix
                           else "run the same command to start again"), file=sys.stderr)
    return code


def resume_command(args, judges: dict[str, Judge]) -> str:
    """This command with --resume, run by this interpreter (sys.executable: the run's venv, not
    whichever `python` comes first): what goes on with its run (every judge's secrets masked)."""
    line = shlex.join([sys.executable, "train.py", *args.argv,
                       *([] if args.resume else ["--resume"])])
    for judge in judges.values():
        line = judge.masked(line)
    return line
