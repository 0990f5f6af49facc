"""tools/ablate.py end to end on a tiny model (train.py and eval.py processes: a 2-arm x 2-seed
ablation, one run cut short and resumed, an arm that fails), and its statistics against scipy."""
import json
import math
import os
import shutil

import numpy as np
import pytest
from scipy import stats

from config import load_config
from conftest import write_run_config
from files.jsonl import append
from tools import ablate, ablate_plan, ablate_report


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


def test_a_runs_numbers_are_its_final_window_and_its_mean_over_all_steps(tmp_path):
    """Two runs that both reach the ceiling differ in the final window by nothing and over all
    steps by how fast they got there."""
    runs = {"fast": [0.5, 1.5, 1.5, 1.5, 1.5], "slow": [0.0, 0.5, 1.0, 1.5, 1.5]}
    for name, rewards in runs.items():
        (tmp_path / name).mkdir()
        append(tmp_path / name / "metrics.jsonl",
               [{"step": step, "reward": r, "step_time": 2.0} for step, r in enumerate(rewards, 1)])
    fast, slow = (ablate_report.run_metrics(tmp_path / n) for n in ("fast", "slow"))
    assert fast["reward"] == slow["reward"] == 1.5  # the last 20% of 5 steps: one step
    assert fast["reward_all_steps"] == pytest.approx(1.3)
    assert slow["reward_all_steps"] == pytest.approx(0.9)
    assert ablate_report.label("reward_all_steps") == "train reward over all steps"


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


def test_two_arms_two_seeds_resume_a_run_cut_short_and_report_a_failed_arm(tmp_path, tiny_llama,
                                                                          capsys):
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
    # equal compute: reward by generated tokens beside reward by step, and at the same tokens
    assert (out / "plots" / "reward_by_tokens.png").is_file()
    assert "![reward](plots/reward.png) ![reward by generated tokens](plots/reward_by_tokens.png)" \
        in md and "reward_at_equal_tokens" in report["arms_summary"]["group"]
    # the planner, on the finished pilot (nothing runs again): seeds and hours for each difference
    held = next(k for k in report["arms_summary"]["group"] if k.startswith("heldout/"))
    capsys.readouterr()
    assert ablate.main(argv + ["--eval", "--plan", "reward=0.1", f"{held}=0.05"]) == 1
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and said[0].startswith(
        "none - group on final-window train reward: to detect 0.1 at 80% power")
    plan = json.loads((out / "report.json").read_text())["plan"]
    assert {p["metric"] for p in plan} == {"reward", held}
    assert all(p["pilot_seeds"] == 2 and (p["seeds"] is None or p["seeds"] >= 2) for p in plan)
    assert "## Seeds needed (--plan)" in (out / "report.md").read_text()
    assert (out / "group" / "seed_1" / "train.log").read_text().count("\n$ ") == 2  # not rerun


def test_the_planners_power_is_the_textbooks_and_a_simulations():
    """The paired t-test's power from the noncentral t against G*Power's table (d_z = delta / sd of
    0.5, 0.8, 1: 34, 15, 10 pairs at 80%) and against simulated paired normal data run through the
    report's own test (scipy.stats.ttest_rel), whose rejection rate is the power."""
    assert [ablate_plan.seeds_needed(d, 1.0) for d in (0.5, 0.8, 1.0)] == [34, 15, 10]
    assert ablate_plan.power(10, 1.0, 1.0) == pytest.approx(0.8031, abs=1e-4)
    rng = np.random.default_rng(0)
    for n, delta, sd in ((4, 0.3, 0.2), (6, 0.1, 0.15), (10, 0.05, 0.1)):
        base = rng.normal(0.5, 0.3, size=(4000, n))  # the baseline's seed-to-seed spread cancels
        arm = base + rng.normal(delta, sd, size=(4000, n))
        rejected = stats.ttest_rel(arm, base, axis=1).pvalue < 0.05
        assert rejected.mean() == pytest.approx(ablate_plan.power(n, delta, sd), abs=0.025)
    assert ablate_plan.seeds_needed(0.0, 1.0) is None and ablate_plan.power(1, 1.0, 1.0) == 0.0
    # a difference far past the spread (d_z 5.4 at 4 seeds: scipy's nct.cdf gave nan), either sign
    assert 0.99 < ablate_plan.power(4, 0.1, 0.0184) == ablate_plan.power(4, -0.1, 0.0184) <= 1


def test_the_plan_from_a_synthetic_pilot_is_the_closed_form_answer_and_its_time():
    """A 3-seed pilot whose differences have sd 0.1: to detect 0.1 (d_z = 1) takes 10 seeds; at the
    spread's 80% upper bound (chi-square, 2 degrees of freedom) more; 2 arms, 2 runs at a time of
    30 minutes each: 10 x 2 / 2 x 0.5 h = 5 h. A simulated ablation at the planned seeds rejects
    about 80% of the time, at one seed fewer less."""
    diffs = [{"arm": "b", "baseline": "a", "metric": "heldout/accuracy", "mean": 0.02,
              "values": [0.0, 0.1, 0.2]}]  # sd 0.1
    (row,) = ablate_plan.plan(diffs, {"heldout/accuracy": 0.1}, 1800.0, 2, 2)
    assert row["sd"] == pytest.approx(0.1) and row["seeds"] == 10 and row["hours"] == 5.0
    upper = 0.1 * math.sqrt(2 / stats.chi2.ppf(0.2, 2))
    assert row["seeds_upper"] == ablate_plan.seeds_needed(0.1, upper) > 10
    (default,) = ablate_plan.plan(diffs, {}, 0.0, 2, 2)  # the pilot's own difference, no pace
    assert default["delta"] == 0.02 and default["hours"] is None
    rng = np.random.default_rng(1)
    rate = {n: (stats.ttest_rel(rng.normal(0.1, 0.1, size=(4000, n)), np.zeros((4000, n)),
                                axis=1).pvalue < 0.05).mean() for n in (9, 10)}
    assert rate[10] >= 0.78 and rate[9] < 0.8
    line = ablate_plan.lines([row], ablate_report.label)[0]
    assert line.startswith("b - a on held-out accuracy: to detect 0.1 at 80% power") \
        and "10 seeds, about 5.0 h at the pilot's pace" in line


def test_a_bad_plan_item_is_one_line(tmp_path, tiny_llama, capsys):
    cfg = write_run_config(tmp_path, tiny_llama)
    assert ablate.main(["--config", str(cfg), "--arm", "a: grpo.beta=0", "--arm", "b: grpo.beta=0",
                        "--out", str(tmp_path / "out"), "--plan", "reward=big"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --plan 'reward=big': write METRIC=DIFF") and "\n" not in err
