"""SFT, data splits, and chaining SFT into GRPO: the GRPO run starts from the SFT policy, and an
adapter never loads silently onto the wrong base."""
import json
from pathlib import Path

import pytest
import torch
import yaml

import logprobs
import train
from config import ConfigError, DataConfig, LoraConfig, ModelConfig, load_config
from data import DataError, load_rows, split
from model import load_inference, load_policy
from run import lifecycle
from sources.adapters import find_adapter

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(5) for b in range(4)]


@pytest.fixture
def sft_config(tmp_path, tiny_llama):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {
        "mode": "sft",
        "model": {"name": str(tiny_llama)},
        "lora": {"r": 8, "alpha": 16},
        "data": {"name": str(data), "prompt": "question", "target": "The answer is {answer}.",
                 "split_seed": 42, "select": [0, 12]},
        "sft": {"batch_size": 12},
        "optim": {"lr": 0.1, "micro_batch_size": 5, "min_lr_ratio": 1.0},
        "run": {"out_dir": str(tmp_path / "sft"), "steps": 12, "save_every": 0},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_the_loss_on_the_reply_tokens(sft_config):
    # all weights: a random 2-layer model learns fast that way (LoRA is tested below)
    path, cfg = sft_config
    assert train.main(["--config", str(path), "--lora.enabled=false", "--optim.lr=0.01"]) == 0
    m = metrics(Path(cfg["run"]["out_dir"]))
    assert len(m) == 12 and m[0]["tokens"] > 0
    assert m[-1]["loss"] < 0.5 * m[0]["loss"], [x["loss"] for x in m]


def test_sft_loss_covers_the_reply_and_its_eos_but_not_the_prompt(sft_config, tiny_llama):
    path, _ = sft_config
    cfg = load_config(path)
    _, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    from modes.sft import sft_batch
    b = sft_batch(tok, [{"prompt": "What is 2 + 3?", "target": "5"},
                        {"prompt": "Hi", "target": "The answer is 42."}], cfg)
    for i, reply in enumerate(["5", "The answer is 42."]):
        n = int(b.completion_mask[i].sum())
        ids = b.completion_ids[i, :n].tolist()
        assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == reply
        assert b.completion_mask[i, n:].sum() == 0
    assert tok.decode(b.prompt_ids[1][b.prompt_mask[1].bool()]).endswith("<|im_start|>assistant\n")
    # a reply copied with its EOS
    b = sft_batch(tok, [{"prompt": "Hi", "target": "Hi." + tok.eos_token}], cfg)
    assert b.completion_ids[0, :int(b.completion_mask[0].sum())].tolist().count(
        tok.eos_token_id) == 1



def test_chat_message_rows_train_on_the_last_assistant_turn(tmp_path):
    """TRL's conversational SFT data: a `messages` column (prompt and target both name it) or
    prompt/completion message lists. A target that is neither text nor such a list is refused."""
    system = {"role": "system", "content": "Answer in JSON."}
    rows = [{"messages": [system, {"role": "user", "content": "Q1"},
                          {"role": "assistant", "content": '{"a": 1}'}],
             "prompt": [system, {"role": "user", "content": "Q2"}],
             "completion": [{"role": "assistant", "content": '{"a": 2}'}], "tags": ["x"]}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    (row,) = load_rows(DataConfig(name=str(data), prompt="messages", target="messages",
                                  answer_key=None))
    assert row["prompt"] == rows[0]["messages"][:2] and row["target"] == '{"a": 1}'
    (row,) = load_rows(DataConfig(name=str(data), prompt="prompt", target="completion",
                                  answer_key=None))
    assert row["prompt"] == rows[0]["prompt"] and row["target"] == '{"a": 2}'
    for target in ("tags", "prompt"):  # a list of strings; messages ending with the user's turn
        with pytest.raises(DataError,
                           match=f"data.target={target} holds a list, not text or chat messages"):
            load_rows(DataConfig(name=str(data), prompt="prompt", target=target, answer_key=None))
    data.write_text(json.dumps({"q": "2 + 3?", "a": 5}) + "\n")  # a number column is the reply "5"
    assert load_rows(DataConfig(name=str(data), prompt="q", target="a",
                                answer_key=None))[0]["target"] == "5"


@pytest.mark.parametrize("merge", [False, True], ids=["continue-adapter", "merge-then-new-lora"])
def test_grpo_starts_from_the_sft_policy(sft_config, tmp_path, merge):
    path, cfg = sft_config
    cfg["run"]["steps"] = 3
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 0
    sft_run = cfg["run"]["out_dir"]
    mcfg = ModelConfig(name=cfg["model"]["name"])
    sft_model, tok = load_inference(mcfg, torch.device("cpu"), adapter=sft_run)
    base_model, _ = load_inference(mcfg, torch.device("cpu"))
    mcfg_from_sft = ModelConfig(name=cfg["model"]["name"], init_adapter=sft_run,
                                merge_init_adapter=merge)
    if not merge:
        # a continued adapter keeps its shape: a config asking for another is refused, not saved as
        # if applied
        with pytest.raises(ConfigError, match=r"continued with its own LoRA shape, so lora.r=4 "
                                              r"\(the adapter's: 8\); lora.alpha=32 \(the "
                                              r"adapter's: 16\) would not apply"):
            load_policy(mcfg_from_sft, LoraConfig(r=4), torch.device("cpu"))
        with pytest.raises(ConfigError, match=r"lora.target_modules=\['q_proj'\] \(the adapter's: "
                                              r"\['down_proj', 'gate_proj', "):
            load_policy(mcfg_from_sft, LoraConfig(r=8, alpha=16, target_modules=["q_proj"]),
                        torch.device("cpu"))
    policy, _ = load_policy(mcfg_from_sft, LoraConfig(r=4) if merge else LoraConfig(r=8, alpha=16),
                            torch.device("cpu"))
    enc = tok(["What is 3 + 1? The answer is 4.", "Hello world"], return_tensors="pt", padding=True,
              add_special_tokens=False)
    with torch.no_grad():
        want = logprobs.sequence_log_probs(sft_model, enc.input_ids, enc.attention_mask, 3)
        got = logprobs.sequence_log_probs(policy, enc.input_ids, enc.attention_mask, 3)
        base = logprobs.sequence_log_probs(base_model, enc.input_ids, enc.attention_mask, 3)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-3)  # SFT did move the policy
    assert len(policy.minigrpo_base["merged"]) == (1 if merge else 0)


def test_a_grpo_adapter_trained_on_a_merged_sft_base_reloads_with_that_merge(sft_config, tmp_path):
    """The MedMCQA seed's lost GRPO phase: this adapter must come back on base + SFT, not base."""
    path, cfg = sft_config
    cfg["run"]["steps"] = 3
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 0
    grpo_cfg = {**cfg, "mode": "grpo", "run": {"out_dir": str(tmp_path / "grpo"), "steps": 1},
                "model": {**cfg["model"], "init_adapter": cfg["run"]["out_dir"],
                          "merge_init_adapter": True},
                "data": {**cfg["data"], "select": [12, 16]},
                "rollout": {"prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4},
                "optim": {"lr": 0.05}, "rewards": [{"name": "short_answer"}]}
    grpo_path = tmp_path / "grpo.yaml"
    grpo_path.write_text(yaml.safe_dump(grpo_cfg))
    assert train.main(["--config", str(grpo_path)]) == 0
    # resumes on the same chain
    assert train.main(["--config", str(grpo_path), "--run.steps=2", "--resume"]) == 0
    adapter = find_adapter(str(tmp_path / "grpo"))
    prov = json.loads((adapter / "minigrpo_base.json").read_text())
    assert prov["base_model"] == cfg["model"]["name"] and len(prov["merged"]) == 1
    mcfg = ModelConfig(name=cfg["model"]["name"])
    reloaded, tok = load_inference(mcfg, torch.device("cpu"), adapter=str(tmp_path / "grpo"))
    from peft import PeftModel
    naive, _ = load_inference(mcfg, torch.device("cpu"))
    # what a plain peft load would do: the wrong base
    naive = PeftModel.from_pretrained(naive, str(adapter))
    enc = tok(["What is 3 + 1? The answer is 4."], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        lp = [logprobs.sequence_log_probs(m, enc.input_ids, enc.attention_mask, 3)
              for m in (reloaded, naive)]
    # the naive load is a different (wrong) model
    assert not torch.allclose(lp[0], lp[1], atol=1e-4)
    named = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    # tools that read the base from here fail loudly
    assert named.startswith("NOT-") and "python -m tools.export" in named
    from peft import AutoPeftModelForCausalLM
    # whichever the hub client raises for a name that is no repo
    with pytest.raises(Exception):  # noqa: B017
        AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    # the reloaded chain is base + SFT merged + GRPO adapter: it equals replaying that by hand
    manual, _ = load_inference(mcfg, torch.device("cpu"), adapter=cfg["run"]["out_dir"])
    manual = PeftModel.from_pretrained(manual.merge_and_unload(), str(adapter))
    with torch.no_grad():
        assert torch.allclose(lp[0], logprobs.sequence_log_probs(manual, enc.input_ids,
                                                                 enc.attention_mask, 3), atol=1e-5)
    # the SFT and GRPO runs moved together (another machine, a renamed folder): the chain is found
    # where it sits relative to the GRPO adapter, and checked by its hash as before
    import shutil
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("sft", "grpo"):
        shutil.move(str(tmp_path / name), str(moved / name))
    again, _ = load_inference(mcfg, torch.device("cpu"), adapter=str(moved / "grpo"))
    with torch.no_grad():
        assert torch.allclose(lp[0], logprobs.sequence_log_probs(again, enc.input_ids,
                                                                 enc.attention_mask, 3), atol=1e-5)
    shutil.rmtree(moved / "sft")
    with pytest.raises(ConfigError, match="missing or changed"):
        load_inference(mcfg, torch.device("cpu"), adapter=str(moved / "grpo"))


def test_an_adapter_on_another_base_is_an_error(sft_config, tmp_path, tiny_gpt2):
    path, cfg = sft_config
    cfg["run"]["steps"] = 1
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 0
    with pytest.raises(ConfigError, match="was trained on base"):
        load_inference(ModelConfig(name=str(tiny_gpt2)), torch.device("cpu"),
                       adapter=cfg["run"]["out_dir"])
    with pytest.raises(ConfigError, match="no LoRA adapter there"):
        load_inference(ModelConfig(name=cfg["model"]["name"]), torch.device("cpu"),
                       adapter=str(tmp_path))


def test_splits_are_disjoint_reproducible_and_checked(sft_config, tmp_path):
    path, cfg = sft_config
    c = load_config(path)
    parts = [load_rows(c.data, select=s) for s in ([0, 10], [10, 15], [15, 20])]
    keys = [{r["question"] for r in p} for p in parts]
    assert [len(k) for k in keys] == [10, 5, 5] \
        and not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    assert load_rows(c.data, select=[0, 10]) == parts[0]  # same seed, same rows
    # shuffled
    assert [r["question"] for r in split(ROWS, 42, [0, 10])] != [r["question"] for r in ROWS[:10]]
    with pytest.raises(DataError, match="reaches past the 20 rows"):
        load_rows(c.data, select=[15, 25])
    with pytest.raises(ConfigError, match="overlap"):
        load_config(path, ["--eval.select=[10, 20]"])


def test_sft_needs_a_target(sft_config):
    path, _ = sft_config
    with pytest.raises(ConfigError, match="data.target"):
        load_config(path, ["--data.target=null"])


def test_sft_resume_reproduces_the_uninterrupted_run(sft_config):
    path, cfg = sft_config
    run = Path(cfg["run"]["out_dir"])
    args = ["--config", str(path), "--run.steps=4", "--run.save_every=2", "--sft.batch_size=5"]
    assert train.main(args) == 0
    full = metrics(run)
    import shutil
    shutil.rmtree(run / "checkpoints/step_000004")
    assert train.main(args + ["--resume"]) == 0
    timing = {"step_time", "peak_memory_mb"}
    assert [{k: v for k, v in m.items() if k not in timing} for m in metrics(run)] == \
           [{k: v for k, v in m.items() if k not in timing} for m in full]


def test_continuing_an_adapter_with_a_kl_term_is_refused(sft_config):
    """With the SFT adapter continued, 'adapter off' is the raw base: the KL would undo the SFT."""
    path, cfg = sft_config
    cfg["run"]["steps"] = 1
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 0
    mcfg = ModelConfig(name=cfg["model"]["name"], init_adapter=cfg["run"]["out_dir"])
    with pytest.raises(ConfigError, match="merge_init_adapter: true"):
        load_policy(mcfg, LoraConfig(), torch.device("cpu"), beta=0.04)
    merged = ModelConfig(name=cfg["model"]["name"], init_adapter=cfg["run"]["out_dir"],
                         merge_init_adapter=True)
    # the merged SFT model is the reference
    load_policy(merged, LoraConfig(), torch.device("cpu"), beta=0.04)


def test_an_adapter_without_a_recorded_base_is_neither_saved_nor_loaded(tmp_path, tiny_llama):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from model import load_base
    from sources.adapters import save_adapter
    base, _ = load_base(ModelConfig(name=str(tiny_llama)), torch.device("cpu"))
    peft_model = get_peft_model(base, PeftLoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match="provenance"):
        save_adapter(peft_model, tmp_path / "a")
    peft_model.save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "minigrpo_base.json").write_text(
        '{"base_model": null, "revision": null, "merged": []}')
    with pytest.raises(ConfigError, match="was trained on base"):
        load_inference(ModelConfig(name=str(tiny_llama)), torch.device("cpu"),
                       adapter=str(tmp_path / "b"))


def test_null_or_empty_fields_are_errors_not_the_text_none(tmp_path):
    from config import DataConfig
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "Q1", "answer": "1"}\n{"question": "Q2", "answer": null}\n')
    with pytest.raises(DataError, match="row 1 has no \\(or an empty\\) field 'answer'"):
        load_rows(DataConfig(name=str(data), prompt="question"))
    data.write_text('{"question": "Q1", "answer": "1", "exp": null}\n')
    with pytest.raises(DataError, match="empty field 'exp'"):
        load_rows(DataConfig(name=str(data), prompt="{question}", target="Because {exp}"))


def test_a_target_that_repeats_the_forced_prefix_is_an_error(tmp_path):
    """SFT on "<think>..." replies after a forced "<think>" would teach "<think><think>"."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "Q1", "answer": "1", "reply": "<think>one</think> 1"}\n')
    with pytest.raises(DataError, match="row 0: data.target starts with data.assistant_prefix "
                                        "'<think>'.*set data.assistant_prefix: ''"):
        load_rows(DataConfig(name=str(data), prompt="question", target="reply",
                             assistant_prefix="<think>"))
    assert load_rows(DataConfig(name=str(data), prompt="question",
                                target="reply"))[0]["target"] == "<think>one</think> 1"


def test_the_builtin_task_holds_400_distinct_problems():
    from config import DataConfig
    rows = load_rows(DataConfig(name="arithmetic"))
    assert len(rows) == 400 and len({r["prompt"] for r in rows}) == 400


def test_sft_eval_every_logs_the_held_out_loss_and_trains_as_without_it(sft_config, tmp_path):
    path, cfg = sft_config
    args = ["--config", str(path), "--run.steps=4", "--lora.enabled=false", "--optim.lr=0.01"]
    assert train.main(args) == 0
    plain = metrics(Path(cfg["run"]["out_dir"]))
    out = tmp_path / "with_eval"
    assert train.main(args + ["--run.eval_every=2", "--eval.select=[12,20]",
                              f"--run.out_dir={out}"]) == 0
    m = metrics(out)
    assert [("eval/loss" in x) for x in m] == [False, True, False, True]
    # 20 rows of one pattern: what it learns carries over
    assert m[3]["eval/loss"] < m[1]["eval/loss"]
    assert [x["loss"] for x in m] == [x["loss"] for x in plain]
    # with rewards configured (MedMCQA's SFT config has them), the held-out rows are also decoded
    # and scored
    out = tmp_path / "with_rewards"
    assert train.main(args + ["--run.eval_every=4", "--eval.select=[12,20]", f"--run.out_dir={out}",
                              "--run.steps=4",
                              "--rewards=[{name: answer_match}]", "--eval.max_new_tokens=4"]) == 0
    last = metrics(out)[-1]
    assert "eval/loss" in last and 0 <= last["eval/accuracy"] <= 1 and last["eval/n"] == 8


def test_lora_dropout_acts_in_sft_only(sft_config, tmp_path):
    """lora.dropout is SFT's: GRPO and DPO turn dropout off (old, reference and current log-probs
    must agree)."""
    path, cfg = sft_config
    for mode, extra, active in (("sft", [], True),
                                ("grpo", ["--data.target=null", "--rewards=[{name: short_answer}]"],
                                 False)):
        r = lifecycle.setup(*train.parse_args(["--config", str(path), f"--mode={mode}",
                                          "--lora.dropout=0.25",
                                           f"--run.out_dir={tmp_path / mode}", *extra]))
        drops = [m for n, m in r.model.named_modules() if n.endswith("lora_dropout.default")]
        assert drops and all(isinstance(m, torch.nn.Dropout) == active for m in drops), mode
        assert not active or all(m.p == 0.25 for m in drops)


def test_sft_dropout_is_loras_alone_never_the_bases(tiny_gpt2):
    """GPT-2 ships dropout 0.1 in its own layers; dropout=True (SFT) turns on lora.dropout only."""
    model, _ = load_policy(ModelConfig(name=str(tiny_gpt2)), LoraConfig(r=4, alpha=8, dropout=0.25),
                           torch.device("cpu"), dropout=True)
    lora = {n for n, m in model.named_modules() if n.endswith("lora_dropout.default")}
    ps = {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert lora and all(ps[n] == 0.25 for n in lora) \
        and all(p == 0.0 for n, p in ps.items() if n not in lora)
    assert len(ps) > len(lora)  # the base has dropout modules of its own, all at 0


def test_a_continued_adapter_takes_this_runs_lora_dropout(sft_config, tmp_path):
    """The adapter's saved lora_dropout is its last run's: a continued SFT uses lora.dropout, GRPO
    none."""
    path, cfg = sft_config
    assert train.main(["--config", str(path), "--run.steps=1"]) == 0  # saved with lora_dropout 0
    for mode, extra, want in (("sft", [], 0.3),
                              ("grpo", ["--data.target=null", "--rewards=[{name: short_answer}]"],
                               0.0)):
        r = lifecycle.setup(*train.parse_args(["--config", str(path), f"--mode={mode}",
                                          "--lora.dropout=0.3", *extra,
                                           f"--model.init_adapter={cfg['run']['out_dir']}",
                                          f"--run.out_dir={tmp_path / (mode + '2')}"]))
        drops = [m for n, m in r.model.named_modules() if n.endswith("lora_dropout.default")]
        assert drops \
            and all((m.p if isinstance(m, torch.nn.Dropout) else 0.0) == want for m in drops), mode


def test_full_fine_tuning_from_a_merged_adapter_trains_and_resumes_only_on_that_base(
        sft_config, tmp_path):
    path, cfg = sft_config
    sft = cfg["run"]["out_dir"]
    assert train.main(["--config", str(path), "--run.steps=1"]) == 0
    out = tmp_path / "full"
    args = ["--config", str(path), "--lora.enabled=false", f"--model.init_adapter={sft}",
            "--model.merge_init_adapter=true",
            "--run.steps=2", "--run.save_every=1", f"--run.out_dir={out}"]
    r = lifecycle.setup(*train.parse_args(args))
    # every weight trains
    assert sum(p.numel() for p in r.params) == sum(p.numel() for p in r.model.parameters())
    assert train.main(args) == 0
    import shutil
    shutil.rmtree(out / "checkpoints/step_000002")
    # the SFT run's newest checkpoint moves on
    assert train.main(["--config", str(path), "--run.steps=2", "--resume"]) == 0
    # so the merged base (a DPO or KL reference) would differ: refused
    assert train.main(args + ["--resume"]) == 2


def test_messages_ahead_of_a_reply_are_kept_or_refused_never_dropped(tmp_path):
    user, tool = {"role": "user", "content": "Q"}, [{"role": "assistant", "content": "call"},
                                                    {"role": "tool", "content": "7"}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [user], "completion": tool
                                + [{"role": "assistant", "content": "It is 7."}]}) + "\n")
    (row,) = load_rows(DataConfig(name=str(data), prompt="prompt", target="completion",
                                  answer_key=None))
    assert row["prompt"] == [user] + tool and row["target"] == "It is 7."
    data.write_text(json.dumps({"chosen": [user, {"role": "assistant", "content": "good"}],
                                "rejected": [{"role": "user", "content": "another"},
                                             {"role": "assistant", "content": "bad"}]}) + "\n")
    with pytest.raises(DataError, match="data.rejected=rejected holds messages before its reply "
                                        "that are not the prompt's"):
        load_rows(DataConfig(name=str(data), prompt="chosen", chosen="chosen", rejected="rejected",
                             answer_key=None))
    # as in ultrafeedback_binarized: text prompt, chat replies
    data.write_text(json.dumps({"prompt": "What is 2+2?",
                                "chosen": [{"role": "user", "content": "What is 2+2?"},
                                           {"role": "assistant", "content": "4"}],
                                "rejected": [{"role": "user", "content": "What is 2+2?"},
                                             {"role": "assistant", "content": "5"}]}) + "\n")
    (row,) = load_rows(DataConfig(name=str(data), prompt="prompt", chosen="chosen",
                                  rejected="rejected", answer_key=None))
    assert (row["chosen"], row["rejected"]) == ("4", "5") and "What is 2+2?" in str(row["prompt"])
