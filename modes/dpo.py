"""Direct preference optimization (`mode: dpo`): the model setup, data, checkpoints and resume of
a GRPO run, trained on preference pairs (a prompt, a chosen reply, a rejected one). Run it
through train.py, e.g. on tools/bestofn.py's best-vs-worst pairs:

    python -m tools.bestofn runs/eval/predictions_sft.jsonl --pairs pairs.jsonl
    python train.py --config my_dpo.yaml  # mode: dpo; data.chosen, data.rejected: the reply columns

With y_w the chosen reply, y_l the rejected one, log pi(y|x) a reply's summed token log-probs
under the policy and log ref(y|x) under the reference (the model DPO starts from: the base with
the adapter switched off, into which model.init_adapter is merged, e.g. the SFT run):

    r_w = beta (log pi(y_w|x) - log ref(y_w|x)),   r_l = beta (log pi(y_l|x) - log ref(y_l|x))
    loss = -(1/n) sum_pairs log sigmoid(r_w - r_l)                          (dpo.loss_type: sigmoid)

dpo.loss_type picks another loss of the same h = (r_w - r_l) / beta (dpo_loss: cDPO's label
smoothing, IPO, hinge). At the first step the policy is the reference, so the sigmoid loss is
log 2 = 0.693. Logged as TRL's
DPOTrainer logs them: rewards/chosen, rewards/rejected (mean r_w, r_l), rewards/margins (mean
r_w - r_l), rewards/accuracies (share of pairs with r_w > r_l), logps/chosen, logps/rejected.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import rollout
from logprobs import micro_batch_log_probs, micro_batches
from model import reference_mode
from scoring.metrics import source_shares
from step import grad_norm_metrics, optimizer_step

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, lengths: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss, implicit rewards from summed reply log-probs, each (n,) -> (loss, r_w, r_l),
    r_w = beta (pi_w - ref_w), r_l = beta (pi_l - ref_l), h = (pi_w - ref_w) - (pi_l - ref_l):

        sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   DPO; label_smoothing
                 eps > 0 is cDPO, for pairs whose label is wrong with probability eps (noisy judges)
        ipo      (h' - 1 / (2 beta))^2, h' the same difference of per-token means (lengths: the
                 two replies' token counts): IPO (arXiv 2310.12036) as TRL computes it
        hinge    max(0, 1 - beta h)                                          SLiC (arXiv 2305.10425)
    """
    r_w = beta * (policy_chosen - ref_chosen)  # (n,)
    r_l = beta * (policy_rejected - ref_rejected)  # (n,)
    h = (r_w - r_l) / beta  # (n,)
    if loss_type == "sigmoid":
        loss = (-(1 - label_smoothing) * F.logsigmoid(beta * h)
                - label_smoothing * F.logsigmoid(-beta * h))
    elif loss_type == "ipo":
        if lengths is None:
            raise ValueError("the ipo loss needs the replies' token counts (lengths)")
        n_chosen, n_rejected = (n.to(h.dtype).clamp(min=1) for n in lengths)
        loss = ((policy_chosen - ref_chosen) / n_chosen
                - (policy_rejected - ref_rejected) / n_rejected - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"dpo.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    return loss, r_w, r_l


def pair_batch(tokenizer, rows: list[dict], cfg,
               device: torch.device | None = None) -> rollout.Rollout:
    """Each row twice, its chosen reply then its rejected one (rows 2i and 2i + 1: a pair stays in
    one micro-batch and its prompt runs once, grpo.share_prompt), as sft.sft_batch builds them."""
    from modes.sft import sft_batch
    twice = [r for r in rows for _ in range(2)]
    replies = [r[k] for r in rows for k in ("chosen", "rejected")]
    return sft_batch(tokenizer, twice, cfg, device, replies=replies,
                     limit=("dpo.max_length", cfg.dpo.max_length))


def pair_passes(r, batch: rollout.Rollout, train: bool, keys: list):
    """For each micro-batch of whole pairs (a pair's two replies are never split): (its rows, their
    summed reply log-probs under the policy, under the reference), as pair_log_probs gives them."""
    for mb in micro_batches(batch, max(r.cfg.optim.micro_batch_size, 2),
                            r.cfg.optim.micro_batch_tokens, group=2):
        yield mb, *pair_log_probs(r, batch, mb, train, keys)


def pair_log_probs(r, batch: rollout.Rollout, mb: slice, train: bool,
                   keys: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed reply log-probs of a micro-batch's rows under the policy (with gradients when `train`)
    and under the reference (without) -> ((m,), (m,)), rows in batch order. keys: one a row of the
    batch, naming its reply; with dpo.cache_reference a reply's reference log-prob is computed once
    a run (r.ref_logps) and read back in later epochs: the reference never changes."""

    def summed(model) -> torch.Tensor:
        logp, C = micro_batch_log_probs(model, batch, batch.input_ids, batch.attention_mask, mb,
                                        r.cfg, temperature=1.0)
        return torch.where(batch.completion_mask[mb, :C].bool(), logp, 0.0).sum(1)  # (m,)
    keys, cache = keys[mb], r.ref_logps if r.cfg.dpo.cache_reference else {}
    if all(k in cache for k in keys):
        ref_logp = torch.tensor([cache[k] for k in keys], device=batch.input_ids.device)
    else:
        with torch.no_grad(), reference_mode(r.model, r.ref_copy) as ref:
            ref_logp = summed(ref).float()
        if r.cfg.dpo.cache_reference:
            cache.update(zip(keys, ref_logp.tolist()))
    with torch.set_grad_enabled(train):
        return summed(r.model), ref_logp


def pairs_loss(cfg, pi: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor):
    """dpo_loss of rows in pairs (chosen at even rows), each (2m,): summed log-probs under the
    policy and the reference, and the replies' token counts -> (loss, r_w, r_l), each (m,)."""
    return dpo_loss(pi[0::2], pi[1::2], ref[0::2], ref[1::2], cfg.dpo.beta, cfg.dpo.loss_type,
                    cfg.dpo.label_smoothing, (lengths[0::2], lengths[1::2]))


def pair_metrics(loss, r_w, r_l, pi) -> dict:
    """TRL's DPO metrics from per-pair values (n,) and the policy's summed log-probs (2n,), chosen
    at even rows."""
    return {"loss": float(loss.mean()), "rewards/chosen": float(r_w.mean()),
            "rewards/rejected": float(r_l.mean()), "rewards/margins": float((r_w - r_l).mean()),
            "rewards/accuracies": float((r_w > r_l).float().mean()),
            "logps/chosen": float(pi[0::2].mean()), "logps/rejected": float(pi[1::2].mean())}


def dpo_step(r) -> tuple[dict, None]:
    """One optimizer step of DPO on dpo.batch_size pairs -> (metrics, None)."""
    cfg, model = r.cfg, r.model
    device = next(model.parameters()).device
    idx = r.sampler.draw(cfg.dpo.batch_size)
    batch = pair_batch(r.tokenizer, [r.rows[i] for i in idx], cfg, device)
    keys = [("train", i, k) for i in idx for k in ("chosen", "rejected")]  # (2n,) as the batch rows
    n = len(idx)
    model.train()
    r.optimizer.zero_grad(set_to_none=True)
    pi, ref, lengths = [], [], batch.completion_mask.sum(1)  # (2n,) reply tokens, EOS included
    for mb, logp, ref_logp in pair_passes(r, batch, train=True, keys=keys):  # (m,) each, m even
        loss, _, _ = pairs_loss(cfg, logp, ref_logp, lengths[mb])  # (m/2,)
        loss = loss.sum() / n  # this micro-batch's share of the mean over the step's pairs
        (r.scaler.scale(loss) if r.scaler else loss).backward()
        pi.append(logp.detach())
        ref.append(ref_logp)
    pi, ref = torch.cat(pi).float(), torch.cat(ref).float()  # (2n,) each
    loss, r_w, r_l = pairs_loss(cfg, pi, ref, lengths)
    grad_norm, lr = optimizer_step(r)
    return pair_metrics(loss, r_w, r_l, pi) | {
        "tokens": float(batch.completion_mask.sum()), "learning_rate": lr,
        **grad_norm_metrics([grad_norm]), "epoch": r.sampler.position / len(r.rows)} \
        | source_shares(r), None


@torch.no_grad()
def held_out_metrics(r) -> dict:
    """eval/loss, eval/rewards/margins, eval/rewards/accuracies, ...: the DPO metrics on the
    held-out pairs (eval.select's), the policy now against the reference. Accuracy near 1 on
    training pairs and near 0.5 on these: DPO memorised its pairs."""
    cfg, model = r.cfg, r.model
    device = next(model.parameters()).device
    was_training, pi, ref, lengths = model.training, [], [], []
    model.eval()
    for i in range(0, len(r.eval_rows), cfg.dpo.batch_size):
        rows = r.eval_rows[i:i + cfg.dpo.batch_size]
        batch = pair_batch(r.tokenizer, rows, cfg, device)
        keys = [("eval", j, k) for j in range(i, i + len(rows)) for k in ("chosen", "rejected")]
        lengths.append(batch.completion_mask.sum(1))
        for _, logp, ref_logp in pair_passes(r, batch, train=False, keys=keys):
            pi.append(logp)
            ref.append(ref_logp)
    model.train(was_training)
    pi, ref = torch.cat(pi).float(), torch.cat(ref).float()
    return {f"eval/{k}": v
            for k, v in pair_metrics(*pairs_loss(cfg, pi, ref, torch.cat(lengths)), pi).items()}
