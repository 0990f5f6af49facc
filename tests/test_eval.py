"""eval.py: the MedMCQA metrics on hand-written completions, pass@k against brute force, and the CLI
end to end on a tiny random Llama (base, a LoRA adapter, an API model on a fake server)."""
import itertools
import json
import math
import time

import pytest
import torch
import yaml

import eval as ev
from config import ConfigError, ModelConfig, RewardSpec
from fake_openai_server import Behaviour, FakeOpenAIServer, ok, server_error
from rewards import compute_rewards
from scoring import metrics
from sources.adapters import save_adapter
from sources.entries import parse_model_entries

MEDMCQA = [RewardSpec("json_valid"), RewardSpec("json_schema"), RewardSpec("choice_accuracy")]


def answer(letter, confidence=0.9, reason="because"):
    return json.dumps({"predicted_category": letter, "confidence": confidence, "reason": reason})


# (completion, gold letter): json_valid, json_schema, correct
HAND_WRITTEN = [
    (answer("A"), "A"),                     # valid, schema, correct
    (answer("B"), "A"),                     # valid, schema, wrong
    ("The answer is A", "A"),               # invalid JSON: no schema, not correct
    (answer("A", confidence=1.5), "A"),     # valid, schema violation (confidence > 1), correct
    ('{"predicted_category": "C"}', "C"),   # valid, schema violation (missing keys), correct
    (answer("D", confidence=0.5), "C"),     # valid, schema, wrong
]


@pytest.mark.parametrize("gold_as", ["letter", "cop"])
def test_medmcqa_metrics_on_hand_written_completions(gold_as):
    if gold_as == "letter":
        specs, samples = MEDMCQA, [{"answer": g} for _, g in HAND_WRITTEN]
    else:  # MedMCQA's cop: 0-based index of the right option
        specs = MEDMCQA[:2] + [RewardSpec("choice_accuracy", args={"gold_key": "cop"})]
        samples = [{"cop": "ABCD".index(g)} for _, g in HAND_WRITTEN]
    res = compute_rewards([c for c, _ in HAND_WRITTEN], samples, specs)
    m = metrics.task_metrics(res.per_reward)
    assert m["accuracy"] == pytest.approx(3 / 6)
    assert m["valid_json_rate"] == pytest.approx(5 / 6)
    assert m["schema_pass_rate"] == pytest.approx(3 / 6) and m["n_schema_pass"] == 3
    # 1 right among the 3 well-formed answers
    assert m["accuracy_on_schema"] == pytest.approx(1 / 3)
    assert not any(k.startswith("pass@") for k in m)  # one sample per prompt: no pass@k


def test_accuracy_on_schema_is_zero_when_no_completion_passes_the_schema():
    res = compute_rewards(["A", '{"predicted_category": "A"}'], [{"answer": "A"}] * 2, MEDMCQA)
    m = metrics.task_metrics(res.per_reward)
    assert m["n_schema_pass"] == 0 and m["accuracy_on_schema"] == 0.0 and m["accuracy"] == 0.5


def test_accuracy_falls_back_to_answer_match_and_skips_rows_without_gold():
    m = metrics.task_metrics({"answer_match": [1.0, None, 0.0, 1.0],
                              "short_answer": [0.5, 1.0, 1.0, 0.2]})
    assert m == {"accuracy": pytest.approx(2 / 3)}  # no JSON rewards: no JSON metrics


def test_task_metrics_report_nothing_without_the_rewards_they_derive_from():
    assert metrics.task_metrics({"short_answer": [1.0, 0.0]}) == {}


def brute_force_pass_at_k(n, c, k):
    """Share of the k-subsets of n samples (c of them correct) that hold a correct one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force_enumeration():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert metrics.pass_at_k(n, c, k) == \
                    pytest.approx(brute_force_pass_at_k(n, c, k)), (n, c, k)


def test_pass_at_k_averages_over_prompts_of_num_samples_completions():
    correct = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # prompts with 1, 3 and 0 right of 3
    m = metrics.task_metrics({"choice_accuracy": correct}, num_samples=3, pass_k=[1, 2, 3])
    assert m["pass@1"] == pytest.approx((1 / 3 + 1 + 0) / 3) == pytest.approx(m["accuracy"])
    assert m["pass@2"] == pytest.approx((2 / 3 + 1 + 0) / 3)
    assert m["pass@3"] == pytest.approx(2 / 3)


def test_greedy_generation_in_left_padded_batches_equals_argmax_decoding_one_prompt_at_a_time(
        tiny_llama):
    from model import load_inference
    from rollout import eos_token_ids
    model, tok = load_inference(ModelConfig(name=str(tiny_llama)), torch.device("cpu"))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
               for q in ("Hi", "What is 2 + 3? Reply with just the number.",
                         "Which vitamin? A) B12")]
    # the second batch holds one prompt
    gen = ev.generate_local(model, tok, prompts, max_new_tokens=7, batch_size=2)
    eos = eos_token_ids(tok, model)
    for i, prompt in enumerate(prompts):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        new = []
        with torch.no_grad():
            while len(new) < 7 and (not new or new[-1] not in eos):
                new.append(int(model(torch.cat([ids, torch.tensor([new], dtype=torch.long)], 1))
                               .logits[0, -1].argmax()))
        assert gen.texts[i] == tok.decode(new, skip_special_tokens=True) \
            and gen.num_tokens[i] == len(new), i
        assert gen.truncated[i] == (new[-1] not in eos)


# ----------------------------------------------------------------------------- end to end

ROWS = [{"question": f"Which vitamin? Option {i}", "answer": "ABCD"[i % 4]} for i in range(12)]
API_REPLY = answer("A")  # right for the rows whose gold is A


@pytest.fixture
def server():
    with FakeOpenAIServer(reply=lambda body: API_REPLY) as s:
        yield s


@pytest.fixture
def project(tmp_path, tiny_llama, server):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {
        "model": {"name": str(tiny_llama)},
        "data": {"name": str(data), "prompt": "Question: {question}",
                 "system_prompt": "Reply in JSON.", "split_seed": 42, "select": [0, 6]},
        "rewards": [{"name": "json_valid"}, {"name": "json_schema"}, {"name": "choice_accuracy"},
                    {"name": "length_penalty", "args": {"max_tokens": 6, "cache_tokens": 2}}],
        "eval": {"select": [6, 11], "max_new_tokens": 6, "batch_size": 2,
                 "out_dir": str(tmp_path / "eval"),
                 "api": {"base_url": server.url, "api_key_env": "MINIGRPO_TEST_NO_SUCH_KEY",
                         "max_retries": 0}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp_path


def make_adapter(tiny_llama, out, base_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero (a no-op adapter); make it change the outputs
            torch.nn.init.normal_(p, std=0.5)
    peft_model.minigrpo_base = {"base_model": base_model, "revision": None, "merged": []}
    save_adapter(peft_model, out)
    return out


def lines(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_base_adapter_and_api_model_are_evaluated_side_by_side(project, tiny_llama, server, capsys):
    cfg, tmp = project
    run = tmp / "grpo_run"  # a run directory: its newest checkpoint's adapter is the one evaluated
    make_adapter(tiny_llama, run / "checkpoints" / "step_000001" / "adapter", "someone/other-base")
    adapter = make_adapter(tiny_llama, run / "checkpoints" / "step_000002" / "adapter",
                           str(tiny_llama))
    out = tmp / "eval"
    # one API request fails (400 is not retried): left out of the metrics
    server.script(server_error(400))
    argv = ["--config", str(cfg), "--models", "base", f"grpo={run}", "api:fake-model"]
    assert ev.main(argv) == 0
    table, err = capsys.readouterr()
    assert "accuracy_on_schema" in table and "fake-model" in table and "grpo" in table
    # a line after each batch of 2 prompts, also outside a terminal
    done = [ln.split(" prompts")[0] for ln in err.splitlines() if "prompts generated" in ln]
    assert done == [f"[eval] {m}: {k}/5" for m in ("base", "grpo") for k in (2, 4, 5)]

    results = json.loads((out / "results.json").read_text())
    assert list(results["models"]) == ["base", "grpo", "fake-model"]
    assert results["held_out"] == {"select": [6, 11], "rows": 5}
    assert results["config"]["eval"]["max_new_tokens"] == 6
    assert results["models"]["grpo"]["source"] == str(adapter)
    for name, r in results["models"].items():
        m = r["metrics"]
        assert m["n"] == (4 if name == "fake-model" else 5), name
        for key in ("accuracy", "valid_json_rate", "schema_pass_rate", "accuracy_on_schema",
                    "n_schema_pass", "reward",
                    "reward/json_valid", "reward/length_penalty", "mean_length"):
            assert key in m, (name, key)
        # listed only when a reward failed
        assert not any(k.startswith("reward_errors/") for k in m)
    local = results["models"]["base"]["metrics"]
    assert 1 <= local["mean_length"] <= 6 and 0 <= local["truncated_rate"] <= 1

    # the fake API answers A: right exactly for the held-out rows whose gold is A, except the
    # failed request
    preds = {name: lines(out / f"predictions_{name}.jsonl") for name in results["models"]}
    assert all(len(p) == 5 for p in preds.values())
    api, api_m = preds["fake-model"], results["models"]["fake-model"]["metrics"]
    assert api_m["api_failures"] == 1 \
        and [p["completion"] == "" for p in api] == [p.get("api_failed", False) for p in api]
    (failed,) = [p for p in api if p.get("api_failed")]
    # not scored, no judge paid
    assert failed["reward"] is None and set(failed["rewards"].values()) == {None}
    assert [p["row"] for p in api] == [6, 7, 8, 9, 10]
    answered = [p for p in api if p["completion"]]
    assert all(p["completion"] == API_REPLY and p["rewards"]["json_schema"] == 1.0
               for p in answered)
    right = sum(p["gold"] == "A" for p in answered)
    assert api_m["accuracy"] == pytest.approx(right / 4) and api_m["valid_json_rate"] == 1.0
    assert api_m["accuracy_on_schema"] == pytest.approx(right / 4) and "truncated_rate" not in api_m
    # the API saw the system prompt and the filled-in template, and the model named in the entry
    bodies = [r.body for r in server.requests]
    assert {b["model"] for b in bodies} == {"fake-model"} and len(bodies) == 5
    assert bodies[0]["messages"][0] == {"role": "system", "content": "Reply in JSON."}
    assert {p["prompt"] for p in api} == {b["messages"][1]["content"] for b in bodies}

    # the adapter changes what the model says; prompts and gold are the same rows for every model
    assert [p["completion"] for p in preds["base"]] != [p["completion"] for p in preds["grpo"]]
    assert [(p["prompt"], p["gold"]) for p in preds["base"]] == \
        [(p["prompt"], p["gold"]) for p in api]

    # greedy decoding is deterministic: a second run writes the same predictions
    # results.json is not overwritten
    assert ev.main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    first = (out / "predictions_base.jsonl").read_text(), \
        (out / "predictions_grpo.jsonl").read_text()
    assert ev.main(argv[:5] + ["--overwrite"]) == 0
    assert ((out / "predictions_base.jsonl").read_text(),
            (out / "predictions_grpo.jsonl").read_text()) == first



def test_a_model_trained_on_the_held_out_rows_is_flagged_from_its_runs_own_config(
        project, tiny_llama, capsys):
    """The MedMCQA workflow's disjoint splits: eval.py reads each adapter's saved training config
    and warns when its data.select overlaps eval.select (same data, split and shuffle)."""
    from config import load_config, save_config
    cfg, tmp = project
    for name, select, warned in (("apart", "[0,6]", False), ("leaky", "[0,8]", True),
                                 ("all", "null", True)):
        ckpt = tmp / name / "checkpoints" / "step_000001"
        make_adapter(tiny_llama, ckpt / "adapter", str(tiny_llama))
        save_config(load_config(cfg, [f"--data.select={select}", "--eval.select=null"]),
                    ckpt / "config.yaml")
        assert ev.main(["--config", str(cfg), "--models", f"{name}={tmp / name}", "--eval.limit=1",
                        "--overwrite"]) == 0
        err = capsys.readouterr().err
        assert (f"warning: {name} was trained on" in err) == warned, err
        if name == "leaky":
            assert "rows [0, 8]" in err and "overlap the held-out rows [6, 11]" in err


def test_unloadable_model_entries_and_a_file_as_out_dir_are_one_line_errors(project, tiny_llama,
                                                                            capsys):
    cfg, tmp = project
    broken = tmp / "broken_export"
    broken.mkdir()
    # config, no weights
    (broken / "config.json").write_text((tiny_llama / "config.json").read_text())
    assert ev.main(["--config", str(cfg), "--models", f"x={broken}"]) == 2
    assert "has a config.json but no weights" in capsys.readouterr().err
    corrupt = make_adapter(tiny_llama, tmp / "corrupt", str(tiny_llama))
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    assert ev.main(["--config", str(cfg), "--models", f"x={corrupt}", "--eval.limit=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: adapter ") and "could not be loaded" in err[-1]
    assert not (tmp / "eval/results.json").exists()
    (tmp / "afile").write_text("")
    assert ev.main(["--config", str(cfg), "--models", "base",
                    f"--eval.out_dir={tmp / 'afile'}"]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err


def test_named_api_endpoints_each_send_their_own_model_and_settings(project, server, capsys):
    """eval.apis: models that need different request settings (GPT-5 takes no temperature) side by
    side with eval.api's plain api:MODEL entries."""
    cfg, tmp = project
    gpt5 = (f"--eval.apis={{gpt5: {{base_url: '{server.url}', api_key_env: "
            "MINIGRPO_TEST_NO_SUCH_KEY, model: gpt-5-mini, "
            "temperature: null, token_param: max_completion_tokens, max_retries: 0}}")
    assert ev.main(["--config", str(cfg), "--models", "api:gpt5", "api:fake-model", gpt5,
                    "--eval.limit=2"]) == 0
    sent = {b["model"]: b for b in (r.body for r in server.requests)}
    assert set(sent) == {"gpt-5-mini", "fake-model"}
    assert "temperature" not in sent["gpt-5-mini"] and "max_completion_tokens" in sent["gpt-5-mini"]
    assert "temperature" in sent["fake-model"]
    results = json.loads((tmp / "eval/results.json").read_text())["models"]
    assert list(results) == ["gpt5", "fake-model"] and results["gpt5"]["metrics"]["n"] == 2
    assert ev.main(["--config", str(cfg), "--models", "api:gpt5", "--eval.api=null",
                    "--overwrite"]) == 2
    assert "'gpt5' is not one of eval.apis (none) and there is no eval.api section" \
        in capsys.readouterr().err



def test_an_api_model_that_never_answers_stops_the_eval_and_hints_name_its_section(
        project, server, capsys):
    """Every request of an api: entry failed (fewer than the client's limit): exit 2 with one line,
    not a results.json with an empty column; a rejected parameter's hint names eval.api's keys."""
    cfg, tmp = project
    server.default = Behaviour(status=500)
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", "--eval.limit=2"]) == 2
    assert "all 2 requests failed (1 try, the last HTTP 500); nothing was scored" \
        in capsys.readouterr().err
    assert not (tmp / "eval/results.json").exists()
    server.default = Behaviour(status=400, code="unsupported_parameter",
                               message="Unsupported parameter: 'max_tokens'")
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", "--eval.limit=2"]) == 2
    assert "take eval.api.token_param: max_completion_tokens and eval.api.temperature: null" \
        in capsys.readouterr().err


def test_an_api_model_samples_n_cached_answers_and_a_prompt_with_a_failed_sample_is_left_out_whole(
        project, server, capsys):
    """eval.num_samples for API models: n requests per prompt, each its own cache entry (a rerun
    pays for none), pass@k and best-of-n over them; one failed sample leaves its prompt out of the
    metrics."""
    cfg, tmp = project
    letters = iter("ABCD" * 10)
    server.reply = lambda body: answer(next(letters))  # each request a different answer
    server.script(server_error(400))  # one sample (whichever request arrives first) fails
    cache = tmp / "api_cache.jsonl"
    args = ["--config", str(cfg), "--models", "api:fake-model", "--eval.limit=3",
            "--eval.num_samples=2", "--eval.temperature=0.7", "--eval.pass_k=[1,2]",
            f"--eval.api.cache_path={cache}", "--eval.api.temperature=0.7"]
    assert ev.main(args) == 0
    m = json.loads((tmp / "eval/results.json").read_text())["models"]["fake-model"]["metrics"]
    preds = lines(tmp / "eval/predictions_fake-model.jsonl")
    assert len(server.requests) == 6 \
        and [(p["row"], p["sample"]) for p in preds] == [(r, i) for r in (6, 7, 8) for i in (0, 1)]
    (bad,) = [i for i, p in enumerate(preds) if p.get("api_failed")]
    sibling = bad ^ 1  # the other sample of the same prompt is left out too
    assert [p["reward"] is None for p in preds] == [i in (bad, sibling) for i in range(6)]
    assert m["n"] == 4 and m["api_failures"] == 1 \
        and {"pass@1", "pass@2", "best_of_n_reward"} <= set(m)
    answered = {i: p["completion"] for i, p in enumerate(preds) if i != bad}
    # distinct samples, each cached
    assert len(set(answered.values())) > 1 and len(cache.read_text().splitlines()) == 5
    server.reset()
    assert ev.main(args + ["--overwrite"]) == 0
    again = lines(tmp / "eval/predictions_fake-model.jsonl")
    # only the failed one is asked again
    assert len(server.requests) == 1 and {i: again[i]["completion"] for i in answered} == answered
    assert ev.main(args[:-1] + ["--eval.api.temperature=0", "--overwrite"]) == 2
    assert "eval.api.temperature is 0 but eval.num_samples=2" in capsys.readouterr().err


def test_a_test_file_of_its_own_is_read_in_file_order_and_a_mixture_names_each_rows_source(
        project, server, capsys):
    """eval.name: BioReasoner's "first 10 samples of test_84.jsonl", with no overlap check against
    data.select (another file) and no shuffle; with a mixture, each prediction names its source."""
    cfg, tmp = project
    test = tmp / "test.jsonl"
    test.write_text("".join(json.dumps({"question": f"Test {i}", "answer": "A"}) + "\n"
                            for i in range(4)))
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", f"--eval.name={test}",
                    "--eval.select=[0,3]", "--eval.keep_columns=[question]"]) == 0
    preds = lines(tmp / "eval/predictions_fake-model.jsonl")
    assert [(p["row"], p["prompt"], p["columns"]) for p in preds] == \
        [(i, f"Question: Test {i}", {"question": f"Test {i}"}) for i in range(3)]
    assert "data.select is not set" not in capsys.readouterr().err
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", f"--eval.name={test}",
                    "--eval.select=null", "--eval.keep_columns=[id]", "--overwrite"]) == 2
    assert "eval.keep_columns: the rows of test have no column 'id'" in capsys.readouterr().err
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", f"--eval.name={test}",
                    "--eval.select=null", "--overwrite"]) == 0
    assert len(lines(tmp / "eval/predictions_fake-model.jsonl")) == 4 \
        and "all, 4 prompts" in capsys.readouterr().out
    mix = (f"--data.mixture=[{{name: '{tmp / 'data.jsonl'}', label: a}}, "
           f"{{name: '{test}', label: b, select: [0, 1]}}]")
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", mix, "--eval.select=[2,4]",
                    "--overwrite", "--data.select=[0,2]", "--data.name=null"]) == 0
    preds = lines(tmp / "eval/predictions_fake-model.jsonl")
    assert [(p["source"], p["row"]) for p in preds] == [("a", 2), ("a", 3), ("b", 2), ("b", 3)]
    m = json.loads((tmp / "eval/results.json").read_text())["models"]["fake-model"]["metrics"]
    # the fake always answers A
    gold = {"a": [p["gold"] for p in preds if p["source"] == "a"], "b": ["A", "A"]}
    for s in "ab":
        assert m[f"{s}/n"] == 2 and m[f"{s}/accuracy"] == gold[s].count("A") / 2
    assert m["a/reward"] == pytest.approx(sum(p["reward"] for p in preds if p["source"] == "a") / 2)
    assert ev.main(["--config", str(cfg), "--models", "api:fake-model", mix, "--eval.select=[2,4]",
                    "--overwrite", "--data.select=[0,2]", "--data.name=null", "--eval.limit=1",
                    "--run.epochs=2"]) == 0
    # each source's first: at its own place
    preds = lines(tmp / "eval/predictions_fake-model.jsonl")
    assert [(p["source"], p["row"]) for p in preds] == [("a", 2), ("b", 2)]
    # as config.yaml saves it: epochs make steps
    saved = json.loads((tmp / "eval/results.json").read_text())["config"]
    assert saved["run"]["epochs"] == 2 and "steps" not in saved["run"]


def test_group_by_reports_each_value_of_a_column_as_well(project, server, capsys):
    """eval.group_by: BioReasoner's prompt types (critique_extend, method_bridge, gap_analysis) each
    scored."""
    cfg, tmp = project
    test = tmp / "typed.jsonl"
    kinds = ["bridge", "gap", "bridge", "gap", "bridge"]
    test.write_text("".join(json.dumps({"question": f"Test {i}", "answer": "AB"[i % 2], "kind": k})
                            + "\n" for i, k in enumerate(kinds)))
    args = ["--config", str(cfg), "--models", "api:fake-model", f"--eval.name={test}",
            "--eval.select=null"]
    assert ev.main(args + ["--eval.group_by=kind"]) == 0
    preds = lines(tmp / "eval/predictions_fake-model.jsonl")
    m = json.loads((tmp / "eval/results.json").read_text())["models"]["fake-model"]["metrics"]
    for k in ("bridge", "gap"):
        # the fake always answers A: the bridge rows' gold is A, the gap rows' B
        mine = [p for p in preds if p["group"] == f"kind={k}"]
        assert m[f"kind={k}/n"] == len(mine) == kinds.count(k)
        assert m[f"kind={k}/accuracy"] == \
            pytest.approx(sum(p["gold"] == "A" for p in mine) / len(mine))
    assert m["kind=bridge/accuracy"] == 1.0 and m["kind=gap/accuracy"] == 0.0
    assert "kind=gap/accuracy" in capsys.readouterr().out  # in the table
    assert ev.main(args + ["--eval.group_by=type", "--overwrite"]) == 2
    assert "eval.group_by: held-out row 0 has no value (text or a number) in column 'type'" \
        in capsys.readouterr().err
    mixed = tmp / "mixed.jsonl"  # 1 and "1" would be one group by name, two in the data
    mixed.write_text("".join(json.dumps({"question": f"T {i}", "answer": "A", "level": v}) + "\n"
                             for i, v in enumerate([1, 2, "1"])))
    assert ev.main(args + [f"--eval.name={mixed}", "--eval.group_by=level", "--overwrite"]) == 2
    assert "column 'level' holds 1 (held-out row 0) and '1' (row 2)" in capsys.readouterr().err


def test_sampling_writes_num_samples_lines_per_prompt_and_is_seeded(project):
    cfg, tmp = project
    argv = ["--config", str(cfg), "--models", "base", "--eval.temperature=1.0",
            "--eval.num_samples=3", "--eval.pass_k=[1,3]", "--eval.limit=2", "--overwrite",
            "--data.assistant_prefix={"]
    assert ev.main(argv) == 0
    preds = lines(tmp / "eval" / "predictions_base.jsonl")
    assert [(p["row"], p["sample"]) for p in preds] == [(r, s) for r in (6, 7) for s in range(3)]
    # best-of-n picks read the whole reply: prefix + completion
    assert {p["assistant_prefix"] for p in preds} == {"{"}
    m = json.loads((tmp / "eval" / "results.json").read_text())["models"]["base"]["metrics"]
    assert m["n"] == 6 and m["pass@1"] == pytest.approx(m["accuracy"]) \
        and 0 <= m["pass@1"] <= m["pass@3"] <= 1
    assert len({p["completion"] for p in preds}) > 1  # sampled, not greedy
    best = [max(p["reward"] for p in preds if p["row"] == r) for r in (6, 7)]
    assert m["best_of_n_reward"] == pytest.approx(sum(best) / 2) \
        and m["best_of_n_reward"] >= m["reward"]
    assert ev.main(argv) == 0
    assert lines(tmp / "eval" / "predictions_base.jsonl") == preds


@pytest.mark.parametrize("models,overrides,message", [
    (["nosuch/dir"], [], "no such file or directory"),
    (["api:"], [], "names no API model"),
    (["base", "base"], [], "appears twice"),
    (["my model=api:x"], [], "the name must be"),
    (["api:gpt-4o-mini"], ["--eval.api=null"], "there is no eval.api section"),
    (["base"], ["--eval.select=null"], "eval.select is not set"),
    (["base"], ["--eval.num_samples=2"], "needs eval.temperature > 0"),
    (["base"], ["--eval.temperature=1.0", "--eval.num_samples=2", "--eval.pass_k=[4]"],
     "eval.pass_k [4]"),
    (["base"], ["--eval.select=[3,8]"], "overlap"),
    (["base"], ["--eval.top_p=0"], "eval.top_p=0.0 is out of range"),
    (["base"], ["--eval.name=/no/such/test.jsonl", "--eval.select=null"],
     "eval.name=/no/such/test.jsonl: no such file"),
    (["base"], ["--judge=null", "--rewards=[{name: judge}]"],
     "needs a judge: add a `judge:` section"),
    (["base"], ["--eval.agreement=[[answer_match, judge]]"],
     "eval.agreement ['answer_match', 'judge']: each entry is two"),
    (["base"], ["--eval.agreement=[[answer_match]]"], "two different reward labels"),
    (["base"], ["--eval.agreement=[[json_valid, json_schema]]",  # a failed call scored 0.0
                "--rewards=[{name: json_valid, fallback: 0.0}, {name: json_schema}]"],
     "set fallback: skip on reward 'json_valid'"),
    (["api:fake-model"], ["--eval.api.base_url=not-a-url"],
     "error: eval.api: base_url='not-a-url' is not an http(s) URL"),
    (["api:fake-model"], ["--eval.api.cache_path={folder}"],
     "eval.api.cache_path={folder}: Is a directory"),
    (["base"], ["--judges.second.cache_path=j.jsonl", "--judges.second.max_concurrent=0",
                "--rewards=[{name: judge, args: {judge: second}}]"],
     "judges.second: need max_concurrent >= 1"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(project, capsys, models, overrides,
                                                            message):
    cfg, tmp = project
    (tmp / "folder").mkdir()
    overrides, message = [o.replace("{folder}", str(tmp / "folder")) for o in overrides], \
        message.replace("{folder}", str(tmp / "folder"))
    assert ev.main(["--config", str(cfg), "--models", *models, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp / "eval").exists()


def test_an_adapter_loads_on_the_base_its_run_recorded_and_another_tools_adapter_must_match(
        project, tiny_llama, capsys):
    """A GRPO phase trained on an SFT phase pushed as a merged model records that model as its base:
    it is evaluated there, beside the base of model.name (MedMCQA's phases in separate jobs). An
    adapter saved by another tool (no provenance) of another base is refused before any load."""
    import shutil

    from transformers import AutoModelForCausalLM
    cfg, tmp = project
    # stands in for the pushed SFT model: another base than model.name, other weights
    sft_merged = tmp / "sft_merged"
    shutil.copytree(tiny_llama, sft_merged)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(sft_merged)
    adapter = make_adapter(sft_merged, tmp / "grpo" / "adapter", str(sft_merged))
    capsys.readouterr()  # the loading bar of make_adapter
    out = tmp / "eval"
    assert ev.main(["--config", str(cfg), "--models", "base", f"grpo={adapter}",
                    f"--eval.out_dir={out}"]) == 0
    assert f"on its run's base {sft_merged}" in capsys.readouterr().err
    # the adapter evaluated with its base as model.name: the same completions
    same = tmp / "eval_same"
    assert ev.main(["--config", str(cfg), "--models", f"grpo={adapter}",
                    f"--model.name={sft_merged}", f"--eval.out_dir={same}"]) == 0
    grpo = [p["completion"] for p in lines(out / "predictions_grpo.jsonl")]
    assert grpo == [p["completion"] for p in lines(same / "predictions_grpo.jsonl")]
    assert grpo != [p["completion"] for p in lines(out / "predictions_base.jsonl")]
    other = make_adapter(tiny_llama, tmp / "other" / "adapter", "someone/other-base")
    # as another tool saved it: its recorded base is only a hint
    (other / "minigrpo_base.json").unlink()
    cfg_path = other / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()),
                                    "base_model_name_or_path": "someone/other-base"}))
    capsys.readouterr()
    assert ev.main(["--config", str(cfg), "--models", "base", str(other),
                    f"--eval.out_dir={tmp / 'eval_other'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'someone/other-base'" in err and "trained on base" in err
    assert not (tmp / "eval_other").exists()


def test_bare_paths_are_named_after_their_directory_and_merged_exports_load_as_full_models(
        tiny_llama):
    entries = parse_model_entries([str(tiny_llama), "api:org/model-7b", "ref=base"],
                                  ModelConfig(name="x"))
    assert [(e.name, e.kind, e.target) for e in entries] == [
        (tiny_llama.name, "full", str(tiny_llama)), ("org_model-7b", "api", "org/model-7b"),
        ("ref", "base", None)]



def test_hub_entries_are_downloaded_then_read_as_local_directories(tiny_llama, tmp_path,
                                                                   monkeypatch):
    """hf:ORG/REPO: the MedMCQA seed pushed each phase to the hub; a pushed adapter (plain peft,
    as TRL pushes it) or a merged model is evaluated as if it were local. Offline: one line."""
    import huggingface_hub
    adapter = make_adapter(tiny_llama, tmp_path / "pushed", str(tiny_llama))
    # as another tool saved it: the base is in adapter_config.json
    (adapter / "minigrpo_base.json").unlink()
    cfg_path = adapter / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()),
                                    "base_model_name_or_path": str(tiny_llama)}))
    repos = {"me/sft": adapter, "me/merged": tiny_llama}
    calls = []

    def fake_download(repo_id, revision=None):
        calls.append((repo_id, revision))
        if repo_id not in repos:
            raise OSError("We couldn't connect to 'https://huggingface.co'")
        return str(repos[repo_id])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    entries = parse_model_entries(["hf:me/sft@refs/pr/3", "m=hf:me/merged"],
                                  ModelConfig(name=str(tiny_llama)))
    assert [(e.name, e.kind, e.target) for e in entries] == [("sft", "adapter", str(adapter)),
                                                             ("m", "full", str(tiny_llama))]
    assert calls == [("me/sft", "refs/pr/3"), ("me/merged", None)]
    from sources import hub
    # the hub's own error, when it answers
    monkeypatch.setattr(hub, "reachable", lambda endpoint: True)
    with pytest.raises(ConfigError,
                       match="could not download me/other from the hub .*couldn't connect"):
        parse_model_entries(["hf:me/other"], ModelConfig(name=str(tiny_llama)))
    # not "set HF_HUB_OFFLINE=0": hub.py set it
    monkeypatch.setattr(hub, "reachable", lambda endpoint: False)
    with pytest.raises(ConfigError, match=r"cannot be reached from this machine and me/other is "
                                          r"not in its cache.*hf download me/other --local-dir"):
        parse_model_entries(["hf:me/other"], ModelConfig(name=str(tiny_llama)))


def test_model_metrics_count_lengths_truncation_and_reward_failures():
    gen = ev.Generated(texts=[answer("A"), "oops"], num_tokens=[12, 6], truncated=[False, True])
    # "Z" is no option: raises
    res = compute_rewards(gen.texts, [{"answer": "A"}, {"answer": "Z"}], MEDMCQA)
    m = metrics.model_metrics(res, gen.num_tokens, gen.truncated, num_samples=1, pass_k=[])
    assert m["reward_errors/choice_accuracy"] == 1 and "reward_errors/json_valid" not in m
    assert m["n"] == 2 and m["mean_length"] == 9.0 and m["truncated_rate"] == 0.5
    # the failed completion is left out (the default fallback: skip), not scored 0
    assert m["reward"] == pytest.approx(3.0) and m["reward/json_schema"] == 0.5



def test_failed_api_requests_are_left_out_of_scoring_and_metrics():
    from config import Config
    cfg = Config(rewards=MEDMCQA)
    rows = [{"prompt": "q", "answer": "A"}, {"prompt": "q2", "answer": "B"}]
    gen = ev.Generated(texts=["", answer("B")], num_tokens=[0, 12], truncated=None,
                       failed=[True, False])
    _, res, m = ev.score_rows(gen, rows, 1, cfg, "", {})
    assert m["n"] == 1 and m["accuracy"] == 1.0 and m["valid_json_rate"] == 1.0 \
        and m["mean_length"] == 12
    assert math.isnan(res.total[0]) and all(v[0] is None for v in res.per_reward.values())
    # a mixture: per source, the answered too
    where = [{"row": 0, "source": "a"}, {"row": 0, "source": "b"}]
    assert metrics.per_source_metrics(where, 1, res, gen.failed) == \
        {"a/n": 0, "b/n": 1, "b/reward": res.total[1], "b/accuracy": 1.0}
    res2 = metrics.RewardResult([0.0, 1.0, 1.0, 0.0], {"choice_accuracy": [0.0, 1.0, 1.0, 0.0]}, {})
    # 2 samples a prompt; a's answered sample is left out with its prompt
    assert metrics.per_source_metrics(where, 2, res2, [True, False, False, False]) == {
        "a/n": 0, "b/n": 2, "b/reward": 0.5, "b/accuracy": 0.5}
    # an outage
    gen = ev.Generated(texts=["", ""], num_tokens=[0, 0], truncated=None, failed=[True, True])
    _, res, m = ev.score_rows(gen, rows, 1, cfg, "", {})
    assert m == {"n": 0} and all(math.isnan(t) for t in res.total)


def test_render_table_puts_metrics_in_rows_and_models_in_columns():
    from rich.console import Console
    console = Console(width=100, record=True)
    console.print(ev.render_table({"base": {"accuracy": 0.25, "n": 4},
                                   "sft": {"accuracy": 0.5, "n": 4, "api_failures": 1}}))
    text = console.export_text()
    rows = {ln.split()[1]: ln.split()[3:-1:2] for ln in text.splitlines() if ln.startswith("│")}
    assert rows["accuracy"] == ["0.250", "0.500"] and rows["n"] == ["4", "4"] \
        and rows["api_failures"] == ["-", "1"]


def test_agreement_leaves_out_unscored_pairs_and_has_no_rank_correlation_for_a_constant_judge():
    assert metrics.agreement([4.0, 4.0, None], [1.0, 5.0, 2.0]) == \
        {"spearman": None, "mean_abs_diff": 2.0, "n": 2}
    assert metrics.agreement([None, 1.0], [2.0, None]) == \
        {"spearman": None, "mean_abs_diff": None, "n": 0}
    assert metrics.agreement([1.0, 2.0, 3.0], [30.0, 20.0, 10.0])["spearman"] == pytest.approx(-1.0)


def test_an_override_holding_a_space_is_an_override_even_right_after_the_model_entries():
    args, overrides = ev.parse_args(["--config", "c.yaml", "--models", "base",
                                     "--eval.agreement=[[a, b]]", "grpo=runs/g",
                                     "--overwrite", "--eval.limit=3"])
    assert args.models == ["base", "grpo=runs/g"] and args.overwrite and args.config == "c.yaml"
    assert overrides == ["--eval.agreement=[[a, b]]", "--eval.limit=3"]


JUDGED = ["--rewards=[{name: json_valid}, "
          "{name: judge, args: {template: 'Rate this: {completion}'}}]",
          "--judge.api_key_env=MINIGRPO_TEST_NO_SUCH_KEY", "--judge.max_retries=0"]


def test_each_model_is_scored_while_the_next_one_generates_and_written_in_order(project, tiny_llama,
                                                                                monkeypatch):
    cfg, tmp = project
    spans, generate, score_model = {}, ev.generate, ev.score_model

    def timed(fn, kind):
        def run(entry, *args):
            t0 = time.monotonic()
            out = fn(entry, *args)
            spans[kind, entry.name] = (t0, time.monotonic())
            return out
        return run
    monkeypatch.setattr(ev, "generate", timed(generate, "generate"))
    monkeypatch.setattr(ev, "score_model", timed(score_model, "score"))
    with FakeOpenAIServer(reply=lambda body: '{"score": 7}') as judge:
        judge.default = ok(delay_s=1.0)  # a slow judge: every request answers after 1 s
        assert ev.main(["--config", str(cfg), "--models", "base", f"again={tiny_llama}",
                        "--eval.limit=3", f"--judge.base_url={judge.url}", *JUDGED]) == 0
    # overlapped with base's scoring
    assert spans["generate", "again"][0] < spans["score", "base"][1]
    # scoring: one model at a time, in order
    assert spans["score", "again"][0] >= spans["score", "base"][1]
    results = json.loads((tmp / "eval/results.json").read_text())["models"]
    assert list(results) == ["base", "again"]
    for name in results:
        assert results[name]["metrics"]["reward/judge"] == pytest.approx(0.7)
        assert results[name]["metrics"]["judge_failures"] == 0
        assert len((tmp / f"eval/predictions_{name}.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("error",
                         [ConfigError("adapter moved"), RuntimeError("CUDA out of memory")])
def test_a_model_that_fails_to_load_still_lets_the_ones_before_it_be_scored_and_written(
        project, tiny_llama, monkeypatch, capsys, error):
    cfg, tmp = project
    generate = ev.generate

    def failing(entry, plan):
        if entry.name == "again":
            raise error
        return generate(entry, plan)
    monkeypatch.setattr(ev, "generate", failing)
    argv = ["--config", str(cfg), "--models", "base", f"again={tiny_llama}", "--eval.limit=3",
            *JUDGED]
    with FakeOpenAIServer(reply=lambda body: '{"score": 7}') as judge:
        judge.default = ok(delay_s=0.5)
        if isinstance(error, ConfigError):  # bad input: one line, exit 2
            assert ev.main([*argv, f"--judge.base_url={judge.url}"]) == 2
            assert "error: adapter moved" in capsys.readouterr().err
        else:  # a crash is raised as it is, once what was generated is written
            with pytest.raises(RuntimeError, match="out of memory"):
                ev.main([*argv, f"--judge.base_url={judge.url}"])
    # its judge calls were paid for
    assert len((tmp / "eval/predictions_base.jsonl").read_text().splitlines()) == 3
    assert not (tmp / "eval/results.json").exists()


def test_a_model_whose_scoring_fails_is_reported_and_the_next_one_is_still_written(
        project, tiny_llama, monkeypatch, capsys):
    cfg, tmp = project
    score_model = ev.score_model

    def failing(entry, *args):
        if entry.name == "base":
            time.sleep(0.5)  # still scoring while the next model generates
            raise ConfigError("the judge template needs field(s) ['question']")
        return score_model(entry, *args)
    monkeypatch.setattr(ev, "score_model", failing)
    assert ev.main(["--config", str(cfg), "--models", "base", f"again={tiny_llama}",
                    "--eval.limit=3"]) == 2
    err = capsys.readouterr().err
    assert "error: scoring base: the judge template needs" in err and err.count("error:") == 1
    assert not (tmp / "eval/predictions_base.jsonl").exists()
    assert len((tmp / "eval/predictions_again.jsonl").read_text().splitlines()) == 3


def test_a_scoring_error_is_still_reported_when_a_later_model_crashes(project, tiny_llama,
                                                                      monkeypatch, capsys):
    cfg, tmp = project
    score_model = ev.score_model
    monkeypatch.setattr(ev, "score_model",
                        lambda entry, *a: (_ for _ in ()).throw(ConfigError("bad template"))
                        if entry.name == "base" else score_model(entry, *a))
    monkeypatch.setattr(ev, "generate", lambda entry, plan, real=ev.generate:
                        real(entry, plan) if entry.name == "base"
                        else (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        ev.main(["--config", str(cfg), "--models", "base", f"again={tiny_llama}", "--eval.limit=3"])
    assert "error: scoring base: bad template" in capsys.readouterr().err


def test_an_interrupted_eval_resumes_from_the_batches_it_saved(project, monkeypatch, capsys):
    """Each batch's completions are appended to partial_<name>.jsonl; run again, a killed eval
    generates only the rest (greedy: the same predictions as an uninterrupted run), and the file
    goes once results.json is written. Another decoding's batches are not reused."""
    cfg, tmp = project
    args = ["--config", str(cfg), "--models", "base", "--eval.batch_size=2"]
    assert ev.main([*args, f"--eval.out_dir={tmp / 'whole'}"]) == 0
    out, real_append, calls = tmp / "resumed", ev.jsonl.append, []

    def killed_after_two(path, records):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(path)
        return real_append(path, records)
    monkeypatch.setattr(ev.jsonl, "append", killed_after_two)
    assert ev.main([*args, f"--eval.out_dir={out}"]) == 130  # Ctrl-C: one line, not a traceback
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err
    monkeypatch.setattr(ev.jsonl, "append", real_append)
    assert len(lines(out / "partial_base.jsonl")) == 2 and not (out / "results.json").exists()
    for other in ("decoding", "batch", "dtype"):
        # the same saved batches, for reruns with other settings
        (tmp / other).mkdir()
        (tmp / other / "partial_base.jsonl").write_text((out / "partial_base.jsonl").read_text())
    generated, real_generate = [], ev.generate_local
    monkeypatch.setattr(ev, "generate_local",
                        lambda m, t, prompts, *a, **k: generated.append(len(prompts))
                        or real_generate(m, t, prompts, *a, **k))
    capsys.readouterr()
    assert ev.main([*args, f"--eval.out_dir={out}"]) == 0
    # 5 held-out rows, 2 a batch
    assert generated == [1] and "4 of 5 prompts' completions from" in capsys.readouterr().err
    assert [p["completion"] for p in lines(out / "predictions_base.jsonl")] == \
        [p["completion"] for p in lines(tmp / "whole" / "predictions_base.jsonl")]
    assert not (out / "partial_base.jsonl").exists()
    generated.clear()
    assert ev.main([*args, "--eval.max_new_tokens=4", f"--eval.out_dir={tmp / 'decoding'}"]) == 0
    assert generated == [5]  # other completions: nothing reused
    generated.clear()
    assert ev.main([*args, "--eval.batch_size=1", f"--eval.out_dir={tmp / 'batch'}"]) == 0
    assert generated == [1]  # a smaller batch (after running out of memory) keeps what was saved
    # the dtype used, not the setting: auto is fp32 here, bf16 on a GPU (a GPU run resumed on a CPU)
    generated.clear()
    assert ev.main([*args, "--model.dtype=bfloat16", f"--eval.out_dir={tmp / 'dtype'}"]) == 0
    assert generated == [5]


def test_the_resume_key_holds_the_device_and_the_dtype_used_there(monkeypatch):
    """model.dtype auto is bf16 on an Ampere GPU and fp32 on a CPU: a GPU run's saved batches are
    not mixed into a CPU rerun; auto and float32 on a CPU compute the same, so they share the
    key."""
    from config import load_config
    from sources.entries import ModelEntry
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    entry = ModelEntry("base", "base", None, "base")

    def key(device, *overrides):
        cfg = load_config(None, ["--rewards=[{name: answer_match}]", *overrides])
        return ev.generation_key(entry, cfg.model, cfg, ["What is 2 + 2?"], torch.device(device))
    assert key("cuda") != key("cpu") == key("cpu", "--model.dtype=float32") != \
        key("cpu", "--model.dtype=bfloat16")


def test_maj_at_n_votes_with_answer_match_s_answers(tmp_path):
    """With answer_match and num_samples n > 1, maj@n: the answer most of a prompt's samples give,
    right or wrong (self-consistency), beside pass@k; samples without a number do not vote."""
    from config import load_config
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({"rewards": [{"name": "answer_match"}],
                                        "eval": {"num_samples": 3, "pass_k": [1, 3]}}))
    cfg = load_config(cfg_path)
    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4"},
            {"prompt": "3 + 3?", "answer": "6"}]
    texts = ["2", "It is 2.", "3",          # majority 2: right
             "5", "5", "4",                 # majority 5: wrong, one sample right (pass@3 counts it)
             "no idea", "6", "hmm"]          # only one sample answers: it decides
    gen = ev.Generated(texts, [1] * 9, [False] * 9)
    _, _, m = ev.score_rows(gen, rows, 3, cfg, "", {})
    assert m["maj@3"] == pytest.approx(2 / 3) and m["pass@3"] == pytest.approx(1.0)
    _, _, one = ev.score_rows(ev.Generated(texts[:3], [1] * 3, [False] * 3), rows, 1, cfg, "", {})
    # one sample a prompt: no vote
    assert "maj@1" not in one and one["accuracy"] == pytest.approx(1 / 3)


def test_rewards_see_the_think_block_the_template_opens_and_the_record_keeps_the_forced_prefix(
        tmp_path, monkeypatch):
    """A DeepSeek-R1-style template ends its generation prompt inside <think>: the rewards get that
    opened block (rollout.reply_prefix), predictions keep only what data.assistant_prefix forced."""
    import rewards
    from conftest import CHATML, write_tiny_model
    seen = set()

    def reward(completion, sample, assistant_prefix="", forced_prefix=None):
        seen.add((assistant_prefix, forced_prefix))
        return 0.0
    monkeypatch.setitem(rewards.REGISTRY, "test_prefix", (reward, False))
    model = write_tiny_model(tmp_path / "r1",
                             chat_template=CHATML.replace("assistant\n'", "assistant\n<think>\n'"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": str(model)},
                                   "data": {"name": str(data), "prompt": "{question}"},
                                   "rewards": [{"name": "test_prefix"}],
                                   "eval": {"select": [0, 2], "max_new_tokens": 3,
                                            "out_dir": str(tmp_path / "eval")}}))
    assert ev.main(["--config", str(cfg), "--models", "base"]) == 0
    assert seen == {("<think>\n", "")}
    assert not any("assistant_prefix" in p
                   for p in lines(tmp_path / "eval" / "predictions_base.jsonl"))


def test_eval_ends_completions_at_training_s_stop_strings_and_reads_eval_name_whole(
        tmp_path, monkeypatch):
    """rollout.stop_strings end training's completions, so they end eval's too (and key its
    resumable batches); eval.name's file is read whole, not cut at data.num_examples (eval.limit
    caps it)."""
    import rollout
    from config import Config, DataConfig, EvalConfig, RolloutConfig
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n"
                            for i in range(12)))
    cfg = Config(data=DataConfig(name="arithmetic", num_examples=5),
                 eval=EvalConfig(name=str(test)), rollout=RolloutConfig(stop_strings=["</answer>"]))
    assert len(ev.held_out_rows(cfg)) == 12
    seen = {}

    def fake(model, tok, prompts, per_call, *args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")
    monkeypatch.setattr(rollout, "generate_in_slices", fake)
    monkeypatch.setattr(rollout, "render_rows",
                        lambda tok, rows, data, **_: [r["prompt"] for r in rows])
    with pytest.raises(RuntimeError, match="stop here"):
        ev.generate_rows(None, None, ev.held_out_rows(cfg)[:2], cfg)
    assert seen["stop_strings"] == ["</answer>"]


def test_prediction_rows_keep_their_place_when_a_map_leaves_rows_out(project):
    """A filtering data.map (rows too long, without gold): each prediction's "row" is its place
    among eval.select's rows before the map, so a gap shows where a row was left out; they were
    renumbered."""
    cfg, tmp = project
    keep = tmp / "keep.py"
    keep.write_text(
        "def odd_out(row):\n    return None if row['question'].endswith('7') else row\n")
    assert ev.main(["--config", str(cfg), "--models", "base", f"--data.map={keep}:odd_out",
                    "--eval.select=[0,11]", "--data.select=null"]) == 0
    preds = lines(tmp / "eval/predictions_base.jsonl")
    from data import split
    want = [j for j, r in enumerate(split(ROWS, 42, [0, 11])) if not r["question"].endswith("7")]
    assert [p["row"] for p in preds] == want and len(want) == 10
    # the first 3 kept, at their places
    assert ev.main(["--config", str(cfg), "--models", "base", f"--data.map={keep}:odd_out",
                    "--eval.select=[0,11]", "--data.select=null", "--eval.limit=3",
                    "--overwrite"]) == 0
    assert [p["row"] for p in lines(tmp / "eval/predictions_base.jsonl")] == want[:3]


def test_a_reward_that_could_not_score_is_said_at_the_end_not_only_counted(project, capsys,
                                                                           monkeypatch):
    """A judge outage mid-eval gives the fallback; a line says how many, so it does not read as bad
    answers."""
    from rewards import REGISTRY
    def down(completions, samples):
        raise ConnectionError("judge down")
    monkeypatch.setitem(REGISTRY, "test_down_judge", (down, True))
    cfg, tmp = project
    assert ev.main(["--config", str(cfg), "--models", "base", "--eval.limit=2", "--overwrite",
                    "--rewards=[{name: test_down_judge, fallback: 0.0}, "
                    "{name: test_down_judge, fallback: skip}]"]) == 0
    err = capsys.readouterr().err
    assert ("[eval] base: reward test_down_judge could not score 2 completion(s), which got its "
            "fallback (0.0)") in err
    # was "fallback (?)"
    assert "reward test_down_judge#2 could not score 2 completion(s), which were left out of it" \
        in err


def test_an_api_reply_cut_at_max_tokens_is_reported_truncated_even_from_the_cache(project, server):
    """finish_reason "length" with some text: scored, but flagged (truncated_rate, the prediction's
    truncated), and the flag comes back with the cached reply on a rerun."""
    cfg, tmp = project
    cache = tmp / "api_cache.jsonl"
    server.script(Behaviour(text='{"predicted_category": "A", "conf', finish_reason="length"))
    args = ["--config", str(cfg), "--models", "api:fake-model", "--eval.limit=2",
            f"--eval.api.cache_path={cache}", "--eval.api.max_concurrent=1"]
    assert ev.main(args) == 0
    first = json.loads((tmp / "eval/results.json").read_text())["models"]["fake-model"]["metrics"]
    preds = [json.loads(x)
             for x in (tmp / "eval/predictions_fake-model.jsonl").read_text().splitlines()]
    assert first["truncated_rate"] == 0.5 \
        and [p.get("truncated", False) for p in preds] == [True, False]
    n_requests = len(server.requests)
    # all from the cache
    assert ev.main(args + ["--overwrite"]) == 0 and len(server.requests) == n_requests
    again = json.loads((tmp / "eval/results.json").read_text())["models"]["fake-model"]["metrics"]
    assert again["truncated_rate"] == 0.5


def test_held_out_rows_missing_a_field_stop_the_eval_or_with_skip_incomplete_are_counted_out(
        project, capsys):
    """BioReasoner's test file had 14 rows without a prompt; its eval scored the other 69. The
    default names the first such row and the setting; data.skip_incomplete leaves them out, counts
    them, and the predictions keep each row's place in the file (issue 29)."""
    cfg, tmp = project
    test = tmp / "test.jsonl"
    test.write_text("".join(json.dumps({"question": f"Test {i}", "answer": "A"} if i % 3 else
                                       {"answer": "A"}) + "\n" for i in range(7)))
    args = ["--config", str(cfg), "--models", "api:fake-model", f"--eval.name={test}",
            "--eval.select=null"]
    assert ev.main(args) == 2
    err = capsys.readouterr().err
    assert "row 0 has no field 'question'" in err and "data.skip_incomplete: true" in err
    assert ev.main([*args, "--data.skip_incomplete=true"]) == 0
    assert "data.skip_incomplete: left out 3 of the 7 rows" in capsys.readouterr().err
    preds = lines(tmp / "eval/predictions_fake-model.jsonl")
    assert [p["row"] for p in preds] == [1, 2, 4, 5]
    m = json.loads((tmp / "eval/results.json").read_text())["models"]["fake-model"]["metrics"]
    assert m["n"] == 4
