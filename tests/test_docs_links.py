"""Every relative link in README.md, docs/**/*.md and bench/'s README.md and RESULTS.md points at
a file that exists, and every #anchor at a heading of its target, named as GitHub names them: the
heading's text lowercased, punctuation dropped, spaces turned to hyphens, a repeated heading
numbered -1, -2, ...

    python -m pytest tests/test_docs_links.py
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "bench" / "RESULTS.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def github_anchor(heading: str) -> str:
    """A heading's anchor on GitHub.

    >>> github_anchor("GPU (H100, 2026-11-27): both targets, with `compile`")
    'gpu-h100-2026-11-27-both-targets-with-compile'
    >>> github_anchor("Summary (CPU, LoRA r=16, B=4 x G=8)")
    'summary-cpu-lora-r16-b4-x-g8'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: its headings', numbered when repeated."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = github_anchor(m.group(1))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
    return out


def broken_links(page: Path) -> list[str]:
    """'page:line: target (why)' for each relative link of `page` that leads nowhere."""
    bad = []
    for n, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with that anchor in {dest.name})")
    return bad


def test_the_pages_are_found():
    assert ROOT / "README.md" in PAGES and len(PAGES) > 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_leads_somewhere(page):
    assert broken_links(page) == []


def test_a_dead_anchor_and_a_missing_file_are_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Title\n## What it shows\n## What it shows\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#what-it-shows-1) [gone](b.md#what-one-run-showed)\n"
                    "[none](c.md) `[code](d.md)` [web](https://x.org/y#z)\n"
                    "```\n[fenced](e.md)\n```\n")
    assert broken_links(page) == [
        "a.md:1: b.md#what-one-run-showed (no heading with that anchor in b.md)",
        "a.md:2: c.md (no such file)"]
