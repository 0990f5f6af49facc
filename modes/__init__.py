"""The other training modes, run through train.py with `mode: sft` or `mode: dpo` in the config:
supervised fine-tuning (sft.py) and direct preference optimization (dpo.py). They share GRPO's
setup, checkpoints and resume; only their step differs."""
