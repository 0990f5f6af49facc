"""sources/seen_prompts.py: a run records the prompts it trained on; eval.py and train.py find
held-out rows among them by content, across seeds, file names, SFT -> GRPO chains, resumes and
merged exports (helper-45's leakage audit found each of these passing unnoticed when only the
configs were compared)."""
import json

import eval as ev
import train
from conftest import write_run_config
from sources import seen_prompts
from tools import export


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def run(cfg, *overrides):
    assert train.main(["--config", str(cfg), "--run.steps=1", *overrides]) == 0


def evaluate(cfg, tmp_path, models, *overrides):
    out = tmp_path / "eval"
    assert ev.main(["--config", str(cfg), "--models", *models, f"--eval.out_dir={out}",
                    "--eval.max_new_tokens=2", "--overwrite", *overrides]) == 0
    return json.loads((out / "results.json").read_text())["models"]


def test_eval_counts_the_held_out_rows_a_run_trained_on_whatever_the_configs_say(
        tmp_path, tiny_llama, capsys):
    cfg = write_run_config(tmp_path, tiny_llama)
    # trained on rows [0, 8) in one shuffle; held out [8, 12) of another: the configs cannot tell
    # which rows meet
    run(cfg, "--data.select=[0,8]", "--data.split_seed=1", f"--run.out_dir={tmp_path / 'a'}")
    recorded = (tmp_path / "a" / seen_prompts.FILE).read_text().split()
    assert len(recorded) == 8 and recorded == sorted(recorded)
    held = ev.held_out_rows(ev.load_config(cfg, ["--eval.select=[8,12]", "--data.split_seed=2"]))
    want = seen_prompts.count(held, set(recorded))
    assert 0 < want < 4  # some of the four, by content
    models = evaluate(cfg, tmp_path, ["base", f"a={tmp_path / 'a'}"], "--eval.select=[8,12]",
                      "--data.split_seed=2")
    assert models["a"]["metrics"]["trained_on_held_out"] == want \
        and "trained_on_held_out" not in models["base"]["metrics"]
    assert f"a was trained on {want} of the 4 held-out prompts" in capsys.readouterr().err
    models = evaluate(cfg, tmp_path, [f"a={tmp_path / 'a'}"], "--eval.select=[8,12]",
                      "--data.split_seed=1")
    assert "trained_on_held_out" not in models["a"]["metrics"]  # the same shuffle: apart
    assert "trained on" not in capsys.readouterr().err


def test_a_chain_a_resume_and_a_merged_export_carry_what_was_trained_on(tmp_path, tiny_llama,
                                                                        capsys):
    cfg = write_run_config(tmp_path, tiny_llama, run={"save_every": 1})
    run(cfg, "--mode=sft", "--data.target=answer", "--data.select=[0,4]",
        f"--run.out_dir={tmp_path / 'sft'}")
    run(cfg, "--data.select=[4,6]", f"--model.init_adapter={tmp_path / 'sft'}",
        f"--run.out_dir={tmp_path / 'grpo'}")
    grpo = set((tmp_path / "grpo" / seen_prompts.FILE).read_text().split())
    assert grpo == set((tmp_path / "sft" / seen_prompts.FILE).read_text().split()) | {
        seen_prompts.prompt_hash(r)
        for r in ev.held_out_rows(ev.load_config(cfg, ["--eval.select=[4,6]"]))}
    # resumed with another data.select (of the same size): it has trained on both
    assert train.main(["--config", str(cfg), "--run.steps=2", "--resume", "--data.select=[6,8]",
                       f"--model.init_adapter={tmp_path / 'sft'}",
                       f"--run.out_dir={tmp_path / 'grpo'}"]) == 0
    assert len(set((tmp_path / "grpo" / seen_prompts.FILE).read_text().split())) == 8
    assert export.main(["--config", str(cfg), "--adapter", str(tmp_path / "grpo"), "--out",
                        str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / seen_prompts.FILE).read_text() == \
        (tmp_path / "grpo" / seen_prompts.FILE).read_text()
    models = evaluate(cfg, tmp_path, [f"merged={tmp_path / 'merged'}"], "--eval.select=[2,12]")
    # rows 2, 3 (SFT) and 4 to 7 (GRPO)
    assert models["merged"]["metrics"]["trained_on_held_out"] == 6
    # trained on from the merged model (model.name, as a pushed SFT phase is): its rows come along
    run(cfg, f"--model.name={tmp_path / 'merged'}", "--data.select=[8,10]",
        f"--run.out_dir={tmp_path / 'more'}")
    assert len(set((tmp_path / "more" / seen_prompts.FILE).read_text().split())) == 10
    # a checkpoint reached through a symlink is still its run's
    (tmp_path / "best").symlink_to(tmp_path / "grpo" / "checkpoints" / "step_000001")
    assert seen_prompts.recorded_file(tmp_path / "best" / "adapter") == \
        tmp_path / "grpo" / seen_prompts.FILE


def test_the_record_is_written_with_the_first_checkpoint_and_a_fresh_run_does_not_inherit_one(
        tmp_path, tiny_llama):
    cfg = write_run_config(tmp_path, tiny_llama)
    out = tmp_path / "r"
    out.mkdir()
    (out / seen_prompts.FILE).write_text("0123456789abcdef\n")  # left in a folder that holds no run
    assert train.main(["--config", str(cfg), "--run.steps=1", "--data.select=[0,3]", "--dry-run",
                       f"--run.out_dir={out}"]) == 0
    assert (out / seen_prompts.FILE).read_text() == "0123456789abcdef\n"  # a dry run writes nothing
    run(cfg, "--data.select=[0,3]", f"--run.out_dir={out}")
    assert "0123456789abcdef" not in (out / seen_prompts.FILE).read_text().split()
    assert len((out / seen_prompts.FILE).read_text().split()) == 3


def test_train_warns_when_its_held_out_rows_are_training_prompts(tmp_path, tiny_llama, capsys):
    cfg = write_run_config(tmp_path, tiny_llama)
    dup = tmp_path / "dup.jsonl"  # a question twice in the file: once on each side of the split
    dup.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n"
                           for q in ["a?", "b?", "c?", "a?"]))
    assert train.main(["--config", str(cfg), f"--data.name={dup}", "--data.prompt={question}",
                       "--data.select=[0,3]",
                       "--eval.select=[3,4]", "--run.eval_every=1", "--dry-run"]) == 0
    assert "1 of the 1 held-out rows have the prompt of a row this run" in capsys.readouterr().err
    assert train.main(["--config", str(cfg), f"--data.name={dup}", "--data.prompt={question}",
                       "--data.select=[0,2]",
                       "--eval.select=[2,3]", "--run.eval_every=1", "--dry-run"]) == 0
    assert "held-out rows have the prompt" not in capsys.readouterr().err


def test_a_pushed_export_s_record_comes_from_the_hub_and_offline_is_nothing(tmp_path, monkeypatch):
    import huggingface_hub

    from config import ModelConfig
    pushed = tmp_path / seen_prompts.FILE
    pushed.write_text("0123456789abcdef\n")
    asked = []

    def download(repo, filename, revision=None):
        asked.append((repo, filename, revision))
        return str(pushed)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert seen_prompts.seen_before(ModelConfig(name="me/medmcqa-sft", revision="v1")) == \
        {"0123456789abcdef"}
    assert asked == [("me/medmcqa-sft", seen_prompts.FILE, "v1")]

    def offline(*a, **k):
        raise OSError("no network")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert seen_prompts.seen_before(ModelConfig(name="me/medmcqa-sft")) == set()


def test_a_record_belongs_to_its_run_its_checkpoints_and_its_adapters_only(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002" / "adapter").mkdir(parents=True)
    (run / "exported").mkdir()
    (run / seen_prompts.FILE).write_text("0123456789abcdef\n")
    for found in (run, run / "checkpoints" / "step_000002",
                  run / "checkpoints" / "step_000002" / "adapter"):
        assert seen_prompts.recorded_file(found) == run / seen_prompts.FILE
    # a model kept in the run's folder is not the run
    assert seen_prompts.recorded_file(run / "exported") is None
    assert seen_prompts.recorded_file(tmp_path) is None
