"""The checks across a config's fields that types alone cannot express, one function a concern.

    for check in CHECKS:     # what config.load_config does once the YAML is typed
        check(cfg)           # ConfigError (one line, naming the key) at the first problem

CHECKS keeps one order, so a config with several problems is always told the same one first; a
new check goes into the function of its concern. Each check takes the typed config.Config: this
module cannot import config.py, which imports it, so `Config` below is only a name for readers.
The readings of a config that the checks share (active_mixture, is_local_data, judge_sections)
live here too; config.py hands them on to the modules that import them from there.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from settings.typed_config import ConfigError

Config = DataConfig = DataSource = JudgeConfig = Any  # config.py's dataclasses, by name only


DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")  # the local data files data.py reads


def is_local_data(name: str | None) -> bool:
    """A built-in task or a local data file (these have no hub splits)."""
    return name in (None, "arithmetic") or Path(name).suffix.lower() in DATA_SUFFIXES


def active_mixture(d: DataConfig) -> tuple[str, list[DataSource] | None]:
    """(its config key, the sources) of a mixed run: data.presets[data.preset] or data.mixture;
    the sources are None when the run reads data.name alone."""
    if d.preset is not None:
        return f"data.presets.{d.preset}", d.presets.get(d.preset)
    return "data.mixture", d.mixture


def judge_sections(cfg: Config) -> dict[str, JudgeConfig]:
    """The configured judges by config key: "judge" (the judge: section) and "judges.NAME"."""
    return {**({"judge": cfg.judge} if cfg.judge else {}),
            **{f"judges.{n}": j for n, j in cfg.judges.items()}}


def check_counts(cfg: Config) -> None:
    """Counts and sizes that must be > 0, and those that must be >= 0 (where 0 means off, all
    or the default)."""
    positive = {"rollout.prompts_per_step": cfg.rollout.prompts_per_step,
                "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
                "grpo.num_iterations": cfg.grpo.num_iterations,
                "optim.micro_batch_size": 8 if cfg.optim.micro_batch_size == "auto"
                else cfg.optim.micro_batch_size,
                "grpo.num_mini_batches": cfg.grpo.num_mini_batches, "run.steps": cfg.run.steps,
                "run.judge_outage_steps": cfg.run.judge_outage_steps, "lora.r": cfg.lora.r,
                "run.judge_unusable_steps": cfg.run.judge_unusable_steps,
                "lora.alpha": cfg.lora.alpha, "sft.batch_size": cfg.sft.batch_size,
                "sft.max_length": cfg.sft.max_length, "dpo.beta": cfg.dpo.beta,
                "dpo.batch_size": cfg.dpo.batch_size, "dpo.max_length": cfg.dpo.max_length}
    for k, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{k} must be > 0, got {v}")
    non_negative = {"run.save_every": cfg.run.save_every, "run.sample_every": cfg.run.sample_every,
                    "run.samples_per_log": cfg.run.samples_per_log,
                    "optim.lr": cfg.optim.lr,  # 0: a control run
                    "rollout.top_k": cfg.rollout.top_k,
                    "optim.warmup_steps": cfg.optim.warmup_steps,
                    "data.num_examples": cfg.data.num_examples,
                    "optim.max_grad_norm": cfg.optim.max_grad_norm,
                    "rollout.max_prompts_per_step": cfg.rollout.max_prompts_per_step,
                    "optim.micro_batch_tokens": cfg.optim.micro_batch_tokens,
                    "grpo.logprob_chunk": cfg.grpo.logprob_chunk,
                    "rollout.prompts_per_generate": cfg.rollout.prompts_per_generate,
                    "run.stop_without_signal": cfg.run.stop_without_signal,
                    "run.eval_every": cfg.run.eval_every, "run.threads": cfg.run.threads,
                    "run.max_minutes": cfg.run.max_minutes, "run.epochs": cfg.run.epochs,
                    "run.judge_wait_minutes": cfg.run.judge_wait_minutes}
    for k, v in non_negative.items():
        if v < 0:
            raise ConfigError(f"{k} must be >= 0, got {v}")


def check_ranges(cfg: Config) -> None:
    """Settings with a range of their own, or another setting they need: optim.warmup_ratio,
    run.keep_checkpoints, the judges' shares, lora.dropout, rollout.max_prompts_per_step."""
    if not 0 <= cfg.optim.warmup_ratio < 1 or (cfg.optim.warmup_ratio and cfg.optim.warmup_steps):
        raise ConfigError(f"optim.warmup_ratio={cfg.optim.warmup_ratio} must be in [0, 1), and set "
                          f"only when optim.warmup_steps is 0 (it is {cfg.optim.warmup_steps})")
    if cfg.run.keep_checkpoints < 1:
        raise ConfigError("run.keep_checkpoints must be >= 1 (the newest checkpoint is what "
                          f"--resume needs), got {cfg.run.keep_checkpoints}")
    for key in ("judge_max_failed_share", "judge_max_unusable_share"):
        if not 0 <= getattr(cfg.run, key) <= 1:
            raise ConfigError(f"run.{key} must be in [0, 1], got {getattr(cfg.run, key)}")
    if not 0 <= cfg.lora.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg.lora.dropout}")
    if cfg.rollout.max_prompts_per_step and (
            not cfg.rollout.resample_zero_std
            or cfg.rollout.max_prompts_per_step < cfg.rollout.prompts_per_step):
        raise ConfigError(f"rollout.max_prompts_per_step={cfg.rollout.max_prompts_per_step} caps "
                          "the prompts resampling draws: it needs rollout.resample_zero_std: true "
                          f"and a value >= prompts_per_step ({cfg.rollout.prompts_per_step}); "
                          "0: 4 x prompts_per_step")


def check_episodes(cfg: Config) -> None:
    """env: and tools: (multi-turn episodes): GRPO on HF generate, names as rewards give them;
    env.name or env.names (TRL's one factory, or its dict of them), not both. What needs the
    classes imported is checked by engines/environments.py (check_environment)."""
    if not (cfg.env or cfg.tools):
        return
    what = "env:" if cfg.env else "tools:"
    if cfg.env and bool(cfg.env.name) == bool(cfg.env.names):
        raise ConfigError("env: give name (one environment class) or names (a dict of them, each "
                          "row's `environment` column picking one), not both" if cfg.env.name
                          else "env: give name: path/to/file.py:Class (or names: {key: ...})")
    if cfg.env and cfg.env.names and cfg.env.args:
        raise ConfigError("env.args goes with env.name; the environments of env.names are built "
                          "with no arguments, as TRL's factories are: name a function that builds "
                          "one with its arguments")
    if cfg.mode != "grpo":
        raise ConfigError(f"{what} runs GRPO episodes; mode: {cfg.mode} has none")
    if cfg.rollout.engine != "hf":
        raise ConfigError(f"{what} episodes sample with HF generate; rollout.engine: vllm "
                          "does not run them yet")
    if cfg.run.eval_every:
        raise ConfigError(f"{what} held-out scoring (run.eval_every) runs single replies, not "
                          "episodes, yet: set run.eval_every: 0")
    named = ([cfg.env.name] if cfg.env.name else list(cfg.env.names.values())) if cfg.env else []
    for key, name in [("env:", n) for n in named] + [("tools:", n) for n in cfg.tools]:
        if ":" not in name:
            raise ConfigError(f"{key} {name!r} must be 'path/to/file.py:name' or "
                              "'package.module:name'")
    if cfg.rollout.max_turns < 1 or cfg.rollout.tool_timeout <= 0:
        raise ConfigError("rollout.max_turns must be >= 1 and rollout.tool_timeout > 0")
    if cfg.rollout.max_episode_tokens < cfg.rollout.max_new_tokens:
        raise ConfigError(f"rollout.max_episode_tokens={cfg.rollout.max_episode_tokens} bounds a "
                          f"whole episode: it must be >= rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens})")


def check_sampling(cfg: Config) -> None:
    """How a rollout batch is drawn and split: vllm_sleep, the groups (G >= 2, mini-batches of
    whole groups), temperature and top_p; and optim.min_lr_ratio's range."""
    if cfg.rollout.vllm_sleep and cfg.rollout.engine != "vllm":
        raise ConfigError("rollout.vllm_sleep puts vLLM to sleep between rollouts; "
                          "it needs rollout.engine: vllm")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    if cfg.grpo.num_mini_batches > 0 and cfg.rollout.prompts_per_step % cfg.grpo.num_mini_batches:
        raise ConfigError(f"grpo.num_mini_batches={cfg.grpo.num_mini_batches} must divide "
                          f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: "
                          "each mini-batch holds whole groups")
    if cfg.rollout.num_generations < 2:
        raise ConfigError("rollout.num_generations must be >= 2 (a group needs a baseline), "
                          f"got {cfg.rollout.num_generations}")
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 "
                          "(GRPO samples; greedy decoding gives identical groups)")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")


def check_engine(cfg: Config) -> None:
    """What each sampling engine allows: truncated importance sampling (grpo.tis_cap, tis_mode)
    needs a sampler that records its own log-probs (vLLM, or HF generate merged or compiled);
    merged_sampling, prompts_per_generate and compile are HF generate's."""
    ro = cfg.rollout
    records = ro.engine == "vllm" or ro.merged_sampling is not False or ro.compile is not False
    if cfg.grpo.tis_cap and (cfg.grpo.tis_cap < 1 or not records):
        raise ConfigError(f"grpo.tis_cap={cfg.grpo.tis_cap} weights tokens by the sampler's own "
                          "log-probs: it needs rollout.engine: vllm, or HF generate with "
                          "rollout.merged_sampling or rollout.compile on, and a cap >= 1 (0 turns "
                          "it off)")
    # vLLM records log-probs after its top-k/top-p filter (renormalised over the tokens kept), HF
    # generate's meter before it, as the trainer scores them (docs/gpu.md, "Which log-prob")
    if cfg.grpo.tis_cap and ro.engine == "vllm" and (ro.top_p < 1 or ro.top_k):
        raise ConfigError("grpo.tis_cap compares vLLM's log-probs, taken after the top-p/top-k "
                          "filter, with the trainer's unfiltered ones: use top_p 1 and top_k 0 "
                          "with it, or HF generate's merged or compiled sampler, which records "
                          "them before the filter")
    # the sampler's log-probs are then those of a distribution without EOS
    if cfg.grpo.tis_cap and ro.ignore_eos:
        raise ConfigError("grpo.tis_cap compares the sampler's log-probs with EOS masked out "
                          "(rollout.ignore_eos) with the trainer's, which keep it: "
                          "use ignore_eos: false with it")
    if cfg.grpo.tis_mode != "token_truncate" and not cfg.grpo.tis_cap:
        raise ConfigError(f"grpo.tis_mode={cfg.grpo.tis_mode} acts on the importance weights: "
                          "set grpo.tis_cap (e.g. 2) too")
    if cfg.rollout.merged_sampling is True and (cfg.model.quant or not cfg.lora.enabled
                                                or cfg.rollout.engine != "hf"):
        raise ConfigError("rollout.merged_sampling folds a LoRA adapter into full-precision "
                          "weights for HF generate: it needs lora.enabled, no model.quant "
                          "and rollout.engine: hf")
    if cfg.rollout.prompts_per_generate and cfg.rollout.engine != "hf":
        raise ConfigError("rollout.prompts_per_generate applies to HF generate; "
                          "vLLM schedules its own batches (set rollout.prompts_per_generate: 0, "
                          "or size vLLM's cache with rollout.vllm_gpu_memory_utilization)")
    if cfg.rollout.compile is True and cfg.rollout.engine != "hf":
        raise ConfigError("rollout.compile applies to HF generate; vLLM compiles its own sampling "
                          "(set rollout.compile: false)")
    # transformers' bnb quantizer is not is_compileable
    if cfg.rollout.compile is True and cfg.model.quant:
        raise ConfigError("rollout.compile: transformers does not compile generate over a 4-bit "
                          "(bitsandbytes) model, so only the static cache's padding would "
                          "remain; set rollout.compile: false")


def check_top_entropy(cfg: Config) -> None:
    """grpo.top_entropy_quantile: its range, and HF generate's entropies."""
    if not 0 <= cfg.grpo.top_entropy_quantile <= 1:
        raise ConfigError("grpo.top_entropy_quantile must be in [0, 1] (the share of tokens kept), "
                          f"got {cfg.grpo.top_entropy_quantile}")
    if cfg.grpo.top_entropy_quantile < 1 and cfg.rollout.engine != "hf":
        raise ConfigError("grpo.top_entropy_quantile picks tokens by the entropy HF generate "
                          "records while sampling; vLLM does not report it: "
                          "set grpo.top_entropy_quantile: 1 with rollout.engine: vllm")


def check_vllm_memory(cfg: Config) -> None:
    """The share of GPU memory vLLM reserves."""
    if not 0 < cfg.rollout.vllm_gpu_memory_utilization < 1:
        raise ConfigError("rollout.vllm_gpu_memory_utilization must be in (0, 1), "
                          f"got {cfg.rollout.vllm_gpu_memory_utilization}")


def check_losses(cfg: Config) -> None:
    """The losses' settings: dpo.label_smoothing, grpo.beta, the clip (epsilon, epsilon_high,
    delta) and cispo_cap."""
    if not 0 <= cfg.dpo.label_smoothing < 0.5 or (cfg.dpo.label_smoothing
                                                  and cfg.dpo.loss_type != "sigmoid"):
        raise ConfigError(f"dpo.label_smoothing={cfg.dpo.label_smoothing} needs "
                          "dpo.loss_type: sigmoid and a value in [0, 0.5) "
                          "(the share of pairs presumed mislabelled)")
    if cfg.grpo.beta < 0:
        raise ConfigError(f"grpo.beta must be >= 0 (0: no KL term), got {cfg.grpo.beta}")
    # epsilon >= 1: a lower bound 1 - eps <= 0 never acts
    if not 0 < cfg.grpo.epsilon < 1 or not cfg.grpo.epsilon_high > 0:
        raise ConfigError("grpo.epsilon must be in (0, 1) and grpo.epsilon_high > 0 "
                          "(the ratio is clipped to [1 - epsilon, 1 + epsilon_high]); "
                          f"got {cfg.grpo.epsilon:g} and {cfg.grpo.epsilon_high:g}")
    if cfg.grpo.delta and (cfg.grpo.delta <= 1 + cfg.grpo.epsilon_high
                           or cfg.grpo.policy_loss != "clip"):
        raise ConfigError(f"grpo.delta={cfg.grpo.delta} caps the clipped objective's ratio for "
                          "negative advantages: it needs policy_loss: clip and a value above "
                          f"1 + epsilon_high = {1 + cfg.grpo.epsilon_high:g} (0 turns it off)")
    if cfg.grpo.cispo_cap < 1:  # below 1 it would shrink even on-policy gradients
        raise ConfigError("grpo.cispo_cap must be >= 1 "
                          f"(the largest importance weight CISPO keeps), got {cfg.grpo.cispo_cap}")


# an objective's knob -> (the objective it belongs to, how the config turns that objective on)
OBJECTIVE_KNOBS = {
    **dict.fromkeys(("cispo_cap",), ("cispo", "grpo.policy_loss: cispo")),
    **dict.fromkeys(("sapo_temperature_pos", "sapo_temperature_neg"),
                    ("sapo", "grpo.policy_loss: sapo")),
    **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                    ("vespo", "grpo.policy_loss: vespo")),
    **dict.fromkeys(("dppo_mask_low", "dppo_mask_high", "kl_tau"),
                    ("dppo", "grpo.policy_loss: dppo")),
    **dict.fromkeys(("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                     "entropy_target"), ("adaptive", "grpo.use_adaptive_entropy: true")),
    **dict.fromkeys(("ref_model_mixup_alpha", "ref_model_sync_steps"),
                    ("sync", "grpo.sync_ref_model: true")),
    "use_bias_correction_kl": ("kl", "grpo.beta > 0"),
    "tis_min": ("tis", "grpo.tis_cap (e.g. 3)"),
}
NON_NEGATIVE_KNOBS = ("kl_tau", "dppo_mask_low", "dppo_mask_high", "off_policy_mask_threshold",
                      "entropy_coef", "entropy_coef_min", "entropy_coef_max",
                      "entropy_coef_delta", "entropy_target", "tis_min", "vespo_k_pos",
                      "vespo_k_neg")
POSITIVE_KNOBS = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos",
                  "vespo_lambda_neg", "ref_model_sync_steps")


def active_objectives(g) -> set[str]:
    """The objectives the grpo section turns on, by OBJECTIVE_KNOBS' names."""
    return {g.policy_loss} | {name for name, on in (
        ("adaptive", g.use_adaptive_entropy), ("sync", g.sync_ref_model), ("kl", g.beta > 0),
        ("tis", g.tis_cap > 0)) if on}


def check_objectives(cfg: Config) -> None:
    """The objectives beyond the clip (grpo.py): no knob set without its objective, no negative
    coefficient, no pairing that cannot work (docs/loss.md says why each)."""
    g = cfg.grpo
    for key in NON_NEGATIVE_KNOBS + POSITIVE_KNOBS:
        if getattr(g, key) < 0 or (key in POSITIVE_KNOBS and getattr(g, key) == 0):
            raise ConfigError(f"grpo.{key} must be {'> 0' if key in POSITIVE_KNOBS else '>= 0'}, "
                              f"got {getattr(g, key)}")
    on, defaults = active_objectives(g), {f.name: f.default for f in dataclasses.fields(g)}
    for key, (objective, how) in OBJECTIVE_KNOBS.items():
        if objective not in on and getattr(g, key) != defaults[key]:
            raise ConfigError(f"grpo.{key}={getattr(g, key)} belongs to {how}, which is off: set "
                              f"{how}, or remove grpo.{key}")
    check_objective_pairs(cfg)


def check_objective_pairs(cfg: Config) -> None:
    """Pairings of the objectives that cannot work (each message names the fix)."""
    g, sequence = cfg.grpo, cfg.grpo.importance_sampling_level == "sequence"
    if g.loss_type == "luspo" and not sequence:
        raise ConfigError("grpo.loss_type: luspo sums each completion's terms under GSPO's one "
                          "ratio a completion: set grpo.importance_sampling_level: sequence")
    if g.policy_loss == "dppo" and sequence:
        raise ConfigError("grpo.policy_loss: dppo masks tokens by how far each one's probability "
                          "moved: use importance_sampling_level: token with it")
    if g.policy_loss == "vespo" and g.tis_cap and g.tis_mode.startswith("sequence"):
        raise ConfigError("grpo.policy_loss: vespo takes the sampler's weights token by token "
                          f"into its own; grpo.tis_mode={g.tis_mode} is per completion: use "
                          "token_truncate or token_mask")
    if g.tis_min and g.tis_min >= g.tis_cap:
        raise ConfigError(f"grpo.tis_min={g.tis_min} must be below grpo.tis_cap={g.tis_cap} "
                          "(the importance weights' bounds)")
    if (g.entropy_coef or g.use_adaptive_entropy) and g.fused_lm_head:
        raise ConfigError("the entropy bonus (grpo.entropy_coef, use_adaptive_entropy) needs the "
                          "training forward's logits, which grpo.fused_lm_head never makes: set "
                          "fused_lm_head: false with it")
    if g.use_adaptive_entropy and g.entropy_coef_min > g.entropy_coef_max:
        raise ConfigError(f"grpo.entropy_coef_min={g.entropy_coef_min} must be <= "
                          f"grpo.entropy_coef_max={g.entropy_coef_max}")
    if g.sync_ref_model and (cfg.lora.enabled or not g.beta > 0
                             or not 0 < g.ref_model_mixup_alpha <= 1):
        raise ConfigError("grpo.sync_ref_model moves the reference towards the policy: it needs "
                          "grpo.beta > 0 (a KL term to use it), full fine-tuning (lora.enabled: "
                          "false; with LoRA the reference is the base, adapter off) and "
                          "ref_model_mixup_alpha in (0, 1]")


def check_mixture(cfg: Config) -> None:
    """data.mixture or data.presets[data.preset]: one of them, replacing data.name, its
    sources' weights >= 0 and not all 0 at the first step or the last."""
    d = cfg.data
    _check_preset_choice(d)
    key, mix = active_mixture(d)
    if mix is None:
        return
    if d.name not in (None, "arithmetic"):
        raise ConfigError(f"{key} replaces data.name: remove data.name={d.name!r} "
                          "(or set it to null)")
    ignored = {"data.split": d.split != "train", "data.config_name": d.config_name is not None,
               "data.revision": d.revision is not None, "data.num_examples": d.num_examples != 0}
    if bad := [k for k, set_ in ignored.items() if set_]:
        raise ConfigError(f"{bad[0]} does not apply to {key}: set it on each source")
    _check_source_weights(key, mix)


def _check_preset_choice(d: DataConfig) -> None:
    """data.preset names one of data.presets, is chosen when presets replace data.name, and is
    not set beside data.mixture."""
    if d.preset is not None and d.preset not in d.presets:
        raise ConfigError(f"data.preset={d.preset!r} is not one of data.presets "
                          f"({', '.join(d.presets) or 'none defined'})")
    # presets, none chosen, and no data.name of its own (else data.name is read)
    if d.presets and d.preset is None and d.mixture is None and d.name in (None, "arithmetic"):
        raise ConfigError("data.presets is set: choose one with data.preset "
                          f"({', '.join(d.presets)}), or give data.name")
    if d.preset is not None and d.mixture is not None:
        raise ConfigError("set data.mixture or data.preset, not both")


def _check_source_weights(key: str, mix: list[DataSource]) -> None:
    """At least one source; weights and sizes >= 0, and not all 0 at the first step or the last."""
    if not mix:
        raise ConfigError(f"{key} is empty: list at least one source")
    for i, src in enumerate(mix):
        if src.weight < 0 or (src.weight_end or 0) < 0 or src.num_examples < 0:
            raise ConfigError(f"{key}[{i}]: weight, weight_end and num_examples must be >= 0")
    for end in (False, True):
        if sum(s.weight_end if end and s.weight_end is not None else s.weight for s in mix) <= 0:
            raise ConfigError(f"{key}: the weights sum to 0 at the {'last' if end else 'first'} "
                              "step; give a source a positive weight")


def _train_ranges(cfg: Config) -> list[tuple[str, list[int] | None]]:
    """(config key, [start, end) or None) of each row range training reads."""
    mix_key, mix = active_mixture(cfg.data)
    return [("data.select", cfg.data.select)] + [(f"{mix_key}[{i}].select", s.select)
                                                 for i, s in enumerate(mix or [])]


def check_rows(cfg: Config) -> None:
    """Row ranges are [start, end), and a split is asked of a hub dataset only (a local file
    has none)."""
    mix_key, mix = active_mixture(cfg.data)
    train_ranges = _train_ranges(cfg)
    for key, sel in train_ranges + [("eval.select", cfg.eval.select)]:
        if sel is not None and (len(sel) != 2 or not 0 <= sel[0] < sel[1]):
            raise ConfigError(f"{key} must be [start, end) with 0 <= start < end, got {sel}")
    for key, src in ([("data", cfg.data)] if mix is None
                     else [(f"{mix_key}[{i}]", s) for i, s in enumerate(mix)]):
        # a split of a local file would be silently ignored (a config_name is only unused)
        if src.split != "train" and is_local_data(src.name):
            raise ConfigError(f"{key}.split={src.split!r} picks a split of a hub dataset; "
                              f"{key}.name={src.name} has none: drop {key}.split "
                              f"(or give the file of that split as {key}.name)")


def check_held_out(cfg: Config) -> None:
    """Evaluation rows are held out: eval.split of a hub dataset only, and eval.select apart
    from every training range of the same rows; run.eval_every names its rows."""
    if cfg.run.eval_every and cfg.eval.select is None and not cfg.eval.name:
        raise ConfigError("run.eval_every needs eval.select (the held-out rows to score, "
                          "e.g. [1500, 1700]) or eval.name")
    mix_key, mix = active_mixture(cfg.data)
    train_ranges = _train_ranges(cfg)
    eval_key, eval_name = (("eval.name", cfg.eval.name) if cfg.eval.name
                           else ("data.name", cfg.data.name))
    local = ([s.name for s in mix if is_local_data(s.name)] if mix is not None and not cfg.eval.name
             else [eval_name] if is_local_data(eval_name) else [])
    if cfg.eval.split is not None and local:  # else ignored: held-out rows would be training rows
        where = (f"{mix_key} source {local[0]}" if mix is not None and not cfg.eval.name
                 else f"{eval_key}={local[0]}")
        raise ConfigError(f"eval.split={cfg.eval.split!r} picks a split of a hub dataset; "
                          f"{where} has none: hold rows out with eval.select instead")
    # another hub split or file holds other rows: only the same split's ranges can overlap
    same_split = not cfg.eval.name and (cfg.eval.split is None or cfg.eval.split in (
        [cfg.data.split] if mix is None else [s.split for s in mix]))
    for key, sel in train_ranges if same_split and cfg.eval.select else []:
        if sel and sel[0] < cfg.eval.select[1] and cfg.eval.select[0] < sel[1]:
            raise ConfigError(f"{key} {sel} and eval.select {cfg.eval.select} overlap: "
                              "evaluation rows must be held out")


def check_judges(cfg: Config) -> None:
    """Judges' names, what Anthropic's endpoint would ignore, and a cache file for each."""
    for name in cfg.judges:
        if (not isinstance(name, str) or name == "judge"
                or not re.fullmatch(r"[A-Za-z0-9_-]+", name)):
            raise ConfigError(f"judges.{name}: a judge's name is letters, digits, _ and - "
                              "(and not 'judge', the judge: section's)")
    endpoints = {**judge_sections(cfg), "eval.api": cfg.eval.api, "precompute.answers":
                 cfg.precompute.answers, **{f"eval.apis.{n}": j for n, j in cfg.eval.apis.items()}}
    for key, endpoint in endpoints.items():
        if endpoint:
            check_anthropic(key, endpoint)
    caches = [(k, j.cache_path) for k, j in judge_sections(cfg).items() if j.cache_path]
    for i, (k, path) in enumerate(caches):
        if other := next((k2 for k2, p2 in caches[:i]
                          if Path(p2).resolve() == Path(path).resolve()), None):
            raise ConfigError(f"{k}.cache_path and {other}.cache_path are both {path}: "
                              "give each judge its own cache file")


# Request fields Anthropic's OpenAI-compatible endpoint (base_url https://api.anthropic.com/v1/)
# documents as ignored; it also caps temperature at 1 and takes n = 1 only.
ANTHROPIC_IGNORES = ("logprobs", "top_logprobs", "response_format", "seed", "presence_penalty",
                     "frequency_penalty", "logit_bias", "reasoning_effort", "metadata",
                     "prediction", "service_tier", "store", "user", "modalities", "audio")


def check_anthropic(key: str, jc: JudgeConfig) -> None:
    """Claude through Anthropic's OpenAI-compatible endpoint: a setting it would ignore or change
    silently (the reply cached under the setting asked for) is refused with the fix."""
    if "api.anthropic.com" not in jc.base_url or jc.azure_endpoint:
        return
    where = f"{key}: Anthropic's OpenAI-compatible endpoint"
    if jc.temperature is not None and jc.temperature > 1:
        raise ConfigError(f"{where} caps temperature at 1: set {key}.temperature to 0-1")
    if ignored := [k for k in jc.extra_body if k in ANTHROPIC_IGNORES]:
        raise ConfigError(f"{where} ignores {', '.join(ignored)}: remove it from {key}.extra_body")
    if jc.extra_body.get("n", 1) != 1:
        raise ConfigError(f"{where} answers one sample a request: remove n from {key}.extra_body "
                          "(samples are separate requests already)")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _looks_like_a_key(name: str) -> bool:
    """api_key_env holding a key rather than a variable's name: a provider's key prefix, or a long
    mix of lower case, upper case and digits (variable names are upper case by convention).

    >>> (_looks_like_a_key("OPENAI_API_KEY"), _looks_like_a_key("gsk_4fT9aQ2x"),
    ...  _looks_like_a_key("a8Fk2LmQ9zP4rT7vW1xY3bN6"))
    (False, True, True)
    """
    if re.fullmatch(r"(sk|gsk|tgp|xai|hf|pplx|nvapi|csk|fw)[-_][A-Za-z0-9_-]{8,}", name, re.I) \
            and not name.isupper() and any(c.isdigit() for c in name):
        return True
    return len(name) >= 20 and "_" not in name and any(c.islower() for c in name) \
        and any(c.isupper() for c in name) and any(c.isdigit() for c in name)


def check_client(section: str, jc: JudgeConfig, mask: Callable[[str], str]) -> None:
    """An API client's settings (a judge, eval.api, precompute.answers), checked as api/client.py
    builds it, once the environment's values are filled in: Azure's api_version, an http(s) URL,
    the limits, and api_key_env a variable's name. `section` starts each message; `mask` hides a
    URL's password in it (config.mask_urls, which this module cannot import)."""
    if jc.azure_endpoint and not jc.api_version:
        raise ConfigError(f"{section}: azure_endpoint needs api_version (e.g. '2024-06-01')")
    # else every call fails, each counted
    for name in ("azure_endpoint",) if jc.azure_endpoint else ("base_url",):
        try:
            url = urlsplit(getattr(jc, name) or "")
        except ValueError:  # "http://[::1/v1": an unclosed IPv6 address
            url = urlsplit("")
        if url.scheme not in ("http", "https") or not url.netloc:
            shown = getattr(jc, name)
            raise ConfigError(f"{section}: {name}={mask(shown) if shown else shown!r} is "
                              "not an http(s) URL; give one such as http://127.0.0.1:8000/v1 "
                              "or https://api.openai.com/v1")
    if jc.max_concurrent < 1 or jc.max_retries < 0 or jc.score_max <= jc.score_min:
        raise ConfigError(f"{section}: need max_concurrent >= 1, max_retries >= 0 and "
                          "score_max > score_min")
    if not jc.timeout_s > 0 or (jc.requests_per_minute is not None
                                and not jc.requests_per_minute >= 0):
        raise ConfigError(f"{section}: need timeout_s > 0 (got {jc.timeout_s}) and "
                          "requests_per_minute >= 0 (0 or null: no limit; "
                          f"got {jc.requests_per_minute})")
    if not _ENV_NAME.fullmatch(jc.api_key_env or "") or _looks_like_a_key(jc.api_key_env):
        raise ConfigError(f"{section}: api_key_env is the NAME of the environment variable that "
                          "holds the key (e.g. OPENAI_API_KEY), not the key; export the key and "
                          "name its variable")


def check_optim_betas(cfg: Config) -> None:
    """AdamW's two betas."""
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas must be two numbers, got {cfg.optim.betas}")


def check_mode(cfg: Config) -> None:
    """What each mode reads: SFT data.target, DPO data.chosen and data.rejected, GRPO
    rewards."""
    if cfg.mode == "sft" and not cfg.data.target:
        raise ConfigError("mode: sft learns data.target: "
                          "set it to the column (or template) of the reply to learn")
    if cfg.mode == "dpo" and cfg.data.target:
        raise ConfigError("data.target is the reply SFT learns; "
                          "mode: dpo reads data.chosen and data.rejected: set data.target: null")
    if cfg.mode != "dpo" and (cfg.data.chosen or cfg.data.rejected):
        raise ConfigError(f"data.chosen and data.rejected are DPO's pairs; mode: {cfg.mode} "
                          "does not read them: set both to null")
    if cfg.mode == "dpo" and not (cfg.data.chosen and cfg.data.rejected):
        raise ConfigError("mode: dpo learns data.chosen over data.rejected: "
                          "set both to the columns (or templates) of the two replies, "
                          "e.g. data.chosen: chosen, data.rejected: rejected "
                          "(tools/bestofn.py's pairs)")
    if cfg.mode == "grpo" and not cfg.rewards and not cfg.env:  # an env's get_reward may be one
        raise ConfigError("rewards: list at least one reward, "
                          "e.g. rewards: [{name: answer_match, weight: 1.0}]")


# The order load_config runs them in (the first problem found is the one reported)
CHECKS = (check_counts, check_ranges, check_episodes, check_sampling, check_engine,
          check_top_entropy, check_vllm_memory, check_losses, check_objectives, check_mixture,
          check_rows, check_held_out, check_judges, check_optim_betas, check_mode)
