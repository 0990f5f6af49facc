"""The project's shape, held: a default GRPO step, its speed levers off, runs only the core's
files, within a budget of statements and of the lines of the functions it enters; with the levers
as auto chooses them, the statements it adds lie in the levers' own code; each feature's seam names
itself on no more lines than step.py's docstring states; the folders and root files stand in layers
whose imports point down, never in a circle; config.py does no work.

Read from the code's own imports (every import statement, inside functions too), so that no later
change brings a cycle back or makes `import train` load the rating page. Print the graph, and the
statements a default step runs, file by file, levers off and as auto chooses, with

    python tests/test_layout.py
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("api", "engines", "files", "gpu", "graders", "modes", "parallel", "run", "scoring",
           "settings", "sources", "tools")  # what a first read can skip
CORE_MAX = 12  # Python files at the root
# the files a default step (the quickstart's settings) runs through, in the README's order
PATH = ("train.py", "step.py", "rollout.py", "rewards.py", "answers.py", "grpo.py", "logprobs.py",
        "data.py")
STEP_BUDGET = 300  # statements a default step executes, levers off (297 measured; 456 before)
SPAN_BUDGET = 800  # lines of the functions such a step enters, each counted whole (796 measured)
# the speed levers' own code: what a step runs beyond the plain path when auto turns them on
LEVER_CODE = {"logprobs.py": ("lean_log_probs", "_shared_prompt_log_probs", "prompt_cache",
                              "selective_log_probs", "chunk_rows", "_SelectiveLogSoftmax",
                              "_pick_and_lse", "_logits_grad"),
              "rollout.py": ("shared_prompt_rows", "prefill_shared")}
# bottom to top: each imports only from its own layer and those below it
LAYERS = (("settings", "files"), ("config",), ("api", "sources"), ("answers", "grpo"),
          ("logprobs", "rollout", "model", "data"), ("rewards", "judge"),
          ("engines", "parallel", "gpu"), ("scoring",), ("step",), ("modes", "eval"), ("run",),
          ("train",), ("graders", "tools"))


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


def test_the_readme_is_a_door_that_names_the_path_and_the_budget():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    walk = readme.split("read the path in this order:", 1)[1].split(".py` (", 1)[0] + ".py`"
    assert " -> ".join(f"`{f}`" for f in PATH) == " ".join(walk.split())
    assert f"{STEP_BUDGET} statements" in readme and f"{SPAN_BUDGET} lines" in readme


LEVERS_OFF = {"grpo": {"share_prompt": False, "logprob_kernel": False}}  # the speed levers, off


def trace_default_step(tmp: Path, levers: dict | None = None) -> dict[str, set[int]]:
    """The lines a default step runs, by file: steps 2 and 3 of the quickstart's config on a tiny
    model (step 1 warms the caches), traced with sys.settrace from train_step's call to its return;
    `levers`: config sections that set the speed levers (default: as auto chooses them)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import step
    import train
    from conftest import write_tiny_model
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["model"]["name"] = str(write_tiny_model(tmp / "tiny"))
    cfg["run"] |= {"out_dir": str(tmp / "run"), "steps": 3}
    cfg["rollout"]["max_new_tokens"] = 8
    for section, values in (levers or {}).items():
        cfg.setdefault(section, {}).update(values)
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    lines, state, code = defaultdict(set), {"calls": 0, "on": False}, step.train_step.__code__
    ours = [str(ROOT / f) for f in (*FOLDERS, *(p.name for p in ROOT.glob("*.py")))]

    def local(frame, event, arg):
        if event == "line":
            lines[frame.f_code.co_filename].add(frame.f_lineno)
        elif event == "return" and frame.f_code is code:
            state["on"] = False
        return local

    def tracer(frame, event, arg):
        if frame.f_code is code:
            state["calls"] += 1
            state["on"] = state["calls"] >= 2
        return local if state["on"] and frame.f_code.co_filename.startswith(tuple(ours)) else None
    sys.settrace(tracer)
    try:
        assert train.main(["--config", str(tmp / "cfg.yaml")]) == 0
    finally:
        sys.settrace(None)
    return {str(Path(f).relative_to(ROOT)): v for f, v in lines.items()}


def statements(path: Path, hit: set[int]) -> set[tuple[int, int]]:
    """The innermost statements holding the lines `hit` (a statement over several lines is one)."""
    nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.stmt)]
    out = set()
    for line in hit:
        inner = [n for n in nodes if n.lineno <= line <= n.end_lineno]
        if inner:
            n = min(inner, key=lambda n: n.end_lineno - n.lineno)
            out.add((n.lineno, n.end_lineno))
    return out


def functions(path: Path) -> list[ast.AST]:
    return [n for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def entered(path: Path, ran: set[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The functions of `path` in whose body one of the statements `ran` lies (the innermost one:
    a nested def's line belongs to the function around it) -> {name: (first line, last line)},
    decorators included."""
    fns = functions(path)
    out = {}
    for start, _ in ran:
        inner = [f for f in fns if f.body[0].lineno <= start <= f.end_lineno]
        if inner:
            f = min(inner, key=lambda f: f.end_lineno - f.lineno)
            first = min([f.lineno] + [d.lineno for d in f.decorator_list])
            out[f"{f.name}:{first}"] = (first, f.end_lineno)
    return out


def test_a_default_step_runs_only_the_paths_files_within_its_budget(tmp_path):
    """Every statement a quickstart step executes with its speed levers off is in PATH's files (a
    feature's seam costs the default step a line there, never a call into its folder); there are
    at most STEP_BUDGET of them, and the functions they lie in span at most SPAN_BUDGET lines."""
    ran = {f: statements(ROOT / f, hit)
           for f, hit in trace_default_step(tmp_path, LEVERS_OFF).items()}
    assert set(ran) <= set(PATH), sorted(set(ran) - set(PATH))
    assert sum(len(s) for s in ran.values()) <= STEP_BUDGET, {f: len(s) for f, s in ran.items()}
    assert {"step.py", "rollout.py", "rewards.py", "grpo.py", "logprobs.py"} <= set(ran)
    spans = {f: sum(b - a + 1 for a, b in entered(ROOT / f, s).values()) for f, s in ran.items()}
    assert sum(spans.values()) <= SPAN_BUDGET, spans


def test_the_speed_levers_add_statements_only_in_their_own_code(tmp_path):
    """The quickstart as auto chooses its levers (on a CPU: prompt sharing, the hand-written
    log-softmax) runs the plain step's statements and, beyond them, only the levers' own code and
    their seam: the one statement that calls into it."""
    off = {f: statements(ROOT / f, hit)
           for f, hit in trace_default_step(tmp_path / "off", LEVERS_OFF).items()}
    auto = {f: statements(ROOT / f, hit)
            for f, hit in trace_default_step(tmp_path / "auto").items()}
    extra = {f: s - off.get(f, set()) for f, s in auto.items()}
    assert extra["logprobs.py"], "auto turned no lever on"
    for f, s in extra.items():
        source, names = (ROOT / f).read_text().splitlines(), LEVER_CODE.get(f, ())
        own = [n for n in ast.walk(ast.parse((ROOT / f).read_text()))
               if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
        outside = [(a, b) for a, b in s if not any(n.lineno <= a <= n.end_lineno for n in own)]
        seams = [(a, b) for a, b in outside
                 if any(f"{name}(" in "".join(source[a - 1:b]) for name in names)]
        assert len(seams) <= 1 and set(outside) == set(seams), (f, sorted(outside))


def seams() -> list[tuple[list[str], int]]:
    """step.py's seam table: (the names a seam goes by, the most lines that may name them)."""
    doc = ast.get_docstring(ast.parse((ROOT / "step.py").read_text()))
    table = doc.split("  seam (its names)", 1)[1].split("\n")[1:]
    rows = [re.match(r"  (\S.*?)\s{2,}(\d+)  ", line) for line in table
            if line.startswith("  ") and not line.startswith("   ")]
    return [([n.strip() for n in m[1].split(",")], int(m[2])) for m in rows if m]


def naming_lines(path: Path, names: list[str]) -> int:
    """Lines of `path` whose code (not its strings or comments) names one of `names`: a name, or a
    dotted name (run.world)."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
    lines = set()
    for i, t in enumerate(toks):
        dotted, j = t.string, i
        while True:
            if t.type == tokenize.NAME and dotted in names:
                lines.add(t.start[0])
            if j + 2 >= len(toks) or toks[j + 1].string != "." or toks[j + 2].type != tokenize.NAME:
                break
            dotted, j = f"{dotted}.{toks[j + 2].string}", j + 2
    return len(lines)


def test_each_seam_names_itself_on_no_more_lines_than_step_py_says():
    table = seams()
    assert len(table) >= 10 and (["run.sample"], 1) in table
    for names, most in table:
        count = sum(naming_lines(ROOT / f, names) for f in PATH)
        assert 0 < count <= most, (names, count, most)


def layer(name: str) -> int:
    top = name.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_imports_point_down_the_layers():
    """Every module stands in one layer, and imports only from its own layer or those below."""
    up = [(name, dep) for name, deps in graph().items() for dep in deps
          if layer(dep) > layer(name)]
    assert up == []


def test_no_import_cycles_anywhere():
    assert cycles(graph()) == []


def test_config_imports_nothing_that_does_work():
    """No client, rewards, ratings or models behind `import config`: the typed-config machinery
    (with its table of TRL's names), its checks across fields and the crash-safe file writer
    only."""
    assert reach(graph(), "config") <= {"settings.typed_config", "settings.checks",
                                        "settings.trl_names", "files.jsonl"}


def test_imports_point_from_the_core_outwards_never_back():
    """The root never imports graders/ or tools/ (graders are reached by name: rewards.lookup);
    api/ and sources/ import none of graders/, modes/, tools/; only tools/ imports tools/."""
    g = graph()
    for name, deps in g.items():
        outer = {d for d in deps if d.startswith(("graders.", "tools."))}
        if "." not in name:
            assert not outer, f"{name} imports {outer}"
        if name.startswith(("api.", "sources.")):
            assert not {d for d in deps
                        if d.startswith(("graders.", "modes.", "tools."))}, (name, deps)
        if not name.startswith("tools."):
            assert not {d for d in deps if d.startswith("tools.")}, (name, deps)


FUNCTION_LINES = 80  # a function a reader follows without scrolling, def to its last line
FUNCTION_COMPLEXITY = 25  # McCabe's count, as radon takes it (checked equal on this tree)


def complexity(fn: ast.FunctionDef) -> int:
    """1 + the decisions in fn's own body (nested functions and classes are their own): each if,
    conditional expression, loop (+1 with an else), except (+1 with an else), extra operand of and
    /or, comprehension and its ifs, assert (its test not looked into), match case but a `_`."""
    n, todo = 1, list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assert):
            n += 1
            continue
        if isinstance(node, (ast.If, ast.IfExp)):
            n += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            n += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            n += len(node.handlers) + bool(node.orelse)
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        elif isinstance(node, ast.Match):
            n += len(node.cases) - any(getattr(c.pattern, "pattern", False) is None
                                       for c in node.cases)
        todo.extend(ast.iter_child_nodes(node))
    return n


def test_every_function_reads_without_scrolling():
    """No function of the product (tests/ and bench/ apart) longer than FUNCTION_LINES lines or
    more complex than FUNCTION_COMPLEXITY: a long one is split by job."""
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "bench") or rel.parts[0].startswith("."):
            continue
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines, cc = fn.end_lineno - fn.lineno + 1, complexity(fn)
                if lines > FUNCTION_LINES or cc > FUNCTION_COMPLEXITY:
                    over.append(f"{rel}:{fn.lineno} {fn.name}: {lines} lines, complexity {cc}")
    assert not over, "\n".join(over)


def test_the_collectives_take_nothing_from_the_step():
    """parallel/ (torchrun's collectives, the ranks' seeds) imports none of the files a step runs
    through: the step calls the collectives, never the other way (parallel/seeds.py seeds both)."""
    g = graph()
    step_files = {f.removesuffix(".py") for f in PATH}
    for name in (n for n in g if n.startswith("parallel.")):
        assert not g[name] & step_files, f"{name} imports {g[name] & step_files}"


def test_rewards_reach_the_judge_through_the_registry_alone():
    """rewards.py, the reward registry, imports nothing from api/ (the judge client): a judge is a
    reward reached by name (judge.py), and the exception that stops a run, JudgeUnusable, lives in
    config.py beside RewardSpec, where the client and the registry both may import it."""
    assert not {d for d in graph()["rewards"] if d.startswith("api.")}, graph()["rewards"]


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
    import tempfile
    for name, deps in sorted(graph().items()):
        print(f"{name:24} -> {', '.join(sorted(deps)) or '-'}")
    print("cycles:", cycles(graph()) or "none")
    for name, levers in (("levers off", LEVERS_OFF), ("as auto chooses", None)):
        with tempfile.TemporaryDirectory() as d:
            ran = {f: statements(ROOT / f, hit)
                   for f, hit in trace_default_step(Path(d), levers).items()}
        print(f"-- {name}")
        for f, s in sorted(ran.items(), key=lambda x: -len(x[1])):
            print(f"{len(s):5d}  {f}")
        span = sum(b - a + 1 for f, s in ran.items() for a, b in entered(ROOT / f, s).values())
        print(f"{sum(len(s) for s in ran.values()):5d}  statements a default step runs, in "
              f"functions of {span} lines")
