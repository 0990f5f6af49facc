"""run/folder_lock.py with real processes: a folder held by one process is refused to another with
one line naming it, a kill -9 frees it, a release leaves nothing it made; train.py started twice
on one run.out_dir trains once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from config import ConfigError
from run import folder_lock

ROOT = Path(__file__).resolve().parent.parent
HOLDER = ("import sys, time; from run import folder_lock; "
          "folder_lock.take(sys.argv[1], 'run.out_dir'); print('held', flush=True); "
          "time.sleep(600)")


def start_holder(folder: Path) -> subprocess.Popen:
    """Another process that holds `folder` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "held\n"
    return proc


def killed(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_held_folder_is_refused_naming_its_holder_until_a_kill_9_frees_it(tmp_path):
    folder = tmp_path / "run"
    holder = start_holder(folder)
    try:
        with pytest.raises(ConfigError) as refused:
            folder_lock.take(folder, "run.out_dir")
        assert str(refused.value).startswith(f"run.out_dir={folder} is in use by -c (pid "
                                             f"{holder.pid} on ")
        assert str(refused.value).endswith("; wait for it to end or stop it, or set another "
                                           "run.out_dir")
    finally:
        killed(holder)
    assert (folder / folder_lock.NAME).exists()  # left by the kill -9, and no longer held
    folder_lock.take(folder, "run.out_dir")
    assert f"pid {os.getpid()} " in (folder / folder_lock.NAME).read_text()
    folder_lock.release()
    assert list(folder.iterdir()) == []  # the lock file goes; the folder was not take()'s


def test_a_release_removes_the_folders_take_made_unless_something_else_is_in_them(tmp_path):
    folder_lock.take(tmp_path / "runs" / "a", "run.out_dir")
    folder_lock.release()
    assert list(tmp_path.iterdir()) == []
    folder_lock.take(tmp_path / "runs" / "b", "run.out_dir")
    (tmp_path / "runs" / "b" / "config.yaml").write_text("")
    folder_lock.release()
    assert [p.name for p in (tmp_path / "runs" / "b").iterdir()] == ["config.yaml"]


def test_a_dry_run_and_torchruns_other_ranks_take_nothing(tmp_path, monkeypatch):
    folder_lock.take(tmp_path / "a", "run.out_dir", dry_run=True)
    monkeypatch.setenv("RANK", "1")
    folder_lock.take(tmp_path / "b", "run.out_dir")
    assert folder_lock.HELD == [] and list(tmp_path.iterdir()) == []


def test_the_process_holding_a_folder_takes_it_again_at_no_cost(tmp_path):
    folder_lock.take(tmp_path / "a", "run.out_dir")
    folder_lock.take(tmp_path / "x" / ".." / "a", "run.out_dir")  # not a second lock: no refusal
    assert len(folder_lock.HELD) == 1
    folder_lock.release()


def test_a_file_system_without_locks_is_said_and_its_folder_still_goes_if_unused(
        tmp_path, monkeypatch, capsys):
    def no_locks(fd, how):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    folder_lock.take(tmp_path / "new" / "run", "run.out_dir")
    assert capsys.readouterr().err == (f"[minigrpo] warning: {tmp_path / 'new' / 'run'} cannot be "
                                       "locked (Function not implemented): make sure no other "
                                       "process writes in it\n")
    folder_lock.release()  # a run that stopped with nothing kept leaves no folder it made
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def config(tmp_path, tiny_llama) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + 1?", "answer": str(a + 1)})
                            + "\n" for a in range(8)))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": str(tiny_llama)}, "lora": {"r": 4, "alpha": 8},
        "data": {"name": str(data), "prompt": "{question}"},
        "rollout": {"prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4},
        "run": {"out_dir": str(tmp_path / "run"), "steps": 1000, "save_every": 1,
                "threads": 1},
        "rewards": [{"name": "answer_match"}]}))
    return path


def test_a_second_trainer_on_a_run_folder_exits_2_naming_the_first_and_after_a_kill_9_resumes(
        config, tmp_path, capsys):
    import train
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "train.py", "--config", str(config)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step_000001").exists():  # training, and saved a step
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert train.main(["--config", str(config), "--resume", "--run.steps=2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: run.out_dir={run} is in use by train.py (pid "
                                  f"{first.pid} on ") and len(err) == 1
    finally:
        killed(first)
    done = len((run / "metrics.jsonl").read_text().splitlines())
    assert train.main(["--config", str(config), "--resume", f"--run.steps={done + 1}"]) == 0
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == done + 1
    assert not (run / folder_lock.NAME).exists()
