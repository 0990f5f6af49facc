"""The one typed config of a minigrpo run: nested dataclasses loaded from YAML.

    cfg = load_config("configs/quickstart.yaml",
                      ["--grpo.beta=0.04", "--rollout.num_generations=8"])

Every field below carries a one-line comment; that comment is the documentation of the knob.
Overrides are `--section.key=value`, the value parsed as YAML (`0.04`, `true`, `[a, b]`, `null`).
An unknown key names the closest valid keys, a wrong type names the expected type, and both
raise ConfigError, which the entry points turn into one line on stderr and exit code 2. How YAML
becomes these dataclasses (extends, overrides, type checks) is settings/typed_config.py; the checks
across fields that load_config runs (rollout.num_generations >= 2, ...) are settings/checks.py.
What is here is the settings, load_config, and the helpers other modules read a config with.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from files import jsonl
from settings.checks import (  # noqa: F401 (the checks' readings of a config and the
    # Anthropic check: imported from here too)
    ANTHROPIC_IGNORES,
    CHECKS,
    DATA_SUFFIXES,
    active_mixture,
    check_anthropic,
    is_local_data,
    judge_sections,
)
from settings.trl_names import check_trl_names
from settings.typed_config import (  # noqa: F401 (ConfigError, ENV_REF: imported from here)
    ENV_REF,
    ConfigError,
    apply_overrides,
    exclusive_layers,
    expand_refs,
    from_dict,
    read_yaml,
)

_USER_INFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^/@\s]+)@")


def mask_urls(text: str) -> str:
    """text with the user info of each URL in it (a password: http://user:pw@host) as ***, but
    for a password (or a user without one) that is only ${NAME} references: its secret is in the
    environment, and the text stays a URL that works.

    >>> mask_urls("error: no reply from http://judge:pw-SECRET@127.0.0.1:8013/v1 (5 tries)")
    'error: no reply from http://***@127.0.0.1:8013/v1 (5 tries)'
    >>> mask_urls("http://judge:${JUDGE_PW}@host/v1"), mask_urls("http://tok3n@host")
    ('http://judge:${JUDGE_PW}@host/v1', 'http://***@host')
    """
    def masked(m: re.Match) -> str:
        user, _, password = m.group(2).partition(":")
        return m.group(0) if _only_references(password or user) else f"{m.group(1)}***@"
    return _USER_INFO.sub(masked, text)


class JudgeUnusable(RuntimeError):
    """A judge that cannot score: the endpoint refused in a way no retry fixes (HTTP 401, 403, 404:
    the key, the model or the URL; 402 or insufficient_quota: the bill; a 400 for a parameter the
    model does not take), its first requests all failed, or its first replies held no usable score
    (its template). api/client.py raises it; the reward registry (rewards.py) lets it through
    instead of scoring with the fallback, so that a run stops instead of training on nothing."""


@dataclass
class RewardSpec:
    """One entry of the config's `rewards:` list."""
    name: str  # a registered name, "package.module:function", or "path/to/file.py:function"
    weight: float = 1.0  # weight of this reward in the total
    args: dict = field(default_factory=dict)  # keyword arguments passed to the function
    fallback: float | Literal["skip"] = "skip"  # value if the function raises or gives no number
    #   (a failed judge call is no judgement): "skip" leaves the completion out of its group's
    #   advantage and the loss; a number scores it so
    label: str | None = None  # rewards/<label>/mean in metrics (None: name; "name#2" if repeated)


@dataclass
class EnvSpec:
    """The config's `env:` section: multi-turn episodes against an environment class written for
    TRL's GRPOTrainer(environment_factory=...), run unchanged (engines/environments.py)."""
    name: str = ""  # "path/to/file.py:Class" or "package.module:Class" (or a function that
    #   returns one): TRL's environment_factory, called with args once per rollout
    args: dict = field(default_factory=dict)  # keyword arguments `name` is called with
    names: dict[str, str] = field(default_factory=dict)  # TRL's dict of factories instead of
    #   name: each row's `environment` column picks one by its key; each called with no arguments


@dataclass
class JudgeConfig:
    # ${NAME} in these is read when a client is built (api/client.py), so the config and the run's
    # saved copy keep the reference: a secret (a header's token, a URL's password) is never saved
    FILLED_BY_CLIENT: ClassVar[tuple] = ("base_url", "model", "azure_endpoint", "api_version",
                                         "extra_headers")
    base_url: str = "http://127.0.0.1:8000/v1"  # OpenAI-compatible endpoint: vLLM, llama.cpp,
    #   Ollama, OpenAI; ${NAME} reads the env
    model: str = ""  # model sent in requests (on Azure: the deployment name); ${NAME} reads the env
    api_key_env: str | None = "OPENAI_API_KEY"  # env var with the key; unset -> "EMPTY" (local
    #   servers); null: the openai SDK's own, AZURE_OPENAI_API_KEY on Azure, else OPENAI_API_KEY
    azure_endpoint: str | None = None  # e.g. https://NAME.openai.azure.com or
    #   ${AZURE_OPENAI_ENDPOINT:-} (empty: not Azure); when set, Azure is used
    api_version: str | None = None  # Azure api-version, e.g. "2024-06-01" (azure_endpoint needs it)
    extra_headers: dict[str, str] = field(default_factory=dict)  # sent in every request; a secret
    #   as "Bearer ${MY_TOKEN}": ${NAME} is read from the env when the client is built, never saved
    max_concurrent: int = 8  # most requests in flight at once
    requests_per_minute: float | None = None  # most requests started per minute, retries included
    timeout_s: float = 60.0  # hard limit on one request
    max_retries: int = 4  # retries after the first try
    #   (429/408/5xx/timeout/connection error/a body that is not JSON only)
    backoff_s: float = 1.0  # first retry waits about this long, doubling each retry, with jitter
    backoff_max_s: float = 30.0  # cap on one wait of our own backoff
    retry_after_max_s: float = 120.0  # a server's Retry-After is honoured up to this (Azure asks
    #   for 45-60 s: sooner is another 429)
    temperature: float | None = 0.0  # judge temperature (part of the cache key); null: not sent,
    #   for models taking only their default (OpenAI's o-series and GPT-5 answer HTTP 400 to others)
    max_tokens: int = 512  # cap on the judge's reply length (part of the cache key)
    token_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"  # the request field
    #   max_tokens goes in: OpenAI's reasoning models (o-series, GPT-5) take only
    #   max_completion_tokens (which counts reasoning tokens too)
    extra_body: dict = field(default_factory=dict)  # more request fields (part of the cache key),
    #   e.g. {reasoning_effort: low}
    score_min: float = 0.0  # lowest valid score; a reply outside [score_min, score_max] fails
    score_max: float = 10.0  # highest valid score
    cache_path: str | None = None  # append-only JSONL of good replies, read at start; None: no file
    memory_cache: bool = True  # keep recent replies in RAM
    memory_cache_size: int = 10000  # most replies kept in RAM (LRU)
    price_prompt_per_m: float = 0.0  # USD per million prompt tokens, for judge_cost_usd
    price_cached_prompt_per_m: float | None = None  # USD per million prompt tokens the provider
    #   served from its prompt cache (usage.prompt_tokens_details.cached_tokens; OpenAI bills them
    #   at a discount); None: price_prompt_per_m
    price_completion_per_m: float = 0.0  # USD per million completion tokens


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # hub id, local directory, or the built-in "smollm2-135m"
    revision: str | None = None  # hub revision (branch, tag or commit) to load
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on
    #   GPUs that have it, else fp16
    quant: Literal["4bit"] | None = None  # NF4 base weights via bitsandbytes (QLoRA; CUDA or CPU)
    chat_template: str | None = None  # Jinja chat template (text or file) for models that ship none
    gradient_checkpointing: bool | Literal["auto"] = "auto"  # recompute activations: less memory,
    #   ~30% slower; auto: off on a CPU, on a GPU chosen with the micro-batch (gpu/memory.py)
    attn_implementation: str | None = None  # "sdpa", "flash_attention_2"; None: transformers picks
    trust_remote_code: bool = False  # allow custom modelling code from the hub
    cache_dir: str = "~/.cache/minigrpo"  # where the built-in model is converted once and reused
    init_adapter: str | None = None  # start from this LoRA: adapter/checkpoint/run dir (e.g. SFT's)
    merge_init_adapter: bool = False  # merge init_adapter into the base and train a fresh LoRA on
    #   top (else continue it)


@dataclass
class LoraConfig:
    enabled: bool = True  # false trains all weights (and keeps a frozen reference copy if beta > 0)
    r: int = 16  # LoRA rank
    alpha: int = 32  # LoRA scaling numerator: the update is (alpha / r) * B @ A
    dropout: float = 0.0  # SFT only: GRPO and DPO turn it off (old/ref log-probs would disagree)
    target_modules: list[str] | str = "all-linear"  # module names to adapt, or "all-linear"


@dataclass
class DataSource:
    name: str  # a local file, hub dataset id or built-in task, as data.name
    weight: float = 1.0  # share of prompts from this source at the first step (normalised)
    weight_end: float | None = None  # final share, linear in between: a curriculum; None: weight
    label: str | None = None  # data/<label> in metrics (None: file stem, or dataset id's last part)
    config_name: str | None = None  # hub dataset config (subset) name
    revision: str | None = None  # hub revision (branch, tag, commit): same rows after hub changes
    split: str = "train"  # hub dataset split
    prompt: str | None = None  # column or template of this source's prompt (None: data.prompt)
    map: str | None = None  # row mapping, e.g. an adapter to the shared columns (None: data.map)
    select: list[int] | None = None  # [start, end) of its shuffled rows to use (None: data.select)
    num_examples: int = 0  # keep the first n rows (0: all)


@dataclass
class DataConfig:
    name: str | None = "arithmetic"  # built-in task ("arithmetic"), a local
    #   .jsonl/.json/.csv/.parquet file, or a hub dataset id (null with a mixture)
    root: str | None = None  # directory for relative data file names (data.name, mixture sources)
    config_name: str | None = None  # hub dataset config (subset) name
    revision: str | None = None  # hub dataset revision (branch, tag or commit): split_seed and
    #   select pick the same rows only while the hub copy keeps its row order (MedMCQA's was
    #   re-uploaded once), so pin it for SFT -> GRPO -> eval
    split: str = "train"  # hub dataset split
    prompt: str = "prompt"  # column of the prompt, or a template like "Q: {question}\nA) {opa}"
    target: str | None = None  # SFT: column or template of the assistant reply to learn
    chosen: str | None = None  # DPO: column/template of the preferred reply (bestofn: chosen)
    rejected: str | None = None  # DPO: column or template of the dispreferred reply (rejected)
    answer_key: str | None = "answer"  # column of the gold answer rewards read (None: no gold)
    system_prompt: str | None = None  # system message put before every prompt
    assistant_prefix: str = ""  # text forced at the reply's start, e.g. "<think>"; counts as prompt
    chat_template_kwargs: dict = field(default_factory=dict)  # extra chat-template arguments, e.g.
    #   {enable_thinking: false} for Qwen3
    tools_prompt: str | None = None  # tools: the system text that describes them to a model whose
    #   chat template declares none ({tools}: their JSON schemas); None: minigrpo's Hermes-style one
    num_examples: int = 0  # built-in task size (0: all 400); files, hub: keep the first n (0: all)
    split_seed: int | None = None  # shuffle all rows with this seed before `select` (MedMCQA: 42)
    select: list[int] | None = None  # [start, end) of (shuffled) rows trained on, e.g. [1000, 1500]
    shuffle_seed: int = 0  # order in which prompts are drawn
    map: str | None = None  # row mapping applied before prompts are built: a built-in
    #   (medmcqa_json) or "file.py:fn" / "module:fn"; None from it drops the row
    mixture: list[DataSource] | None = None  # weighted sources, replacing data.name (see data.py)
    presets: dict[str, list[DataSource]] = field(default_factory=dict)  # named mixtures, e.g.
    #   GRubrics' open_only, curriculum
    preset: str | None = None  # the data.presets entry to train on (e.g. --data.preset=curriculum)
    skip_long: bool = False  # leave out (and count) training rows over the length limit
    #   (rollout.max_prompt_tokens; sft.max_length, dpo.max_length) instead of stopping at the
    #   first: real datasets hold a few very long rows
    skip_incomplete: bool = False  # leave out (and count) rows missing a field the prompt, a
    #   reply or the gold answer reads (an eval file's rows without a prompt) instead of stopping
    group_by: str | None = None  # a column: rows sharing its value become one row (before splits
    #   and data.map), e.g. a cache of one answer a row -> one question a row; None: row by row
    group_lists: dict[str, str] = field(default_factory=dict)  # group_by: list column -> the row
    #   column it collects, in file order, e.g. {answers: answer, gold_scores: gold_score}; other
    #   columns are the group's first row's


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4  # B: distinct prompts (groups) per rollout batch, i.e. per run step
    num_generations: int = 8  # G: completions sampled per prompt
    max_new_tokens: int = 64  # completion length cap; longer ones are cut and flagged truncated
    max_prompt_tokens: int = 512  # prompts longer than this are an error (data.skip_long: left out)
    temperature: float = 1.0  # sampling temperature; the trainer's log-probs use the same value
    top_p: float = 1.0  # nucleus sampling; the loss's log-probs are softmax(logits / T)'s,
    #   untruncated, so < 1 samples slightly off the policy it trains (as in TRL)
    top_k: int = 0  # top-k sampling (0: off); off the policy as top_p < 1 is
    stop_strings: list[str] = field(default_factory=list)  # extra strings that end a completion
    ignore_eos: bool = False  # EOS suppressed, always max_new_tokens: fixed-length speed benchmarks
    compile: bool | Literal["auto"] = "auto"  # HF generate with a static KV cache, compiled by
    #   transformers on CUDA (prompts padded to 64, 96, 128, 192, ... tokens: a compilation each);
    #   no prompt sharing; auto: on on GPUs of compute capability >= 8 (A10, A100, H100), off
    #   elsewhere (gpu/auto.py)
    prompts_per_generate: int = 0  # prompts (groups) per HF generate call, 0: all at once; fewer
    #   caps the sampling KV cache at this many x G rows (e.g. 2 of B=16 prompts: 1/8 of the cache)
    #   for more, smaller calls; see bench/memory_estimate.py
    overlap_rewards: bool = True  # with prompts_per_generate: score each slice (judge calls,
    #   ratings) while the next one samples
    merged_sampling: bool | Literal["auto"] = "auto"  # HF generate with the LoRA update folded
    #   into the base weights (restored after): faster sampling; see model.py; auto: on with
    #   rollout.compile's auto on a GPU, off on a CPU (gpu/auto.py)
    engine: Literal["hf", "vllm"] = "hf"  # who samples: HF generate, or vLLM on the same GPU
    #   (LoRA only; see engines/vllm_engine.py)
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM reserves (weights +
    #   KV cache); the trainer gets the rest
    vllm_sleep: bool = False  # sleep vLLM (free KV cache, offload weights) while the trainer runs
    resample_zero_std: bool = False  # DAPO dynamic sampling: draw until B groups have signal
    max_prompts_per_step: int = 0  # resampling's cap on prompts per step (0: 4 * prompts_per_step)
    max_turns: int = 4  # env or tools: assistant turns an episode has at most (engines/episodes.py)
    max_episode_tokens: int = 512  # env or tools: tokens after the prompt an episode has at most,
    #   the model's and the environment's; a longer one is cut and flagged truncated
    tool_timeout: float = 10.0  # tools: seconds a tool call may run before its result is an error


@dataclass
class GrpoConfig:
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "luspo"] = "dapo"  # loss normalisation
    #   (grpo.aggregate); luspo: each completion's sum (LUSPO, with importance_sampling_level:
    #   sequence)
    beta: float = 0.0  # weight of the k3 KL to the reference; 0 skips the reference forward
    use_bias_correction_kl: bool = True  # the k3 term times the ratio: its gradient is then that of
    #   KL(policy || reference), the KL it estimates (TRL's default; grpo.k3, docs/loss.md)
    sync_ref_model: bool = False  # TR-DPO's moving reference: every ref_model_sync_steps steps,
    #   reference = alpha x policy + (1 - alpha) x reference (beta > 0, full fine-tuning)
    ref_model_mixup_alpha: float = 0.6  # sync_ref_model: alpha
    ref_model_sync_steps: int = 512  # sync_ref_model: every this many steps (rollout batches)
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float = 0.28  # upper clip: ratio <= 1 + epsilon_high (DAPO clip-higher)
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO's one ratio
    #   per completion (with loss_type: grpo and epsilons near 3e-4 / 4e-4); differs only off-policy
    #   or with tis_cap (grpo.py)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # std used in advantages
    reward_aggregation: Literal["sum", "normalize_then_sum"] = "sum"  # advantages of the weighted
    #   sum, or of the sum of each reward normalised in its group (GDPO; grpo.normalize_then_sum)
    num_iterations: int = 1  # mu: passes over each rollout batch
    num_mini_batches: int = 1  # optimizer steps per pass: the B groups, shuffled, split into this
    #   many mini-batches (B divisible by it), each its own loss and update (PPO's minibatches); the
    #   later ones are off-policy. Not TRL's steps_per_generation, which counts
    #   gradient-accumulation steps (TRL: steps_per_generation / GA updates)
    mask_truncated_completions: bool = False  # drop completions without EOS from the loss (DAPO)
    zero_std_tol: float = 1e-6  # groups whose rewards span (max - min) at most this carry no signal
    skip_flat_updates: bool = False  # no optimizer step for an update whose groups are all flat
    #   (every A 0) with beta 0: its gradient is zero (flat_updates; docs/loss.md)
    logprob_chunk: int = 0  # rows of logits per chunk in the log-prob computation; 0: about 2^26
    #   logits a chunk (256 MiB in fp32: 441 rows at Qwen's 151,936-token vocabulary, 1365 at
    #   SmolLM2's 49,152); see logprobs.py
    fused_lm_head: bool = False  # log-probs from hidden states chunk by chunk: the (N, C, V) logits
    #   never exist (GPU memory)
    logprob_kernel: bool | Literal["auto"] = "auto"  # the loss's log-probs by the hand-written
    #   log-softmax (logprobs.selective_log_probs: fp32 chunks, its backward written out: one fp32
    #   chunk of logits at a time) instead of log_softmax and gather; auto: on (gpu/auto.py)
    share_prompt: bool | Literal["auto", "prefill"] = "auto"  # run each prompt through the model
    #   once per group, not G times (see logprobs.py): true: in the sampling prefill and the loss
    #   forward; prefill: the sampling prefill only; auto: true on CPU, prefill on a GPU (there the
    #   loss's second pass costs more kernel launches than it saves at short prompts:
    #   bench/RESULTS.md), chosen at setup (gpu/auto.py); false: never
    top_entropy_quantile: float = 1.0  # policy gradient only on the step's top share of tokens by
    #   sampling entropy (0.2: "80/20", arXiv 2506.01939; 1: all)
    delta: float = 0.0  # two-sided clip (INTELLECT-2): with A < 0 the ratio is also capped at delta
    #   (> 1 + epsilon_high, e.g. 4); 0: off
    policy_loss: Literal["clip", "cispo", "sapo", "vespo", "dppo"] = "clip"  # the per-token term
    #   (grpo.py; TRL's loss_type cispo, sapo, vespo): clip: PPO's clipped objective; cispo: a
    #   detached weight min(ratio, cispo_cap) on -A log p (MiniMax-M1); sapo: a soft gate instead
    #   of the clip; vespo: a smooth Gamma weight of each completion's ratio; dppo: prime-rl's
    #   DPPO + KL (a mask on the change in probability, plus kl_tau log^2 ratio). All the same
    #   gradient on-policy
    cispo_cap: float = 5.0  # policy_loss: cispo: the cap on its importance weight
    #   (TRL: epsilon_high = 5 with loss_type cispo)
    sapo_temperature_pos: float = 1.0  # policy_loss: sapo: the gate's temperature for A > 0
    sapo_temperature_neg: float = 1.05  # and for A <= 0 (larger: damped sooner)
    vespo_k_pos: float = 2.0  # policy_loss: vespo: the weight's power for A >= 0 (low ratios)
    vespo_lambda_pos: float = 3.0  # and its decay (high ratios)
    vespo_k_neg: float = 3.0  # the power for A < 0
    vespo_lambda_neg: float = 2.0  # the decay for A < 0
    dppo_mask_low: float = 0.2  # policy_loss: dppo: A < 0 tokens whose probability fell by more
    #   than this since sampling leave the policy term
    dppo_mask_high: float = 0.2  # and A > 0 tokens whose probability rose by more than this
    kl_tau: float = 1e-3  # policy_loss: dppo: weight of (log ratio)^2 on every token
    off_policy_mask_threshold: float = 0.0  # drop from the policy term the completions with A < 0
    #   whose mean log(pi_old / pi) passed this (DeepSeek-V3.2; e.g. 0.5); 0: off (TRL's None)
    entropy_coef: float = 0.0  # an entropy bonus: loss - entropy_coef x the training forward's mean
    #   entropy (0: off, and no entropy is computed); the starting value with use_adaptive_entropy
    use_adaptive_entropy: bool = False  # Skywork-OR1: after each update the coefficient moves by
    #   entropy_coef_delta, up when the entropy was <= entropy_target, down otherwise, and applies
    #   only while the entropy is <= entropy_target
    entropy_coef_min: float = 0.0  # use_adaptive_entropy: the coefficient's lower bound
    entropy_coef_max: float = 1.0  # its upper bound
    entropy_coef_delta: float = 0.005  # its step after each update
    entropy_target: float = 0.2  # use_adaptive_entropy: the entropy (nats) to hold the policy above
    tis_cap: float = 0.0  # weight tokens by min(pi_trainer / pi_sampler, tis_cap): vLLM's
    #   rollouts, or HF generate's merged or compiled sampler (0: off; 2-3 is usual)
    tis_mode: Literal[  # ratio per token or completion; cap it or mask past it (step.py)
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "token_truncate"
    tis_min: float = 0.0  # with tis_cap: ratios below this are raised to it (truncate modes) or
    #   masked (mask modes); 0: no lower bound (TRL's vllm_importance_sampling_clip_min)


@dataclass
class OptimConfig:
    lr: float = 1e-5  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW betas
    warmup_steps: int = 0  # linear warmup (optimizer updates)
    warmup_ratio: float = 0.0  # or this share of the run's updates (TRL's warmup_ratio); not both
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0  # gradient clipping (0: off)
    micro_batch_size: int | Literal["auto"] = "auto"  # completions per forward/backward;
    #   accumulation covers the rest; auto: 8 on a CPU, on a GPU the largest that fits
    #   (gpu/memory.py)
    micro_batch_tokens: int = 0  # also cap a micro-batch at this many padded tokens
    #   (rows x longest row): flat memory with long, uneven completions (0: off)


@dataclass
class RunConfig:
    out_dir: str = "runs/quickstart"  # run directory: config, metrics, samples, checkpoints
    steps: int = 60  # rollout batches (each num_iterations x num_mini_batches optimizer updates)
    epochs: float = 0.0  # when > 0, sets run.steps to this many passes over the rows, rounded up:
    #   epochs x rows / rows a step (rollout.prompts_per_step, sft.batch_size or dpo.batch_size)
    seed: int = 0  # seeds python, numpy and torch
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    threads: int = 0  # CPU threads for torch (0: torch's default)
    save_every: int = 20  # checkpoint every n steps (and at the end); 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept whole (what --resume needs)
    keep_adapters: bool = True  # older checkpoints keep just their LoRA adapter (MBs), for eval.py
    sample_every: int = 5  # write sampled completions every n steps (0 = never)
    samples_per_log: int = 0  # completions written each time, the step's first (0: one whole group)
    report_to: Literal["none", "wandb", "trackio"] = "none"  # also send each step's metrics to
    #   Weights & Biases or Trackio (pip install wandb / trackio; their own env vars, e.g.
    #   WANDB_API_KEY, WANDB_MODE=offline, apply)
    project: str = "minigrpo"  # the tracker's project; the run is named after run.out_dir
    eval_every: int = 0  # every n steps, score eval.py's held-out rows (eval.select, eval.limit of
    #   them) as eval.py decodes them: eval/reward, eval/accuracy, ... in metrics.jsonl; 0 = never
    stop_without_signal: int = 0  # checkpoint and stop (exit code 3) after this many steps in a row
    #   in which no group's rewards differed (frac_reward_zero_std = 1: every advantage 0, nothing
    #   learned); 0: only warn, after 5
    max_minutes: float = 0.0  # a job's time limit: checkpoint and stop (exit code 0) after the step
    #   past which the next one would end later than this many minutes from the process's start;
    #   --resume goes on. 0: no limit
    judge_outage: Literal["wait", "stop"] = "wait"  # a judge that got no reply to (nearly) any call
    #   for judge_outage_steps steps in a row: wait, asking again with backoff (a line each minute)
    #   up to judge_wait_minutes, then checkpoint and stop (exit code 4); stop: do so at once
    judge_outage_steps: int = 1  # steps in a row a judge must be down before judge_outage acts
    judge_wait_minutes: float = 30.0  # judge_outage: wait gives up after this long (0: never)
    judge_max_failed_share: float = 0.5  # a step in which more than this share of a judge's calls
    #   got no reply is not trained on (no update; judge_steps_skipped); 1: always trained on
    judge_max_unusable_share: float = 0.5  # a judge whose replies held no usable score more often
    #   than this for judge_unusable_steps steps in a row stops the run (exit code 2); 1: never
    judge_unusable_steps: int = 3  # steps in a row judge_max_unusable_share must be passed


@dataclass
class SftConfig:
    batch_size: int = 16  # examples per optimizer step (micro-batched by optim.micro_batch_size)
    max_length: int = 1024  # prompt + reply tokens; longer is an error (data.skip_long: left out)


@dataclass
class DpoConfig:
    beta: float = 0.1  # pull to the reference: the implicit reward is beta x the log-ratio
    batch_size: int = 8  # pairs per optimizer step (micro-batched by optim.micro_batch_size rows,
    #   a pair's two together)
    max_length: int = 1024  # prompt + reply tokens, for each reply; a longer pair is an error
    #   (data.skip_long: left out)
    cache_reference: bool = True  # each reply's reference log-prob once a run, not every epoch
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"  # DPO's; IPO
    #   (per-token means, squared); hinge (SLiC): see modes/dpo.py
    label_smoothing: float = 0.0  # sigmoid: the share of pairs presumed mislabelled
    #   (cDPO, for noisy judges); 0: plain DPO


@dataclass
class HealthConfig:
    """run/health.py's thresholds: a one-line diagnosis when a run's metrics pass one."""
    enabled: bool = True  # false: no health lines
    truncated_share: float = 0.5  # completions/clipped_ratio at least this, `patience` steps
    patience: int = 3  # steps in a row a share must hold before it is said
    entropy_floor: float = 0.05  # sampling entropy under this in the first early_share of steps
    early_share: float = 0.3  # of run.steps: "early" for entropy_floor
    window: int = 5  # steps compared with the window before them for length_growth
    length_growth: float = 1.5  # mean length grown this many times over a window ...
    reward_gain: float = 0.0  # ... while the mean reward rose by at most this
    clip_max: float = 0.2  # clip_ratio/region_mean above this (the clip acts only off-policy)
    kl_max: float = 1.0  # kl (grpo.beta > 0) above this
    judge_failure_share: float = 0.2  # a judge's failures / calls over the last `window` steps
    eval_drop: float = 0.02  # eval/reward (else eval/accuracy) fell by more over eval_points
    #   held-out evaluations (run.eval_every), never rising between them, while the reward rose
    eval_points: int = 3  # the last held-out evaluations eval_drop compares (at least 2)
    sampler_gap_max: float = 0.3  # sampler_logp_abs_diff above this stops the run (0: never): the
    #   sampler is not sampling the trained policy (a vLLM that lost its adapter)


@dataclass
class EvalConfig:
    select: list[int] | None = None  # held-out [start, end) of the shuffled rows, e.g. [1500, 1700]
    split: str | None = None  # hub split eval.py reads (e.g. "test" for GSM8K); None: data.split
    name: str | None = None  # a held-out file (or hub dataset) of its own, read in its order with
    #   data's prompt, map and answer_key; eval.select picks its rows (None: all). None: data's rows
    config_name: str | None = None  # eval.name's hub config (None: data.config_name; "default" for
    #   a dataset without configs)
    num_samples: int = 1  # completions per prompt; more gives pass@k
    temperature: float = 0.0  # 0: greedy decoding
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    max_new_tokens: int = 256  # completion length cap
    pass_k: list[int] = field(default_factory=lambda: [1])  # k values for pass@k (k <= num_samples)
    batch_size: int = 16  # prompts per generate call
    limit: int = 0  # evaluate only the first n held-out rows of each data source (0: all)
    out_dir: str = "runs/eval"  # results.json, predictions_<model>.jsonl
    keep_columns: list[str] = field(default_factory=list)  # row columns copied into each prediction
    #   line (under "columns"), e.g. [id, prompt_type]
    group_by: str | None = None  # a row column: n, reward and accuracy for each of its values as
    #   well (<column>=<value>/accuracy, ...), e.g. prompt_type
    api: JudgeConfig | None = None  # endpoint for `api:MODEL` entries (its model field is ignored)
    apis: dict[str, JudgeConfig] = field(default_factory=dict)  # named endpoints with their own
    #   model and settings (GPT-5: temperature: null, ...): `api:NAME` uses eval.apis.NAME
    agreement: list[list[str]] = field(default_factory=list)  # pairs of reward labels, e.g.
    #   [[logic, logic_second]] (one criterion from two judges): eval reports
    #   agreement/<a>_vs_<b>/spearman and /mean_abs_diff


@dataclass
class PrecomputeConfig:
    questions: str | None = None  # questions to answer, one a row: a local
    #   .jsonl/.json/.csv/.parquet file or a hub dataset id
    config_name: str | None = None  # hub dataset config (subset) name, e.g. "main" for openai/gsm8k
    split: str = "train"  # hub dataset split (MATH-500 has only "test")
    map: str | None = None  # row mapping first: a built-in adapter
    #   (healthbench, medqa, medmcqa_json) or "file.py:fn"
    question: str = "{question}"  # column or template of the question the answer policy is asked
    limit: int = 0  # the first n questions only (0: all), counted before precompute.map: try a few
    #   before paying for all
    num_answers: int = 4  # K answers per question, the answers a rubric must rank
    system_prompt: str | None = None  # the answer policy's system message
    answers: JudgeConfig | None = None  # the answer policy: an OpenAI-compatible endpoint (model,
    #   temperature > 0 or null, cache_path: required, every answer is paid for)
    rubric_key: str = "rubric"  # gold by the judge: section: the column of the expert rubric it
    #   grades each answer by
    template: str = "rubric_scoring"  # ... by this template (rubric_alignment's); scaled to [0, 1]
    criteria_key: str | None = None  # gold by the judge per criterion instead, as HealthBench
    #   grades: the column of [{criterion, points}] (HealthBench's rubrics); gold = points of the
    #   criteria met / positive points, in [0, 1]
    criteria_template: str = "criterion_met"  # ... asking if one criterion is met ({"met": 0 or 1})
    gold_reward: RewardSpec | None = None  # gold by a rule instead, e.g. {name: choice_accuracy,
    #   args: {gold_key: answer}}: each answer's value of this reward (1 right, 0 wrong)
    keep_constant: bool = False  # keep questions whose K gold scores are all equal
    #   (rubric_alignment scores them 0: no signal)
    out: str | None = None  # the answer file written (JSON Lines: the row's columns, answers,
    #   gold_scores); never overwritten


@dataclass
class Config:
    mode: Literal["grpo", "sft", "dpo"] = "grpo"  # what train.py does: GRPO, supervised fine-tuning
    #   on data.target, or DPO on preference pairs (data.chosen over data.rejected)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    rewards: list[RewardSpec] = field(default_factory=list)  # reward functions, weights and args
    env: EnvSpec | None = None  # multi-turn: an environment class whose methods are the tools
    #   (docs/multi-turn.md); None, and no tools: one reply per prompt
    tools: list[str] = field(default_factory=list)  # multi-turn: "file.py:function"s the model
    #   calls in the chat template's tool-call format (TRL's tools=), with or without an env
    judge: JudgeConfig | None = None  # OpenAI-compatible judge for judge-based rewards (judge.py)
    judges: dict[str, JudgeConfig] = field(default_factory=dict)  # more judges by name, for a
    #   reward's args: {judge: NAME} (two judges scoring the same completions: dual-judge
    #   evaluation); each a full judge section
    sft: SftConfig = field(default_factory=SftConfig)  # supervised fine-tuning (mode: sft)
    dpo: DpoConfig = field(default_factory=DpoConfig)  # direct preference optimization (mode: dpo)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation with eval.py
    health: HealthConfig = field(default_factory=HealthConfig)  # run/health.py's thresholds
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)  # answers for
    #   rubric_alignment (tools/precompute.py)


# One of each pair decides: a later layer's choice (a file that extends, the command line) wins;
# True: turning off epochs needs steps (not the default 60)
EXCLUSIVE = (("run.steps", "run.epochs", True), ("optim.warmup_steps", "optim.warmup_ratio", False))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """YAML file (and the files it `extends`) + `--section.key=value` overrides -> validated Config
    (ConfigError on any problem)."""
    raw: dict = read_yaml(Path(path), exclusive=EXCLUSIVE) if path is not None else {}
    given: dict = {}  # exclusive_layers' command-line layer (--run.epochs=3, --run={epochs: 3})
    apply_overrides(given, [o for o in overrides
                            if any(f"{k}.".startswith(o[2:].split("=", 1)[0] + ".")
                                   for pair in EXCLUSIVE for k in pair[:2])], Config)
    exclusive_layers(raw, given, EXCLUSIVE, "the command line")
    apply_overrides(raw, overrides, Config)
    check_trl_names(raw, Config)  # --grpo.num_generations: TRL's name, here rollout.num_generations
    cfg = from_dict(Config, expand_refs(raw, Config))  # ${NAME}: read once, then typed
    for check in CHECKS:  # the checks across fields, in settings/checks.py
        check(cfg)
    return cfg


def length_limit(cfg: Config) -> tuple[str, int]:
    """The token limit a row must fit -> (its key, the limit): prompt + reply for SFT and DPO (each
    reply), the prompt for GRPO."""
    return {"sft": ("sft.max_length", cfg.sft.max_length),
            "dpo": ("dpo.max_length", cfg.dpo.max_length)}.get(
        cfg.mode, ("rollout.max_prompt_tokens", cfg.rollout.max_prompt_tokens))


def judge_names(cfg: Config) -> list[str]:
    """A reward's args.judge: "judge" (the judge: section, the default) or a judges: key."""
    return [k.removeprefix("judges.") for k in judge_sections(cfg)]


def data_label(d: DataConfig) -> str:
    """What a run trained on, for titles and model cards: data.name, or the mixture's sources."""
    key, sources = active_mixture(d)
    if not sources:
        return d.name
    names = " + ".join(s.name for s in sources)
    return f"preset {d.preset} ({names})" if d.preset is not None else f"mixture ({names})"


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _only_references(value: Any) -> bool:
    """A header value whose secret is in the environment: ${NAME} references and short words only
    (a reference's default counts as written: it is in the config).

    >>> (_only_references("Bearer ${TOKEN}"), _only_references("Bearer sk-live-1234 ${X}"),
    ...  _only_references("ml"), _only_references("Bearer ${T:-sk-live-1234}"))
    (True, False, False, False)
    """
    text = str(value)
    rest = ENV_REF.sub(lambda m: f" {m.group(2) or ''} ", text)
    return rest != text and all(len(word) < 8 for word in rest.split())


def redacted(d: Any) -> Any:
    """The config as a dict, with extra_headers values (often an Authorization header) masked,
    except those that hold only ${NAME} references (and words like Bearer): their secret is in the
    environment; and a password written in a URL (http://user:pw@host) too."""
    if isinstance(d, dict):
        return {k: ({h: x if _only_references(x) else "***" for h, x in v.items()}
                    if k == "extra_headers" and isinstance(v, dict) else redacted(v))
                for k, v in d.items()}
    return ([redacted(x) for x in d] if isinstance(d, list)
            else mask_urls(d) if isinstance(d, str) else d)


def saved_dict(cfg: Config) -> dict:
    """The config as a run records it (config.yaml, the tracker, results.json): secrets masked, and
    run.steps left out when run.epochs makes them (saved, they would be set twice)."""
    d = redacted(config_to_dict(cfg))
    if cfg.run.epochs:  # the steps are the epochs' (with_epochs in train.py)
        del d["run"]["steps"]
    return d


def save_config(cfg: Config, path: str | Path) -> None:
    """Write saved_dict(cfg) as YAML, atomically (tmp file + rename)."""
    jsonl.write_atomic(path, yaml.safe_dump(saved_dict(cfg), sort_keys=False))
