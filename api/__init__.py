"""The OpenAI-compatible client behind every API call (judges, API models in eval.py, the answer
policy of tools/precompute.py): client.py (cache, retries, rate limit, cost), reply_cache.py (the
append-only cache of paid replies) and outage.py (a judge that stops answering mid-run)."""
