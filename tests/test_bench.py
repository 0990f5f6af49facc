"""bench/ stays walkable and runnable: every script imports and every config loads (so none
breaks silently when the code it measures moves), every bench/ script or config that a script,
config or page names exists, the shell scripts parse, and the top level holds at most 10 files,
each study in a folder that bench/README.md names.

    python -m pytest tests/test_bench.py

The imports run in one fresh process (~10 s), each script as `python bench/<study>/<script>.py`
would see the world: its own folder first on sys.path, nothing of the repository imported before
it, and no `__main__`, so no benchmark runs.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in BENCH.rglob("*.py"))
PATH = re.compile(r"bench/[\w./-]+?\.(?:py|yaml|sh)\b")

# run in a fresh interpreter: import each script by path, as a module that is not __main__
IMPORT_EACH = """
import importlib.util, json, sys
from pathlib import Path
root, scripts = Path(sys.argv[1]), sys.argv[2:]
base_path, base_modules = list(sys.path), set(sys.modules)
errors = {}
for n, rel in enumerate(scripts):
    path = root / rel
    sys.path[:] = [str(path.parent)] + base_path
    try:
        spec = importlib.util.spec_from_file_location(f"bench_script_{n}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        errors[rel] = None
    except BaseException as err:  # SystemExit too: a script must not exit on import
        errors[rel] = f"{type(err).__name__}: {err}"
    for name in set(sys.modules) - base_modules:  # the next script finds the repository itself
        file = getattr(sys.modules[name], "__file__", None) or ""
        if file.startswith(str(root)) and "site-packages" not in file:  # not a .venv inside it
            del sys.modules[name]
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(ROOT), *SCRIPTS],
                          cwd=tmp_path_factory.mktemp("elsewhere"), env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_scripts_are_found():
    assert "bench/speed_vs_trl/vs_trl.py" in SCRIPTS and len(SCRIPTS) >= 15


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_imports(import_errors, script):
    assert import_errors[script] is None, f"{script}: {import_errors[script]}"


def test_bench_keeps_at_most_10_files_at_its_top_level():
    top = sorted(p.name for p in BENCH.iterdir() if p.is_file())
    assert len(top) <= 10, f"bench/ holds {len(top)} files: {top}; a study goes in a folder"


def test_the_readme_names_every_study_folder():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    folders = [p.name for p in BENCH.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))]
    assert folders and not [f for f in folders if f"({f}/)" not in readme]


def named_files() -> list[Path]:
    """The files that may name a bench script or config: the code, the configs, the pages (not
    RESULTS.md, which names removed outputs by commit, nor the outputs themselves)."""
    out = [ROOT / "README.md", BENCH / "README.md"]
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "__pycache__")]
        out += [Path(folder) / f for f in files if f.endswith((".py", ".sh", ".yaml", ".ipynb"))
                or (f.endswith(".md") and "docs" in Path(folder).relative_to(ROOT).parts)]
    return out


def test_every_bench_script_or_config_that_is_named_exists():
    missing = [f"{f.relative_to(ROOT)}: {name}" for f in named_files()
               for name in sorted(set(PATH.findall(f.read_text(encoding="utf-8"))))
               if not (ROOT / name).exists()]
    assert not missing


@pytest.mark.parametrize("config", sorted(p.relative_to(ROOT).as_posix()
                                           for p in BENCH.rglob("*.yaml")))
def test_every_bench_config_loads_and_names_rewards_that_exist(config, monkeypatch):
    """As train.py reads it from the repository root: `extends:` and `file.py:fn` rewards."""
    from config import load_config
    from rewards import resolve
    monkeypatch.chdir(ROOT)
    assert all(resolve(spec)[0] for spec in load_config(config).rewards)


def test_vs_trl_reads_its_settings_with_the_configs_own_override_parser():
    """--minigrpo-set and --variant go through train.py's parser: a list entry by name, a text
    field kept as text, a wrong one refused naming it."""
    import importlib.util

    from config import ConfigError
    spec = importlib.util.spec_from_file_location("vs_trl", BENCH / "speed_vs_trl" / "vs_trl.py")
    vs_trl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_trl)
    cfg = {"rollout": {"max_new_tokens": 64}, "rewards": [{"name": "answer_match", "weight": 1.0}]}
    vs_trl.apply_settings(cfg, ["rollout.prompts_per_generate=8", "rewards.answer_match.weight=2",
                                "data.system_prompt=1e-4"])
    assert cfg == {"rollout": {"max_new_tokens": 64, "prompts_per_generate": 8},
                   "rewards": [{"name": "answer_match", "weight": 2}],
                   "data": {"system_prompt": "1e-4"}}
    with pytest.raises(ConfigError, match="rewards.judge.weight"):
        vs_trl.apply_settings(cfg, ["rewards.judge.weight=1"])


@pytest.mark.parametrize("script", ["bench/gpu_checks.sh", "bench/gpu_kit.sh"])
def test_the_gpu_shell_scripts_parse(script):
    done = subprocess.run(["sh", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
