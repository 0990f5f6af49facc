"""A run's state: what run/lifecycle.setup builds and checks before the run folder is touched, and
what the step (step.py) and the loop (train.py) read and keep between steps.

    r = lifecycle.setup(args, overrides)   # a Run; lifecycle.prepare(r) fills its prepared objects
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import grpo
from api.client import Judge
from config import Config
from data import PromptSampler
from engines import vllm_engine
from rewards import Rewards


@dataclass
class Run:
    """Everything the loop needs, built (and checked) before the run directory is touched."""
    cfg: Config
    run_dir: Path
    rows: list[dict]
    source_labels: list[str]  # one per data source (a mixture has several)
    device: torch.device
    model: torch.nn.Module
    tokenizer: object
    ref_copy: torch.nn.Module | None  # full fine-tuning with a reference (GRPO beta > 0, DPO) only
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object  # a GradScaler for fp16, else None
    sampler: PromptSampler
    judges: dict[str, Judge]  # by name: "judge" (the judge: section) and the judges: section's
    start: int  # last completed step (0 for a new run)
    engine: vllm_engine.VllmEngine | None = None  # rollout.engine: vllm
    world: int = 1  # processes under torchrun (parallel/distributed.py); 1: this one alone
    eval_rows: list[dict] | None = None  # run.eval_every: the held-out rows
    warned_all_truncated: bool = False  # the all-truncated warning is given once a run
    phase: str = "training"  # what the step is doing (sampling, training, scoring the held-out
    #   rows, syncing to vLLM): out of GPU memory, out_of_memory's advice fits it
    ref_logps: dict = field(default_factory=dict)  # DPO: by reply, dpo.cache_reference's log-probs
    changed: list[str] = field(default_factory=list)  # --resume: settings unlike the checkpoint's
    step: int = 0  # the step under way (what an interrupted run reports)
    # prepared once (lifecycle.prepare), what a GRPO step calls:
    rewards: Rewards | None = None  # the rewards, resolved: rewards(texts, samples, num_tokens=...)
    sample: Callable | None = None  # the sampler chosen: sample(prompts) -> rollout.Rollout
    prompts_per_step: int = 0  # B: this process's share of rollout.prompts_per_step (torchrun)
    resample: Callable | None = None  # DAPO dynamic sampling (scoring/dynamic_sampling.py)
    sample_and_score: Callable | None = None  # episodes, or the reward overlap: (rows, samples)
    #   -> (rollout, RewardResult); None: sample, then score
    loss: grpo.LossSettings | None = None  # the loss's settings
