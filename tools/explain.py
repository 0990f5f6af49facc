"""One GRPO step of a config, explained: for one group, the prompt as the model sees it, its G
completions, their rewards (each named reward and the weighted total), the group's mean, std and
advantages; for one completion (the largest |advantage|) its tokens' log-probs, ratios, clipped
terms and loss mask; then its share of the loss and the gradient norm of the loss. Each quantity
names the line of code that computes it, read from the code at run time (inspect), so the
references follow the code as it changes.

    python -m tools.explain --config configs/quickstart.yaml
    python -m tools.explain --config configs/quickstart.yaml --grpo.loss_type=grpo --group 2
    python -m tools.explain --config runs/quickstart/config.yaml --resume   # at its checkpoint

The step is train.py's first (or, with --resume, the next), with the run's seed, built by
run/lifecycle.setup as --dry-run builds it (checked, nothing started, no vLLM: HF generate samples),
and done here from the core's functions in the paper's order (one_step). It changes no weight (no
optimizer step) and writes no file. Single-turn GRPO configs only; groups come as drawn (no
resample_zero_std, no mini-batch shuffle).
"""
from __future__ import annotations

import argparse
import inspect
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import grpo
import rewards
import rollout
import step
import train
from config import ConfigError
from logprobs import batch_log_probs, micro_batch_log_probs
from model import reference_mode
from run import lifecycle
from run.state import Run

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100  # the terminal the output fits
TOKENS = 24  # rows of the token table at most


# ----------------------------------------------------------------------------- the step


@dataclass
class Explained:
    """What one_step computed: the batch, its rewards and advantages, and for completion `row` its
    per-token terms, its share of the loss, the loss and the gradient norm."""
    idx: list[int]  # (B,) the data rows drawn
    prompts: list[str]  # (B,) as rendered
    batch: rollout.Rollout
    per_reward: dict[str, list]  # name -> (N,)
    total: torch.Tensor  # (N,)
    adv: torch.Tensor  # (N,)
    mask: torch.Tensor  # (N, C)
    group: int
    row: int
    terms: dict | None = None  # completion `row`'s (C,) tensors: logp, old, ratio, clip, loss_t
    share: float = 0.0
    loss: float = 0.0
    norm: grpo.LossNorm | None = None
    grad_norm: float = 0.0


def one_step(r: Run, group: int | None) -> Explained:
    """Sample, score, advantages, then the loss and gradient of the update holding the chosen
    completion: step.train_step's order, on the first iteration (on-policy)."""
    cfg, ro, G = r.cfg, r.cfg.rollout, r.cfg.rollout.num_generations
    idx = r.sampler.draw(ro.prompts_per_step)  # 1. B prompts
    rows = [r.rows[i] for i in idx]
    prompts = rollout.render_rows(r.tokenizer, rows, cfg.data)
    batch = r.sample(prompts)  # 2. G completions each, by the sampler chosen at setup, scored by
    res = r.rewards(batch.texts, [row for row in rows for _ in range(G)],  # the rewards prepared
                    num_tokens=batch.num_tokens())
    total = torch.tensor(res.total).float()  # (N,)
    adv = grpo.group_advantages(total, G, cfg.grpo.scale_rewards,  # 3. A_i
                                zero_std_tol=cfg.grpo.zero_std_tol)
    mask = step.loss_mask(r, batch, total)  # (N, C)
    group = pick_group(total, G, cfg.grpo.zero_std_tol) if group is None else group
    row = group * G + int(adv.view(-1, G)[group].abs().argmax())
    out = Explained(idx, prompts, batch, res.per_reward, total, adv, mask, group, row)
    return loss_and_gradient(r, out)


def loss_and_gradient(r: Run, e: Explained) -> Explained:
    """4. The loss of the update holding completion e.row, micro-batch by micro-batch as
    step.update takes it, backward, and the gradient's norm; no optimizer step."""
    cfg, g = r.cfg, r.cfg.grpo
    keep = None  # the tokens in the policy-gradient term: all, or the high-entropy ones
    if g.top_entropy_quantile < 1:
        keep = grpo.high_entropy_mask(e.batch.entropy, e.mask, g.top_entropy_quantile)
    mbs, e.norm = next((mbs, norm) for mbs, norm in step.mini_batches(cfg, e.batch, e.mask, e.total,
                                                                     e.adv)
                       if any(mb.start <= e.row < mb.stop for mb in mbs))
    ref_logp = None
    if g.beta > 0:
        with reference_mode(r.model, r.ref_copy) as ref:
            ref_logp = batch_log_probs(ref, e.batch, cfg, mbs)  # (N, C)
    settings, adv = r.loss, e.adv.to(r.device)
    r.model.train()
    r.optimizer.zero_grad(set_to_none=True)
    for mb in mbs:
        logp, C = micro_batch_log_probs(r.model, e.batch, e.batch.input_ids,
                                        e.batch.attention_mask, mb, cfg)  # (n, C)
        ref = None if ref_logp is None else ref_logp[mb, :C]
        k = None if keep is None else keep[mb, :C]
        loss, _ = grpo.grpo_loss(logp, None, ref, adv[mb], e.mask[mb, :C], e.norm, settings,
                                 None, k)  # old_logp None: on-policy
        loss.backward()
        e.loss += float(loss.detach())
        if mb.start <= e.row < mb.stop:
            e.terms, e.share = token_terms(logp.detach(), ref, adv[mb], e.mask[mb, :C], k, e.norm,
                                           settings, e.row - mb.start)
    e.grad_norm = float(torch.nn.utils.clip_grad_norm_(r.params, math.inf))  # inf: no clipping
    r.optimizer.zero_grad(set_to_none=True)
    return e


@torch.no_grad()
def token_terms(logp, ref, adv, mask, keep, norm, s: grpo.LossSettings, i: int):
    """Row i's per-token terms, as grpo_loss computes them on-policy (old_logp = logp, detached),
    and its share of the micro-batch's loss: the loss with every other row's terms zeroed."""
    ref = None if ref is None else torch.where(mask.bool(), ref, logp)
    loss_t, rho, _ = grpo.per_token_loss(logp, logp, ref, adv, mask, s, None, keep)  # (n, C) each
    clip = rho.clamp(1 - s.epsilon, 1 + s.epsilon_high) * adv[:, None]  # (n, C)
    alone = torch.zeros_like(loss_t)
    alone[i] = loss_t[i]
    share = float(grpo.aggregate(alone, mask, norm))
    return {"logp": logp[i], "old": logp[i], "ratio": rho[i], "clip": clip[i],
            "loss_t": loss_t[i], "mask": mask[i]}, share


def pick_group(total: torch.Tensor, G: int, tol: float) -> int:
    """The first group whose rewards differ (it has a signal), else group 0."""
    flat = grpo.zero_std_groups(total, G, tol).tolist()
    return flat.index(False) if False in flat else 0


# ----------------------------------------------------------------------------- where and showing


def where(fn, snippet: str = "") -> str:
    """'file:line name' of the line of fn's source holding `snippet` (else its def line), read
    from the code at run time: never a number written down."""
    fn = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(fn)
    at = next((i for i, s in enumerate(lines) if snippet and snippet in s), None)
    if at is None:
        at = next(i for i, s in enumerate(lines) if s.lstrip().startswith(("def ", "async def ")))
    path = Path(inspect.getsourcefile(fn)).resolve()
    top = Path(sys.modules[fn.__module__.split(".")[0]].__file__).resolve().parent
    ours = path.is_relative_to(ROOT) and "site-packages" not in path.parts  # not a .venv's
    home = ROOT if ours else top.parent  # a library's (torch's): from its site-packages
    return f"{path.relative_to(home)}:{start + at} {fn.__qualname__}"


def line(label: str, what: str, ref: str = "") -> str:
    """A quantity, what it is, and the line computing it, right-aligned at WIDTH."""
    room = WIDTH - 2 - 14 - len(ref) - 1
    what = what if len(what) <= room else what[:room - 3] + "..."
    return f"  {label:<14}{what:<{room}} {ref}".rstrip()


def cut(text: str, n: int) -> str:
    """repr(text) in at most n characters."""
    s = repr(text)
    return s if len(s) <= n else s[:n - 4] + "...'"


def fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"


def reward_ref(name: str) -> str:
    """The registered reward function's line, else the batch's (a reward named by file)."""
    found = rewards.lookup(name)
    return where(found[0]) if found else where(rewards.Rewards.__call__)


def show_prompt(r: Run, e: Explained) -> list[str]:
    B, G = len(e.idx), r.cfg.rollout.num_generations
    out = ["", "1. Draw B prompts and render them",
           line("prompts", f"B={B}: data rows {', '.join(map(str, e.idx))}",
                where(type(r.sampler).draw)),
           line("rendered", "chat template, system prompt, forced prefix",
                where(rollout.render_rows)),
           f"  group {e.group} of {B}" + (" (the first whose rewards differ)"
               if not bool(grpo.zero_std_groups(e.total, G).all()) else " (no group's differ)")
           + f", data row {e.idx[e.group]}, as the model sees it:"]
    return out + [f"    | {s[:WIDTH - 6]}" for s in e.prompts[e.group].split("\n")]


def show_group(r: Run, e: Explained) -> list[str]:
    cfg, G = r.cfg, r.cfg.rollout.num_generations
    ro, lo = cfg.rollout, e.group * G
    mean, std, _ = grpo.group_stats(e.total, G)
    eps = inspect.signature(grpo.group_advantages).parameters["eps"].default  # step's: default
    scale = {"group": f"(r - mean) / (std + {eps:g})", "none": "r - mean (scale_rewards: none)",
             "batch": f"(r - mean) / (the batch's std + {eps:g})"}[cfg.grpo.scale_rewards]
    out = ["", "2. Sample G completions, score them, advantages",
           line("completions", f"G={G}, temperature {ro.temperature:g}, at most "
                f"{ro.max_new_tokens} tokens", where(rollout.generate_rollout, "model.generate(")),
           *[line(k, f"reward, weight {s.weight:g}", reward_ref(s.name))
             for k, s in zip(e.per_reward, cfg.rewards)],
           line("total", "sum of weight x reward", where(rewards.weighted_sum, "spec.weight * v")),
           line("mean, std", f"{mean[e.group]:.4f}, {std[e.group]:.4f} (over the group)",
                where(grpo.group_stats, "return mean")),
           line("advantage", f"A = {scale}", where(grpo.group_advantages)), ""]
    return out + group_rows(e, range(lo, lo + G))


def group_rows(e: Explained, rows: range) -> list[str]:
    """The group's table: each completion's rewards, total, advantage and text (on its own line
    when the rewards leave under 30 columns); * marks completion e.row."""
    names = list(e.per_reward)
    head = f"  {'i':>3}" + "".join(f" {n[:12]:>12}" for n in names) + f" {'total':>8} {'A':>8}"
    room = WIDTH - len(head) - 2
    out = [head + ("  completion" if room >= 30 else "")]
    for i in rows:
        nums = "".join(f" {fmt(e.per_reward[n][i]):>12}" for n in names)
        mark = "*" if i == e.row else " "
        text = f"  {cut(e.batch.texts[i], min(room, 80))}" if room >= 30 else ""
        out.append(f" {mark}{i:>3}{nums} {fmt(float(e.total[i])):>8} {float(e.adv[i]):>+8.4f}"
                   + text)
        if room < 30:
            out.append(f"        {cut(e.batch.texts[i], 80)}")
    return out


def show_tokens(r: Run, e: Explained) -> list[str]:
    g = r.cfg.grpo
    t, n = e.terms, int(e.batch.completion_mask[e.row].sum())
    out = ["", f"3. Completion {e.row} (*: the largest |A| in its group, "
           f"A = {float(e.adv[e.row]):+.4f}), token by token",
           line("log-prob", f"log pi(token | before) at T={r.cfg.rollout.temperature:g}",
                where(micro_batch_log_probs)),
           line("old log-prob", "the sampler's: log-prob, detached", where(
               grpo.grpo_loss, "old_logp = d if")),
           line("ratio", "rho = exp(log-prob - old log-prob)", where(grpo.per_token_loss,
                                                                     "rho = torch.exp(")),
           line("clip x A", f"clip(rho, 1 - {g.epsilon:g}, 1 + {g.epsilon_high:g}) x A",
                where(grpo.per_token_loss, "rho.clamp(")),
           line("loss_t", "-min(rho A, clip(rho) A)" + (" + beta KL" if g.beta else ""),
                where(grpo.per_token_loss, "loss = -torch.minimum")),
           line("mask", "1: in the loss (up to EOS, reward not skipped)", where(step.loss_mask)),
           "  On-policy (the first pass, before any update) old log-prob = log-prob, so rho = 1 "
           "exactly and", "  the clip, which bounds rho to [1 - eps, 1 + eps_high], does nothing; "
           "the gradient still", "  flows through rho's d log-prob (docs/loss.md).", "",
           f"  {'t':>3}  {'token':<16} {'log-prob':>9} {'old':>9} {'ratio':>7} {'clip x A':>9}"
           f" {'loss_t':>9} {'mask':>4}"]
    rows = list(range(min(n + 1, len(t["logp"]))))  # its tokens, and a padding one after
    shown = rows if len(rows) <= TOKENS else rows[:TOKENS - 4] + [None] + rows[-3:]
    return out + [f"  {'...':>3}" if j is None else token_row(r, e, j, n) for j in shown]


def token_row(r: Run, e: Explained, j: int, n: int) -> str:
    """Token j of completion e.row (n tokens long; past them, padding)."""
    t = e.terms
    tok = cut(r.tokenizer.decode([int(e.batch.completion_ids[e.row, j])]), 16) if j < n \
        else "(padding)"
    return (f"  {j:>3}  {tok:<16} {float(t['logp'][j]):>9.4f} {float(t['old'][j]):>9.4f}"
            f" {float(t['ratio'][j]):>7.4f} {float(t['clip'][j]):>+9.4f}"
            f" {float(t['loss_t'][j]):>+9.4f} {int(t['mask'][j]):>4}")


def show_loss(r: Run, e: Explained) -> list[str]:
    nm = e.norm
    per = {"dapo": f"sum of m x loss_t / {nm.num_tokens} tokens in the update",
           "grpo": f"mean of loss_t over its tokens / {nm.num_sequences} completions",
           "dr_grpo": f"sum of m x loss_t / ({nm.num_sequences} x {nm.max_completion_length})",
           "bnpo": f"token mean in its micro-batch / {nm.num_micro_batches}"}[nm.loss_type]
    return ["", "4. The loss and its gradient (no optimizer step: no weight changes)",
            line("its share", f"{e.share:+.6f} = {per}", where(grpo.aggregate)),
            line("the loss", f"{e.loss:+.6f} = the sum of the completions' shares",
                 where(grpo.grpo_loss)),
            line("grad norm", f"{e.grad_norm:.6f} (not clipped)",
                 where(torch.nn.utils.clip_grad_norm_))]


def report(r: Run, e: Explained, config: str) -> str:
    cfg = r.cfg
    head = [f"One GRPO step, explained: {config}, step {r.start + 1}, seed {cfg.run.seed}, "
            f"{cfg.model.name} on {r.device}",
            "Each quantity names the line of code that computes it (file:line function)."]
    return "\n".join(head + show_prompt(r, e) + show_group(r, e) + show_tokens(r, e)
                     + show_loss(r, e))


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Any other option is train.py's: --config, --resume, "
                                        "--section.key=value")
    ap.add_argument("--group", type=int, help="the group to show (default: the first whose "
                                              "rewards differ)")
    own, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    args, overrides = train.parse_args(rest)
    args.dry_run = True  # setup checks all and starts nothing (no vLLM engine)
    try:
        with tempfile.TemporaryDirectory(prefix="minigrpo-explain-") as tmp:
            # setup probes that run.out_dir is writable: probe a folder of ours instead (--resume
            # reads its checkpoint from the run's own)
            r = lifecycle.setup(args, overrides + ([] if args.resume else [f"--run.out_dir={tmp}"]))
        if r.cfg.mode != "grpo" or r.cfg.env or r.cfg.tools:
            raise ConfigError("tools.explain shows a single-turn GRPO step (mode: grpo, no env: "
                              "or tools:)")
        B = r.cfg.rollout.prompts_per_step
        if own.group is not None and not 0 <= own.group < B:
            raise ConfigError(f"--group {own.group}: a step has groups 0 to {B - 1}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(r, one_step(r, own.group), args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
