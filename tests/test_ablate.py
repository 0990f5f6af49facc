"""tools/ablate.py end to end on a tiny model (train.py and eval.py processes: a 2-arm x 2-seed
ablation, one run cut short and resumed, an arm that fails), and its statistics against scipy."""
import json
import os
import shutil

import pytest
from scipy import stats

from config import load_config
from conftest import write_run_config
from files.jsonl import append
from tools import ablate, ablate_report


def test_interval_matches_scipy_and_the_hand_worked_numbers():
    iv = ablate_report.interval([1.0, 2.0, 3.0, 4.0])
    assert iv["mean"] == 2.5 and iv["n"] == 4
    # 2.5 -+ t(0.975, 3) * sd / sqrt(4) = 2.5 -+ 3.1824 * 0.6455
    assert iv["ci"] == pytest.approx([0.4457, 4.5543], abs=1e-4)
    assert iv["ci"] == pytest.approx(stats.t.interval(0.95, 3, loc=2.5, scale=stats.sem([1, 2, 3,
                                                                                          4])))
    assert ablate_report.interval([0.7])["ci"] is None  # one seed: no interval
    assert ablate_report.interval([0.7, 0.7])["ci"] == [0.7, 0.7]  # no spread: the point


def test_paired_difference_matches_scipy_and_the_sentence_says_when_it_is_not_resolved():
    base, arm = [1.0, 2.0, 3.0, 4.0], [1.5, 2.1, 3.9, 4.2]  # differences 0.5, 0.1, 0.9, 0.2
    d = ablate_report.paired(arm, base)
    ci = stats.ttest_rel(arm, base).confidence_interval(0.95)
    assert d["mean"] == pytest.approx(0.425)
    assert d["ci"] == pytest.approx([ci.low, ci.high])
    assert d["ci"] == pytest.approx([-0.1469, 0.9969], abs=1e-4)  # 0.425 -+ 3.1824 * 0.1797
    assert ablate_report.sentence("none", "group", "heldout/accuracy", d) == (
        "none - group: +0.43 (95% CI -0.15 to +1.00) on held-out accuracy: not resolved at 4 seeds")
    clear = ablate_report.paired([1.5, 2.6, 3.55, 4.52], base)  # differences 0.5 to 0.6
    assert ablate_report.sentence("none", "group", "reward", clear).endswith(
        "on final-window train reward: none higher at 4 seeds")
    lower = ablate_report.paired([0.5, 1.4, 2.45, 3.48], base)
    assert ablate_report.sentence("b", "a", "reward", lower).endswith("b lower at 4 seeds")


def test_arms_parse_and_bad_input_is_one_line_naming_what_to_fix(tmp_path, tiny_llama, capsys):
    assert ablate.parse_arm("x: grpo.beta=0.04 --rollout.temperature=1").overrides == [
        "--grpo.beta=0.04", "--rollout.temperature=1"]
    cfg = write_run_config(tmp_path, tiny_llama)
    for arms, says in ((["a: grpo.beta=0", "b: grpo.nonsense=1"], "arm b: "),
                       (["a: grpo.beta=0"], "two or more --arm"),
                       (["a: grpo.beta=0", "a: grpo.beta=1"], "different names"),
                       (["a grpo.beta=0", "b: grpo.beta=1"], "NAME: section.key=value"),
                       (["a: beta", "b: grpo.beta=1"], "'beta' is not section.key=value"),
                       (["a: run.seed=3", "b: grpo.beta=1"], "sets run.out_dir and run.seed")):
        argv = ["--config", str(cfg), "--out", str(tmp_path / "out")]
        assert ablate.main(argv + [a for arm in arms for a in ("--arm", arm)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_cpu_runs_share_the_cores_and_a_gpu_runs_one_at_a_time(tmp_path, tiny_llama, monkeypatch):
    cfg = load_config(write_run_config(tmp_path, tiny_llama, run={"device": "cpu"}))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    # bench/two_runs_one_cpu/cpu_threads.log's pair of 1 thread
    assert ablate.placement(cfg, 4, 0) == (2, 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert ablate.placement(cfg, 4, 0) == (4, 4)
    assert ablate.placement(cfg, 8, 2) == (2, 8)
    cfg.run.device = "cuda"
    assert ablate.placement(cfg, 4, 0) == (1, 0)


def test_a_budget_too_short_starts_nothing_and_says_so(tmp_path, tiny_llama, capsys):
    cfg = write_run_config(tmp_path, tiny_llama)
    out = tmp_path / "out"
    assert ablate.main(["--config", str(cfg), "--arm", "a: grpo.beta=0", "--arm", "b: grpo.beta=0",
                        "--out", str(out), "--max-minutes", "0.01"]) == 1
    report = json.loads((out / "report.json").read_text())
    assert {r["status"] for r in report["runs"]} == {"not started"}
    assert "run the same command again to go on" in capsys.readouterr().err


def test_two_arms_two_seeds_resume_a_run_cut_short_and_report_a_failed_arm(tmp_path, tiny_llama):
    cfg = write_run_config(tmp_path, tiny_llama, run={"save_every": 1},
                           data={"select": [0, 8]}, eval={"select": [8, 12], "max_new_tokens": 8})
    out = tmp_path / "out"
    argv = ["--config", str(cfg), "--out", str(out), "--seeds", "2",
            "--arm", "group: grpo.scale_rewards=group", "--arm", "none: grpo.scale_rewards=none",
            "--arm", f"broken: data.name={tmp_path / 'missing.jsonl'}",  # fails in train.py
            "--set", "health.patience=1"]  # 8 new tokens: most completions truncated at once
    assert ablate.main(argv) == 1  # the broken arm failed; the others finished
    report = json.loads((out / "report.json").read_text())
    status = {(r["arm"], r["seed"]): (r["status"], r["exit_code"]) for r in report["runs"]}
    assert status == {("group", 0): ("finished", 0), ("group", 1): ("finished", 0),
                      ("none", 0): ("finished", 0), ("none", 1): ("finished", 0),
                      ("broken", 0): ("failed", 2), ("broken", 1): ("failed", 2)}
    assert report["arms_summary"]["group"]["reward"]["n"] == 2
    assert [d["arm"] for d in report["paired"] if d["metric"] == "reward"] == ["none"]
    # the first step of a seed samples the same completions in both arms
    first = {arm: [json.loads((out / arm / f"seed_{s}" / "metrics.jsonl").read_text()
                              .splitlines()[0])["reward"] for s in (0, 1)] for arm in ("group",
                                                                                          "none")}
    assert first["group"] == first["none"]

    # cut group/seed_1 back to its step-1 checkpoint, as a kill during step 2 leaves it
    cut = out / "group" / "seed_1"
    (cut / "ablate.json").unlink()
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("")
    append(cut / "metrics.jsonl", [json.loads(lines[0])])

    assert ablate.main(argv + ["--eval"]) == 1
    assert "resumed from" in (cut / "train.log").read_text()
    assert (out / "group" / "seed_0" / "train.log").read_text().count("\n$ ") == 1  # skipped
    report = json.loads((out / "report.json").read_text())
    assert {r["status"] for r in report["runs"] if r["arm"] != "broken"} == {"finished"}
    for arm in ("group", "none"):
        for seed in (0, 1):
            assert (out / arm / f"seed_{seed}" / "eval" / "results.json").is_file()
        assert any(k.startswith("heldout/") for k in report["arms_summary"][arm])
    md = (out / "report.md").read_text()
    assert "none - group: " in md and "at 2 seeds" in md
    assert "most completions truncated" in md  # each run's health lines
    assert (out / "plots" / "reward.png").is_file()
