"""TRL's GRPOConfig names, for authors who come from TRL: an unknown config key that is one of them
gets one line naming minigrpo's key, not a did-you-mean from the same section.

    grpo.num_generations: TRL's name; here it is rollout.num_generations

Only names with a real equivalent here are mapped. Where the meaning differs (TRL's batch sizes
count completions, minigrpo's a step's prompts), the same line says so. check_trl_names runs on the
raw YAML (after overrides) before the dataclasses are built, so it wins over the generic error.
"""
from __future__ import annotations

import dataclasses
import typing

from settings.typed_config import ConfigError

_PROMPTS = ("TRL's prompts a step = per_device_train_batch_size x gradient_accumulation_steps x "
            "GPUs / num_generations")

# TRL's name -> (minigrpo's key, what differs; "" when nothing does)
TRL_NAMES: dict[str, tuple[str, str]] = {
    # GRPOConfig's own
    "num_generations": ("rollout.num_generations", ""),
    "max_completion_length": ("rollout.max_new_tokens", ""),
    "max_prompt_length": ("rollout.max_prompt_tokens",
                          "a longer prompt is an error, or left out with data.skip_long=true; "
                          "TRL truncates it from the left"),
    "temperature": ("rollout.temperature", ""),
    "top_p": ("rollout.top_p", ""),
    "top_k": ("rollout.top_k", "0 is off, as TRL's None"),
    "use_vllm": ("rollout.engine", "use_vllm: true is rollout.engine=vllm"),
    "vllm_gpu_memory_utilization": ("rollout.vllm_gpu_memory_utilization", ""),
    "generation_batch_size": ("rollout.prompts_per_step",
                              "it counts prompts, each sampled rollout.num_generations times; "
                              "TRL's counts completions"),
    "per_device_train_batch_size": ("rollout.prompts_per_step",
                                    "it counts prompts; TRL's counts completions per device and "
                                    "forward pass, as optim.micro_batch_size does here; "
                                    + _PROMPTS),
    "gradient_accumulation_steps": ("rollout.prompts_per_step",
                                    "a step's prompts x num_generations are accumulated in "
                                    "micro-batches of optim.micro_batch_size completions; "
                                    + _PROMPTS),
    "steps_per_generation": ("grpo.num_mini_batches",
                             "it counts optimizer updates per rollout batch; TRL's counts "
                             "gradient-accumulation steps (TRL's updates = it / "
                             "gradient_accumulation_steps)"),
    "beta": ("grpo.beta", "dpo.beta for mode: dpo"),
    "epsilon": ("grpo.epsilon", ""),
    "epsilon_high": ("grpo.epsilon_high", "0.28 by default here, TRL's defaults to epsilon"),
    "delta": ("grpo.delta", "0 is off, as TRL's None"),
    "num_iterations": ("grpo.num_iterations", ""),
    "loss_type": ("grpo.loss_type", ""),
    "scale_rewards": ("grpo.scale_rewards", "TRL's true is group, false is none"),
    "mask_truncated_completions": ("grpo.mask_truncated_completions", ""),
    "importance_sampling_level": ("grpo.importance_sampling_level", ""),
    "top_entropy_quantile": ("grpo.top_entropy_quantile", ""),
    "vllm_importance_sampling_cap": ("grpo.tis_cap", "0 is off"),
    "vllm_importance_sampling_clip_max": ("grpo.tis_cap", "0 is off"),
    "vllm_importance_sampling_clip_min": ("grpo.tis_min", "0 is off, as TRL's None"),
    "vllm_importance_sampling_mode": ("grpo.tis_mode", "token_truncate by default here, TRL's "
                                      "sequence_mask"),
    "reward_weights": ("rewards", "each entry of the rewards: list has its own weight"),
    "chat_template_kwargs": ("data.chat_template_kwargs", ""),
    # TrainingArguments'
    "learning_rate": ("optim.lr", ""),
    "weight_decay": ("optim.weight_decay", ""),
    "adam_beta1": ("optim.betas", "a list [beta1, beta2]"),
    "adam_beta2": ("optim.betas", "a list [beta1, beta2]"),
    "max_grad_norm": ("optim.max_grad_norm", ""),
    "warmup_ratio": ("optim.warmup_ratio", ""),
    "warmup_steps": ("optim.warmup_steps", ""),
    "lr_scheduler_type": ("optim.min_lr_ratio",
                          "the schedule is always warmup then cosine to lr x min_lr_ratio: "
                          "TRL's cosine is 0, constant is 1"),
    "max_steps": ("run.steps", ""),
    "num_train_epochs": ("run.epochs", ""),
    "output_dir": ("run.out_dir", ""),
    "seed": ("run.seed", ""),
    "save_steps": ("run.save_every", ""),
    "save_total_limit": ("run.keep_checkpoints", "older checkpoints keep their adapter "
                                                  "(run.keep_adapters)"),
    "eval_steps": ("run.eval_every", ""),
    "logging_steps": ("run.sample_every",
                      "every step's metrics are logged; this is how often completions are "
                      "written"),
    "report_to": ("run.report_to", ""),
    "bf16": ("model.dtype", "bf16: true is model.dtype=bfloat16"),
    "fp16": ("model.dtype", "fp16: true is model.dtype=float16"),
    "gradient_checkpointing": ("model.gradient_checkpointing", ""),
}


# TRL's loss_type values that are an objective here (grpo.policy_loss), with the normalisation
# TRL gives each
TRL_LOSS_TYPES = {"cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"), "vespo": ("vespo", "dapo")}


def trl_value_hint(section: str, values: dict) -> str | None:
    """The one-line error for grpo.loss_type set to TRL's name of an objective.

    >>> trl_value_hint("grpo", {"loss_type": "sapo"})
    "grpo.loss_type=sapo: TRL's name; here it is grpo.policy_loss: sapo with grpo.loss_type: grpo"
    """
    loss_type = values.get("loss_type")
    if section != "grpo" or not isinstance(loss_type, str) or loss_type not in TRL_LOSS_TYPES:
        return None
    objective, norm = TRL_LOSS_TYPES[loss_type]
    return (f"grpo.loss_type={loss_type}: TRL's name; here it is grpo.policy_loss: {objective} "
            f"with grpo.loss_type: {norm}")


def trl_hint(key: str) -> str | None:
    """The one-line error for the unknown key `key` (dotted) when its last part is TRL's name.

    >>> trl_hint("grpo.num_generations")
    "grpo.num_generations: TRL's name; here it is rollout.num_generations"
    >>> trl_hint("grpo.betta") is None
    True
    """
    name = key.rsplit(".", 1)[-1]
    if name not in TRL_NAMES:
        return None
    target, differs = TRL_NAMES[name]
    return f"{key}: TRL's name; here it is {target}" + (f" ({differs})" if differs else "")


def _sections(root: type) -> dict[str, type]:
    """The dataclass-typed fields of `root` (X | None unwrapped): the sections of fixed keys."""
    out = {}
    for name, tp in typing.get_type_hints(root).items():
        options = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):
            out[name] = options[0]
    return out


def check_trl_names(raw: dict, root: type) -> None:
    """ConfigError for the first key of `raw` unknown to `root` (top level, or in one of its
    sections) that is TRL's name for a setting, naming minigrpo's key."""
    sections = _sections(root)
    names = {f.name for f in dataclasses.fields(root)}
    for k, v in raw.items():
        if k not in names and (hint := trl_hint(str(k))):
            raise ConfigError(hint)
        if k in sections and isinstance(v, dict):
            if hint := trl_value_hint(str(k), v):
                raise ConfigError(hint)
            fields = {f.name for f in dataclasses.fields(sections[k])}
            for sub in v:
                if sub not in fields and (hint := trl_hint(f"{k}.{sub}")):
                    raise ConfigError(hint)
