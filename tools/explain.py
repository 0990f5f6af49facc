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
and done here by the step's own functions (step.score, step.make_batch, step.backward,
step.clip_gradients: one_step), so what it prints is what the step trains on; this file only
prints. It changes no weight (no optimizer step) and writes no file. Single-turn GRPO configs
only; groups come as drawn (no resample_zero_std, no mini-batch shuffle).
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
from logprobs import micro_batch_log_probs
from run import lifecycle
from run.state import Run

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100  # the terminal the output fits
TOKENS = 24  # rows of the token table at most


# ----------------------------------------------------------------------------- the step


@dataclass
class Explained:
    """What the step's own functions computed, for one step: the batch trained on (rewards,
    advantages, loss mask, mini-batches), and for completion `row` its per-token terms, its share of
    the loss, the loss of its update and the gradient norm."""
    idx: list[int]  # (B,) the data rows drawn
    prompts: list[str]  # (B,) as rendered
    batch: step.Batch  # what step.make_batch made of the scored groups
    group: int
    row: int
    terms: dict | None = None  # completion `row`'s (C,) tensors: logp, old, ratio, clip, loss_t
    share: float = 0.0
    loss: float = 0.0
    norm: grpo.LossNorm | None = None
    grad_norm: float = 0.0

    @property
    def per_reward(self) -> dict[str, list]:  # name -> (N,)
        return self.batch.kept.per_reward

    @property
    def total(self) -> torch.Tensor:  # (N,) the weighted sum
        return self.batch.kept.total

    @property
    def adv(self) -> torch.Tensor:  # (N,) what the updates train on
        return self.batch.advantages

    @property
    def mask(self) -> torch.Tensor:  # (N, C) the tokens in the loss
        return self.batch.mask


def one_step(r: Run, group: int | None) -> Explained:
    """step.train_step's first stages, by its own functions: draw, sample and score
    (step.score: the sampler and rewards prepared at setup), then step.make_batch (advantages,
    loss mask, mini-batches); then the loss and gradient of the update holding the chosen
    completion (loss_and_gradient)."""
    G = r.cfg.rollout.num_generations
    idx = r.sampler.draw(r.prompts_per_step)  # 1. B prompts
    prompts = rollout.render_rows(r.tokenizer, [r.rows[i] for i in idx], r.cfg.data)
    batch = step.make_batch(r, step.score(r, idx))  # 2. G completions each, scored; 3. A_i
    group = pick_group(batch.kept.total, G, r.cfg.grpo.zero_std_tol) if group is None else group
    row = group * G + int(batch.advantages.view(-1, G)[group].abs().argmax())
    return loss_and_gradient(r, Explained(idx, prompts, batch, group, row))


def loss_and_gradient(r: Run, e: Explained) -> Explained:
    """4. The first update holding completion e.row, micro-batch by micro-batch as step.update
    takes it (step.backward), and the gradient norm the step logs (step.clip_gradients, before
    the clip); then the gradients are dropped: no optimizer step, no weight changes."""
    mbs, e.norm = next((mbs, norm) for mbs, norm in e.batch.minis
                       if any(mb.start <= e.row < mb.stop for mb in mbs))
    r.model.train()
    r.optimizer.zero_grad(set_to_none=True)
    for mb in mbs:
        sums, logp, weight = step.backward(r, e.batch, mb, e.norm, None)
        e.loss += sums["loss"]
        if mb.start <= e.row < mb.stop:
            e.terms, e.share = token_terms(r, e, mb, logp, weight)
    if r.scaler:  # fp16: the step's norm is of the unscaled gradients
        r.scaler.unscale_(r.optimizer)
    e.grad_norm = step.clip_gradients(r)
    r.optimizer.zero_grad(set_to_none=True)
    return e


@torch.no_grad()
def token_terms(r: Run, e: Explained, mb: slice, logp, weight) -> tuple[dict, float]:
    """Completion e.row's per-token terms, by grpo.per_token_loss on what step.backward gave
    grpo_loss, and its share of the loss: the micro-batch's loss, every other row's terms zeroed."""
    b, s, C, i = e.batch, r.loss, logp.shape[1], e.row - mb.start
    mask, adv = b.mask[mb, :C], b.advantages[mb]  # (n, C), (n,)
    old = logp if b.old_logp is None else b.old_logp[mb, :C]  # on-policy: the log-probs themselves
    ref = None if b.ref_logp is None else torch.where(mask.bool(), b.ref_logp[mb, :C], logp)
    keep = None if b.keep is None else b.keep[mb, :C]
    loss_t, rho, _ = grpo.per_token_loss(logp, old, ref, adv, mask, s, weight, keep)  # (n, C) each
    clip = rho.clamp(1 - s.epsilon, 1 + s.epsilon_high) * adv[:, None]  # (n, C)
    alone = torch.zeros_like(loss_t)
    alone[i] = loss_t[i]
    share = float(grpo.aggregate(alone, mask, e.norm))
    ones = torch.ones_like(logp[i])
    return {"logp": logp[i], "old": old[i], "ratio": rho[i], "clip": clip[i],
            "weight": ones if weight is None else weight[i],
            "keep": ones if keep is None else keep[i], "loss_t": loss_t[i], "mask": mask[i]}, share


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
    r_ = "s" if cfg.grpo.reward_aggregation == "normalize_then_sum" else "r"
    scale = {"group": f"({r_} - mean) / (std + {grpo.EPS:g})",
             "none": f"{r_} - mean (scale_rewards: none)",
             "batch": f"({r_} - mean) / (the batch's std + {grpo.EPS:g})"}[cfg.grpo.scale_rewards]
    out = ["", "2. Sample G completions, score them, advantages",
           line("completions", f"G={G}, temperature {ro.temperature:g}, at most "
                f"{ro.max_new_tokens} tokens", where(rollout.generate_rollout, "model.generate(")),
           *[line(k, f"reward, weight {s.weight:g}", reward_ref(s.name))
             for k, s in zip(e.per_reward, cfg.rewards)],
           line("total", "sum of weight x reward", where(rewards.weighted_sum, "spec.weight * v")),
           line("mean, std", f"{mean[e.group]:.4f}, {std[e.group]:.4f} (over the group)",
                where(grpo.group_stats, "return mean")),
           *([line("s", "GDPO: sum of weight x reward normalised in its group",
                   where(grpo.normalize_then_sum))]
             if cfg.grpo.reward_aggregation == "normalize_then_sum" else []),
           line("advantage", f"A = {scale}", where(grpo.group_advantages)),
           line("taken by", "step.make_batch, as the step takes them", where(step.make_batch)), ""]
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
        text = f"  {cut(e.batch.kept.rollout.texts[i], min(room, 80))}" if room >= 30 else ""
        out.append(f" {mark}{i:>3}{nums} {fmt(float(e.total[i])):>8} {float(e.adv[i]):>+8.4f}"
                   + text)
        if room < 30:
            out.append(f"        {cut(e.batch.kept.rollout.texts[i], 80)}")
    return out


def show_tokens(r: Run, e: Explained) -> list[str]:
    g = r.cfg.grpo
    t, n = e.terms, int(e.batch.kept.rollout.completion_mask[e.row].sum())
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
           *([line("w", f"the sampler's importance weight ({g.tis_mode}, cap {g.tis_cap:g})",
                   where(grpo.sampler_weight))] if e.batch.kept.rollout.sampler_logp is not None
             else []),
           *([line("keep", f"1: a top-{g.top_entropy_quantile:g} entropy token (policy term)",
                   where(grpo.high_entropy_mask))] if e.batch.keep is not None else []),
           line("mask", "1: in the loss (up to EOS, reward not skipped)", where(step.loss_mask)),
           "  On-policy (the first pass, before any update) old log-prob = log-prob, so rho = 1 "
           "exactly and", "  the clip, which bounds rho to [1 - eps, 1 + eps_high], does nothing; "
           "the gradient still", "  flows through rho's d log-prob (docs/loss.md).", "",
           f"  {'t':>3}  {'token':<16} {'log-prob':>9} {'old':>9} {'ratio':>7} {'clip x A':>9}"
           + "".join(f" {k:>6}" for k in extra_columns(e)) + f" {'loss_t':>9} {'mask':>4}"]
    rows = list(range(min(n + 1, len(t["logp"]))))  # its tokens, and a padding one after
    shown = rows if len(rows) <= TOKENS else rows[:TOKENS - 4] + [None] + rows[-3:]
    return out + [f"  {'...':>3}" if j is None else token_row(r, e, j, n) for j in shown]


def token_row(r: Run, e: Explained, j: int, n: int) -> str:
    """Token j of completion e.row (n tokens long; past them, padding)."""
    t = e.terms
    tok = cut(r.tokenizer.decode([int(e.batch.kept.rollout.completion_ids[e.row, j])]), 16) \
        if j < n else "(padding)"
    return (f"  {j:>3}  {tok:<16} {float(t['logp'][j]):>9.4f} {float(t['old'][j]):>9.4f}"
            f" {float(t['ratio'][j]):>7.4f} {float(t['clip'][j]):>+9.4f}"
            + "".join(f" {float(t[k][j]):>6.3f}" for k in extra_columns(e))
            + f" {float(t['loss_t'][j]):>+9.4f} {int(t['mask'][j]):>4}")


def extra_columns(e: Explained) -> list[str]:
    """The token table's columns beyond the plain loss's: the sampler's weight, the entropy mask."""
    return ([k for k, on in (("weight", e.batch.kept.rollout.sampler_logp is not None),
                             ("keep", e.batch.keep is not None)) if on])


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
