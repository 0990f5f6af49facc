"""What the core stands on and a first read can skip: crash-safe files (jsonl.py), the typed-config
machinery (typed_config.py), where a model comes from (hub.py) and its adapters (adapters.py),
checkpoints (checkpoint.py), the prompt order (sampler.py), data maps (maps.py), reading answers
(answers.py), user plugins (plugins.py), what a run shows (display.py), eval.py's entries and
metrics (entries.py, metrics.py), training-data overlap (overlap.py) and vLLM rollouts
(vllm_engine.py)."""
