"""Data-parallel GRPO under torchrun: N processes (ranks), each sampling and scoring its share of
the step's B prompts (whole groups, so advantages stay exact), their gradients summed before every
optimizer update, so the update is the one a single process takes on the same global batch.

    torchrun --nproc_per_node=2 train.py --config configs/quickstart.yaml   # 2 GPUs, or 2 CPU ranks

docs/multi-gpu.md says how to run it on N GPUs and N nodes, and what scales. What crosses ranks,
each call made by every rank in the same order (a collective):

  the loss normaliser  sum_norms: each mini-batch's sequences, tokens, micro-batches (step.py)
  the gradients        sum_gradients: one all-reduce (sum) before clipping (step.optimizer_step)
  the metrics          gather_drawn, gather, all_sum: every rank's completions and counters
  the decisions        agree, down_anywhere: stops, time limits and judge outages, taken together
  the checkpoint       gather of each rank's RNG, data position and judge totals; rank 0 writes

Why a sum and not DistributedDataParallel's mean: every normaliser counts the whole step across
ranks, so a rank's loss is its share of the global loss and the shares' gradients add up to the
global gradient. One all-reduce after accumulation (per update, not per micro-batch) leaves the
model unwrapped: LoRA's disable_adapter (the reference), generate and saving are untouched.
With one process (plain `python train.py`) every function returns its input: no process group.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

from config import Config, ConfigError
from parallel import seeds

TIMEOUT = datetime.timedelta(minutes=60)  # the longest a rank waits for the others (rank 0's eval)
BUCKET = 2**24  # gradient elements per all-reduce (64 MiB in fp32)


def world() -> int:
    """Processes in the run: torchrun's WORLD_SIZE, 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's number, 0 .. world() - 1; rank 0 writes the run's files."""
    return int(os.environ.get("RANK", "0"))


def quiet_other_ranks() -> None:
    """Ranks > 0 say nothing (rank 0 speaks for the run), but a crash's traceback still shows."""
    if rank() > 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the process's life)
        sys.excepthook = lambda *e: sys.__excepthook__(*e) or sys.__stderr__.flush()


def speak(error: BaseException) -> None:
    """A rank > 0 whose step failed on its own (out of memory, a full disk) says why; an interrupt,
    which torchrun sends every rank, stays rank 0's to say. `torchrun --tee 3` names the rank."""
    if rank() > 0 and not isinstance(error, KeyboardInterrupt):
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def check_config(cfg: Config) -> None:
    """Under torchrun: what cannot run data-parallel, or does not divide among the ranks, as one
    ConfigError before anything loads."""
    n, B = world(), cfg.rollout.prompts_per_step
    if n == 1:
        return
    fix = "run it with python train.py"
    refused = [
        (cfg.mode != "grpo", f"mode: {cfg.mode} is not data-parallel; {fix}"),
        (cfg.rollout.engine == "vllm", f"rollout.engine: vllm (one engine per rank) is not "
                                       f"data-parallel; use rollout.engine: hf, or {fix}"),
        (any(s.name == "human" for s in cfg.rewards),
         f"the human reward's rating queue has one trainer; {fix}"),
        (cfg.grpo.scale_rewards == "batch", "grpo.scale_rewards: batch divides by the std of the "
                                            "whole batch, which no rank sees; use group or none"),
        (cfg.grpo.top_entropy_quantile < 1, "grpo.top_entropy_quantile < 1 takes its quantile "
                                            f"over the whole step's tokens; {fix}"),
        (B % n > 0, f"rollout.prompts_per_step={B} (the global B) must be a multiple of the {n} "
                    "processes (each samples whole groups)"),
        (B % n == 0 and (B // n) % cfg.grpo.num_mini_batches > 0,
         f"grpo.num_mini_batches={cfg.grpo.num_mini_batches} must divide each process's "
         f"{B // n} prompts (rollout.prompts_per_step={B} over {n} processes)"),
    ]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"torchrun with {n} processes: {why}")


def start(device: torch.device) -> torch.device:
    """Join the process group (NCCL on GPUs, gloo on CPU) -> the rank's device (cuda:LOCAL_RANK)."""
    if world() == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        atexit.register(stop)  # also when setup fails after this (a --resume refused)
    return device


def stop() -> None:
    """Leave the process group, then collect garbage while the interpreter is whole: a reference
    cycle still holding the group let gloo's threads die in the interpreter's teardown, which
    aborts the process ("terminate called without an active exception": 6 of 51 two-process
    test runs on 2 CPU cores; 0 of 36 with the collect)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def same_start(params: list[torch.Tensor], seed: int) -> None:
    """Every rank starts from rank 0's trainable weights, and samples with its own seed."""
    if world() == 1:
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)
    seeds.seed_everything(seeds.rank_seed(seed, rank()))  # rank 0 keeps run.seed


def sum_norms(minis: list) -> list:
    """Each mini-batch's (micro-batches, grpo.LossNorm) with the norm's counts (sequences, tokens,
    micro-batches, completions with signal) summed over the ranks: the whole step's mini-batch."""
    if world() == 1:
        return minis
    counts = torch.tensor([[n.num_sequences, n.num_tokens, n.num_micro_batches, n.num_signal]
                           for _, n in minis], dtype=torch.float64, device=_device())  # (k, 4)
    dist.all_reduce(counts)
    return [(mbs, dataclasses.replace(n, num_sequences=int(c[0]), num_tokens=int(c[1]),
                                      num_micro_batches=int(c[2]), num_signal=int(c[3])))
            for (mbs, n), c in zip(minis, counts.tolist())]


def sum_gradients(params: list[torch.Tensor]) -> None:
    """p.grad = the sum over the ranks of p.grad, for every trainable p (buckets of flat fp32)."""
    if world() == 1:
        return
    for p in params:
        if p.grad is None:  # no micro-batch of this rank reached it: the others' sum still does
            p.grad = torch.zeros_like(p)
    i = 0
    while i < len(params):
        bucket, size = [], 0
        while i < len(params) and (not bucket or size + params[i].numel() <= BUCKET):
            bucket.append(params[i])
            size += params[i].numel()
            i += 1
        flat = torch.cat([p.grad.reshape(-1).float() for p in bucket])  # (size,)
        dist.all_reduce(flat)
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p.grad))


def all_sum(values: dict) -> dict:
    """The dict with each number summed over the ranks (loss sums, judge counters)."""
    if world() == 1:
        return values
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return {k: type(v)(s) for (k, v), s in zip(values.items(), t.tolist())}


def gather(obj) -> list:
    """[every rank's obj], in rank order (tensors inside go through the CPU)."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, _cpu(obj))
    return out


def gather_drawn(r, drawn) -> list:
    """Every rank's step.Scored drawn this step, for metrics over the global batch. Their samples
    come back as r.rows' own dicts (source_metrics finds a row's source by identity), and the
    sampler's per-source counts become the step's over all ranks."""
    if world() == 1:
        return [drawn]
    r.sampler.counts = [int(c) for c in all_sum(dict(enumerate(r.sampler.counts))).values()]
    index = {id(row): i for i, row in enumerate(r.rows)}
    if drawn.rollout.episodes:  # a user's environment object need not pickle: it stays here
        drawn = dataclasses.replace(drawn, rollout=dataclasses.replace(drawn.rollout, episodes=[
            dataclasses.replace(e, env=None) for e in drawn.rollout.episodes]))
    parts = gather(dataclasses.replace(drawn, samples=[index.get(id(s), s) for s in drawn.samples]))
    return [dataclasses.replace(p, samples=[r.rows[s] if isinstance(s, int) else s
                                            for s in p.samples]) for p in parts]


def whole_step(r, drawn, updates, concat):
    """step.train_step's seam: every rank's completions drawn, joined by `concat` (the same on every
    rank), and the updates' sums summed over the ranks (in place)."""
    updates.sums, updates.tis = all_sum(updates.sums), all_sum(updates.tis)
    return concat(gather_drawn(r, drawn), r.tokenizer.pad_token_id)


def agree(flag: bool) -> bool:
    """True on every rank when it is on any (a time limit each rank measures on its own clock)."""
    if world() == 1:
        return flag
    t = torch.tensor([float(flag)], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def down_anywhere(down: list, judges: dict) -> list:
    """The judges down on any rank (outage.down of each rank's own calls), on every rank."""
    if world() == 1:
        return down
    names = set().union(*gather({n for n, j in judges.items() if any(j is d for d in down)}))
    return [j for n, j in judges.items() if n in names]


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def check_world(saved: int, ckpt) -> None:
    """--resume: a checkpoint continues with the number of processes that wrote it."""
    if saved != world():
        raise ConfigError(f"--resume: {ckpt} was written by {saved} process(es), this run has "
                          f"{world()}; resume with torchrun --nproc_per_node={saved}"
                          + (" (or python train.py)" if saved == 1 else ""))


def _device() -> torch.device:
    """Where collectives' tensors live: the rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")


def _cpu(x):
    """x with every tensor inside (dataclass fields, dicts, lists) moved to the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _cpu(getattr(x, f.name))
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    return x
