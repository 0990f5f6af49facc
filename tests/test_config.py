"""Config loading: YAML + overrides, unknown keys, wrong types, missing files; every field
documented."""
import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

import config
from config import ConfigError, load_config
from settings.trl_names import TRL_NAMES

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


MINIMAL = "rewards: [{name: answer_match}]\n"


def test_yaml_and_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "grpo: {beta: 0.1}\n"),
                      ["--grpo.beta=0.04", "--rollout.num_generations=8",
                       "--lora.target_modules=[q_proj, v_proj]",
                       "--model.quant=null", "--optim.lr=1e-4"])
    assert cfg.grpo.beta == 0.04 and cfg.rollout.num_generations == 8
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.model.quant is None
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == 1e-4
    assert cfg.rewards[0].name == "answer_match"


def test_one_reward_of_the_list_is_overridden_by_index_label_or_name(tmp_path):
    """A sweep over one reward's weight (GRubrics' REWARD_LAMBDA_*) without restating the list."""
    path = write(tmp_path, "rewards:\n  - {name: json_valid}\n  - {name: choice_accuracy, label: "
                           "acc, args: {gold_key: cop}}\n  - {name: judge, label: clarity}\n"
                           "  - {name: judge, label: relevance}\n")
    cfg = load_config(path, ["--rewards.0.weight=0.5", "--rewards.acc.args.gold_key=answer",
                             "--rewards.clarity.fallback=skip",
                             "--rewards.json_valid.label=valid", "--rewards.3.label=null"])
    assert [r.weight for r in cfg.rewards] == [0.5, 1.0, 1.0, 1.0] \
        and cfg.rewards[1].args == {"gold_key": "answer"}
    assert cfg.rewards[2].fallback == "skip" and cfg.rewards[0].label == "valid" \
        and cfg.rewards[3].label is None
    assert load_config(path, ["--rewards.1={name: json_schema}"]).rewards[1].name == "json_schema"
    for override, message in [("--rewards.9.weight=1", r"'9' is neither an index \(0 to 3\) nor a "
                                                       r"label or name.*json_valid, acc"),
                              ("--rewards.judge.weight=1",
                               "'judge' is the name of 2 entries; give their label or index"),
                              ("--rewards.acc.wieght=1",
                               r"unknown config key 'rewards\[1\].wieght'"),
                              # a digit to isdigit(), not to int()
                              ("--rewards.².weight=1", r"'²' is neither an index"),
                              # a full-width 2 is not index 2
                              ("--rewards.２.weight=1", r"'２' is neither an index")]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, [override])
    dotted = write(tmp_path, "rewards:\n  - {name: my_rewards.py:brevity}\n")
    with pytest.raises(ConfigError,
                       match="a name with a dot .* by its index, or by a label: you give it"):
        load_config(dotted, ["--rewards.my_rewards.py:brevity.weight=2"])
    assert load_config(dotted, ["--rewards.0.weight=2"]).rewards[0].weight == 2.0
    with pytest.raises(ConfigError, match="the config has no list 'rewards' to index"):
        load_config(write(tmp_path, "grpo: {beta: 0.0}\n"), ["--rewards.0.weight=1"])


def test_an_int_is_accepted_where_a_float_is_expected(tmp_path):
    assert load_config(write(tmp_path, MINIMAL + "grpo: {beta: 1}\n")).grpo.beta == 1.0


def test_unknown_key_names_the_key_and_the_closest_valid_ones(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"unknown config key 'grpo.betta'.*did you mean grpo.beta"):
        load_config(write(tmp_path, MINIMAL + "grpo: {betta: 0.1}\n"))
    with pytest.raises(ConfigError, match=r"'rollout.num_generation'.*rollout.num_generations"):
        load_config(write(tmp_path, MINIMAL), ["--rollout.num_generation=4"])
    with pytest.raises(ConfigError, match="unknown config key 'optimizer'"):
        load_config(write(tmp_path, MINIMAL + "optimizer: {lr: 1}\n"))


def _resolves(dotted: str) -> bool:
    """`dotted` names a field of Config (a section's, or a top-level one)."""
    import typing
    tp = config.Config
    for part in dotted.split("."):
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        if not dataclasses.is_dataclass(tp) or part not in typing.get_type_hints(tp):
            return False
        tp = typing.get_type_hints(tp)[part]
    return True


@pytest.mark.parametrize("name", sorted(TRL_NAMES))
def test_a_trl_name_in_any_section_names_minigrpos_key_in_one_line(tmp_path, name):
    target, differs = TRL_NAMES[name]
    assert _resolves(target), target  # the line points at a real key
    section = next(s for s in ("grpo", "rollout", "optim") if not _resolves(f"{s}.{name}"))
    for where, args in ((f"{section}.{name}", [f"--{section}.{name}=1"]), (name, [f"--{name}=1"])):
        with pytest.raises(ConfigError) as e:
            load_config(write(tmp_path, MINIMAL), args)
        assert str(e.value).startswith(f"{where}: TRL's name; here it is {target}")
        assert "\n" not in str(e.value) and (differs in str(e.value))
    with pytest.raises(ConfigError, match=f"^{section}.{name}: TRL's name"):  # in the file too
        load_config(write(tmp_path, MINIMAL + f"{section}: {{{name}: 1}}\n"))


def test_trl_batch_names_say_that_trl_counts_completions(tmp_path):
    with pytest.raises(ConfigError, match=r"^grpo.per_device_train_batch_size: TRL's name; here "
                       r"it is rollout.prompts_per_step \(it counts prompts; TRL's counts "
                       r"completions"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.per_device_train_batch_size=2"])
    # a TRL name where minigrpo has it is fine, and a typo still gets its did-you-mean
    assert load_config(write(tmp_path, MINIMAL), ["--grpo.beta=0.04"]).grpo.beta == 0.04
    with pytest.raises(ConfigError, match=r"did you mean grpo.beta"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.betta=0.04"])


def test_wrong_type_names_the_key_and_the_expected_type(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.num_generations: expected int, got 'eight'"):
        load_config(write(tmp_path, MINIMAL), ["--rollout.num_generations=eight"])
    with pytest.raises(ConfigError,
                       match=r"grpo.loss_type: expected one of 'grpo', 'bnpo', 'dr_grpo', 'dapo'"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.loss_type=ppo"])
    with pytest.raises(ConfigError, match=r"lora.enabled: expected bool"):
        load_config(write(tmp_path, MINIMAL), ["--lora.enabled=3"])
    with pytest.raises(ConfigError, match=r"rollout.num_generations: expected int, got True"):
        load_config(write(tmp_path, MINIMAL), ["--rollout.num_generations=true"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].weight: expected float"):
        load_config(write(tmp_path, "rewards: [{name: x, weight: heavy}]\n"))


def test_missing_file_and_bad_yaml_and_bad_overrides(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "grpo: [beta: \n"))
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(write(tmp_path, MINIMAL), ["grpo.beta=1"])


def test_cross_field_checks(tmp_path):
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        load_config(write(tmp_path, MINIMAL), ["--rollout.num_generations=1"])
    with pytest.raises(ConfigError, match="rewards: list at least one reward"):
        load_config(write(tmp_path, "grpo: {beta: 0}\n"))
    with pytest.raises(ConfigError, match=r"grpo.top_entropy_quantile must be in \[0, 1\]"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.top_entropy_quantile=1.5"])
    with pytest.raises(ConfigError,
                       match="vLLM does not report it: set grpo.top_entropy_quantile: 1"):
        load_config(write(tmp_path, MINIMAL),
                    ["--grpo.top_entropy_quantile=0.2", "--rollout.engine=vllm"])
    assert load_config(write(tmp_path, MINIMAL), [  # as TRL (grpo.py): the pairing runs
        "--grpo.top_entropy_quantile=0.2", "--grpo.importance_sampling_level=sequence"])
    assert load_config(write(tmp_path, MINIMAL),
                       ["--grpo.top_entropy_quantile=0"]).grpo.top_entropy_quantile == 0.0
    with pytest.raises(ConfigError, match=r"grpo.delta=1.2 caps .* above 1 \+ epsilon_high = 1.28"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.delta=1.2", "--grpo.epsilon_high=0.28"])
    with pytest.raises(ConfigError, match="it needs policy_loss: clip"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.delta=4", "--grpo.policy_loss=cispo"])
    with pytest.raises(ConfigError, match="grpo.cispo_cap must be >= 1"):
        load_config(write(tmp_path, MINIMAL), ["--grpo.policy_loss=cispo", "--grpo.cispo_cap=0.5"])
    assert load_config(write(tmp_path, MINIMAL), ["--grpo.delta=4"]).grpo.delta == 4.0
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing=0.2 needs dpo.loss_type: sigmoid"):
        load_config(write(tmp_path, MINIMAL), ["--dpo.label_smoothing=0.2", "--dpo.loss_type=ipo"])
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing=0.5 needs .* in \[0, 0.5\)"):
        load_config(write(tmp_path, MINIMAL), ["--dpo.label_smoothing=0.5"])


OBJECTIVE_ERRORS = [  # (overrides, the start of the one-line error)
    (["--grpo.sapo_temperature_neg=2"], "grpo.sapo_temperature_neg=2.0 belongs to "
     "grpo.policy_loss: sapo, which is off: set grpo.policy_loss: sapo, or remove"),
    (["--grpo.vespo_k_pos=1"], "grpo.vespo_k_pos=1.0 belongs to grpo.policy_loss: vespo"),
    (["--grpo.kl_tau=0.01"], "grpo.kl_tau=0.01 belongs to grpo.policy_loss: dppo"),
    (["--grpo.cispo_cap=3"], "grpo.cispo_cap=3.0 belongs to grpo.policy_loss: cispo"),
    (["--grpo.entropy_target=1"], "grpo.entropy_target=1.0 belongs to "
     "grpo.use_adaptive_entropy: true"),
    (["--grpo.ref_model_sync_steps=8"], "grpo.ref_model_sync_steps=8 belongs to "
     "grpo.sync_ref_model: true"),
    (["--grpo.use_bias_correction_kl=false"], "grpo.use_bias_correction_kl=False belongs to "
     "grpo.beta > 0"),
    (["--grpo.tis_min=0.5"], "grpo.tis_min=0.5 belongs to grpo.tis_cap"),
    (["--grpo.entropy_coef=-0.01"], "grpo.entropy_coef must be >= 0, got -0.01"),
    (["--grpo.policy_loss=dppo", "--grpo.kl_tau=-1"], "grpo.kl_tau must be >= 0"),
    (["--grpo.off_policy_mask_threshold=-0.5"], "grpo.off_policy_mask_threshold must be >= 0"),
    (["--grpo.policy_loss=sapo", "--grpo.sapo_temperature_pos=0"],
     "grpo.sapo_temperature_pos must be > 0"),
    (["--grpo.loss_type=luspo"], "grpo.loss_type: luspo sums each completion's terms under "
     "GSPO's one ratio a completion: set grpo.importance_sampling_level: sequence"),
    (["--grpo.policy_loss=dppo", "--grpo.importance_sampling_level=sequence"],
     "grpo.policy_loss: dppo masks tokens"),
    (["--grpo.policy_loss=vespo", "--grpo.tis_cap=2", "--grpo.tis_mode=sequence_mask",
      "--rollout.merged_sampling=true"], "grpo.policy_loss: vespo takes the sampler's weights"),
    (["--grpo.tis_cap=2", "--grpo.tis_min=2", "--rollout.merged_sampling=true"],
     "grpo.tis_min=2.0 must be below grpo.tis_cap=2.0"),
    (["--grpo.entropy_coef=0.01", "--grpo.fused_lm_head=true"], "the entropy bonus "
     "(grpo.entropy_coef, use_adaptive_entropy) needs the training forward's logits"),
    (["--grpo.sync_ref_model=true", "--grpo.beta=0.1"], "grpo.sync_ref_model moves the reference"),
    (["--grpo.sync_ref_model=true", "--lora.enabled=false"], "grpo.sync_ref_model moves"),
    (["--grpo.use_adaptive_entropy=true", "--grpo.entropy_coef_min=0.5",
      "--grpo.entropy_coef_max=0.1"], "grpo.entropy_coef_min=0.5 must be <= "
     "grpo.entropy_coef_max=0.1"),
    (["--grpo.loss_type=sapo"], "grpo.loss_type=sapo: TRL's name; here it is grpo.policy_loss: "
     "sapo with grpo.loss_type: grpo"),
    (["--grpo.loss_type=cispo"], "grpo.loss_type=cispo: TRL's name; here it is "
     "grpo.policy_loss: cispo with grpo.loss_type: dapo"),
]


@pytest.mark.parametrize("overrides, message", OBJECTIVE_ERRORS)
def test_an_objectives_bad_input_is_one_line_naming_the_key_and_the_fix(tmp_path, overrides,
                                                                        message):
    """A knob without its objective, a negative coefficient, a pairing that cannot work, TRL's
    name for an objective: one line (train.py exits 2 on a ConfigError)."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, MINIMAL), overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_each_objective_loads_with_its_own_knobs(tmp_path):
    for overrides in (["--grpo.policy_loss=sapo", "--grpo.sapo_temperature_neg=2"],
                      ["--grpo.policy_loss=vespo", "--grpo.vespo_lambda_neg=1"],
                      ["--grpo.policy_loss=dppo", "--grpo.kl_tau=0.01", "--grpo.dppo_mask_low=0.1"],
                      ["--grpo.loss_type=luspo", "--grpo.importance_sampling_level=sequence"],
                      ["--grpo.off_policy_mask_threshold=0.5"],
                      ["--grpo.use_adaptive_entropy=true", "--grpo.entropy_target=1"],
                      ["--grpo.beta=0.1", "--grpo.use_bias_correction_kl=false"],
                      ["--grpo.beta=0.1", "--grpo.sync_ref_model=true", "--lora.enabled=false",
                       "--grpo.ref_model_sync_steps=64"],
                      ["--grpo.tis_cap=3", "--grpo.tis_min=0.5", "--rollout.merged_sampling=true"]):
        assert load_config(write(tmp_path, MINIMAL), overrides).grpo, overrides


def test_share_prompt_takes_a_bool_or_auto_and_logprob_chunk_zero(tmp_path):
    path = write(tmp_path, "rewards: [{name: answer_match}]\n")
    assert load_config(path).grpo.share_prompt == "auto" \
        and load_config(path).grpo.logprob_chunk == 0
    for v, want in (("true", True), ("false", False), ("auto", "auto")):
        assert load_config(path, [f"--grpo.share_prompt={v}"]).grpo.share_prompt == want
    with pytest.raises(ConfigError, match="grpo.share_prompt"):
        load_config(path, ["--grpo.share_prompt=sometimes"])
    with pytest.raises(ConfigError, match="grpo.logprob_chunk must be >= 0"):
        load_config(path, ["--grpo.logprob_chunk=-1"])
    with pytest.raises(ConfigError, match="rollout.prompts_per_generate must be >= 0"):
        load_config(path, ["--rollout.prompts_per_generate=-2"])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["--grpo.beta=0.04"])
    config.save_config(cfg, tmp_path / "saved.yaml")
    again = load_config(tmp_path / "saved.yaml")
    assert again == cfg


def test_every_config_field_has_a_one_line_comment():
    src = inspect.getsource(config)
    for cls in (config.ModelConfig, config.LoraConfig, config.DataConfig, config.RolloutConfig,
                config.GrpoConfig, config.OptimConfig, config.RunConfig):
        for f in dataclasses.fields(cls):
            line = next(ln for ln in inspect.getsource(cls).splitlines()
                        if ln.strip().startswith(f"{f.name}:"))
            assert "  # " in line, f"{cls.__name__}.{f.name} has no comment"
    assert src


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)
    assert yaml.safe_load(path.read_text())


def test_null_overrides_clear_optional_text_fields_and_other_text_stays_verbatim(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "data: {system_prompt: Be brief.}\n"),
                      ["--data.system_prompt=null", "--data.answer_key=~",
                       "--data.prompt={question} {{x}}"])
    assert cfg.data.system_prompt is None and cfg.data.answer_key is None
    assert cfg.data.prompt == "{question} {{x}}"
    cfg = load_config(write(tmp_path, MINIMAL + "data: {assistant_prefix: <think>}\n"),
                      ["--data.assistant_prefix="])
    # an empty override is empty text, not null (a str field takes no null)
    assert cfg.data.assistant_prefix == ""


def test_a_missing_required_key_and_non_finite_numbers_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="rewards\\[0\\]: missing required key 'name'"):
        load_config(write(tmp_path, "rewards: [{weight: 1.0}]\n"))
    with pytest.raises(ConfigError, match="optim.lr: expected a finite number"):
        load_config(write(tmp_path, MINIMAL), ["--optim.lr=nan"])
    with pytest.raises(ConfigError, match="run.save_every must be >= 0"):
        load_config(write(tmp_path, MINIMAL), ["--run.save_every=-1"])


def test_saved_configs_mask_extra_headers(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "judge: {model: m, extra_headers: {Authorization: "
                                                "Bearer sk-SECRET}}\n"))
    config.save_config(cfg, tmp_path / "saved.yaml")
    text = (tmp_path / "saved.yaml").read_text()
    assert "sk-SECRET" not in text and "Authorization: '***'" in text


def test_extends_merges_sections_key_by_key_and_replaces_lists(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/base.yaml").write_text(MINIMAL + "mode: sft\n"
                                            "data: {target: '{answer}', system_prompt: Be brief.}\n"
                                            "optim: {lr: 2.0e-4, micro_batch_size: 4}\n")
    child = tmp_path / "sub/child.yaml"
    child.write_text("extends: base.yaml\nmode: grpo\noptim: {lr: 1.0e-5}\n"
                     "rewards: [{name: short_answer}]\n")
    cfg = load_config(child, ["--optim.micro_batch_size=2"])
    assert cfg.mode == "grpo" and cfg.data.system_prompt == "Be brief." \
        and cfg.data.target == "{answer}"
    # merged, then the override wins
    assert cfg.optim.lr == 1e-5 and cfg.optim.micro_batch_size == 2
    assert [r.name for r in cfg.rewards] == ["short_answer"]  # a list is replaced, not appended to


def test_extends_lets_a_child_clear_a_mapping_with_an_empty_one_or_null(tmp_path):
    """A child's `judge: {extra_body: {}}` kept the parent's grammar (and paid 249 requests again
    under its old cache keys): an empty mapping, or null, replaces the parent's (issue 47)."""
    (tmp_path / "base.yaml").write_text(
        MINIMAL + "judge: {model: m, extra_body: {grammar: 'root ::= [0-9]'}}\n"
        "data: {chat_template_kwargs: {enable_thinking: false}}\n")
    for clear in ("{}", "null"):
        child = tmp_path / "child.yaml"
        child.write_text(f"extends: base.yaml\njudge: {{extra_body: {clear}}}\n"
                         f"data: {{chat_template_kwargs: {clear}}}\n")
        cfg = load_config(child)
        assert cfg.judge.extra_body == {} and cfg.judge.model == "m", clear
        assert cfg.data.chat_template_kwargs == {}
        config.save_config(cfg, tmp_path / "saved.yaml")
        assert yaml.safe_load((tmp_path / "saved.yaml").read_text())["judge"]["extra_body"] == {}
    # a mapping with keys still merges into the parent's
    child.write_text("extends: base.yaml\njudge: {extra_body: {top_k: 1}}\n")
    assert load_config(child).judge.extra_body == {"grammar": "root ::= [0-9]", "top_k": 1}


def test_extends_errors_name_the_file(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("extends: b.yaml\n")
    b.write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="makes a cycle"):
        load_config(a)
    a.write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError,
                       match=r"config file not found: .*missing.yaml \(extended by .*a.yaml\)"):
        load_config(a)
    a.write_text("extends: [b.yaml]\n")
    with pytest.raises(ConfigError, match="extends: expected the path"):
        load_config(a)


def test_eval_on_another_split_may_reuse_the_training_range(tmp_path):
    text = MINIMAL + "data: {name: openai/gsm8k, select: [0, 100]}\neval: {select: [0, 50]}\n"
    with pytest.raises(ConfigError, match="overlap"):
        load_config(write(tmp_path, text))
    assert load_config(write(tmp_path, text), ["--eval.split=test"]).eval.split == "test"
    with pytest.raises(ConfigError, match="data.name=rows.jsonl has none"):
        # a local file has no splits
        load_config(write(tmp_path, text), ["--eval.split=test", "--data.name=rows.jsonl"])
    # a mixture: hub sources' test split holds other rows; a local source would give its training
    # rows again
    mix = MINIMAL + ("data: {mixture: [{name: openai/gsm8k, select: [0, 100]}, {name: %s, select: "
                     "[0, 100]}]}\neval: {select: [0, 50]}\n")
    with pytest.raises(ConfigError, match="overlap"):
        load_config(write(tmp_path, mix % "cais/mmlu"))
    assert load_config(write(tmp_path, mix % "cais/mmlu"),
                       ["--eval.split=test"]).eval.split == "test"
    with pytest.raises(ConfigError, match="data.mixture source rows.jsonl has none"):
        load_config(write(tmp_path, mix % "rows.jsonl"), ["--eval.split=test"])


def test_named_judges_are_typed_sections_with_their_own_names_and_caches(tmp_path):
    rewards = ("rewards: [{name: judge}, {name: judge, args: {judge: second}}, {name: judge, args: "
               "{judge: third}}]\n")
    text = rewards + ("judge: {model: a, cache_path: c/a.jsonl}\n"
                      "judges: {second: {model: b, cache_path: c/b.jsonl}}\n")
    cfg = load_config(write(tmp_path, text),
                      ["--judges.second.model=1234", "--judges.third.max_concurrent=2"])
    # text stays text
    assert cfg.judges["second"].model == "1234" and cfg.judges["second"].cache_path == "c/b.jsonl"
    assert cfg.judges["third"].max_concurrent == 2 \
        and config.judge_names(cfg) == ["judge", "second", "third"]
    with pytest.raises(ConfigError, match="judges.second.max_concurrent: expected int"):
        load_config(write(tmp_path, text), ["--judges.second.max_concurrent=many"])
    with pytest.raises(ConfigError, match="unknown config key 'judges.second.modle'"):
        load_config(write(tmp_path, text), ["--judges.second.modle=x"])
    with pytest.raises(ConfigError, match="judges.judge: a judge's name"):
        load_config(write(tmp_path, text), ["--judges.judge.model=x"])
    with pytest.raises(ConfigError,
                       match="judges.second.cache_path and judge.cache_path are both c/./a.jsonl"):
        load_config(write(tmp_path, text), ["--judges.second.cache_path=c/./a.jsonl"])
    for name in ("2", "true"):  # YAML reads these as an int and a bool
        with pytest.raises(ConfigError, match="a judge's name is letters"):
            load_config(write(tmp_path, text + f"judges: {{{name}: {{model: x}}}}\n"))


def test_a_config_that_is_not_text_and_a_section_left_empty(tmp_path):
    """A binary file is one line, not a UnicodeDecodeError; `run:` with every key commented out
    (YAML's null) is one line too, with or without an override: read as defaults, it would also
    drop the section of a file it extends."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00r")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(bad)
    for overrides in ([], ["--run.steps=7"]):
        with pytest.raises(ConfigError, match="'?run'? is empty \\(null\\)"):
            load_config(write(tmp_path, MINIMAL + "run:\n  # steps: 3\n"), overrides)
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {Path('configs/quickstart.yaml').resolve()}\nrun:\n")
    with pytest.raises(ConfigError, match="run is empty"):
        load_config(child)


@pytest.mark.parametrize("override, message", [
    ("--lora.alpha=0", r"lora.alpha must be > 0"),  # the update scaled to nothing
    # 0 is a control run: the base policy's rewards, sampled as training would
    ("--optim.lr=-1e-5", r"optim.lr must be >= 0"),
    ("--lora.dropout=1.5", r"lora.dropout must be in \[0, 1\)"),  # not blamed on target_modules
    # ignored without it
    ("--rollout.max_prompts_per_step=8", r"needs rollout.resample_zero_std: true"),
    ("--rollout.vllm_sleep=true", r"rollout.vllm_sleep .* needs rollout.engine: vllm"),
    # a judge's failures: a share, and steps in a row
    ("--run.judge_max_failed_share=1.5", r"^run.judge_max_failed_share must be in \[0, 1\], got 1"),
    ("--run.judge_max_unusable_share=-0.1", r"^run.judge_max_unusable_share must be in \[0, 1\]"),
    ("--run.judge_unusable_steps=0", r"^run.judge_unusable_steps must be > 0, got 0$"),
])
def test_settings_that_would_train_nothing_or_be_ignored_are_refused(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, MINIMAL), [override])
    cfg = load_config(write(tmp_path, MINIMAL),
                      ["--rollout.resample_zero_std=true", "--rollout.max_prompts_per_step=8"])
    assert cfg.rollout.max_prompts_per_step == 8
    with pytest.raises(ConfigError, match=r">= prompts_per_step \(4\)"):
        load_config(write(tmp_path, MINIMAL),
                    ["--rollout.resample_zero_std=true", "--rollout.max_prompts_per_step=2"])


def test_every_recipe_writes_its_own_run_directory():
    """A config that extends another and forgets run.out_dir would train into (or --resume) the
    other's run."""
    from pathlib import Path
    dirs = {}
    for path in sorted(Path("configs").glob("*.yaml")):
        dirs.setdefault(load_config(path).run.out_dir, []).append(path.name)
    assert {d: names for d, names in dirs.items() if len(names) > 1} == {}


def test_steps_or_epochs_the_later_layer_decides_and_one_layer_may_not_set_both(tmp_path):
    """A recipe that counts epochs extends one that counts steps (bioreasoner_dpo.yaml); the command
    line's --run.steps beats a file's epochs; a file, or a command line, that sets both is
    refused."""
    parent = tmp_path / "parent.yaml"
    parent.write_text(MINIMAL + "run: {steps: 200}\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: parent.yaml\nrun: {epochs: 3}\n")
    # steps: made from the epochs
    assert (load_config(child).run.epochs, load_config(child).run.steps) == (3, 60)
    assert (load_config(child, ["--run.steps=2"]).run.epochs,
            load_config(child, ["--run.steps=2"]).run.steps) == (0, 2)
    with pytest.raises(ConfigError, match=r"the command line turns off run.epochs=3, which an "
                                          r"earlier layer set: give run.steps"):
        load_config(child, ["--run.epochs=0"])  # the parent's steps are gone: not a silent 60 steps
    grandchild = tmp_path / "grandchild.yaml"  # a file that turns them off likewise
    grandchild.write_text("extends: child.yaml\nrun: {epochs: 0}\n")
    with pytest.raises(ConfigError,
                       match=r"grandchild.yaml turns off run.epochs=3, which an earlier layer set"):
        load_config(grandchild)
    with pytest.raises(ConfigError, match=r"turns off run.epochs=3"):
        load_config(child, ["--run.epochs=0e0"])  # text that convert reads as 0 is 0 here too
    assert load_config(child, ["--run.epochs=0", "--run.steps=7"]).run.steps == 7
    with pytest.raises(ConfigError,
                       match="the command line sets both run.steps=5 and run.epochs=1: keep one"):
        load_config(parent, ["--run={steps: 5, epochs: 1}"])  # one mapping is one layer too
    # the section replaced: the file's epochs are gone
    assert load_config(child, ["--run={steps: 5}"]).run.steps == 5
    assert load_config(parent, ["--run.epochs=1"]).run.epochs == 1
    both = write(tmp_path, MINIMAL + "run: {steps: 10, epochs: 2}\n")
    with pytest.raises(ConfigError,
                       match=r"c.yaml sets both run.steps=10 and run.epochs=2: keep one"):
        load_config(both)


def test_warmup_ratio_on_the_command_line_replaces_a_files_warmup_steps_as_epochs_replace_steps(
        tmp_path):
    """--optim.warmup_ratio=0.1 on a recipe with warmup_steps (quickstart.yaml,
    bioreasoner_dpo.yaml) was refused until --optim.warmup_steps=0 was added too, unlike
    --run.epochs over a file's run.steps."""
    path = write(tmp_path, MINIMAL + "optim: {warmup_steps: 5}\n")
    cfg = load_config(path, ["--optim.warmup_ratio=0.1"])
    assert (cfg.optim.warmup_steps, cfg.optim.warmup_ratio) == (0, 0.1)
    with pytest.raises(ConfigError, match="the command line sets both optim.warmup_steps=3 and "
                                          "optim.warmup_ratio=0.1"):
        load_config(path, ["--optim.warmup_steps=3", "--optim.warmup_ratio=0.1"])


@pytest.mark.parametrize("override, bad", [("--grpo.epsilon=2", "2"), ("--grpo.epsilon=1", "1"),
                                           ("--grpo.epsilon=0", "0"),
                                           ("--grpo.epsilon_high=0", "0.2")])
def test_a_clip_range_that_never_clips_is_refused_with_the_key_named(tmp_path, override, bad):
    """Issue 30: epsilon=2 was accepted, and the lower clip bound 1 - 2 = -1 never acts."""
    with pytest.raises(ConfigError, match=r"grpo.epsilon must be in \(0, 1\) and "
                                          rf"grpo.epsilon_high > 0 .*got {bad} "):
        load_config(write(tmp_path, MINIMAL), [override])


def test_a_run_dir_nothing_can_be_created_in_is_refused_before_anything_loads(tmp_path):
    """Issue 30: as root os.access says /proc is writable; the run died at mkdir after the model
    loaded."""
    from settings.typed_config import check_writable
    with pytest.raises(ConfigError,
                       match=r"run.out_dir=/proc/x: cannot create anything in /proc \("):
        check_writable("/proc/x", "run.out_dir")
    # a folder that can be made: fine, and nothing left
    check_writable(tmp_path / "new" / "run", "run.out_dir")
    assert list(tmp_path.iterdir()) == []


def test_anthropic_endpoint_settings_it_would_ignore_or_cap_are_refused(tmp_path):
    base = {"judge": {"base_url": "https://api.anthropic.com/v1/", "model": "claude-sonnet-4-5",
                      "api_key_env": "ANTHROPIC_API_KEY"},
            "rewards": [{"name": "judge"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base))
    assert load_config(str(path)).judge.model == "claude-sonnet-4-5"  # temperature 0: fine
    for override, message in [
            ("--judge.temperature=1.5", r"^judge: Anthropic's .* caps temperature at 1: set "
                                        r"judge.temperature to 0-1$"),
            ("--judge.extra_body={response_format: {type: json_object}}",
             r"ignores response_format: remove it from judge.extra_body$"),
            ("--judge.extra_body={n: 4}", r"one sample a request: remove n from judge.extra_body")]:
        with pytest.raises(ConfigError, match=message):
            load_config(str(path), [override])
    answers = {"precompute": {"answers": {**base["judge"], "temperature": 2.0}}}
    path.write_text(yaml.safe_dump({**base, **answers}))
    with pytest.raises(ConfigError, match=r"^precompute.answers: Anthropic"):
        load_config(str(path))


def test_a_weight_reads_the_environment_as_the_grubrics_reward_lambdas(tmp_path, monkeypatch):
    """GRubrics' REWARD_LAMBDA_* weights: ${NAME} (or ${NAME:-default}) in a field that is not text
    is the environment's value; unset without a default, a one-line error naming the key; a text
    field keeps its ${NAME} for the client (a secret is never saved)."""
    for name in ("REWARD_LAMBDA_ALIGNMENT", "REWARD_LAMBDA_FORMAT", "REWARD_LAMBDA_LENGTH"):
        monkeypatch.delenv(name, raising=False)
    weights = [r.weight for r in load_config("configs/grubrics.yaml").rewards]
    assert weights == [1.0, 0.0, 0.0]
    monkeypatch.setenv("REWARD_LAMBDA_FORMAT", "0.3")
    monkeypatch.setenv("REWARD_LAMBDA_LENGTH", "1e-1")
    cfg = load_config("configs/grubrics.yaml")
    assert [(r.name, r.weight) for r in cfg.rewards] == \
        [("rubric_alignment", 1.0), ("rubric_format", 0.3), ("length_penalty", 0.1)]
    path = write(tmp_path, MINIMAL + "rewards:\n  - {name: think_format, weight: "
                 "'${MINIGRPO_NO_X}'}\njudge: {model: '${MINIGRPO_NO_X}'}\n")
    with pytest.raises(ConfigError, match=r"^rewards\[0\].weight reads \$\{MINIGRPO_NO_X\}, which "
                       r"is not set in the environment; export it"):
        load_config(path)
    monkeypatch.setenv("MINIGRPO_NO_X", "two")  # a bad value names the variable it came from
    with pytest.raises(ConfigError, match=r"^rewards\[0\].weight reads \$\{MINIGRPO_NO_X\}='two' "
                       r"from the environment: expected float, got 'two'; fix the variable"):
        load_config(path)
    monkeypatch.setenv("REWARD_LAMBDA_FORMAT", "abc")
    with pytest.raises(ConfigError, match=r"^rewards\[1\].weight reads "
                       r"\$\{REWARD_LAMBDA_FORMAT\}='abc' from the environment"):
        load_config("configs/grubrics.yaml")
    monkeypatch.setenv("REWARD_LAMBDA_FORMAT", "")  # empty: the default, as in the shell
    assert load_config("configs/grubrics.yaml").rewards[1].weight == 0.0
    bad_default = tmp_path / "bad_default.yaml"
    bad_default.write_text("rewards: [{name: think_format, weight: '${MINIGRPO_NO_Y:-heavy}'}]\n")
    with pytest.raises(ConfigError,
                       match=r"weight reads the default of \$\{MINIGRPO_NO_Y:-heavy\}"):
        load_config(bad_default)
    monkeypatch.setenv("MINIGRPO_NO_X", "2")
    cfg = load_config(path)
    assert cfg.rewards[0].weight == 2.0 and cfg.judge.model == "${MINIGRPO_NO_X}"


@pytest.mark.parametrize("name", ["medmcqa_sft", "medmcqa_grpo", "bioreasoner_sft",
                                  "bioreasoner_dpo", "bioreasoner", "grubrics_sft"])
def test_the_recipes_of_projects_that_ran_trl_use_trls_optimizer_defaults(name):
    """An author who "ran TRL with lr 5e-6" gets TRL's AdamW betas and a cosine that ends at 0."""
    cfg = load_config(f"configs/{name}.yaml")
    assert (cfg.optim.betas, cfg.optim.min_lr_ratio) == ([0.9, 0.999], 0.0)


def test_every_field_reads_the_environment_once_when_the_config_loads(tmp_path, monkeypatch):
    """Issue 56: one expansion, after YAML and overrides and before the types are checked, for
    every field: text where it stands, a field that is not text as its YAML value; a value that
    came from the environment is never read again; a judge's URL, model and headers keep theirs
    for the client (a secret is never saved)."""
    env = {"MG_MODEL": "", "MG_N": "24", "MG_LR": "1e-4", "MG_FLAG": "true", "MG_LOSS": "grpo",
           "MG_STOPS": "[END, STOP]", "MG_WORDS": "3", "MG_ROOT": str(tmp_path),
           "MG_PROMPT": "Answer ${HOME} plainly", "MG_OTHER": "${MG_LR}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = write(tmp_path, (
        "model: {name: '${MG_MODEL:-smollm2-135m}'}\n"
        "data: {root: '${MG_ROOT}', system_prompt: '${MG_PROMPT}', skip_long: '${MG_FLAG}'}\n"
        "rollout: {max_new_tokens: '${MG_N}', stop_strings: ['${MG_STOPS}', 'x-${MG_N}']}\n"
        "grpo: {loss_type: '${MG_LOSS}'}\n"
        "rewards: [{name: short_answer, args: {max_words: '${MG_WORDS}', note: 'n${MG_N}'}}]\n"
        "judge: {model: '${MG_MODEL:-gpt-4o-mini}'}\n"))
    cfg = load_config(path, ["--optim.lr=${MG_LR}", "--run.out_dir=${MG_ROOT}/run"])
    assert (cfg.model.name, cfg.data.root, cfg.run.out_dir) == \
        ("smollm2-135m", str(tmp_path), f"{tmp_path}/run")
    assert (cfg.rollout.max_new_tokens, cfg.optim.lr, cfg.data.skip_long, cfg.grpo.loss_type) == \
        (24, 1e-4, True, "grpo")
    assert cfg.rollout.stop_strings == ["[END, STOP]", "x-24"]  # text stays text
    assert cfg.rewards[0].args == {"max_words": 3, "note": "n24"}
    assert cfg.data.system_prompt == "Answer ${HOME} plainly"  # a value is not read again
    assert cfg.judge.model == "${MG_MODEL:-gpt-4o-mini}"  # the client's, read when it is built
    with pytest.raises(ConfigError, match=r"^optim.lr reads \$\{MG_OTHER\}='\$\{MG_LR\}' from the "
                       r"environment: expected float"):
        load_config(path, ["--optim.lr=${MG_OTHER}"])
    monkeypatch.delenv("MG_N")
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens reads \$\{MG_N\}, which is "
                       r"not set in the environment"):
        load_config(path)


def test_a_variable_that_names_itself_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """MYLR='${MYLR}' ended in a 3,000-line RecursionError."""
    import train
    monkeypatch.setenv("MYLR", "${MYLR}")
    path = write(tmp_path, MINIMAL + "optim: {lr: '${MYLR}'}\n")
    with pytest.raises(ConfigError, match=r"^optim.lr reads \$\{MYLR\}, whose value '\$\{MYLR\}' "
                       r"names itself"):
        load_config(path)
    assert train.main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MYLR" in err[0] and "optim.lr" in err[0]


def test_a_model_name_from_the_environment_dry_runs(tmp_path, monkeypatch, capsys):
    """`model.name: ${MYMODEL:-smollm2-135m}` failed as "could not load tokenizer for
    model.name=${MYMODEL:-smollm2-135m}"."""
    import train
    monkeypatch.delenv("MYMODEL", raising=False)
    path = write(tmp_path, MINIMAL + "model: {name: '${MYMODEL:-smollm2-135m}'}\n"
                 f"run: {{out_dir: '{tmp_path}/run'}}\n")
    assert train.main(["--config", str(path), "--dry-run", "--run.threads=1"]) == 0
    assert "config, data, model and judges check out" in capsys.readouterr().out
