"""plots.py: one PNG per metric from hand-written metrics.jsonl files (one of them torn by a kill)
and from an eval results.json; without matplotlib, one line saying how to install it and exit code
2."""
import json
import sys

import pytest

from tools import plots

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path, steps, torn=False):
    path.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 0.1 / s, "reward": 0.5 + 0.01 * s,
                         "rewards/answer_match/mean": 0.3, "rewards/short_answer/mean": 0.7,
                         "kl": 0.001 * s, "completions/mean_length": 12.0,
                         "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01,
                         "learning_rate": 1e-4}) for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n"
                                        + ('{"step": 9, "loss": 0.0' if torn else ""))
    return path


@pytest.fixture
def runs(tmp_path):
    return write_run(tmp_path / "runs/a", 5, torn=True), write_run(tmp_path / "runs/b", 3)


def test_two_runs_give_one_png_per_training_metric_and_the_torn_line_is_skipped(runs, tmp_path,
                                                                                capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    assert plots.main([str(runs[0]), str(runs[1]), "--out", str(out), "--smooth", "0.5"]) == 0
    want = {"reward", "rewards_answer_match_mean", "rewards_short_answer_mean", "kl",
            "completions_mean_length", "clip_ratio", "learning_rate", "loss"}
    assert {p.name for p in out.iterdir()} == {f"{m}.png" for m in want}
    assert all((out / f"{m}.png").read_bytes().startswith(PNG) for m in want)
    captured = capsys.readouterr()
    assert "a: skipped 1 unparsable line(s)" in captured.err.replace(str(runs[0].parent) + "/", "")
    assert len(captured.out.splitlines()) == len(want)  # one path per file written


def test_metrics_reads_records_in_step_order_keeping_the_last_line_of_a_repeated_step(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 2, "reward": 0.2}\n\n{"step": 1, "reward": 0.1}\n[1, 2]\n'
                 '{"step": 2, "reward": 0.3}\n{"st')
    recs, skipped = plots.read_metrics(str(f))
    assert [(r["step"], r["reward"]) for r in recs] == [(1, 0.1), (2, 0.3)] and skipped == 2


def test_ema_follows_its_formula():
    # s_t = 0.5 s_{t-1} + 0.5 x_t, s_1 = x_1
    assert plots.ema([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]


def test_chosen_metrics_only_and_one_no_run_logged_is_an_error(runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots"
    assert plots.main([str(runs[0]), "--metrics", "reward", "clip_ratio", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["clip_ratio.png", "reward.png"]
    assert plots.main([str(runs[0]), "--metrics", "rewad", "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: no input logged metric 'rewad'") and "reward" in err


def test_eval_results_give_one_bar_chart_per_metric(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps({"models": {"base": {"accuracy": 0.41, "pass@1": 0.41, "n": 200, "notes": "x"},
                               "runs/grpo": {"accuracy": 0.58, "pass@1": 0.58, "n": 200}}}))
    out = tmp_path / "plots"
    assert plots.main(["--eval", str(results), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["heldout_accuracy.png", "heldout_pass_1.png"]
    assert (out / "heldout_accuracy.png").read_bytes().startswith(PNG)


def test_held_out_bars_and_eval_every_curves_share_a_folder_without_overwriting(tmp_path):
    """The README's ablation writes both into plots/ablation: eval/reward's curve and the reward bar
    differ."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/reward": 0.1 * s})
                                               + "\n" for s in (1, 2)))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"models": {"base": {"reward": 0.4}, "run": {"reward": 0.6}}}))
    out = tmp_path / "plots"
    assert plots.main([str(run), "--metrics", "eval/reward", "--out", str(out)]) == 0
    assert plots.main(["--eval", str(results), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["eval_reward.png", "heldout_reward.png"]


def test_eval_results_in_the_nested_shape_eval_py_writes(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"config": {}, "models": {
        "base": {"kind": "base", "source": None, "metrics": {"accuracy": 0.46, "n": 100}},
        "trained": {"kind": "adapter", "source": "runs/q",
                    "metrics": {"accuracy": 0.75, "n": 100}}}}))
    out = tmp_path / "plots"
    assert plots.main(["--eval", str(results), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["heldout_accuracy.png"]


@pytest.mark.parametrize("argv, says", [(["missing_run"], "no metrics.jsonl"),
                                        (["--eval", "nope.json"], "--eval nope.json"),
                                        ([], "nothing to plot")])
def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, argv, says):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert plots.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


def test_without_matplotlib_it_prints_the_install_hint_and_exits_2(runs, tmp_path, monkeypatch,
                                                                   capsys):
    # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.main([str(runs[0]), "--out", str(tmp_path / "plots")]) == 2
    assert capsys.readouterr().err == "plots need matplotlib: pip install matplotlib\n"
    assert not (tmp_path / "plots").exists()


def test_a_dpo_run_gets_its_own_default_curves(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "runs/dpo"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 0.69 / s, "rewards/margins": 0.1 * s, "rewards/accuracies": 0.5,
         "rewards/chosen": 0.1, "eval/loss": 0.6, "eval/rewards/accuracies": 0.6,
         "learning_rate": 1e-4}) + "\n" for s in (1, 2)))
    out = tmp_path / "plots"
    assert plots.main([str(run), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == \
        {f"{m}.png" for m in ("rewards_margins", "rewards_accuracies", "eval_loss",
                              "eval_rewards_accuracies", "learning_rate", "loss")}


def test_nothing_to_draw_or_nowhere_to_write_is_one_line_and_writes_nothing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("{torn\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"models": {"a": {"metrics": {"note": "text"}}}}))
    (tmp_path / "afile").write_text("x")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"models": {"a": {"accuracy": 0.5}}}))
    for argv, message in (([str(empty)], "no metrics lines to draw"),
                          (["--eval", str(results)], "no model has a numeric metric"),
                          (["--eval", str(good), "--out", str(tmp_path / "afile")], "is a file"),
                          (["--eval", str(good), "--out", str(tmp_path / "afile" / "x")],
                           "afile is a file, not a folder")):
        assert plots.main([*argv, "--out", str(tmp_path / "plots")] if "--out" not in argv
                          else argv) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: ") and message in last \
            and not (tmp_path / "plots").exists(), last
