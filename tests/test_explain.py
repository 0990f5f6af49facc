"""tools/explain.py: one step explained on a tiny random model. What it prints is what the code
computes (the advantages of the printed rewards, the step train.py takes), every file:line it names
lies inside the function it names, and it writes nothing."""
import ast
import re
from pathlib import Path

import pytest
import torch
import yaml

import grpo
import step
import train
from conftest import write_run_config
from run import lifecycle
from tools import explain

ROOT = Path(__file__).resolve().parents[1]
REF = re.compile(r"([\w/.]+\.py):(\d+) ([\w.]+)")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def files_under(path: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*")}


def inside_function(path: str, line: int, name: str) -> bool:
    """Is `line` of `path` (the repository's, else under site-packages) in a function `name`?"""
    where = ROOT / path if (ROOT / path).is_file() else Path(torch.__file__).parents[1] / path
    tree = ast.parse(where.read_text(encoding="utf-8"))
    return any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == name
               and min([d.lineno for d in f.decorator_list] + [f.lineno]) <= line <= f.end_lineno
               for f in ast.walk(tree))


def group_table(out: str) -> tuple[list[float], list[float]]:
    """The printed group's (totals, advantages)."""
    lines = out.splitlines()
    head = next(s for s in lines if s.strip().startswith("i ") and "total" in s)
    width = len(head.split("  completion")[0])
    rows = []
    for s in lines[lines.index(head) + 1:]:
        if not s.strip():
            break
        if re.match(r"^ [ *]\s*\d+ ", s):
            rows.append(s[:width].split())
    return [float(r[-2]) for r in rows], [float(r[-1]) for r in rows]


def test_explain_prints_one_step_with_the_code_behind_each_quantity_and_writes_nothing(
        tmp_path, tiny_llama, capsys):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    cfg = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(out_dir)})
    before = files_under(tmp_path)
    assert explain.main(["--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert files_under(tmp_path) == before  # nothing written, in the run's folder or beside it
    for section in ("1. Draw B prompts", "as the model sees it:", "2. Sample G completions",
                    "3. Completion", "On-policy", "4. The loss and its gradient", "grad norm"):
        assert section in out, section
    totals, adv = group_table(out)
    assert len(totals) == 4  # G
    expected = grpo.group_advantages(torch.tensor(totals), 4)
    assert torch.allclose(torch.tensor(adv), expected, atol=2e-3), (adv, expected)
    refs = REF.findall(out)
    assert len(refs) >= 14 and any(p.startswith("torch/") for p, _, _ in refs)
    for path, line, name in refs:
        assert inside_function(path, int(line), name.split(".")[-1]), (path, line, name)
    ratios = [float(s.split()[-4]) for s in out.split("loss_t mask")[1].splitlines()[1:]
              if re.match(r"^\s+\d+\s", s)]
    assert ratios and all(x == 1.0 for x in ratios)  # on-policy


STEP_VARIANTS = {
    "sum": {},
    "normalize_then_sum": {"grpo": {"reward_aggregation": "normalize_then_sum"},
                           "rewards": [{"name": "short_answer", "args": {"max_words": 2}},
                                       {"name": "answer_match", "weight": 0.5}]},
    "sampler weight": {"rollout": {"merged_sampling": True}, "grpo": {"tis_cap": 2.0}},
    "top entropy": {"grpo": {"top_entropy_quantile": 0.5}},
}


@pytest.mark.parametrize("variant", list(STEP_VARIANTS))
def test_the_step_explained_is_the_step_train_takes(tmp_path, tiny_llama, variant):
    """Same seed: the explainer's completions, rewards, advantages, loss mask, loss and gradient
    norm are step.train_step's first, for each reward aggregation, with a sampler's importance
    weight and with the entropy mask (whose columns it prints)."""
    sections = {k: v for k, v in STEP_VARIANTS[variant].items() if k != "rewards"}
    cfg = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(tmp_path / "run")},
                           optim={"lr": 0.0, "micro_batch_size": 3}, **sections)
    if "rewards" in STEP_VARIANTS[variant]:
        text = yaml.safe_load(cfg.read_text())
        cfg.write_text(yaml.safe_dump(text | {"rewards": STEP_VARIANTS[variant]["rewards"]}))

    def setup():
        args, overrides = train.parse_args(["--config", str(cfg)])
        return lifecycle.setup(args, overrides)
    r = setup()
    e = explain.one_step(r, None)
    out = explain.report(r, e, str(cfg))
    metrics, batch = step.train_step(setup())
    assert e.batch.kept.rollout.texts == batch.kept.rollout.texts
    assert e.total.tolist() == pytest.approx(batch.kept.total.tolist(), nan_ok=True)
    assert e.adv.tolist() == pytest.approx(batch.advantages.tolist())
    assert torch.equal(e.mask, batch.mask)
    assert e.loss == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-9)
    assert e.grad_norm == pytest.approx(metrics["grad_norm"], rel=1e-4)
    if variant == "sampler weight":
        assert batch.kept.rollout.sampler_logp is not None and " weight " in out
    if variant == "top entropy":
        assert batch.keep is not None and " keep " in out
    if variant == "normalize_then_sum":  # the advantages are not those of the plain totals
        assert "GDPO" in out
        assert not torch.allclose(e.adv, grpo.group_advantages(e.total, 4))


def test_explain_refuses_what_it_cannot_show(tmp_path, tiny_llama, capsys):
    cfg = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(tmp_path / "run")})
    assert explain.main(["--config", str(cfg), "--group", "2"]) == 2
    assert "--group 2" in capsys.readouterr().err
