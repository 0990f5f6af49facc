"""Every recipe page's commands run as written (issue 56): each fenced bash block of
docs/recipes/*.md, command by command in the page's order, in a folder laid out as the pages assume
(configs/, tests/, data/), in one process (train.py, eval.py and tools.* through their main(); the
fake servers, the rating page and `python -c` as the processes the page starts).

A train.py command gets --dry-run (config, data, model and judges checked, nothing trained), unless
a later command reads its run (names its folder, starts from it or resumes it): that one trains one
step at the smallest size. eval.py, tools.export check and the rest run at their smallest size.

What the test substitutes, and nothing else:
- models: a model.name that is not a local folder (a hub id, the built-in smollm2-135m) is a tiny
  random model; a repo the page pushed to (--push-to-hub ORG/NAME) is the folder it pushed;
- data: the author's files (data/...) are the fixtures in the same columns (data_files), a hub
  dataset is its fixture (HUB, HUB_FILES), row ranges sized for the real sets are ranges of the
  fixtures (ROWS), and people's ratings are the test's, posted to the page the page serves;
- endpoints: every API, judge and Azure endpoint is a fake OpenAI-compatible server (a URL on the
  page is the server the page started there, the port a free one), the hub is faked as
  tests/test_deploy.py fakes it, and the trackers (wandb, trackio) are stand-ins;
- sizes: SMALL's overrides on the commands that run;
- installs (`pip install`) are not run.
An output a command writes that an earlier command (an alternative the page offers) already wrote is
moved aside first, as a reader following that block alone would not have it. EXPECTED lists the
commands whose outcome differs on a random model, and what they must say instead.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import eval as ev
import train
from config import load_config
from fake_openai_server import FakeOpenAIServer, judge_or_answer
from files import jsonl
from rating_client import needs_page, queue
from test_deploy import hub  # noqa: F401 (a fixture: the fake hub)
from test_recipes import fake_tracker

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures"
# the README's order; a page that starts from another's run comes after it
PAGES = ["README", "medmcqa", "gsm8k", "grubrics", "bioreasoner", "qgen-judge", "qgen-human", "t4"]
STARTS_FROM = {"qgen-human": "qgen-judge"}  # qgen_human.yaml trains on from runs/qgen
HUB = {"openai/gsm8k": ["--data.name=tests/fixtures/gsm8k_sample.jsonl", "--data.config_name=null",
                        "--eval.split=null", "--data.select=[0,30]"],
       "openlifescienceai/medmcqa": ["--data.name=tests/fixtures/medmcqa_sample.jsonl"]}
HUB_FILES = {"GBaker/MedQA-USMLE-4-options": "tests/fixtures/medqa_sample.jsonl",
             "openlifescienceai/medmcqa": "tests/fixtures/medmcqa_sample.jsonl"}
# rows of the real sets -> rows of their fixtures (40, 30, 12 and 6 rows)
ROWS = {(0, 450): (0, 30), (450, 500): (30, 40), (0, 1000): (0, 16), (1000, 1500): (16, 32),
        (1500, 1700): (32, 40), (0, 1319): (30, 40), (0, 200): (30, 40), (1000, 5000): (0, 6),
        (0, 400): (0, 4), (400, 450): (4, 6), (0, 150): (0, 12)}
SMALL = {"train": ["--run.steps=1", "--run.epochs=0", "--rollout.prompts_per_step=2",
                   "--rollout.num_generations=2", "--rollout.max_new_tokens=4",
                   "--optim.micro_batch_size=4", "--sft.batch_size=2", "--dpo.batch_size=2",
                   "--run.save_every=0", "--eval.limit=2", "--eval.max_new_tokens=4"],
         "eval": ["--eval.limit=2", "--eval.max_new_tokens=4"],
         "tools.export check": ["--limit", "2", "--max-new-tokens", "4"]}
# a command's start -> (exit code, what it says) on a random model
EXPECTED = {
    # its samples never close a think block: nothing passes --require think_format=1 (the names it
    # asks for exist: an unknown one exits 2)
    "python -m tools.bestofn runs/bestof4_bioreasoner/": (1, "nothing passed the bars"),
    # the fake endpoint is not the adapter: the comparison runs and finds the replies differ
    "python -m tools.export check": (1, "prompts get the adapter's greedy reply"),
}


def commands(page: str) -> list[str]:
    """The page's commands: its fenced bash blocks' lines, continuations joined, comment lines
    dropped (a comment after a command is shlex's to drop)."""
    text = (ROOT / "docs/recipes" / f"{page}.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        out += [ln.strip() for ln in block.replace("\\\n", " ").splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_files(ws: Path) -> None:
    """The author's files the pages name, as fixtures in the same columns."""
    bio = [json.loads(ln)
           for ln in (FIXTURES / "bioreasoner_sample.jsonl").read_text().splitlines()]
    good = [f"<think>Both papers agree.</think> PMID: {r['valid_pmids'][0]}" for r in bio]
    files = {
        "train_750.jsonl": [{"prompt": r["prompt"], "response": g} for r, g in zip(bio, good)],
        "dpo_distillation_pairs.jsonl": [{"prompt": r["prompt"], "chosen": g, "rejected":
                                          "<think>Unclear.</think> PMID: 12345678"}
                                         for r, g in zip(bio, good)],
        "grpo_prompts.jsonl": [{**r, "prompt_id": r["id"]} for r in bio],  # the seed's id column
        "test_84.jsonl": bio}
    (ws / "data/cache").mkdir(parents=True)
    for name, rows in files.items():
        (ws / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    for src, dst in (("bioreasoner_corpus.jsonl", "corpus.jsonl"),
                     ("healthbench_sample.jsonl", "healthbench.jsonl"),
                     ("backend_roles.json", "backend_roles.json"),
                     ("grubrics_open.jsonl", "cache/grubrics_open.jsonl"),
                     ("grubrics_verifiable.jsonl", "cache/grubrics_verifiable.jsonl")):
        (ws / "data" / dst).write_text((FIXTURES / src).read_text())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """One folder for every page (qgen-human trains on from qgen-judge's run); a fake API."""
    ws = tmp_path_factory.mktemp("pages")
    for name in ("configs", "tests"):
        (ws / name).symlink_to(ROOT / name)
    data_files(ws)
    with FakeOpenAIServer(reply=judge_or_answer(5)) as api:
        yield {"dir": ws, "api": api, "done": set()}


@dataclass
class Page:
    """A shell session on one page: its environment, the servers it started, the repos it pushed."""
    ws: dict
    tiny: Path
    mp: pytest.MonkeyPatch  # the environment: export and NAME=VALUE
    urls: dict[str, str] = field(default_factory=dict)  # a URL on the page -> the server there
    pushed: dict[str, str] = field(default_factory=dict)  # a repo pushed to -> the folder pushed
    procs: list[subprocess.Popen] = field(default_factory=list)

    def text(self, token: str) -> str:
        """A token with the page's endpoints, pushed repos and hub datasets substituted."""
        for url, real in self.urls.items():
            token = token.replace(url, real)
        api = self.ws["api"]  # any other endpoint: the test's own fake API
        token = re.sub(r"https?://(?!127\.0\.0\.1)[^\s'\"]+",
                       lambda m: api.url if m.group().endswith("/v1") else api.root, token)
        for repo, folder in self.pushed.items():
            token = re.sub(rf"(?<![\w./-])(hf:)?{re.escape(repo)}(?![\w./-])", folder, token)
        for name, path in HUB_FILES.items():
            token = token.replace(f"={name}", f"={path}")
        return token

    def run(self, line: str, later: list[str]) -> None:
        argv = [self.text(t) for t in shlex.split(line, comments=True)]
        env = {}  # NAME=VALUE before a command: for that command only, as in a shell
        while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
            k, _, v = argv.pop(0).partition("=")
            env[k] = os.environ.get(k)
            self.mp.setenv(k, v)
        if argv[0] == "export":
            for item in argv[1:]:
                self.mp.setenv(*item.split("=", 1))
        elif argv[0] == "pip":
            return  # an install: not run
        elif argv[-1] == "&" or argv[2:4] == ["tools.ratings", "serve"]:  # its own terminal
            self.start(argv[:-1] if argv[-1] == "&" else argv)
        else:
            out = argv[argv.index(">") + 1] if ">" in argv else None
            argv = argv[:argv.index(">")] if out else argv
            code, said = self.call(argv, out, later)
            want = next((v for k, v in EXPECTED.items() if line.startswith(k)), (0, ""))
            assert (code, want[1] in said) == (want[0], True), f"{line}\n-> {code}: {said[-3000:]}"
        for k, v in env.items():
            self.mp.setenv(k, v) if v is not None else self.mp.delenv(k)

    def start(self, argv: list[str]) -> None:
        """A server the page starts in the background, on a free port instead of its own."""
        port = free_port()
        if "tools.ratings" in argv:
            argv += ["--port", str(port)]
            url = "http://127.0.0.1:8000"
        else:
            given = argv.index("--port")
            url, argv[given + 1] = f"http://127.0.0.1:{argv[given + 1]}", str(port)
        self.urls[url] = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, *argv[1:]], env={**os.environ,
                                "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/pending" if "tools.ratings"
                                       in argv else f"http://127.0.0.1:{port}/v1/models", timeout=1)
                return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.05)
        raise AssertionError(f"{argv} did not start")

    def call(self, argv: list[str], out: str | None, later: list[str]) -> tuple[int, str]:
        """Run one command in this process (a `python -c` in its own); -> (exit code, output)."""
        if argv[1] == "-c":
            done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True)
            Path(out or os.devnull).write_text(done.stdout)
            return done.returncode, done.stderr
        args = argv[3:] if argv[1] == "-m" else argv[2:]
        name = argv[2] if argv[1] == "-m" else argv[1].removesuffix(".py")
        main = {"train": train.main, "eval": ev.main}.get(name) or \
            importlib.import_module(name).main
        if name == "train":
            args = self.train_args(args, later)
        elif "--config" in args:
            size = f"{name} check" if args[0] == "check" else name
            args = [*self.substituted(args), *SMALL.get(size, [])]
        move_aside(outputs(name, args, out))
        said, err = io.StringIO(), io.StringIO()
        with redirect_stdout(said), redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:  # argparse's
                code = e.code
        if out:
            Path(out).write_text(said.getvalue())
        if "--push-to-hub" in args:  # the fake hub holds what was pushed: later commands read it
            self.pushed[args[args.index("--push-to-hub") + 1]] = args[args.index("--out") + 1]
        return code, said.getvalue() + err.getvalue()

    def substituted(self, args: list[str]) -> list[str]:
        """The page's arguments with the model, data rows and endpoints the test gives instead."""
        cfg = resolved(args)
        fixture = [] if Path(cfg.data.name or "").exists() else HUB.get(cfg.data.name, [])
        rows = [f"--{key}.select=[{a},{b}]" for key, sel in (("data", cfg.data.select),
                                                             ("eval", cfg.eval.select))
                for a, b in [ROWS.get(tuple(sel or ()), sel or (None, None))] if sel]
        model = [] if Path(cfg.model.name).exists() else [f"--model.name={self.tiny}"]
        sections = {"judge": cfg.judge, "eval.api": cfg.eval.api,
                    "precompute.answers": cfg.precompute.answers,
                    **{f"judges.{n}": j for n, j in cfg.judges.items()},
                    **{f"eval.apis.{n}": j for n, j in cfg.eval.apis.items()}}
        given = {a.split("=", 1)[0] for a in args}  # the page's own endpoint stays
        urls = [f"--{key}.base_url={self.ws['api'].url}" for key, s in sections.items()
                if s and s.base_url and f"--{key}.base_url" not in given]
        urls += [f"--{key}.requests_per_minute=null" for key, s in sections.items() if s]  # fakes'
        return [*fixture, *args, *rows, *model, *urls]

    def train_args(self, args: list[str], later: list[str]) -> list[str]:
        """--dry-run, unless a later command reads this run and it has none yet: then one step."""
        cfg = resolved(args)
        out = cfg.run.out_dir
        holds = (Path(out) / "metrics.jsonl").exists()
        real = (self.read_later(out, later) and not holds) or "--resume" in args
        return [*self.substituted(args), *(SMALL["train"] if real else ["--dry-run"])]

    def read_later(self, out: str, later: list[str]) -> bool:
        """A later command names the run's folder, starts from it (init_adapter) or resumes it."""
        if any(re.search(rf"(?<![\w./-]){re.escape(out)}(?![\w./-])", c) for c in later):
            return True
        for c in later:
            if c.startswith("python train.py"):
                cfg = resolved(shlex.split(c, comments=True)[2:])
                if cfg.model.init_adapter == out or (" --resume" in c and cfg.run.out_dir == out):
                    return True
        return False


def resolved(args: list[str]):
    """The config a command's --config and --section.key=value arguments make."""
    return load_config(args[args.index("--config") + 1],
                       [a for a in args if a.startswith("--") and "=" in a])


def outputs(name: str, args: list[str], out: str | None) -> list[str]:
    """What a command writes that must not be there yet (never overwritten)."""
    flags = {"tools.bestofn": ("--pairs", "--sft", "--out"), "tools.export": ("--out",)}
    paths = [args[i + 1] for i, a in enumerate(args) if a in flags.get(name, ())]
    paths += [a.split("=", 1)[1] for a in args if a.startswith("--precompute.out=")]
    if name == "eval":
        paths.append(resolved(args).eval.out_dir)
    return paths + ([out] if out else [])


def move_aside(paths: list[str]) -> None:
    for p in map(Path, paths):
        if p.exists():
            p.rename(p.with_name(f"{p.name}.earlier{time.monotonic_ns()}"))


def rate_on_the_page(page: Page) -> None:
    """People rate: two roles' questions queued as the human reward queues them, rated through
    the page the page's `tools.ratings serve` serves."""
    folder = Path("runs/qgen_human/ratings")
    roles = json.loads((FIXTURES / "backend_roles.json").read_text())[:2]
    items = [(f"r{i}q{j}", role["title"], f"Question {j} about {role['title']}?")
             for i, role in enumerate(roles) for j in range(2)]
    for id_, prompt, question in items:
        queue(folder, id_, 1, prompt, question, ["relevance", "clarity", "discriminative_power"])
    body = {"ratings": [{"id": id_, "scores": {"relevance": 5 - 3 * (id_[-1] == "1"), "clarity": 3,
                                                "discriminative_power": 4}}
                        for id_, _, _ in items]}
    url = page.urls["http://127.0.0.1:8000"]
    request = urllib.request.Request(f"{url}/api/rate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    assert json.loads(urllib.request.urlopen(request).read()) == {"saved": 4}


def run_page(name: str, ws: dict, tiny: Path, monkeypatch) -> None:
    page = Page(ws, tiny, monkeypatch)
    lines = commands(name)
    if any("tools.ratings serve" in line for line in lines):
        needs_page()  # the `ratings` extra
    try:
        for i, line in enumerate(lines):
            page.run(line, lines[i + 1:])
            if "tools.ratings serve" in line:
                rate_on_the_page(page)
            if "--eval.out_dir=runs/bestof4_bioreasoner" in line:  # stage 5's samples
                from tools.bestofn import key_of
                preds = jsonl.load("runs/bestof4_bioreasoner/predictions_base.jsonl")
                missing = [p["row"] for p in preds if not key_of(p, "prompt_id")]
                assert preds and not missing, f"no prompt_id, the merge's key, on rows {missing}"
            if line.startswith("python -m tools.bestofn runs/bestof4_bioreasoner/"):
                # the pairs a real model's samples would give, for the round's DPO to train on
                Path("data/dpo_v21_pairs.jsonl").write_text(
                    Path("data/dpo_distillation_pairs.jsonl").read_text())
    finally:
        for proc in page.procs:
            proc.terminate()
            proc.wait()
    ws["done"].add(name)


@pytest.mark.parametrize("name", PAGES)
def test_every_command_on_the_page_runs_as_written(name, workspace, tiny_llama, hub,  # noqa: F811
                                                   monkeypatch):
    monkeypatch.chdir(workspace["dir"])
    monkeypatch.delenv("HF_TOKEN")  # the fake hub's; a page sets its own where it needs one
    for tracker in ("wandb", "trackio"):
        fake_tracker(monkeypatch, tracker)
    before = STARTS_FROM.get(name)
    if before and before not in workspace["done"]:  # run alone (-k): the page it starts from first
        run_page(before, workspace, tiny_llama, monkeypatch)
    run_page(name, workspace, tiny_llama, monkeypatch)


def test_the_pages_commands_are_what_the_test_runs():
    """Each page is in PAGES, and every command starts with something the test knows how to run."""
    assert sorted(PAGES) == sorted(p.stem for p in (ROOT / "docs/recipes").glob("*.md"))
    known = ("python train.py ", "python eval.py ", "python -m tools.", "python -c ",
             "python tests/fake_openai_server.py ", "pip install ", "export ", "HF_TOKEN=")
    for name in PAGES:
        for line in commands(name):
            assert line.startswith(known), (name, line)
