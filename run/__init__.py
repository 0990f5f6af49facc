"""A run's lifecycle around the loop: built and checked before the first step (lifecycle.py),
one trainer per run folder (folder_lock.py), checkpoints and --resume (checkpoint.py), when it saves
and stops (policy.py), what it shows (display.py), its state (state.py)."""
