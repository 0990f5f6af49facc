"""Rewards over a batch beyond the plain sum: reading answers out of completions (answers.py), the
reward specs checked before a run (batch.py), the metrics eval.py reports (metrics.py)."""
