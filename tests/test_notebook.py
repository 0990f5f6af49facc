"""notebooks/grpo_colab_t4.ipynb runs top to bottom: its code cells in order, in one namespace, on
CPU with a tiny model and tiny settings put in place of its parameter cell (tag `parameters`); the
cells marked `# ci: skip` (install, clone, Drive, Colab secrets) are left out. IPython's display
is stubbed, so nothing beyond the default install is needed. A failing cell fails the test, named.

    python -m pytest tests/test_notebook.py
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "grpo_colab_t4.ipynb"
SKIP = "# ci: skip"


def code_cells() -> list[tuple[list[str], str]]:
    """(tags, source) of each code cell, in order."""
    nb = json.loads(NOTEBOOK.read_text())
    return [(c.get("metadata", {}).get("tags", []), "".join(c["source"]))
            for c in nb["cells"] if c["cell_type"] == "code"]


def tiny_parameters(model: Path, run_dir: Path) -> str:
    """The parameter cell for CI: the quickstart's task on a tiny model, 2 steps of 2 x 4
    completions of 8 tokens, 4 held-out rows, a curve redrawn every second."""
    extra = ["--rollout.prompts_per_step=2", "--rollout.num_generations=4",
             "--rollout.max_new_tokens=8", "--run.save_every=1", "--eval.batch_size=2",
             "--eval.max_new_tokens=8"]
    return (f"CONFIG = 'configs/quickstart.yaml'\nMODEL = {str(model)!r}\nSTEPS = 2\n"
            f"MAX_MINUTES = 10\nRUN_DIR = {str(run_dir)!r}\nEVAL_ROWS = 4\nHUB_REPO = ''\n"
            f"EXPORT_DTYPE = 'float32'\nLIVE_EVERY_S = 1\nEXTRA = {extra!r}\n")


def fake_ipython(shown: list) -> types.ModuleType:
    display = types.ModuleType("IPython.display")
    display.Image = lambda filename, **kw: filename
    display.display = shown.append
    display.clear_output = lambda wait=False: None
    package = types.ModuleType("IPython")
    package.display = display
    return package


def test_the_notebook_has_one_parameter_cell_and_marks_the_colab_only_cells():
    cells = code_cells()
    assert sum("parameters" in tags for tags, _ in cells) == 1
    skipped = [src for _, src in cells if src.startswith(SKIP)]
    assert any("git" in s and "requirements-gpu.txt" in s for s in skipped)  # clone, install
    assert any("drive.mount" in s for s in skipped) and any("HF_TOKEN" in s for s in skipped)
    params = next(src for tags, src in cells if "parameters" in tags)
    assert "STEPS = 150" in params and "MAX_MINUTES = 45" in params


def test_the_notebook_runs_top_to_bottom_on_cpu_with_tiny_settings(tmp_path, tiny_llama,
                                                                   monkeypatch):
    shown: list = []
    package = fake_ipython(shown)
    monkeypatch.setitem(sys.modules, "IPython", package)
    monkeypatch.setitem(sys.modules, "IPython.display", package.display)
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    namespace: dict = {"__name__": "__notebook__"}
    for i, (tags, src) in enumerate(code_cells()):
        if src.startswith(SKIP):
            continue
        if "parameters" in tags:
            src = tiny_parameters(tiny_llama, run_dir)
        try:
            exec(compile(src, f"<notebook cell {i}>", "exec"), namespace)
        except Exception as e:
            log = run_dir / "train.log"
            pytest.fail(f"notebook code cell {i} failed: {type(e).__name__}: {e}\n"
                        + (log.read_text()[-3000:] if log.exists() else ""))
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    assert set(namespace["results"]) == {"base", "trained"}
    assert (run_dir / "merged" / "config.json").is_file()
    log = (run_dir / "train.log").read_text()
    assert "step 2/2" in log and " elapsed | " in log  # the step lines and the pace line
    try:
        import matplotlib  # noqa: F401  (an optional extra: the curves need it)
    except ImportError:
        return
    assert any(str(s).endswith("reward.png") for s in shown)


def test_the_gpu_requirements_are_the_cpu_ones_without_the_torch_pin():
    def pins(name: str) -> dict[str, str]:
        lines = [ln.split("#")[0].strip() for ln in (ROOT / name).read_text().splitlines()]
        return dict(ln.replace(">=", "==", 1).split("==", 1) for ln in lines if ln)
    cpu, gpu = pins("requirements.txt"), pins("requirements-gpu.txt")
    assert cpu.pop("torch") == "2.13.0" and gpu.pop("torch") == "2.6,<2.14"
    assert gpu == cpu


def test_the_readme_opens_the_notebook_from_the_repository_the_notebook_clones():
    """One place to change when the repository moves: the README's Colab link and REPO_URL."""
    import re
    readme = (ROOT / "README.md").read_text()
    link = re.search(r"colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/main/"
                     r"notebooks/grpo_colab_t4\.ipynb", readme)
    url = re.search(r'REPO_URL = "https://github\.com/([^"]+)"',
                    "".join(source for _, source in code_cells()))
    assert link and url and link.group(1) == url.group(1)
