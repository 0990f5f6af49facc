"""A run's lifecycle around the loop: built and checked before the first step (lifecycle.py),
checkpoints and --resume (checkpoint.py), what it shows (display.py), the prompts it trained on
(overlap.py)."""
