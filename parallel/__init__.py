"""Data-parallel GRPO under torchrun (distributed.py): what crosses processes, and where."""
