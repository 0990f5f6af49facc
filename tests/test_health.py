"""run/health.py: each check fires on metrics made to trip it, once, with the step it began at; and
stays quiet on a healthy run."""
import json
import math

from config import HealthConfig
from run import health


def steps(n: int, **metrics) -> list[dict]:
    """n steps of a healthy run, each metric a value or a function of the step."""
    base = {"reward": 0.5, "entropy": 0.8, "completions/mean_length": 10.0,
            "completions/clipped_ratio": 0.0, "clip_ratio/region_mean": 0.0}
    return [{"step": s, **base, **{k: v(s) if callable(v) else v for k, v in metrics.items()}}
            for s in range(1, n + 1)]


def said(history: list[dict], h: HealthConfig | None = None, total: int = 20) -> list[str]:
    monitor = health.Monitor(h or HealthConfig(), total)
    return [line for m in history for line in monitor.after_step(m)]


def test_a_healthy_run_says_nothing():
    assert said(steps(20, reward=lambda s: 0.5 + s / 40)) == []


def test_most_completions_truncated_fires_after_patience_steps_with_the_step_it_began():
    lines = said(steps(8, **{"completions/clipped_ratio": lambda s: 0.9 if s >= 4 else 0.1}))
    assert len(lines) == 1 and lines[0].startswith("most completions truncated since step 4 ")
    assert "health.truncated_share 0.5" in lines[0] and "max_new_tokens" in lines[0]
    assert said(steps(8, **{"completions/clipped_ratio": lambda s: 0.9 if s % 2 else 0.1})) == []


def test_entropy_collapsed_early_fires_early_only():
    lines = said(steps(10, entropy=lambda s: 0.01 if s >= 3 else 0.8))
    assert lines == [lines[0]] and lines[0].startswith("entropy collapsed early: 0.010 at step 3 ")
    assert said(steps(20, entropy=lambda s: 0.01 if s >= 15 else 0.8)) == []  # late: converged


def test_length_growing_without_reward_fires_and_not_when_reward_rises_with_it():
    longer = {"completions/mean_length": lambda s: 10.0 if s <= 5 else 20.0}
    lines = said(steps(10, **longer))
    assert len(lines) == 1 and lines[0].startswith("length growing without reward since step 1")
    assert said(steps(10, **longer, reward=lambda s: 0.2 if s <= 5 else 0.6)) == []


def test_clip_fraction_and_kl_out_of_range_fire_at_their_step():
    clip = said(steps(5, **{"clip_ratio/region_mean": lambda s: 0.4 if s == 3 else 0.01}))
    assert clip and clip[0].startswith("clip fraction 0.400 at step 3 ")
    kl = said(steps(5, kl=lambda s: 2.0 if s == 4 else 0.1))
    assert kl and kl[0].startswith("KL to the reference 2.000 at step 4 ")
    assert said(steps(5, kl=lambda s: 2.0), HealthConfig(kl_max=5.0)) == []  # the config's bound


def test_skipped_updates_and_nan_metrics_fire():
    assert said(steps(3, skipped_updates=lambda s: 1 if s == 2 else 0))[0].startswith(
        "1 update(s) skipped on a non-finite gradient at step 2")
    assert said(steps(3, loss=lambda s: math.nan if s == 3 else 0.1))[0].startswith(
        "non-finite loss at step 3")


def test_summary_repeats_what_fired_and_a_resumed_run_does_not_say_it_again(tmp_path):
    history = steps(6, entropy=0.01)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in history[:4]))
    resumed = health.Monitor(HealthConfig(), 20, path)
    assert [resumed.after_step(m) for m in history[4:]] == [[], []]  # said before the resume
    assert resumed.summary() == ["health: " + said(history)[0]]
    assert health.Monitor(HealthConfig(enabled=False), 20, path).summary() == []


def test_a_sampler_far_from_the_trainer_stops_the_run_at_each_such_step_and_says_nothing_else(
        tmp_path):
    """Issue 57: sampler_logp_abs_diff above health.sampler_gap_max (0.3 nats a token) is a stop
    (monitor.stop: its line; train.py stops with it), not a line to read later; bf16 (0.015) and
    a top-p filter of 0.8 (at most 0.22) stay under it. Off with sampler_gap_max 0 or health off;
    a resumed run's logged steps do not stop it, its next large step does."""
    monitor = health.Monitor(HealthConfig(), 20)
    gaps = {1: 0.015, 2: 0.22, 3: 0.31}
    said_lines = [monitor.after_step(m) for m in steps(3, sampler_logp_abs_diff=gaps.get)]
    assert said_lines == [[], [], []] and monitor.stop.startswith(
        "the sampler is not sampling the policy being trained: sampler_logp_abs_diff 0.310 nats a "
        "token at step 3 (> health.sampler_gap_max 0.3;")
    assert "rollout.vllm_sleep: false" in monitor.stop
    monitor.after_step(steps(4)[-1])  # a step without the metric: the HF sampler's
    assert monitor.stop is None
    for h in (HealthConfig(sampler_gap_max=0), HealthConfig(enabled=False)):
        off = health.Monitor(h, 20)
        off.after_step(steps(1, sampler_logp_abs_diff=5.0)[0])
        assert off.stop is None
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in steps(2, sampler_logp_abs_diff=1.0)))
    resumed = health.Monitor(HealthConfig(), 20, path)
    assert resumed.stop is None
    resumed.after_step(steps(3, sampler_logp_abs_diff=1.0)[-1])
    assert "at step 3" in resumed.stop


def test_a_runs_config_is_its_newest_resumed_one(tmp_path):
    assert health.run_config(tmp_path) == tmp_path / "config.yaml"
    for name in ("config.yaml", "config_resumed_step_000002.yaml",
                 "config_resumed_step_000010.yaml"):
        (tmp_path / name).write_text("{}\n")
    assert health.run_config(tmp_path).name == "config_resumed_step_000010.yaml"


def test_a_judge_failing_more_than_its_share_of_calls_fires_with_the_step_it_began():
    failing = {"judge_calls": 8.0, "judge_failures": lambda s: 6.0 if s >= 4 else 0.0}
    lines = said(steps(10, **failing))
    assert len(lines) == 1 and lines[0].startswith("the judge failing since step 4: ")
    assert "health.judge_failure_share 0.2" in lines[0] and "judge_failures" in lines[0]
    named = said(steps(10, **{"judges/rubric/calls": 4.0, "judges/rubric/failures": 4.0}))
    assert named and named[0].startswith("judge rubric failing since step 1: 20 of 20 calls")
    # a healthy judge: a failure now and then, steps answered from the cache (no calls)
    assert said(steps(20, judge_calls=lambda s: 8.0 if s % 3 else 0.0,
                      judge_failures=lambda s: 1.0 if s % 5 == 0 else 0.0)) == []
    assert said(steps(10, **failing), HealthConfig(judge_failure_share=0.8)) == []


def held_out(values: dict[int, float], reward) -> list[dict]:
    """20 steps, held-out eval/reward logged at the steps in values (run.eval_every)."""
    return [{**m, **({"eval/reward": values[m["step"]]} if m["step"] in values else {})}
            for m in steps(20, reward=reward)]


def test_train_reward_rising_while_held_out_falls_fires_at_the_first_evaluation_compared():
    rising = lambda s: 0.2 + s / 40  # noqa: E731
    lines = said(held_out({5: 0.6, 10: 0.5, 15: 0.4, 20: 0.3}, rising))
    assert len(lines) == 1 and lines[0].startswith(
        "train reward rising while held-out falls since step 5: eval/reward 0.600 -> 0.400 over "
        "3 evaluations")
    assert "health.eval_drop 0.02" in lines[0]
    accuracy = [{k.replace("eval/reward", "eval/accuracy"): v for k, v in m.items()}
                for m in held_out({5: 0.6, 10: 0.5}, rising)]
    assert said(accuracy, HealthConfig(eval_points=2))[0].startswith(
        "train reward rising while held-out falls since step 5: eval/accuracy 0.600 -> 0.500")


def test_held_out_check_is_quiet_when_both_rise_when_train_falls_too_or_on_a_blip():
    rising = lambda s: 0.2 + s / 40  # noqa: E731
    assert said(held_out({5: 0.3, 10: 0.4, 15: 0.5, 20: 0.6}, rising)) == []  # learning
    assert said(held_out({5: 0.6, 10: 0.5, 15: 0.4}, lambda s: 0.8 - s / 40)) == []  # all falls
    assert said(held_out({5: 0.6, 10: 0.4, 15: 0.55}, rising)) == []  # noise, not a trend
    assert said(held_out({5: 0.6, 10: 0.59, 15: 0.59}, rising)) == []  # under eval_drop
    assert said(steps(20, reward=rising)) == []  # no run.eval_every: nothing to compare
