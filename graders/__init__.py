"""Rewards beyond the rule rewards (rewards.py) and the LLM judge (judge.py): citation checks
(citations.py), a trained reward model (reward_model.py) and people's ratings (ratings.py, with
its page rating_page.py, the seed's queue API rating_queue.py and their server rating_server.py).
The core reaches them only by name, through rewards.lookup."""
