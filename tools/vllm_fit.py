"""Is requirements-vllm.txt a set vLLM itself supports? Resolves the set (the trainer's GPU pins
with the torch and transformers vLLM declares and tests, and vLLM's window) with each vLLM release
the window allows, checks each pairing, and says what installing it does to this machine.

    pip install uv==0.13.8          # the resolver: uv reads wheel metadata by range requests, in
    python -m tools.vllm_fit        #   seconds (pip's own resolver downloads each 300 MB wheel)
    python -m tools.vllm_fit --window ">=0.31.0,<0.33.0"    # another window for the same set
    python -m tools.vllm_fit --set requirements-gpu.txt --window ">=0.27.0,<0.31.0"  # the old one
    python -m tools.vllm_fit --pins        # the set's pins that differ from requirements.txt
    python -m tools.vllm_fit --installed   # ... and are what this Python imports, their needs met

A release fits when the set resolves with it (so its pins lie in the ranges the release declares:
vLLM 0.32 declares torch==2.13.0 and transformers>=5.16.1,<5.20.0), the resolver keeps the set's
torch and transformers, and both came out before the release did: a newer one the release cannot
have tested (vLLM 0.27-0.30 declare transformers with no upper bound, and transformers 5.23.0 came
out after all of them). Then, from the torch installed here (none, a CPU build, another CUDA
build), what the set replaces, and the CUDA build it pulls (cuda-toolkit, nvidia-cuda-runtime).

Needs PyPI. Exit 0: every release in the window fits; 1: one does not (the line says which and
why), or no release is in the window; 2: no uv. vLLM pins torch exactly, so a window that lets pip
pick a release with another torch would swap the trainer's torch for it.
--pins and --installed serve CI's second job (make vllm-test): the trainer's tests under the set's
transformers, installed over .venv (--installed exits 1 naming what is not as the set says).
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
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "requirements-vllm.txt"
KEEP = ("torch", "transformers")  # the pins vLLM must leave as the set has them
INDEX = "https://pypi.org/simple"
PLATFORM = "x86_64-manylinux_2_35"  # vLLM's wheels: Linux, CUDA


def window(path: Path = SET) -> SpecifierSet:
    """The vllm line's version specifier, e.g. >=0.32.0,<0.33.0."""
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"vllm\s*([<>=!~][^#]*?)\s*(#.*)?", line.strip())
        if m:
            return SpecifierSet(m.group(1))
    raise ValueError(f"{path} has no vllm line")


def without_vllm(path: Path = SET) -> list[str]:
    """The set's requirement lines but its vllm line."""
    return [ln for ln in path.read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")
            and canonicalize_name(re.split(r"[<>=!~;\s\[]", ln.strip())[0]) != "vllm"]


def pins(compiled: str) -> dict[str, str]:
    """A resolver's (or a requirements file's) name==version lines -> {canonical name: version}."""
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


def check(spec: SpecifierSet, dates: dict[str, dict[str, str]],
          resolve: Callable[[list[str]], tuple[dict | None, str]]) -> tuple[list[str], dict]:
    """-> (one line per problem, none: the window fits; {release: its resolved pins}).
    dates: {package: {version: its upload time}} for vllm and KEEP's packages; resolve(extra
    requirement lines) -> (pins, "") or (None, the resolver's reason), for the set without its
    vllm line plus those lines."""
    base, why = resolve([])
    if base is None:
        return [f"requirements-vllm.txt without vllm does not resolve: {why}"], {}
    found = releases_in(spec, list(dates["vllm"]))
    if not found:
        return [f"no vllm release in the window {spec}"], {}
    problems, sets = [], {}
    for v in found:
        got, why = resolve([f"vllm=={v}"])
        if got is None:
            problems.append(f"vllm=={v} does not install with requirements-vllm.txt: {why}")
            continue
        moved = [f"{k} {base.get(k)} -> {got.get(k)}" for k in KEEP if got.get(k) != base.get(k)]
        when = dates["vllm"][v][:10]
        later = [f"{k} {got[k]} ({dates[k][got[k]][:10]})" for k in KEEP
                 if dates[k].get(got.get(k), "")[:19] > dates["vllm"][v][:19]]
        if moved:
            problems.append(f"vllm=={v} changes {', '.join(moved)}")
        elif later:
            problems.append(f"vllm=={v} ({when}) came out before {', '.join(later)}: a pairing "
                            "it never tested; pin the transformers its release tested")
        else:
            sets[v] = got
    return problems, sets


def cuda_build(got: dict[str, str]) -> str:
    """The CUDA a resolved set pulls, from its CUDA packages: "CUDA 13.0 (cuda-toolkit 13.0.3.0,
    nvidia-cuda-runtime 13.0.96)"."""
    cuda = {k: v for k, v in sorted(got.items())
            if k == "cuda-toolkit" or k.startswith("nvidia-cuda-runtime")}
    if not cuda:
        return "no CUDA packages"
    major_minor = ".".join(next(iter(cuda.values())).split(".")[:2])
    return f"CUDA {major_minor} ({', '.join(f'{k} {v}' for k, v in cuda.items())})"


def what_it_does(got: dict[str, str], installed: str | None) -> str:
    """What installing the resolved set does to this machine's torch, and the CUDA it pulls."""
    torch = got.get("torch")
    here = ("" if installed is None
            else f", keeping the torch installed here ({installed})" if installed == torch
            else f", replacing the torch installed here ({installed})")
    return f"installing it pulls torch {torch} built for {cuda_build(got)}{here}"


def uv_resolver(uv: str, python: str,
                path: Path = SET) -> Callable[[list[str]], tuple[dict | None, str]]:
    """resolve() through `uv pip compile` for Linux x86_64 and the given Python version, of the
    set at `path` without its vllm line."""
    def resolve(extra: list[str]) -> tuple[dict | None, str]:
        with tempfile.TemporaryDirectory() as tmp:
            req = Path(tmp) / "requirements.in"
            req.write_text("\n".join([*without_vllm(path), *extra]) + "\n")
            p = subprocess.run([uv, "pip", "compile", "--quiet", "--no-header", "--no-annotate",
                                "--python-version", python, "--python-platform", PLATFORM,
                                "--index-url", INDEX, str(req)],
                               capture_output=True, text=True, timeout=300)
        return (pins(p.stdout), "") if p.returncode == 0 else (None, reason(p.stderr))
    return resolve


def upload_dates(name: str) -> dict[str, str]:
    """{version: its first file's upload time} of a package on PyPI (the simple index, JSON)."""
    req = urllib.request.Request(f"{INDEX}/{name}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    out: dict[str, str] = {}
    for f in files:
        m = re.match(rf"{re.escape(name)}-([^-]+?)(?:-|\.tar\.gz$|\.zip$)", f["filename"], re.I)
        if m and f.get("upload-time"):
            out[m.group(1)] = min(out.get(m.group(1), "9"), f["upload-time"])
    return out


def differing(path: Path = SET, trainer: Path = ROOT / "requirements.txt") -> dict[str, str]:
    """The set's pins (but vllm) that requirements.txt pins otherwise: what CI installs over it."""
    mine, theirs = pins(path.read_text()), pins(trainer.read_text())
    return {k: v for k, v in mine.items() if k != "vllm" and theirs.get(k) != v}


def not_as_pinned(wanted: dict[str, str]) -> list[str]:
    """Of `wanted` ({name: version}), what this Python finds otherwise: another version, or a
    requirement of one of them that the packages it finds do not meet."""
    problems = []
    for name, version in wanted.items():
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed")
            continue
        if found != version:
            problems.append(f"{name} {found} is found first, not {version}")
            continue
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} {version} needs {req}, found {have or 'none'}")
    return problems


def find_uv() -> str | None:
    try:
        from uv import find_uv_bin  # the uv package's own binary
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def installed_torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                    help="the Python version to resolve for (default: this one)")
    ap.add_argument("--set", type=Path, default=SET, help="the requirements file to resolve "
                    "(default requirements-vllm.txt); its vllm line is the window")
    ap.add_argument("--window", type=SpecifierSet, help="the vllm versions to check instead of "
                    "the set's vllm line, e.g. '>=0.31.0,<0.33.0'")
    ap.add_argument("--pins", action="store_true",
                    help="print the set's pins that differ from requirements.txt, and exit")
    ap.add_argument("--installed", action="store_true",
                    help="check that those pins are what this Python imports, their needs met")
    args = ap.parse_args(argv)
    if args.pins or args.installed:
        problems = not_as_pinned(differing()) if args.installed else []
        print(*(problems or [f"{k}=={v}" for k, v in differing().items()]),
              file=sys.stderr if problems else sys.stdout)
        return 1 if problems else 0
    uv = find_uv()
    if uv is None:
        print("tools/vllm_fit.py resolves with uv: pip install uv==0.13.8", file=sys.stderr)
        return 2
    spec = args.window or window(args.set)
    dates = {name: upload_dates(name) for name in ("vllm", *KEEP)}
    problems, sets = check(spec, dates, uv_resolver(uv, args.python, args.set))
    for line in problems:
        print(line, file=sys.stderr)
    for v, got in sets.items():
        print(f"vllm {v} ({dates['vllm'][v][:10]}) fits {args.set.name}: torch "
              f"{got.get('torch')} and transformers {got.get('transformers')}, in the ranges it "
              f"declares and out before it; {what_it_does(got, installed_torch())}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
