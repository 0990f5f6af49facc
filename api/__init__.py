"""The OpenAI-compatible client behind every API call (judges, API models in eval.py, the answer
policy of tools/precompute.py): client.py (cache, retries, rate limit, cost) and reply_cache.py (the
append-only cache of paid replies). What training does when a judge stops answering is
scoring/outage.py's."""
