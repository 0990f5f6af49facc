"""Data: splits identical to `datasets` shuffles, row maps, weighted mixtures and curricula, and
the sampler's resumable state."""
import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml

import train
from config import ConfigError, DataConfig, DataSource, load_config
from data import DataError, PromptSampler, check_not_data_file, load_rows, load_sources, split


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_split_picks_the_rows_of_a_datasets_shuffle_with_the_same_seed():
    datasets = pytest.importorskip("datasets")
    rows = [{"i": i} for i in range(300)]
    ds = datasets.Dataset.from_list(rows)
    for lo, hi in ([0, 100], [100, 150], [150, 170]):
        assert split(rows, 42, [lo, hi]) == ds.shuffle(seed=42).select(range(lo, hi)).to_list()
    # a hub Dataset is split the same way
    assert split(ds, 42, [10, 20]) == split(rows, 42, [10, 20])


MCQ = {"question": "Which vitamin is found only in animal foods?", "opa": "C", "opb": "B12",
       "opc": "K", "opd": "E", "cop": 1,
       "exp": "Vitamin B12 is made by bacteria and reaches people through animal products.  " * 10}


def test_medmcqa_json_map_builds_the_reply_to_learn_and_the_gold_letter(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [MCQ, {**MCQ, "cop": 3, "exp": None}])
    cfg = DataConfig(name=path, map="medmcqa_json", prompt="Q: {question}\nA) {opa}\nB) {opb}",
                     target="{target_json}", answer_key="answer_letter")
    first, second = load_rows(cfg)
    reply = json.loads(first["target"])
    assert first["answer_letter"] == "B" and reply["predicted_category"] == "B" \
        and reply["confidence"] == 0.95
    # whitespace folded, then cut
    assert len(reply["reason"]) == 250 and "  " not in reply["reason"]
    assert json.loads(second["target"])["reason"] == "The answer is D) E."
    assert first["prompt"].startswith("Q: Which vitamin")


def test_a_map_that_fails_names_the_row_and_nothing_else_loads(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [MCQ, {**MCQ, "cop": 7}])
    with pytest.raises(DataError,
                       match=r"data.map=medmcqa_json failed on row 1: ValueError: cop must be"):
        load_rows(DataConfig(name=path, map="medmcqa_json", prompt="question", answer_key=None))
    with pytest.raises(DataError, match="not a built-in map"):
        load_rows(DataConfig(name=path, map="medmcq_json", prompt="question", answer_key=None))


def test_a_map_from_a_users_file(tmp_path):
    (tmp_path / "maps.py").write_text("def shout(row):\n"
                                      "    return {**row, 'loud': row['question'].upper()}\n")
    path = write_jsonl(tmp_path / "m.jsonl", [MCQ])
    rows = load_rows(DataConfig(name=path, map=f"{tmp_path / 'maps.py'}:shout", prompt="{loud}",
                                answer_key=None))
    assert rows[0]["prompt"] == MCQ["question"].upper()


def test_a_map_that_returns_none_leaves_the_row_out_after_the_split(tmp_path, capsys):
    """A filter (rows too long, rows without gold): the split is taken first, so the held-out rows
    stay held out; it says how many it dropped, and dropping every row is an error."""
    (tmp_path / "maps.py").write_text("def short(row):\n    return row if row['i'] % 3 else None\n"
                                      "def none(row):\n    return None\n")
    path = write_jsonl(tmp_path / "m.jsonl", [{"i": i, "question": f"q{i}"} for i in range(30)])
    cfg = DataConfig(name=path, map=f"{tmp_path / 'maps.py'}:short", prompt="question",
                     answer_key=None, split_seed=42, select=[0, 20])
    kept = load_rows(cfg)
    picked = split([{"i": i} for i in range(30)], 42, [0, 20])
    assert [r["i"] for r in kept] == [r["i"] for r in picked if r["i"] % 3]
    assert f"left out {20 - len(kept)} of the 20 rows" in capsys.readouterr().err
    rows = [{"i": i, "question": f"q{i}", "answer": "" if i == 4 else "1"} for i in range(6)]
    with pytest.raises(DataError, match="row 4 has no"):
        # its place in the file, not among the rows kept
        load_rows(DataConfig(name=write_jsonl(tmp_path / "a.jsonl", rows),
                             map=f"{tmp_path / 'maps.py'}:short", prompt="question"))
    with pytest.raises(DataError, match="left out every one of the 20 rows"):
        load_rows(DataConfig(name=path, map=f"{tmp_path / 'maps.py'}:none", prompt="question",
                             answer_key=None, split_seed=42, select=[0, 20]))


def test_resuming_on_sources_of_other_sizes_is_refused():
    """The saved positions would draw other rows (a filtering map changed, say); old states without
    sizes still load."""
    s = PromptSampler([10], seed=0)
    s.draw(5)
    with pytest.raises(ConfigError, match=r"data sources of \[10\] rows, this config gives \[9\]"):
        PromptSampler([9], seed=0).load_state(s.state())
    t = PromptSampler([10], seed=0)
    t.load_state({"position": 5, "positions": [5]})
    assert t.draw(3) == s.draw(3)


def test_mixture_draws_by_weight_and_a_curriculum_moves_from_one_source_to_the_other():
    s = PromptSampler([10, 30], seed=3, weights=[(1.0, 0.0), (0.0, 1.0)])
    s.progress = 0.0
    assert all(i < 10 for i in s.draw(50))  # all from the first source at the start
    s.progress = 1.0
    assert all(i >= 10 for i in s.draw(50))  # all from the second at the end
    mixed = PromptSampler([10, 30], seed=3, weights=[(3.0, 3.0), (1.0, 1.0)])
    first = sum(i < 10 for i in mixed.draw(4000)) / 4000
    assert 0.72 < first < 0.78  # 3 : 1
    assert mixed.pop_counts() == [round(first * 4000), 4000 - round(first * 4000)] \
        and mixed.pop_counts() == [0, 0]


def test_each_source_is_drawn_epoch_by_epoch_and_the_state_resumes_exactly():
    s = PromptSampler([5, 7], seed=1, weights=[(1.0, 1.0), (1.0, 1.0)])
    draws = s.draw(60)
    a = [i for i in draws if i < 5][:5]
    assert sorted(a) == [0, 1, 2, 3, 4]  # a whole epoch of source 0 before any repeat
    t = PromptSampler([5, 7], seed=1, weights=[(1.0, 1.0), (1.0, 1.0)])
    t.draw(23)
    resumed = PromptSampler([5, 7], seed=1, weights=[(1.0, 1.0), (1.0, 1.0)])
    resumed.load_state(json.loads(json.dumps(t.state())))
    assert resumed.draw(37) == draws[23:]


def test_one_source_draws_as_before_and_old_checkpoints_load():
    s = PromptSampler([6], seed=0)
    draws = s.draw(14)
    assert sorted(draws[:6]) == list(range(6)) and sorted(draws[6:12]) == list(range(6))
    old = PromptSampler([6], seed=0)
    old.load_state(4)  # a checkpoint written before mixtures stored the position as an int
    assert old.draw(10) == draws[4:]
    with pytest.raises(ConfigError, match="2 data sources"):
        PromptSampler([6], seed=0).load_state({"position": 3, "positions": [1, 2]})


def mix_config(tmp_path, extra: dict) -> DataConfig:
    a = write_jsonl(tmp_path / "easy.jsonl", [{"q": f"a{i}", "answer": "1"} for i in range(6)])
    b = write_jsonl(tmp_path / "hard.jsonl", [{"q": f"b{i}", "answer": "2"} for i in range(4)])
    raw = {"data": {"prompt": "{q}", **extra}, "rewards": [{"name": "answer_match"}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw).replace("EASY", a).replace("HARD", b))
    return path


def test_presets_are_named_mixtures_chosen_on_the_command_line(tmp_path):
    path = mix_config(tmp_path, {"preset": "easy_only", "presets": {
        "easy_only": [{"name": "EASY"}],
        "curriculum": [{"name": "EASY", "weight": 1.0, "weight_end": 0.2},
                       {"name": "HARD", "weight": 0.0, "weight_end": 0.8, "label": "hard"}]}})
    cfg = load_config(path)
    assert [s.label for s in load_sources(cfg.data)] == ["easy"]
    cfg = load_config(path, ["--data.preset=curriculum"])
    sources = load_sources(cfg.data)
    assert [(s.label, len(s.rows), s.weight, s.weight_end) for s in sources] == \
        [("easy", 6, 1.0, 0.2), ("hard", 4, 0.0, 0.8)]
    assert isinstance(cfg.data.presets["curriculum"][1], DataSource)
    assert Counter(r["answer"] for r in load_rows(cfg.data)) == {"1": 6, "2": 4}
    # a file extending a preset config and reading one data file (grubrics_sft.yaml): presets unused
    cfg = load_config(path, ["--data.preset=null", f"--data.name={tmp_path / 'hard.jsonl'}"])
    assert [s.label for s in load_sources(cfg.data)] == ["hard"]


@pytest.mark.parametrize("extra, message", [
    ({"preset": "nope", "presets": {"a": [{"name": "EASY"}]}},
     "data.preset='nope' is not one of data.presets \\(a\\)"),
    ({"presets": {"a": [{"name": "EASY"}]}}, "choose one with data.preset"),
    ({"preset": "a", "presets": {"a": [{"name": "EASY", "wieght": 2}]}},
     "unknown config key 'data.presets.a\\[0\\].wieght'; did you mean"),
    ({"mixture": [{"name": "EASY"}], "name": "other.jsonl"}, "data.mixture replaces data.name"),
    ({"mixture": [{"name": "EASY", "weight": 0.0}]}, "weights sum to 0 at the first step"),
    ({"mixture": [{"name": "EASY", "weight": 1.0, "weight_end": -1.0}]}, "must be >= 0"),
    ({"mixture": [], "name": "arithmetic"}, "is empty"),
])
def test_bad_mixtures_are_one_line_errors_naming_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(mix_config(tmp_path, extra))


def test_the_judge_cache_may_not_be_a_data_file(tmp_path):
    cfg = load_config(mix_config(tmp_path, {"mixture": [{"name": "EASY"}, {"name": "HARD"}]}))
    check_not_data_file(cfg.data, str(tmp_path / "judge_cache.jsonl"), "judge.cache_path")
    with pytest.raises(DataError, match="judge.cache_path=.* is a data file"):
        check_not_data_file(cfg.data, str(tmp_path / "hard.jsonl"), "judge.cache_path")


def test_a_mixed_run_logs_source_shares_and_resumes_exactly(tmp_path, tiny_llama):
    path = mix_config(tmp_path, {"mixture": [{"name": "EASY", "weight": 1.0, "weight_end": 0.0},
                                             {"name": "HARD", "weight": 0.0, "weight_end": 1.0}]})
    args = ["--config", str(path), f"--model.name={tiny_llama}", "--lora.r=2",
            "--rollout.prompts_per_step=2", "--rollout.num_generations=2",
            "--rollout.max_new_tokens=4", f"--run.out_dir={tmp_path / 'run'}", "--run.steps=3",
            "--run.save_every=1", "--run.sample_every=1", "--run.samples_per_log=4",
            f"--rewards=[{{name: '{tmp_path / 'gold.py'}:gold'}}]"]
    (tmp_path / "gold.py").write_text("def gold(completion, sample):\n"
                                      "    return float(sample['answer'])\n")
    assert train.main(args) == 0
    lines = [json.loads(ln) for ln in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [(m["data/easy"], m["data/hard"]) for m in (lines[0], lines[-1])] == \
        [(1.0, 0.0), (0.0, 1.0)]
    # the curriculum itself, step by step
    assert [m["data/hard/weight"] for m in lines] == [0.0, 0.5, 1.0]
    # each source's reward: easy rows score 1, hard rows 2 (a source not drawn in a step has none)
    assert (lines[0]["data/easy/reward"], lines[-1]["data/hard/reward"]) == (1.0, 2.0)
    assert "data/hard/reward" not in lines[0] and "data/easy/reward" not in lines[-1]
    def drawn():  # the prompts each step trained on, and what it sampled
        return [(s["step"], s["prompt"], s["completion"])
                for s in map(json.loads, (tmp_path / "run/samples.jsonl").read_text().splitlines())]
    before = drawn()
    assert [s[1][0] for s in before] == ["a"] * 4 + [s[1][0] for s in before[4:8]] + ["b"] * 4
    shutil.rmtree(tmp_path / "run/checkpoints/step_000003")
    assert train.main(args + ["--resume"]) == 0
    assert drawn() == before


def test_relative_data_files_are_read_from_data_root(tmp_path):
    (tmp_path / "cache").mkdir()
    write_jsonl(tmp_path / "cache/easy.jsonl", [{"q": "a", "answer": "1"}])
    cfg = DataConfig(root=str(tmp_path / "cache"), mixture=[DataSource(name="easy.jsonl")],
                     prompt="{q}")
    assert load_rows(cfg)[0]["prompt"] == "a"
    with pytest.raises(DataError, match="is a data file"):
        check_not_data_file(cfg, str(tmp_path / "cache/easy.jsonl"), "judge.cache_path")
    # a paid-for file in a preset this run does not read is protected too
    cfg = DataConfig(root=str(tmp_path / "cache"),
                     presets={"open": [DataSource(name="open.jsonl")],
                              "paid": [DataSource(name="paid.jsonl")]}, preset="open")
    with pytest.raises(DataError, match="is a data file"):
        check_not_data_file(cfg, str(tmp_path / "cache/paid.jsonl"), "judge.cache_path")


def test_an_empty_or_missing_file_says_so_and_where_it_was_looked_for(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    for select in (None, [0, 8]):
        with pytest.raises(DataError, match="holds no rows"):
            load_rows(DataConfig(name=str(tmp_path / "empty.jsonl"), prompt="q", answer_key=None,
                                 select=select))
    with pytest.raises(DataError, match=f"no such file \\({tmp_path / 'cache' / 'gone.jsonl'}\\)"):
        load_rows(DataConfig(name="gone.jsonl", root=str(tmp_path / "cache"), prompt="q"))


def test_each_source_may_bring_its_own_range_and_column_adapter(tmp_path):
    (tmp_path / "adapt.py").write_text("def qa(row):\n"
                                       "    return {'q': row['question'], 'answer': row['gold']}\n")
    other = write_jsonl(tmp_path / "other.jsonl",
                        [{"question": f"c{i}", "gold": "3"} for i in range(10)])
    path = mix_config(tmp_path, {"mixture": [{"name": "EASY", "select": [0, 2]},
                                             {"name": other, "map": f"{tmp_path / 'adapt.py'}:qa",
                                              "select": [0, 4]}], "split_seed": 1})
    cfg = load_config(path)
    easy, adapted = load_sources(cfg.data)
    assert len(easy.rows) == 2 and len(adapted.rows) == 4 \
        and adapted.rows[0]["prompt"].startswith("c")
    held_out = load_sources(cfg.data, select=[4, 6])[1]  # eval.select replaces every source's range
    assert len(held_out.rows) == 2 \
        and {r["q"] for r in held_out.rows}.isdisjoint(r["q"] for r in adapted.rows)
    with pytest.raises(ConfigError,
                       match=r"data.mixture\[1\].select \[0, 4\] and eval.select \[3, 6\] overlap"):
        load_config(path, ["--eval.select=[3,6]"])


def test_a_list_column_reads_as_a_comma_separated_list_in_a_template(tmp_path):
    write_jsonl(tmp_path / "roles.jsonl", [{"role": "backend", "skills": ["Go", "Postgres"]}])
    (row,) = load_rows(DataConfig(name=str(tmp_path / "roles.jsonl"),
                                  prompt="A {role} role: {skills}; first {skills[0]}",
                                  answer_key=None))
    assert row["prompt"] == "A backend role: Go, Postgres; first Go" \
        and row["skills"] == ["Go", "Postgres"]


def test_a_json_file_holding_one_object_reads_the_rows_under_its_one_list(tmp_path):
    f = tmp_path / "roles.json"
    f.write_text(json.dumps({"version": 2, "roles": [{"q": "a"}, {"q": "b"}]}, indent=1))
    assert [r["prompt"]
            for r in load_rows(DataConfig(name=str(f), prompt="q", answer_key=None))] == ["a", "b"]
    f.write_text(json.dumps({"a": [{"q": "a"}], "b": [{"q": "b"}]}, indent=1))
    with pytest.raises(DataError,
                       match=r"holds one JSON object with several lists of rows \(a, b\)"):
        load_rows(DataConfig(name=str(f), prompt="q", answer_key=None))
    # JSON lines named .json
    f.write_text(json.dumps({"q": "a"}) + "\n" + json.dumps({"q": "b"}) + "\n")
    assert len(load_rows(DataConfig(name=str(f), prompt="q", answer_key=None))) == 2
    # one row, one line
    f.write_text(json.dumps({"q": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert load_rows(DataConfig(name=str(f), prompt="q",
                                answer_key=None))[0]["messages"][0]["content"] == "hi"
    f.write_text(json.dumps({"data": [{"q": "a"}, {"q": "b"}]}))  # json.dump's default: one line
    assert [r["prompt"]
            for r in load_rows(DataConfig(name=str(f), prompt="q", answer_key=None))] == ["a", "b"]


def test_an_unreachable_hub_is_used_offline_at_once(monkeypatch):
    """No network: one DNS lookup decides, and hub calls use the local cache instead of retrying for
    ~25 s per file (a dataset id that is not cached fails at once, with one line)."""
    import time

    import datasets.config
    import huggingface_hub.constants as hub_constants

    from sources import hub
    monkeypatch.setattr(hub, "reachable", lambda endpoint: False)
    with hub.offline_if_unreachable():
        assert hub_constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert not hub_constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE  # restored
    t0 = time.monotonic()
    with pytest.raises(DataError,
                       match="could not load hub dataset data.name=minigrpo-test/no-such-dataset"):
        load_rows(DataConfig(name="minigrpo-test/no-such-dataset", prompt="q"))
    assert time.monotonic() - t0 < 10


def test_hub_errors_keep_the_configs_to_pick_from_and_say_what_to_do_offline(monkeypatch):
    """datasets puts the list of configs on its error's second line; an exception without a message
    is named, not an IndexError; a dataset missing from the cache of a machine without a network
    says how to bring it over."""
    import datasets

    from sources import hub
    monkeypatch.setattr(hub, "reachable", lambda endpoint: True)
    raised = [ValueError("Config name is missing.\nPlease pick one among the available configs: "
                         "['main', 'socratic']\nExample: ..."), ValueError()]
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: (_ for _ in ()).throw(raised.pop(0)))
    with pytest.raises(DataError, match=r"openai/gsm8k \(split train\): Config name is missing. "
                                        r"Please pick one among the available configs: "
                                        r"\['main', 'socratic'\]$"):
        load_rows(DataConfig(name="openai/gsm8k", prompt="q"))
    with pytest.raises(DataError, match=r"\(config main, split test\): ValueError$"):
        load_rows(DataConfig(name="openai/gsm8k", config_name="main", split="test", prompt="q"))
    monkeypatch.setattr(hub, "reachable", lambda endpoint: False)
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: (_ for _ in ()).throw(ConnectionError("Couldn't reach")))
    with pytest.raises(DataError, match=r"cannot be reached from this machine and openai/gsm8k is "
                                        r"not in its cache: download it .*\(hf download "
                                        r"openai/gsm8k --repo-type dataset --local-dir DIR\)"):
        load_rows(DataConfig(name="openai/gsm8k", prompt="q"))
    monkeypatch.setattr(
        datasets, "load_dataset",
        lambda *a, **k: (_ for _ in ()).throw(ValueError('Unknown split "validation".')))
    with pytest.raises(DataError, match=r'Unknown split "validation"'):
        # cached, offline, a wrong split: that is the error
        load_rows(DataConfig(name="openai/gsm8k", split="validation", prompt="q"))


def test_a_proxy_makes_the_hub_count_as_reachable(monkeypatch):
    from sources import hub
    monkeypatch.setattr(hub.socket, "getaddrinfo",
                        lambda *a: (_ for _ in ()).throw(OSError("no DNS")))
    hub.reachable.cache_clear()
    try:
        for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(k, raising=False)
        assert not hub.reachable("https://hf.example")
        hub.reachable.cache_clear()
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
        assert hub.reachable("https://hf.example")
    finally:
        hub.reachable.cache_clear()


def test_a_downloaded_dataset_folder_loads_by_path_and_a_revision_reaches_load_dataset(
        tmp_path, monkeypatch):
    """`hf download --repo-type dataset X --local-dir ./x` leaves a folder: ./x, /abs/x and
    data.root/x all load it (before, a path starting with . or / was "no such file")."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "ds" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"q": ["a", "b", "c"]}),
                   tmp_path / "ds" / "data" / "test-00000-of-00001.parquet")
    monkeypatch.chdir(tmp_path)
    for name, root in (("./ds", None), (str(tmp_path / "ds"), None), ("ds", str(tmp_path))):
        rows = load_rows(DataConfig(name=name, root=root, split="test", prompt="q",
                                    answer_key=None))
        assert [r["prompt"] for r in rows] == ["a", "b", "c"]
    with pytest.raises(DataError, match=r"\(split train\): Unknown split \"train\""):
        # the folder's own error
        load_rows(DataConfig(name="./ds", prompt="q", answer_key=None))
    import datasets
    seen = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: seen.append((a, k)) or [{"q": "x"}])
    load_rows(DataConfig(name="org/set", config_name="main", revision="abc123", prompt="q",
                         answer_key=None))
    load_rows(DataConfig(name=None, mixture=[DataSource(name="org/two", revision="def456")],
                         prompt="q", answer_key=None))
    assert seen == [(("org/set", "main"), {"split": "train", "revision": "abc123"}),
                    (("org/two", None), {"split": "train", "revision": "def456"})]


def test_precompute_and_eval_name_pick_a_hub_config_of_their_own(monkeypatch):
    """precompute.config_name reaches load_dataset (GSM8K has no default config); eval.name's config
    is eval.config_name, else data.config_name's ("default" names a dataset without configs)."""
    import datasets

    import eval as ev
    from config import Config, EvalConfig, PrecomputeConfig
    from tools import precompute
    seen = []
    monkeypatch.setattr(
        datasets, "load_dataset",
        lambda *a, **k: seen.append((a, k["split"])
                                    + ((k["revision"],) if k.get("revision") else ()))
        or [{"question": "x", "answer": "1"}])
    precompute.load_questions(PrecomputeConfig(questions="openai/gsm8k", config_name="main",
                                               split="test", question="{question}",
                                               gold_reward={"name": "answer_match"}))
    # the training set's commit
    data = DataConfig(name="openai/gsm8k", config_name="main", revision="abc123", prompt="question")
    ev.held_out_rows(Config(data=data, eval=EvalConfig(name="HuggingFaceH4/MATH-500",
                                                       config_name="default", split="test")))
    ev.held_out_rows(Config(data=data, eval=EvalConfig(name="openai/gsm8k", split="test")))
    assert seen == [(("openai/gsm8k", "main"), "test"),
                    (("HuggingFaceH4/MATH-500", "default"), "test"),
                    (("openai/gsm8k", "main"), "test")]
    with pytest.raises(ConfigError,
                       match="data.revision does not apply to data.mixture: set it on each source"):
        load_config(None,
                    ["--data.name=null", "--data.mixture=[{name: a.jsonl}]", "--data.revision=abc"])


def test_medmcqa_s_unanswered_test_split_says_so():
    from sources.maps import medmcqa_json
    with pytest.raises(ValueError, match="test split has no answers"):
        medmcqa_json({"question": "q", "opa": "a", "opb": "b", "opc": "c", "opd": "d", "cop": -1,
                      "exp": ""})


def test_files_that_cannot_be_read_as_their_suffix_are_one_line_errors(tmp_path):
    """Latin-1 JSON Lines, a .parquet that is not Parquet: DataError naming the file, not a
    traceback; a CSV saved by Excel (a byte-order mark before the first column's name) reads its
    columns."""
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"question": "caf\u00e9"}\n'.encode("latin-1"))
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    for path, message in ((latin, "is not UTF-8 text"),
                          (fake, "cannot read it as parquet (ArrowInvalid")):
        with pytest.raises(DataError, match=message.replace("(", r"\(")):
            load_rows(DataConfig(name=str(path), prompt="{question}", answer_key=None))
    excel = tmp_path / "excel.csv"
    excel.write_bytes("\ufeffquestion,answer\nWhat is 1 + 1?,2\n".encode("utf-8"))
    assert load_rows(DataConfig(name=str(excel), prompt="question"))[0]["prompt"] == \
        "What is 1 + 1?"


@pytest.mark.parametrize("row,prompt,message", [
    ({"question": [0, "x"]}, "question",
     'the prompt is list, neither text nor a conversation .* template: "{question}"'),
    ({"question": {"a": 1}}, "question", "the prompt is dict, neither text nor a conversation"),
    ({"question": "hi"}, "{question.upper}", "reads an attribute"),
])
def test_a_prompt_that_is_not_text_or_a_conversation_is_one_line(tmp_path, row, prompt, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_rows(DataConfig(name=str(path), prompt=prompt, answer_key=None))


def test_a_conversation_whose_content_is_a_list_of_parts_is_a_prompt(tmp_path):
    path = tmp_path / "d.jsonl"
    conv = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}]
    path.write_text(json.dumps({"prompt": conv}) + "\n")
    assert load_rows(DataConfig(name=str(path), prompt="prompt",
                                answer_key=None))[0]["prompt"] == conv


def test_a_split_of_a_local_file_is_refused_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="data.split='test' picks a split of a hub dataset"):
        load_config(None, ["--data.name=tests/fixtures/gsm8k_sample.jsonl", "--data.split=test",
                           "--rewards=[{name: answer_match}]"])
    # a source's too (it was ignored)
    with pytest.raises(ConfigError, match=r"data.mixture\[1\].split='test' picks a split of a hub "
                                          r"dataset; data.mixture\[1\].name=b.jsonl has none"):
        load_config(None, ["--data.name=null",
                           "--data.mixture=[{name: a.jsonl}, {name: b.jsonl, split: test}]"])


def test_chat_rows_whose_prompt_ends_with_the_gold_reply_are_refused_for_grpo_and_eval(
        tmp_path, capsys):
    """TRL's SFT rows (`messages` ending with the assistant's answer) reused for GRPO or eval with
    data.target unset: the prompt held the answer, and the model copied it (a 3/3 reward,
    silently)."""
    turns = [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "Q1"},
             {"role": "assistant", "content": '{"predicted_category": "B"}'}]
    data = tmp_path / "mcq.jsonl"
    data.write_text(json.dumps({"messages": turns, "cop": "B"}) + "\n")
    with pytest.raises(DataError, match=r"row 0: data.prompt=messages ends with the assistant's "
                                        r"reply.*set data.target: messages"):
        load_rows(DataConfig(name=str(data), prompt="messages", answer_key="cop"))
    (row,) = load_rows(DataConfig(name=str(data), prompt="messages", target="messages",
                                  answer_key="cop"))
    assert row["prompt"] == turns[:2] and row["target"] == '{"predicted_category": "B"}'
    # in a mixture data.target would split every source: the advice is the source's own
    other = tmp_path / "open.jsonl"
    other.write_text(json.dumps({"messages": turns[1:2], "cop": "A"}) + "\n")
    mix = [DataSource(name=str(data)), DataSource(name=str(other))]
    with pytest.raises(DataError, match=r"data source 'mcq': row 0: .*give this source map: "
                                        r"split_messages and prompt: prompt"):
        load_rows(DataConfig(name=None, mixture=mix, prompt="messages", answer_key="cop"))
    with pytest.raises(DataError, match=r"prompt: prompt .*; and data.answer_key: null, since its "
                                        r"rows have no 'answer'"):
        # the default answer_key: said, not a second error
        load_rows(DataConfig(name=None, mixture=mix, prompt="messages"))
    with pytest.raises(DataError, match="split_messages") as err:
        # the column split_messages makes: no hint to clear it
        load_rows(DataConfig(name=None, mixture=mix, prompt="messages", answer_key="completion"))
    assert "data.answer_key: null" not in str(err.value)
    mix[0] = DataSource(name=str(data), map="split_messages", prompt="prompt")
    rows = load_rows(DataConfig(name=None, mixture=mix, prompt="messages", answer_key="cop"))
    assert [r["prompt"] for r in rows] == [turns[:2], turns[1:2]] \
        and rows[0]["completion"] == '{"predicted_category": "B"}'
    with data.open("a") as f:
        # a row without a reply: left out by the map, and said with the source's own keys
        f.write(json.dumps({"messages": turns[:2], "cop": "C"}) + "\n")
    assert len(load_rows(DataConfig(name=None, mixture=mix, prompt="messages",
                                    answer_key="cop"))) == 2
    assert "data.mixture[0].map=split_messages left out 1 of the 2 rows of data.mixture[0].name=" \
        in capsys.readouterr().err
    # prompt-only rows: as they were
    data.write_text(json.dumps({"messages": turns[:2], "cop": "B"}) + "\n")
    assert load_rows(DataConfig(name=str(data), prompt="messages",
                                answer_key="cop"))[0]["prompt"] == turns[:2]


def test_group_by_turns_a_cache_of_one_answer_a_row_into_one_question_a_row():
    """GRubrics' cache may hold one answer a row (appended answer by answer, questions
    interleaved): data.group_by regroups them into rubric_alignment's answers and gold_scores, the
    same rows as the one-question-a-row fixture, before the splits pick questions."""
    fixtures = Path(__file__).parent / "fixtures"
    whole = [json.loads(ln) for ln in (fixtures / "grubrics_open.jsonl").read_text().splitlines()]
    cfg = DataConfig(name=str(fixtures / "grubrics_open_one_answer_a_row.jsonl"),
                     prompt="{question}", answer_key=None, group_by="id",
                     group_lists={"answers": "answer", "gold_scores": "gold_score"})
    rows = load_rows(cfg)
    assert len(rows) == len(whole) == 20
    assert [(r["question"], r["answers"], r["gold_scores"]) for r in rows] == \
        [(w["question"], w["answers"], w["gold_scores"]) for w in whole]
    # select picks questions, not answers
    assert len(load_rows(dataclasses.replace(cfg, split_seed=0, select=[0, 5]))) == 5
    with pytest.raises(DataError, match="data.group_by: row 0 of .* has no field 'score'"):
        load_rows(dataclasses.replace(cfg, group_lists={"gold_scores": "score"}))
    with pytest.raises(DataError, match="give data.group_lists"):
        load_rows(dataclasses.replace(cfg, group_lists={}))
