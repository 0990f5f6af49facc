"""The recipes in configs/ run end to end on CPU: each for 2 steps on a tiny random model and its
fixture under tests/fixtures/, judges answered by the local fake OpenAI-compatible server. The
configs are used as shipped; only size, model, data location and endpoints are overridden."""
import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import yaml
from scipy.stats import spearmanr

import eval as ev
import train
from config import load_config
from data import load_rows
from fake_openai_server import FakeOpenAIServer
from graders import ratings
from rating_client import needs_page, page_client, rater

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures"


def small(tiny, out, steps=2):
    """Overrides that shrink a recipe to a CPU smoke run (no tracker: recipes name the seeds')."""
    return [f"--model.name={tiny}", "--model.gradient_checkpointing=false", "--run.report_to=none",
            "--rollout.prompts_per_step=2", "--rollout.num_generations=3",
            "--rollout.max_new_tokens=8", "--optim.micro_batch_size=4", f"--run.steps={steps}",
            f"--run.out_dir={out}", "--run.save_every=0",
            "--eval.max_new_tokens=8", "--eval.limit=3", f"--eval.out_dir={out}/eval"]


def metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def judge_overrides(server, cache):
    return [f"--judge.base_url={server.url}", f"--judge.cache_path={cache}",
            "--judge.api_key_env=MINIGRPO_NO_SUCH_KEY",
            "--judge.requests_per_minute=null", "--judge.max_retries=0"]


def judge_reply(body) -> str:
    """A deterministic fake judge: criteria for built-in templates, a varying score for rubrics."""
    text = body["messages"][-1]["content"]
    if "relevance" in text:
        return '{"relevance": 8, "clarity": 6, "discriminative_power": 7}'
    if "novelty" in text:
        return '{"logic": 4, "novelty": 3}'
    if "Rubric:" in text:
        answer = text.split("Answer to grade:")[1]
        return '{"score": %d}' % (len(answer) % 11)
    # an API model being evaluated
    return "How would you make a payment API idempotent under retries?"


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(reply=judge_reply) as s:
        yield s


def fake_tracker(monkeypatch, name: str) -> list:
    """A stand-in for wandb or trackio (init/log/finish), recording its calls."""
    import importlib.machinery
    import sys
    import types
    calls = []
    fake = types.ModuleType(name)
    fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda metrics, step: calls.append(("log", step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, name, fake)
    return calls


def test_medmcqa_sft_then_grpo_from_it_then_eval_of_base_sft_and_grpo(tmp_path, tiny_llama,
                                                                       monkeypatch):
    data = [f"--data.name={FIXTURES / 'medmcqa_sample.jsonl'}"]
    shipped = [Path(load_config(f"configs/medmcqa_{k}.yaml").run.out_dir).name
               for k in ("sft", "grpo")]
    # the seed's Trackio project and run names (the runs' folders)
    assert shipped == ["sft-qwen3-0.6b-800steps", "grpo-qwen3-0.6b-400steps"]
    sft, grpo = (tmp_path / name for name in shipped)
    calls = fake_tracker(monkeypatch, "trackio")
    assert train.main(["--config", "configs/medmcqa_sft.yaml", *small(tiny_llama, sft), *data,
                       "--data.select=[0,16]", "--eval.select=[32,40]", "--sft.batch_size=4",
                       "--run.report_to=trackio"]) == 0  # the recipe's own, small() turned off
    assert metrics(sft)[-1]["loss"] > 0
    init = calls[0][1]
    assert (init["project"], init["name"]) == ("medmcqa-classifier", "sft-qwen3-0.6b-800steps")
    assert [c[1] for c in calls if c[0] == "log"] == [1, 2]
    assert train.main(["--config", "configs/medmcqa_grpo.yaml", *small(tiny_llama, grpo), *data,
                       "--data.select=[16,32]", "--eval.select=[32,40]",
                       f"--model.init_adapter={sft}"]) == 0
    m = metrics(grpo)
    assert {"rewards/json_valid/mean", "rewards/json_schema/mean",
            "rewards/choice_accuracy/mean"} <= set(m[0])
    base = json.loads((grpo / "checkpoints/step_000002/adapter/minigrpo_base.json").read_text())
    assert str(sft) in json.dumps(base)  # the GRPO adapter records base + SFT as its base
    assert ev.main(["--config", "configs/medmcqa_grpo.yaml", "--models", "base", f"sft={sft}",
                    f"grpo={grpo}", f"--model.name={tiny_llama}", *data, "--data.select=[16,32]",
                    "--eval.select=[32,40]", "--eval.max_new_tokens=8", "--eval.limit=3",
                    f"--eval.out_dir={tmp_path / 'eval'}"]) == 0
    results = json.loads((tmp_path / "eval/results.json").read_text())
    for name in ("base", "sft", "grpo"):
        assert {"accuracy", "valid_json_rate", "schema_pass_rate", "accuracy_on_schema"} \
            <= set(results["models"][name]["metrics"])


def test_gsm8k_with_a_forced_think_prefix(tmp_path, tiny_llama):
    run = tmp_path / "run"
    assert train.main(["--config", "configs/gsm8k.yaml", *small(tiny_llama, run),
                       f"--data.name={FIXTURES / 'gsm8k_sample.jsonl'}", "--data.select=[0,30]",
                       "--eval.select=[30,40]", "--eval.split=null", "--run.sample_every=1"]) == 0
    m = metrics(run)
    assert {"rewards/answer_match/mean", "rewards/think_format/mean"} <= set(m[-1])
    prompts = [json.loads(ln)["prompt"] for ln in (run / "samples.jsonl").read_text().splitlines()]
    # the gold solution never reaches the prompt
    assert prompts and all("####" not in p for p in prompts)


@pytest.mark.parametrize("preset", ["open_only", "verifiable_only", "curriculum", "full_mix"])
def test_grubrics_presets_train_on_a_read_only_answer_cache(tmp_path, tiny_llama, server, preset):
    cache = tmp_path / "data_cache"
    cache.mkdir()
    for name in ("grubrics_open.jsonl", "grubrics_verifiable.jsonl"):
        shutil.copy(FIXTURES / name, cache / name)
        (cache / name).chmod(0o444)  # the trainer must not need to write the pre-computed answers
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in cache.iterdir()}
    run = tmp_path / "run"
    args = ["--config", "configs/grubrics.yaml", *small(tiny_llama, run, steps=3),
            f"--data.root={cache}", f"--data.preset={preset}", "--data.select=[0,16]",
            *judge_overrides(server, tmp_path / "judge.jsonl")]
    assert train.main(args) == 0
    m = metrics(run)
    assert all(x["reward_errors/rubric_alignment"] == 0 for x in m) and m[0]["judge_requests"] > 0
    assert any(x["rewards/rubric_alignment/mean"] != 0 for x in m)
    if preset in ("curriculum", "full_mix"):
        # both sources are drawn from (the shares' schedule: test_data.py)
        assert {"data/verifiable", "data/open"} <= set(m[0])
    after = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in cache.iterdir()}
    assert after == before and (tmp_path / "judge.jsonl").stat().st_size > 0
    # pointing the judge's cache at one of the run's data files is refused before anything runs
    data_file = cache / ("grubrics_verifiable.jsonl" if preset == "verifiable_only"
                         else "grubrics_open.jsonl")
    assert train.main([*args[:-len(judge_overrides(server, ''))],
                       *judge_overrides(server, data_file),
                       f"--run.out_dir={tmp_path / 'other'}"]) == 2


def test_grubrics_judge_and_answer_policy_follow_the_environment_openai_or_azure(server,
                                                                                 monkeypatch):
    """The seed's judge is read from its environment (AZURE_OPENAI_ENDPOINT, AZURE_OPENAI_API_KEY,
    JUDGE_MODEL): one config serves OpenAI or Azure with no flag (it took four, issue 46), and so do
    its answer policy and its baselines' API rubric writers (api:DEPLOYMENT on Azure)."""
    import dataclasses

    from api.client import Judge
    cfg = load_config("configs/grubrics.yaml")
    assert (cfg.run.report_to, cfg.run.project) == ("wandb", "grubrics")  # the seed's tracker
    # and the baselines' API rubric writers (api:MODEL): they took three --eval.api flags
    sections = {"judge": cfg.judge, "precompute.answers": cfg.precompute.answers,
                "eval.api": dataclasses.replace(cfg.eval.api, model="gpt-4o-mini")}
    for key, section in sections.items():  # nothing set: OpenAI's endpoint, key and model
        client = Judge(dataclasses.replace(section, cache_path=None), label=key)
        assert (client.cfg.azure_endpoint, client.cfg.base_url, client.cfg.api_key_env,
                client.cfg.model) == ("", "https://api.openai.com/v1", "OPENAI_API_KEY",
                                      "gpt-4o-mini"), key
    monkeypatch.setenv("AZURE_OPENAI_ENDPOINT", server.root)
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-SECRET-key")
    monkeypatch.setenv("JUDGE_MODEL", "grubrics-judge")
    monkeypatch.setenv("ANSWER_MODEL", "grubrics-answers")
    sections["eval.api"] = dataclasses.replace(sections["eval.api"], model="gpt-4.1-deployment")
    for key, deployment in (("judge", "grubrics-judge"), ("precompute.answers", "grubrics-answers"),
                            ("eval.api", "gpt-4.1-deployment")):
        client = Judge(dataclasses.replace(sections[key], cache_path=None, max_retries=0),
                       label=key)
        before = len(server.requests)
        assert client.complete_many([[{"role": "user", "content": f"Grade for {key}"}]])[0]
        req = server.requests[before]
        assert req.path == f"/openai/deployments/{deployment}/chat/completions"
        assert "api-version=2024-06-01" in req.query
        assert req.headers["api-key"] == "azure-SECRET-key"


def test_grubrics_sft_on_the_physicians_rubrics_then_grpo_from_it(tmp_path, tiny_llama, server):
    """grubrics_sft.yaml: HealthBench's rubrics, rewritten as the GRPO prompt asks (weights summing
    to 10), are the SFT target; grubrics.yaml's GRPO then starts from that adapter, merged."""
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    assert train.main(["--config", "configs/grubrics_sft.yaml", *small(tiny_llama, sft),
                       f"--data.root={FIXTURES}", "--data.name=healthbench_sample.jsonl",
                       "--data.select=[0,6]", "--sft.batch_size=2"]) == 0
    assert [m["loss"] > 0 for m in metrics(sft)] == [True, True]
    cfg = load_config(sft / "config.yaml")
    rows = load_rows(cfg.data)  # the sixth question has three criteria: left out by the map
    assert len(rows) == 5 and all(r["prompt"] == r["question"] for r in rows)
    assert rows[0]["target"].splitlines() == \
        ["1. (4 points) Recommends reducing salt intake",
         "2. (3 points) Recommends regular aerobic exercise",
         "3. (3 points) Suggests home blood pressure monitoring and follow-up with a doctor",
         "4. (costs 4 points) Claims supplements can replace medication"]
    cache = tmp_path / "data_cache"
    shutil.copytree(FIXTURES, cache, ignore=shutil.ignore_patterns("*.md"))
    assert train.main(["--config", "configs/grubrics.yaml", *small(tiny_llama, grpo),
                       f"--data.root={cache}", "--data.select=[0,6]", f"--model.init_adapter={sft}",
                       "--model.merge_init_adapter=true",
                       *judge_overrides(server, tmp_path / "judge.jsonl")]) == 0
    assert metrics(grpo)[-1]["reward_errors/rubric_alignment"] == 0
    base = json.loads((grpo / "checkpoints/step_000002/adapter/minigrpo_base.json").read_text())
    assert str(sft) in json.dumps(base)
    # the seed's baselines: base, SFT, GRPO and an API rubric writer, the same reward over held-out
    # questions of each source, in one table
    out = tmp_path / "eval"
    assert ev.main(["--config", "configs/grubrics.yaml", "--models", "base", f"sft={sft}",
                    f"grpo={grpo}", "api:rubric-writer", f"--model.name={tiny_llama}",
                    f"--data.root={cache}", "--data.preset=full_mix", "--data.select=[0,6]",
                    "--eval.select=[6,9]", "--eval.max_new_tokens=8", f"--eval.out_dir={out}",
                    f"--eval.api.base_url={server.url}", f"--eval.api.cache_path={out}/api.jsonl",
                    "--eval.api.api_key_env=MINIGRPO_NO_SUCH_KEY",
                    *judge_overrides(server, tmp_path / "judge.jsonl")]) == 0
    table = json.loads((out / "results.json").read_text())["models"]
    assert list(table) == ["base", "sft", "grpo", "rubric-writer"]
    for name, row in table.items():
        assert {"reward/rubric_alignment", "open/reward", "verifiable/reward"} \
            <= set(row["metrics"]) and row["metrics"]["n"] == 6, name


def test_bioreasoner_rules_and_judge_rewards(tmp_path, tiny_llama, server):
    data = [f"--data.name={FIXTURES / 'bioreasoner_sample.jsonl'}", "--data.select=[0,24]",
            "--eval.select=[24,30]", "--eval.name=null"]
    rules, judged = tmp_path / "rules", tmp_path / "judged"
    assert train.main(["--config", "configs/bioreasoner.yaml", *small(tiny_llama, rules),
                       *data]) == 0
    first = metrics(rules)[0]
    assert {"rewards/think_format/mean", "rewards/citation_grounding/mean",
            "rewards/hallucinated/mean"} <= set(first)
    # the tribunal's pass rate (issue 29): one minus the hallucination rate, as in its reports
    assert first["rewards/pass/mean"] == pytest.approx(1 - first["rewards/hallucinated/mean"])
    assert train.main(["--config", "configs/bioreasoner_judge.yaml", *small(tiny_llama, judged),
                       *data, *judge_overrides(server, tmp_path / "judge.jsonl")]) == 0
    m = metrics(judged)[0]
    # mean(logic 4, novelty 3) on a 0-5 scale
    assert m["rewards/judge/mean"] == pytest.approx(3.5 / 5)
    assert m["reward_errors/judge"] == 0


def weights_of(model_dir: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_bioreasoner_chain_sft_merge_dpo_merge_grpo(tmp_path, tiny_llama):
    """The original project's chain, each stage's config as shipped (it extends the one before):
    SFT on a teacher's replies, merged; DPO on the merged SFT model, merged; GRPO from that."""
    from tools import export
    rows = [json.loads(ln)
            for ln in (FIXTURES / "bioreasoner_sample.jsonl").read_text().splitlines()][:8]
    good = [f"<think>Both papers agree.</think> PMID: {r['valid_pmids'][0]}" for r in rows]
    teacher, pairs = tmp_path / "train_750.jsonl", tmp_path / "dpo_distillation_pairs.jsonl"
    teacher.write_text("".join(json.dumps({"prompt": r["prompt"], "response": g}) + "\n"
                               for r, g in zip(rows, good)))
    pairs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": g,
                                         "rejected": "<think>Unclear.</think> PMID: 12345678"})
                             + "\n" for r, g in zip(rows, good)))
    runs = {k: tmp_path / k for k in ("sft", "dpo", "v21", "grpo")}
    merged = {k: tmp_path / f"models/bioreasoner-{k}" for k in ("sft", "dpo", "v21")}
    assert train.main(["--config", "configs/bioreasoner_sft.yaml", *small(tiny_llama, runs["sft"]),
                       f"--data.name={teacher}", "--sft.batch_size=4"]) == 0
    assert metrics(runs["sft"])[-1]["loss"] > 0
    assert export.main(["--config", "configs/bioreasoner_sft.yaml", "--adapter", str(runs["sft"]),
                        "--out", str(merged["sft"]), f"--model.name={tiny_llama}"]) == 0
    assert train.main(["--config", "configs/bioreasoner_dpo.yaml", *small(merged["sft"],
                       runs["dpo"]), f"--data.name={pairs}", "--dpo.batch_size=4"]) == 0
    m = metrics(runs["dpo"])
    assert m[0]["loss"] == pytest.approx(0.6931, abs=1e-4) \
        and {"rewards/margins", "logps/chosen"} <= set(m[0])
    assert export.main(["--config", "configs/bioreasoner_dpo.yaml", "--adapter", str(runs["dpo"]),
                        "--out", str(merged["dpo"]), f"--model.name={merged['sft']}"]) == 0
    # each merge changed the weights it was given
    base, sft_w, dpo_w = (weights_of(d) for d in (tiny_llama, merged["sft"], merged["dpo"]))
    name = next(k for k in base if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert not torch.equal(base[name], sft_w[name]) and not torch.equal(sft_w[name], dpo_w[name])
    # stage 5, the v2.1 round, is a config of its own (it was seven flags on stage 3's)
    assert train.main(["--config", "configs/bioreasoner_dpo_v21.yaml",
                       *small(merged["dpo"], runs["v21"]), f"--data.name={pairs}",
                       "--dpo.batch_size=4"]) == 0
    saved = yaml.safe_load((runs["v21"] / "config.yaml").read_text())
    assert (saved["lora"]["r"], saved["optim"]["lr"], saved["mode"]) == (32, 2e-6, "dpo")
    assert export.main(["--config", "configs/bioreasoner_dpo_v21.yaml", "--adapter",
                        str(runs["v21"]), "--out", str(merged["v21"]),
                        f"--model.name={merged['dpo']}"]) == 0
    assert train.main(["--config", "configs/bioreasoner.yaml", *small(merged["v21"], runs["grpo"]),
                       f"--data.name={FIXTURES / 'bioreasoner_sample.jsonl'}"]) == 0
    assert "rewards/citation_grounding/mean" in metrics(runs["grpo"])[0]
    saved = yaml.safe_load((runs["grpo"] / "config.yaml").read_text())
    assert saved["mode"] == "grpo" and saved["model"]["name"] == str(merged["v21"])


def test_bioreasoner_dual_judge_trains_and_evaluates_with_two_judges_and_their_agreement(
        tmp_path, tiny_llama, server):
    """configs/bioreasoner_dual_judge.yaml: a second judge (its own server, cache and counters)
    scores the same completions; eval.py reports both judges' scores and agreement/* recomputed here
    from the predictions."""
    def varying(mult: int):  # scores that vary with the completion, a different way for each judge
        def reply(body) -> str:
            n = len(body["messages"][-1]["content"]) * mult
            return json.dumps({"logic": n % 6, "novelty": n // 6 % 6})
        return reply
    data = [f"--data.name={FIXTURES / 'bioreasoner_sample.jsonl'}", "--data.select=[0,24]",
            "--eval.select=[24,30]", "--eval.name=null"]
    run, out = tmp_path / "run", tmp_path / "eval"
    with FakeOpenAIServer(reply=varying(1)) as second, FakeOpenAIServer(reply=varying(5)) as first:
        judges = [*judge_overrides(server, tmp_path / "judge.jsonl"),
                  f"--judges.second.base_url={second.url}",
                  f"--judges.second.cache_path={tmp_path / 'second.jsonl'}",
                  "--judges.second.api_key_env=MINIGRPO_NO_SUCH_KEY",
                  "--judges.second.max_retries=0"]
        assert train.main(["--config", "configs/bioreasoner_dual_judge.yaml",
                           *small(tiny_llama, run), *data, *judges]) == 0
        m = metrics(run)[0]
        # the reward is still the first judge's
        assert m["rewards/judge/mean"] == pytest.approx(3.5 / 5)
        assert (m["rewards/logic/mean"], m["rewards/novelty/mean"]) == (4.0, 3.0)  # raw 0-5 scores
        assert "rewards/logic_second/mean" in m and m["reward_errors/logic_second"] == 0
        # the second judge is asked once per distinct completion (its novelty entry reads its cache)
        assert 0 < m["judges/second/requests"] <= 6 and m["judges/second/cache_hits"] >= 6
        assert m["judge_requests"] <= 6 \
            and len(second.requests) == metrics(run)[-1]["judges/second/requests_total"]
        # eval: a first judge whose scores vary too
        judges[:2] = judge_overrides(first, tmp_path / "first.jsonl")[:2]
        assert ev.main(["--config", "configs/bioreasoner_dual_judge.yaml", "--models", "base",
                        f"grpo={run}", f"--model.name={tiny_llama}", *data, *judges,
                        "--eval.max_new_tokens=8", "--eval.limit=6", f"--eval.out_dir={out}"]) == 0
    results = json.loads((out / "results.json").read_text())["models"]
    for name in ("base", "grpo"):
        got = results[name]["metrics"]
        preds = [json.loads(ln)["rewards"]
                 for ln in (out / f"predictions_{name}.jsonl").read_text().splitlines()]
        assert got["judges/second/failures"] == 0 and got["judge_failures"] == 0
        for crit in ("logic", "novelty"):
            a, b = [p[crit] for p in preds], [p[f"{crit}_second"] for p in preds]
            key = f"agreement/{crit}_vs_{crit}_second"
            assert got[f"reward/{crit}_second"] == pytest.approx(sum(b) / len(b))
            assert got[f"{key}/n"] == 6 and got[f"{key}/mean_abs_diff"] == pytest.approx(
                sum(abs(x - y) for x, y in zip(a, b)) / 6)
            rho = spearmanr(a, b).statistic if len(set(a)) > 1 and len(set(b)) > 1 else None
            assert got[f"{key}/spearman"] == (pytest.approx(rho) if rho is not None else None)


def test_question_generation_with_a_judge_then_eval_against_an_api_model(tmp_path, tiny_llama,
                                                                         server):
    run = tmp_path / "run"
    data = [f"--data.name={FIXTURES / 'backend_roles.json'}", "--data.select=[0,32]",
            "--eval.select=[32,40]"]
    judge = judge_overrides(server, tmp_path / "judge.jsonl")
    assert train.main(["--config", "configs/qgen.yaml", *small(tiny_llama, run), *data,
                       *judge]) == 0
    m = metrics(run)[0]
    assert m["rewards/judge/mean"] == pytest.approx(0.7)  # mean(8, 6, 7) / 10
    # the seed's eval metrics, on its 0-10 scale
    assert (m["rewards/composite/mean"], m["rewards/relevance/mean"], m["rewards/clarity/mean"],
            m["rewards/discriminative_power/mean"]) == pytest.approx((7.0, 8.0, 6.0, 7.0))
    # the per-criterion entries cost no requests
    assert m["judge_requests"] <= 6 and m["judge_cache_hits"] >= 24
    # the seed's comparison: its API models by its aliases (eval.apis), each with its own settings
    apis = [f"--eval.apis.{name}.{key}={value}"
            for name in ("grok-4-1", "claude-4-5-haiku", "gpt-5-mini")
            for key, value in (("base_url", server.url), ("api_key_env", "MINIGRPO_NO_SUCH_KEY"),
                               ("cache_path", tmp_path / f"{name}.jsonl"))]
    before = len(server.requests)
    assert ev.main(["--config", "configs/qgen.yaml", "--models", "base", f"grpo={run}",
                    "api:fake-model", "api:grok-4-1", "api:claude-4-5-haiku", "api:gpt-5-mini",
                    f"--model.name={tiny_llama}", *data, *judge, *apis,
                    f"--eval.api.base_url={server.url}",
                    "--eval.api.api_key_env=MINIGRPO_NO_SUCH_KEY", "--eval.max_new_tokens=8",
                    "--eval.limit=3", f"--eval.out_dir={tmp_path / 'eval'}"]) == 0
    results = json.loads((tmp_path / "eval/results.json").read_text())["models"]
    assert set(results) == {"base", "grpo", "fake-model", "grok-4-1", "claude-4-5-haiku",
                            "gpt-5-mini"}
    from test_judge import anthropic_objections
    asked = {r.body["model"]: r.body for r in server.requests[before:]}
    claude, gpt5 = asked["claude-haiku-4-5-20251001"], asked["gpt-5-mini-2025-08-07"]
    # the seed's grok-4-1 answered (the judge, the same model, asks at temperature 0)
    assert any(r.body["model"] == "grok-4-1-fast-non-reasoning" and r.body["temperature"] == 0.7
               for r in server.requests[before:])
    assert anthropic_objections(claude) == [] and claude["temperature"] == 0.7
    assert "temperature" not in gpt5 and "max_tokens" not in gpt5 \
        and gpt5["max_completion_tokens"] == 4096
    # as in training: the reward rescaled to 0-1, the seed's metrics on its 0-10
    got = results["fake-model"]["metrics"]
    assert got["reward/judge"] == pytest.approx(0.7) and got["reward/composite"] == pytest.approx(7)
    assert got["reward/clarity"] == pytest.approx(6.0)
    # the seed's last stage: the merged export, with what a server reads; it answers as the adapter
    from tools import export
    merged = tmp_path / "exports/qgen"
    assert export.main(["--config", "configs/qgen.yaml", "--adapter", str(run), "--out",
                        str(merged), "--dtype", "float32", f"--model.name={tiny_llama}"]) == 0
    assert export.serving_gaps(merged) == []
    assert ev.main(["--config", "configs/qgen.yaml", "--models", f"grpo={run}", f"merged={merged}",
                    f"--model.name={tiny_llama}", *data, *judge, "--eval.max_new_tokens=8",
                    "--eval.limit=3", f"--eval.out_dir={tmp_path / 'eval_export'}"]) == 0
    preds = {name: [json.loads(ln)["completion"] for ln in (
        tmp_path / f"eval_export/predictions_{name}.jsonl").read_text().splitlines()]
        for name in ("grpo", "merged")}
    assert len(preds["grpo"]) == 3 and preds["grpo"] == preds["merged"]


def test_question_generation_holds_50_of_the_500_roles_out_and_its_page_says_why():
    """36 steps, not the original's 40: the recipe trains on 450 roles and evaluates on the other 50
    (issue 46); --data.select=null trains on all 500 as the original did."""
    from run.lifecycle import with_epochs
    cfg = load_config(ROOT / "configs/qgen.yaml")
    assert (cfg.data.select, cfg.eval.select) == ([0, 450], [450, 500])
    assert with_epochs(cfg, 450).run.steps == 36
    everything = load_config(ROOT / "configs/qgen.yaml", ["--data.select=null"])
    assert everything.data.select is None and with_epochs(everything, 500).run.steps == 40
    page = (ROOT / "docs/recipes/qgen-judge.md").read_text()
    assert "450 of the 500 roles" in page and "--data.select=null" in page


def test_question_generation_rated_by_people_on_the_rating_page(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's ratings folder, runs/qgen_human/ratings, lands here
    # a broken page fails the test, not hangs it
    monkeypatch.setitem(ratings.human.__kwdefaults__, "timeout_s", 60.0)
    monkeypatch.setitem(ratings.human.__kwdefaults__, "poll_s", 0.05)  # 32 groups to wait for
    needs_page()
    ratings._STORES.clear()
    stop = threading.Event()
    rater(page_client("runs/qgen_human/ratings"),
          lambda c: {"relevance": "5", "clarity": "3", "discriminative_power": "4"}, stop)
    run = tmp_path / "run"
    data = [f"--data.name={FIXTURES / 'backend_roles.json'}", "--data.select=[0,32]",
            "--model.init_adapter=null"]
    # the shipped batch (16 roles x 4 questions), not small()'s: people rate 64 questions a step
    shipped = [a for a in small(tiny_llama, run) if not a.startswith(("--rollout.prompts_per_step",
                                                                      "--rollout.num_generations"))]
    try:
        assert train.main(["--config", str(ROOT / "configs/qgen_human.yaml"), *shipped,
                           *data]) == 0
    finally:
        stop.set()
        ratings._STORES.clear()
    for m in metrics(run):
        assert m["rewards/human/mean"] == pytest.approx(0.75)  # mean((5-1)/4, (3-1)/4, (4-1)/4)
        assert (m["rewards/relevance/mean"], m["rewards/clarity/mean"]) == pytest.approx((1.0, 0.5))
        assert m["reward_errors/human"] == 0
    rated = tmp_path / "runs/qgen_human/ratings/ratings.jsonl"
    # at most every completion of 2 steps, once
    assert 1 <= len(rated.read_text().splitlines()) <= 2 * 16 * 4
    # the seed's online batch read as qgen.yaml reads its offline one: 16 roles a step (SkyRL's
    # train_batch_size counts prompts), each role's 4 questions shown together
    queued = [json.loads(ln) for ln in (rated.parent / "queue.jsonl").read_text().splitlines()]
    groups: dict[int, list[dict]] = {}
    for q in queued:
        groups.setdefault(q["batch"], []).append(q)
    assert len(groups) == 2 * 16 and all(len(g) == 4 for g in groups.values())
    assert len({q["prompt"] for q in queued}) == 32  # data.select [0, 32]: each role once


def test_the_docs_bestofn_by_names_rewards_that_bioreasoner_judge_logs():
    """The docs' BioReasoner DPO round: tools/bestofn.py --by logic+novelty+think_format over
    eval.py's predictions from bioreasoner_judge.yaml (bioreasoner_dpo.yaml's commands), which
    logged no logic nor novelty: the command stopped with "--by logic: no prediction has a reward of
    that name"."""
    import re

    from config import load_config
    from rewards import reward_keys
    logged = set(reward_keys(load_config("configs/bioreasoner_judge.yaml").rewards))
    pages = [Path("docs/recipes/bioreasoner.md"), Path("docs/evaluation.md")]
    found = [by for page in pages for by in re.findall(r"`--by ([\w+]+)`", page.read_text())]
    # the page still gives the command: the test checks something
    assert "logic+novelty+think_format" in found
    for by in found:
        assert set(by.split("+")) <= logged, by


def test_bioreasoner_page_runs_the_chain_as_the_project_did_v20_then_v21_then_grpo():
    """The project's GRPO started from its merged v2.1 (SFT, DPO v2.0, DPO v2.1 on best-of-4 pairs
    "with 2+ score delta"), its tribunal decoded at temperature 0.7 up to 1,024 tokens, and a long
    prompt must not stop a 15k-prompt run."""
    import re
    page = (ROOT / "docs/recipes/bioreasoner.md").read_text()
    chain = page.split("```bash")[1].split("```")[0]
    outs = re.findall(r"--out (\S+)", chain)
    # the seed's model folders and pair files
    assert outs == ["models/bioreasoner-sft", "models/bioreasoner-2.0-merged",
                    "models/bioreasoner-2.1-merged"]
    assert "--config configs/bioreasoner_dpo_v21.yaml" in chain
    assert "--pairs data/dpo_v21_pairs.jsonl" in chain
    v21 = load_config(ROOT / "configs/bioreasoner_dpo_v21.yaml")
    assert (v21.model.name, v21.data.name, v21.lora.r, v21.lora.alpha, v21.optim.lr,
            v21.run.epochs, v21.dpo.beta) == (outs[1], "data/dpo_v21_pairs.jsonl", 32, 64, 2e-6,
                                              2, 0.1)
    assert load_config(ROOT / "configs/bioreasoner_dpo.yaml").data.name == \
        "data/dpo_distillation_pairs.jsonl"
    cfg = load_config(ROOT / "configs/bioreasoner.yaml")
    assert cfg.model.name == outs[-1] == "models/bioreasoner-2.1-merged" and cfg.data.skip_long
    assert (cfg.eval.temperature, cfg.eval.max_new_tokens, cfg.eval.num_samples) == (0.7, 1024, 1)
    # logic and novelty are logged raw, 0-5 each: the project's scale, so its delta is 2
    margins = re.findall(r"--by logic\+novelty\+think_format --min-margin (\S+)",
                         page + (ROOT / "configs/bioreasoner_dpo_v21.yaml").read_text())
    assert margins and set(margins) == {"2"}
    judge = load_config(ROOT / "configs/bioreasoner_judge.yaml")
    raw = [r for r in judge.rewards if r.label in ("logic", "novelty")]
    assert len(raw) == 2 and all(r.args["normalize"] is False for r in raw)
    assert (judge.judge.score_min, judge.judge.score_max) == (0, 5)


def test_bioreasoner_claude_judge_sends_what_anthropics_openai_compatible_endpoint_takes(
        tmp_path, server):
    """The seed's lead judge, Claude Opus, as a config beside the local ones: its requests (the
    fake server standing in for Anthropic) use none of the fields Anthropic's layer ignores."""
    import dataclasses

    from api.client import Judge
    from judge import judge_reward
    from test_judge import anthropic_objections
    cfg = load_config(ROOT / "configs/bioreasoner_claude_judge.yaml")
    section = cfg.judge
    assert (section.base_url, section.model, section.api_key_env) == (
        "https://api.anthropic.com/v1/", "claude-opus-4-5", "ANTHROPIC_API_KEY")
    assert (section.score_min, section.score_max) == (0, 5)  # the local judge's scale, extended
    client = Judge(dataclasses.replace(section, base_url=server.url, max_retries=0,
                                       cache_path=str(tmp_path / "claude.jsonl")))
    before = len(server.requests)
    scores = judge_reward(["<think>Both papers agree.</think> PMID: 99908795"],
                          [{"prompt": "Bridge these papers."}], judge=client,
                          template="logic_novelty")
    assert scores == [pytest.approx(3.5 / 5)]
    body = server.requests[before].body
    assert body["model"] == "claude-opus-4-5" and anthropic_objections(body) == []


def test_bioreasoner_search_looks_papers_up_and_is_scored_on_its_final_answer(
        tmp_path, tiny_llama, monkeypatch):
    """bioreasoner_search.yaml: the multi-turn version, a search tool over a local corpus."""
    from sources.plugins import import_function
    corpus = FIXTURES / "bioreasoner_corpus.jsonl"
    monkeypatch.setenv("BIOREASONER_CORPUS", str(corpus))
    search = import_function("configs/bioreasoner_search.py:search", what="tool")
    assert search("butyrate CD8 exhaustion").splitlines()[0].startswith("[PMID: 99908795] Butyrate")
    assert search("zebra quasar") == "no paper matches those words"
    pmids = tmp_path / "corpus_pmids.txt"
    pmids.write_text("".join(json.loads(ln)["pmid"] + "\n"
                             for ln in corpus.read_text().splitlines()))
    run, config = tmp_path / "run", tmp_path / "search.yaml"
    rewards = yaml.safe_load((ROOT / "configs/bioreasoner_search.yaml").read_text())["rewards"]
    for r in rewards:
        if "valid_file" in r.get("args", {}):
            r["args"]["valid_file"] = str(pmids)  # the corpus's ids
    config.write_text(yaml.safe_dump({"extends": str(ROOT / "configs/bioreasoner_search.yaml"),
                                      "rewards": rewards}))
    assert train.main(["--config", str(config), *small(tiny_llama, run),
                       f"--data.name={FIXTURES / 'bioreasoner_sample.jsonl'}",
                       "--data.select=[0,24]", "--eval.name=null", "--eval.select=[24,30]",
                       "--rollout.max_episode_tokens=64",
                       "--grpo.mask_truncated_completions=false"]) == 0
    m = metrics(run)[0]
    assert {"episodes/turns", "episodes/tool_calls", "rewards/citation_grounding/mean",
            "rewards/pass/mean"} <= set(m)


@pytest.mark.parametrize("page", ["medmcqa", "grubrics", "bioreasoner", "qgen-judge"])
def test_each_seed_page_says_where_your_own_models_system_prompt_goes(page, tmp_path):
    """The recipes' system prompts are this project's; an author starting from their own SFT or
    exported model passes the one it learned (issue 46): each page's config for that loads, and
    replaces the recipe's system prompt."""
    text = (ROOT / f"docs/recipes/{page}.md").read_text()
    assert "your own" in text.lower() and "system_prompt" in text
    block = next(b.split("```")[0] for b in text.split("```yaml\n")[1:]
                 if b.startswith("# configs/my_"))
    raw = yaml.safe_load(block)
    raw["extends"] = str(ROOT / "configs" / raw["extends"])
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg, recipe = load_config(path), load_config(raw["extends"])
    assert cfg.data.system_prompt.startswith("(") and cfg.data.system_prompt != \
        recipe.data.system_prompt
    assert cfg.run.out_dir == recipe.run.out_dir  # all else is the recipe's
