"""The project's shape, held: the root is the core, imports point one way, config.py does no work.

Read from the code's own imports (every import statement, inside functions too), so that no later
change brings a cycle back or makes `import train` load the rating page. Print the graph with

    python tests/test_layout.py
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("api", "engines", "files", "graders", "modes", "parallel", "plumbing", "run", "scoring",
           "settings", "sources", "tools")  # what a first read can skip
CORE_MAX = 12  # Python files at the root
TEACHERS_PATH = ("train.py", "step.py", "rollout.py", "rewards.py", "grpo.py", "logprobs.py")


def modules() -> dict[str, Path]:
    """Every module of the project by its import name (train, files.jsonl, ...)."""
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for folder in FOLDERS:
        found |= {f"{folder}.{p.stem}": p
                  for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out & known


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of g: its strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in g[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_root_holds_the_core_alone():
    core = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(core) <= CORE_MAX, core
    assert {"train.py", "grpo.py", "rewards.py", "judge.py", "data.py", "eval.py"} <= set(core)


def test_the_teachers_path_reads_in_one_sitting_and_the_readme_is_a_door():
    """The six files one GRPO step runs through, in the README's order: at most 1,500 lines."""
    lines = {f: len((ROOT / f).read_text().splitlines()) for f in TEACHERS_PATH}
    assert sum(lines.values()) <= 1500, lines
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert " -> ".join(f"`{f}`" for f in TEACHERS_PATH[:3]) in readme


def test_no_import_cycles_anywhere():
    assert cycles(graph()) == []


def test_config_imports_nothing_that_does_work():
    """No client, rewards, ratings or models behind `import config`: the typed-config machinery, its
    checks across fields and the crash-safe file writer only."""
    assert reach(graph(), "config") <= {"settings.typed_config", "settings.checks", "files.jsonl"}


def test_imports_point_from_the_core_outwards_never_back():
    """The root never imports graders/ or tools/ (graders are reached by name: rewards.lookup);
    api/ and plumbing/ import none of graders/, modes/, tools/; only tools/ imports tools/."""
    g = graph()
    for name, deps in g.items():
        outer = {d for d in deps if d.startswith(("graders.", "tools."))}
        if "." not in name:
            assert not outer, f"{name} imports {outer}"
        if name.startswith(("api.", "plumbing.")):
            assert not {d for d in deps
                        if d.startswith(("graders.", "modes.", "tools."))}, (name, deps)
        if not name.startswith("tools."):
            assert not {d for d in deps if d.startswith("tools.")}, (name, deps)


def test_importing_train_loads_no_grader_and_no_tool():
    code = ("import sys, train; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('graders', 'tools')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_a_config_naming_a_grader_loads_it_by_name():
    import rewards
    fn, batched = rewards.lookup("citation_grounding")
    assert fn.__module__ == "graders.citations" and batched is False


if __name__ == "__main__":
    for name, deps in sorted(graph().items()):
        print(f"{name:24} -> {', '.join(sorted(deps)) or '-'}")
    print("cycles:", cycles(graph()) or "none")
