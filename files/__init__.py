"""Files that survive a kill: append-only JSON Lines and atomic rewrites (jsonl.py), and a stop
(Ctrl-C, SIGTERM, a full disk) said in one line."""
