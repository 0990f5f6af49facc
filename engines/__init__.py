"""Sampling beyond HF generate: vLLM (vllm_engine.py), and multi-turn episodes against your tools
or an environment class written for TRL (episodes.py, environments.py, tool_calls.py). Each returns
the same rollout.Rollout."""
