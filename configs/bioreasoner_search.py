"""BioReasoner with a `search` tool (docs/recipes/bioreasoner.md, "Looking papers up"): the model
may search a local corpus of papers before it answers, and the citation rewards score its final
answer, any paper of the corpus counting as valid.

    python train.py --config configs/bioreasoner_search.yaml

The corpus is JSON Lines with `pmid`, `title` and `abstract` (the original project's 15k papers);
the environment variable BIOREASONER_CORPUS names the file (default data/corpus.jsonl). The search
is keyword overlap with the title and abstract, best three papers first: enough to find a paper by
what it is about, and readable in one sitting (a BM25 or embedding index would slot in here).
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache

WORD = re.compile(r"[a-z0-9]+")


@lru_cache(maxsize=2)
def papers(path: str) -> list[tuple[str, str, set]]:
    """The corpus once a process: (pmid, "title. abstract", its words) per paper."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [(str(r["pmid"]), f"{r['title']}. {r.get('abstract') or ''}".strip(),
             set(WORD.findall(f"{r['title']} {r.get('abstract') or ''}".lower()))) for r in rows]


def search(query: str) -> str:
    """Searches the paper corpus for the papers that best match some keywords.

    Args:
        query: keywords, e.g. "butyrate CD8 T-cell exhaustion"
    """
    words = set(WORD.findall(query.lower()))
    found = sorted((-len(words & w), pmid, text)
                   for pmid, text, w in papers(os.environ.get("BIOREASONER_CORPUS",
                                                              "data/corpus.jsonl")))
    hits = [f"[PMID: {pmid}] {text[:400]}" for score, pmid, text in found[:3] if score < 0]
    return "\n".join(hits) or "no paper matches those words"
