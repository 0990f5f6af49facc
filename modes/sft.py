"""Supervised fine-tuning (`mode: sft`): the model setup, data, checkpoints and resume of a GRPO
run, with a cross-entropy loss on the reply tokens only. Run it through train.py:

    python train.py --config my_sft.yaml  # a config with mode: sft, data.target: the reply column

An example is rendered exactly like a GRPO prompt (chat template, system prompt, forced
assistant prefix) followed by the target reply and EOS, so SFT teaches the distribution that GRPO
later samples from, and a GRPO config starts from the result with `model.init_adapter: runs/sft`.

    loss = -(1/T) sum_t log pi(y_t | x, y_<t),   T = reply tokens in the whole optimizer step
"""
from __future__ import annotations

import torch

import rollout
from logprobs import micro_batch_log_probs, micro_batches
from scoring.metrics import source_shares
from step import grad_norm_metrics, optimizer_step


def sft_batch(tokenizer, rows: list[dict], cfg, device: torch.device | None = None,
              replies: list[str] | None = None,
              limit: tuple[str, int] | None = None) -> rollout.Rollout:
    """Left-padded rendered prompts and right-padded replies (each ending in EOS) as a Rollout (on
    device). replies: one a row (default: the rows' targets); limit: (config key, tokens) a row may
    hold (sft.max_length)."""
    prompts = rollout.render_rows(tokenizer, rows, cfg.data)
    replies = [rollout.with_eos(tokenizer, t)
               for t in (replies if replies is not None else [r["target"] for r in rows])]
    key, most = limit or ("sft.max_length", cfg.sft.max_length)
    p = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        c = tokenizer(replies, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    lengths = p.attention_mask.sum(1) + c.attention_mask.sum(1)  # (n,)
    if int(lengths.max()) > most:
        i = int(lengths.argmax())
        raise ValueError(f"an example has {int(lengths[i])} tokens > {key}={most}: "
                         f"{prompts[i][:80]!r}")
    return rollout.Rollout(*(x.to(device or "cpu") for x in (p.input_ids, p.attention_mask,
        c.input_ids, c.attention_mask.float(), torch.zeros(len(rows), dtype=torch.bool))), replies)


def sft_step(r) -> tuple[dict, None]:
    """One optimizer step of SFT on sft.batch_size examples -> (metrics, None)."""
    cfg, model = r.cfg, r.model
    device = next(model.parameters()).device
    rows = [r.rows[i] for i in r.sampler.draw(cfg.sft.batch_size)]
    batch = sft_batch(r.tokenizer, rows, cfg, device)
    # (n, P + C) x2, (n, C)
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.completion_mask
    tokens = float(mask.sum())
    model.train()
    r.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens):
        logp, C = micro_batch_log_probs(model, batch, ids, attn, mb, cfg, temperature=1.0)  # (m, C)
        loss = -torch.where(mask[mb, :C].bool(), logp, 0.0).sum() / tokens  # a micro-batch's share
        (r.scaler.scale(loss) if r.scaler else loss).backward()
        total += float(loss.detach())
    grad_norm, lr = optimizer_step(r)
    return {"loss": total, "tokens": tokens, "learning_rate": lr, **grad_norm_metrics([grad_norm]),
            "epoch": r.sampler.position / len(r.rows)} | source_shares(r), None


@torch.no_grad()
def held_out_loss(r) -> float:
    """eval/loss: the mean reply-token cross-entropy on the held-out rows (eval.select's), the
    training loss on unseen rows: where it turns up while the training loss falls, SFT overfits."""
    cfg, model = r.cfg, r.model
    device = next(model.parameters()).device
    was_training, nll, tokens = model.training, 0.0, 0.0
    model.eval()
    for i in range(0, len(r.eval_rows), cfg.sft.batch_size):
        batch = sft_batch(r.tokenizer, r.eval_rows[i:i + cfg.sft.batch_size], cfg, device)
        for mb in micro_batches(batch, cfg.optim.micro_batch_size, cfg.optim.micro_batch_tokens):
            logp, C = micro_batch_log_probs(model, batch, batch.input_ids, batch.attention_mask, mb,
                                            cfg, temperature=1.0)
            mask = batch.completion_mask[mb, :C].bool()  # (m, C)
            nll -= float(torch.where(mask, logp, 0.0).sum())
            tokens += float(mask.sum())
    model.train(was_training)
    return nll / max(tokens, 1.0)
