"""Where a run's parts come from: models from a folder, the hub or the built-in (hub.py), LoRA
adapters and their bases (adapters.py), eval.py's model entries (entries.py), row maps for
datasets (maps.py), your own functions named "file.py:function" (plugins.py), and the prompts a
run trained on, for the held-out checks (seen_prompts.py)."""
