"""Rewards over a batch beyond the plain sum, and what they decide: the reward specs checked before
a run (checks.py), rewards scored while the next slice samples (pipelined.py), DAPO's dynamic
sampling (dynamic_sampling.py), a step whose judge mostly failed (outage.py), the metrics eval.py
reports (metrics.py)."""
