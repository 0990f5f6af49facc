"""Does vLLM install next to the trainer without changing torch or transformers? Resolves
requirements-gpu.txt alone, then with each vLLM release that requirements-vllm.txt's window allows,
and compares the pins the resolver chose.

    pip install uv==0.13.8          # the resolver: uv reads wheel metadata by range requests, in
    python -m tools.vllm_fit        #   seconds (pip's own resolver downloads each 300 MB wheel)

Needs PyPI. Exit 0: every release in the window resolves with the GPU set's torch and
transformers; 1: one does not (the line says which release and why: the resolver's reason, or the
package it would change), or no release is in the window; 2: no uv. vLLM pins torch exactly
(vllm 0.27-0.30: torch==2.13.0), so a window that lets pip pick a release with another torch
would swap the trainer's torch for it, or leave vLLM's compiled code on the wrong one.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
KEEP = ("torch", "transformers")  # the pins vLLM must leave as the GPU set has them
INDEX = "https://pypi.org/simple"
PLATFORM = "x86_64-manylinux_2_35"  # vLLM's wheels: Linux, CUDA


def window(path: Path = ROOT / "requirements-vllm.txt") -> SpecifierSet:
    """The vllm line's version specifier, e.g. >=0.27.0,<0.31.0."""
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"vllm\s*([<>=!~][^#]*?)\s*(#.*)?", line.strip())
        if m:
            return SpecifierSet(m.group(1))
    raise ValueError(f"{path} has no vllm line")


def pins(compiled: str) -> dict[str, str]:
    """A resolver's name==version lines -> {canonical name: version}."""
    out = {}
    for line in compiled.splitlines():
        m = re.match(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;#]+)", line.strip())
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def reason(stderr: str) -> str:
    """The resolver's one line of why (uv: the line after "cause:"), else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    cause = [ln.removeprefix("cause:").strip() for ln in lines if ln.startswith("cause:")]
    return (cause or lines or ["the resolver failed without a reason"])[-1][:400]


def releases_in(spec: SpecifierSet, versions: list[str]) -> list[str]:
    """The final releases of `versions` that `spec` allows, oldest first."""
    return sorted((v for v in versions if not Version(v).is_prerelease and v in spec), key=Version)


def check(spec: SpecifierSet, versions: list[str],
          resolve: Callable[[list[str]], tuple[dict | None, str]]) -> list[str]:
    """One line per problem (none: the window fits). resolve(extra requirement lines) ->
    (pins, "") or (None, the resolver's reason), for requirements-gpu.txt plus those lines."""
    base, why = resolve([])
    if base is None:
        return [f"requirements-gpu.txt alone does not resolve: {why}"]
    found = releases_in(spec, versions)
    if not found:
        return [f"no vllm release in the window {spec}"]
    problems = []
    for v in found:
        got, why = resolve([f"vllm=={v}"])
        if got is None:
            problems.append(f"vllm=={v} does not install with requirements-gpu.txt: {why}")
            continue
        moved = [f"{k} {base.get(k)} -> {got.get(k)}" for k in KEEP if got.get(k) != base.get(k)]
        if moved:
            problems.append(f"vllm=={v} changes {', '.join(moved)}")
    return problems


def uv_resolver(uv: str, python: str) -> Callable[[list[str]], tuple[dict | None, str]]:
    """resolve() through `uv pip compile` for Linux x86_64 and the given Python version."""
    def resolve(extra: list[str]) -> tuple[dict | None, str]:
        with tempfile.TemporaryDirectory() as tmp:
            req = Path(tmp) / "requirements.in"
            req.write_text("\n".join([f"-r {ROOT / 'requirements-gpu.txt'}", *extra]) + "\n")
            p = subprocess.run([uv, "pip", "compile", "--quiet", "--no-header", "--no-annotate",
                                "--python-version", python, "--python-platform", PLATFORM,
                                "--index-url", INDEX, str(req)],
                               capture_output=True, text=True, timeout=300)
        return (pins(p.stdout), "") if p.returncode == 0 else (None, reason(p.stderr))
    return resolve


def released_versions() -> list[str]:
    """vllm's versions on PyPI (the simple index, JSON)."""
    req = urllib.request.Request(f"{INDEX}/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["versions"]


def find_uv() -> str | None:
    try:
        from uv import find_uv_bin  # the uv package's own binary
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                    help="the Python version to resolve for (default: this one)")
    args = ap.parse_args(argv)
    uv = find_uv()
    if uv is None:
        print("tools/vllm_fit.py resolves with uv: pip install uv==0.13.8", file=sys.stderr)
        return 2
    spec = window()
    problems = check(spec, released_versions(), uv_resolver(uv, args.python))
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"vllm{spec} installs with requirements-gpu.txt, torch and transformers unchanged")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
