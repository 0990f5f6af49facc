"""run/interrupts.py: Ctrl-C and SIGTERM keep the last finished step, saved with the state it ended
in, so --resume goes on as the uninterrupted run; a stop while a step updates waits for it to be
logged and saved; a second stop while the stop's checkpoint is written leaves the one before it
whole. Real signals, on a tiny random Llama: a train.py process, and train.main in this one."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import step
import train
from conftest import write_run_config
from modes import sft
from run import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TIMING = {"step_time", "rollout_time", "rollout_tokens_per_s", "peak_memory_mb"}
SLOW = ("import time\n\n\ndef slow(completion, sample):\n    time.sleep(0.05)\n"
        "    return 1.0 / (1 + len(completion))\n")


@pytest.fixture
def config(tmp_path, tiny_llama):
    """A 4-step GRPO run with no periodic checkpoint; its reward sleeps 50 ms a completion, so a
    step spends most of its time scoring, as real ones do."""
    (tmp_path / "slow.py").write_text(SLOW)
    path = write_run_config(tmp_path, tiny_llama, run={"steps": 4, "save_every": 1000,
                                                       "threads": 1})
    return ["--config", str(path), f"--rewards=[{{name: '{tmp_path / 'slow.py'}:slow'}}]"]


def lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def without_timing(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in metrics]


def names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def uninterrupted(args: list[str], tmp_path: Path, *extra: str) -> tuple[list[dict], dict]:
    """The same run without a stop -> its metrics, its last adapter."""
    run = tmp_path / "whole"
    assert train.main([*args, f"--run.out_dir={run}", *extra]) == 0
    last = names(run)[-1]
    return lines(run / "metrics.jsonl"), load_file(
        run / "checkpoints" / last / "adapter/adapter_model.safetensors")


def same_as_uninterrupted(run: Path, whole: tuple[list[dict], dict]) -> None:
    metrics, adapter = whole
    assert without_timing(lines(run / "metrics.jsonl")) == without_timing(metrics)
    resumed = load_file(run / "checkpoints" / names(run)[-1] / "adapter/adapter_model.safetensors")
    assert resumed.keys() == adapter.keys()
    assert all(torch.equal(resumed[k], adapter[k]) for k in adapter)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stopped_train_py_saves_its_last_logged_step_and_resume_ends_as_the_uninterrupted_run(
        config, tmp_path, sig):
    """train.py stopped after its second metrics line (most likely while step 3 scores): exit 130
    (143), one line ending in the resume command, a checkpoint at the last logged step though
    run.save_every is far, the prompts trained on recorded; --resume ends where the
    uninterrupted run does, metrics and adapter alike."""
    run = tmp_path / "run"
    args = [*config, f"--run.out_dir={run}"]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() \
                or len((run / "metrics.jsonl").read_text().splitlines()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(getattr(signal, sig))
        err = proc.communicate(timeout=60)[1].strip().splitlines()
    finally:
        proc.kill()
    assert proc.returncode == (130 if sig == "SIGINT" else 143)
    done = lines(run / "metrics.jsonl")[-1]["step"]
    assert done in (2, 3) and names(run) == [f"step_{done:06d}"]
    assert err[-1].startswith(f"[minigrpo] interrupted ({'Ctrl-C' if sig == 'SIGINT' else sig}) ")
    assert shlex.split(err[-1].split("go on with: ")[1]) == [sys.executable, "train.py", *args,
                                                             "--resume"]
    assert "Traceback" not in "\n".join(err) and (run / "trained_prompts.txt").is_file()
    assert train.main([*args, "--resume"]) == 0
    same_as_uninterrupted(run, uninterrupted(config, tmp_path))


def test_a_stop_while_a_step_scores_drops_it_and_saves_the_state_the_step_before_ended_in(
        config, tmp_path, capsys, monkeypatch):
    """SIGINT once step 3 has drawn its prompts and sampled (the RNG states and data position have
    moved): step 3 is dropped, step 2 saved as it ended, and --resume reproduces the uninterrupted
    run exactly."""
    run, real = tmp_path / "run", step.score
    args = [*config, f"--run.out_dir={run}"]

    def score(r, idx):
        scored = real(r, idx)
        if r.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return scored
    monkeypatch.setattr(step, "score", score)
    assert train.main(args) == 130
    err, ckpt = capsys.readouterr().err.strip().splitlines()[-1], run / "checkpoints/step_000002"
    assert err.startswith("[minigrpo] interrupted (Ctrl-C) during step 3 (dropped); step 2, the "
                          f"last finished, saved in {ckpt}: go on with: ")
    assert [m["step"] for m in lines(run / "metrics.jsonl")] == [1, 2]
    monkeypatch.setattr(step, "score", real)
    whole = uninterrupted(config, tmp_path)
    assert train.main([*args, "--resume"]) == 0
    same_as_uninterrupted(run, whole)


@pytest.fixture
def sft_args(tmp_path, tiny_llama):
    """The same rows for SFT: 4 a step, the reply "The answer is N."."""
    (tmp_path / "sft").mkdir()
    path = write_run_config(tmp_path / "sft", tiny_llama, run={"save_every": 1000, "threads": 1})
    return ["--config", str(path), "--mode=sft", "--data.prompt=question",
            "--data.target=The answer is {answer}.", "--sft.batch_size=4", "--rewards=[]"]


@pytest.mark.parametrize("mode", ["grpo", "sft"])
def test_a_stop_while_a_step_updates_waits_for_the_step_to_be_logged_and_saved(
        mode, config, sft_args, tmp_path, capsys, monkeypatch):
    """SIGINT inside step 2's optimizer update (GRPO's step, and SFT's through the same loop): the
    update ends, step 2 is logged and saved whole, exit 130; --resume then ends as the
    uninterrupted run."""
    args = config if mode == "grpo" else sft_args
    run, where = tmp_path / "run", step if mode == "grpo" else sft
    real = where.optimizer_step

    def optimizer_step(r):
        if r.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(r)
    monkeypatch.setattr(where, "optimizer_step", optimizer_step)
    assert train.main([*args, f"--run.out_dir={run}", "--run.steps=3"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert "[minigrpo] Ctrl-C: the run stops once step 2 is logged and saved; Ctrl-C again stops " \
           "at once, from the last checkpoint" in err
    assert err[-1].startswith("[minigrpo] interrupted (Ctrl-C) after step 2; step 2, the last "
                              "finished, saved in ")
    assert [m["step"] for m in lines(run / "metrics.jsonl")] == [1, 2]
    assert names(run) == ["step_000002"]
    monkeypatch.setattr(where, "optimizer_step", real)
    whole = uninterrupted(args, tmp_path, "--run.steps=3")
    assert train.main([*args, f"--run.out_dir={run}", "--run.steps=3", "--resume"]) == 0
    same_as_uninterrupted(run, whole)


def test_a_second_stop_while_the_stop_saves_leaves_the_checkpoint_before_whole(
        config, tmp_path, capsys, monkeypatch):
    """Step 4 stopped while it scores; a second Ctrl-C inside the save of step 3: no step_*.tmp,
    step 2's checkpoint untouched byte for byte, one line (no traceback) that says so and names
    the checkpoint --resume takes; --resume goes on from it."""
    run, real_score, real_save = tmp_path / "run", step.score, torch.save
    args = [*config, f"--run.out_dir={run}", "--run.save_every=2"]
    before = {}

    def score(r, idx):
        if r.step == 4:
            before.update({p: p.read_bytes() for p in (run / "checkpoints").rglob("*")
                           if p.is_file()})
            os.kill(os.getpid(), signal.SIGINT)
        return real_score(r, idx)

    def save(obj, f, *a, **k):
        if before:  # the stop's own save
            raise KeyboardInterrupt
        return real_save(obj, f, *a, **k)
    monkeypatch.setattr(step, "score", score)
    monkeypatch.setattr(checkpoint.torch, "save", save)
    assert train.main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()
    ckpt = run / "checkpoints/step_000002"
    assert err[-1].startswith("[minigrpo] interrupted (Ctrl-C) during step 4 (dropped), and again "
                              f"while saving step 3 (not saved); --resume goes on from {ckpt}: go "
                              "on with: ")
    assert "Traceback" not in "\n".join(err) and names(run) == ["step_000002"]
    assert before and before == {p: p.read_bytes() for p in (run / "checkpoints").rglob("*")
                                 if p.is_file()}
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    monkeypatch.setattr(step, "score", real_score)
    assert train.main([*args, "--resume"]) == 0
    assert [m["step"] for m in lines(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_stop_before_any_step_ends_keeps_nothing_and_a_saved_step_is_not_saved_again(
        config, tmp_path, capsys, monkeypatch):
    """A stop in step 1 is today's: nothing of the run kept. A stop in step 3 of a run that saved
    step 2 names that checkpoint and leaves it as it was. A second stop inside an update stops
    at once, from the last checkpoint (the weights may be half updated)."""
    run, real = tmp_path / "run", step.score
    args = [*config, f"--run.out_dir={run}"]
    at = {"step": 1}

    def score(r, idx):
        if r.step == at["step"]:
            os.kill(os.getpid(), signal.SIGINT)
        return real(r, idx)
    monkeypatch.setattr(step, "score", score)
    assert train.main(args) == 130
    assert capsys.readouterr().err.strip().endswith(
        "stopped at step 1, before any checkpoint (nothing of the run was kept): run the same "
        "command to start again") and not run.exists()

    at["step"] = 3
    assert train.main([*args, "--run.save_every=2"]) == 130
    ckpt = run / "checkpoints/step_000002"
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"[minigrpo] interrupted (Ctrl-C) during step 3 (dropped); step 2 is saved in {ckpt}: ")
    assert names(run) == ["step_000002"]

    monkeypatch.setattr(step, "score", real)
    real_step = step.optimizer_step

    def twice(r):
        if r.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(r)
    monkeypatch.setattr(step, "optimizer_step", twice)
    assert train.main([*args, "--run.save_every=2", "--resume"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: interrupted (Ctrl-C) twice, the second while step 3 updated the weights; stopped "
        f"at step 3, the last checkpoint in {run}: go on with: ")
    assert names(run) == ["step_000002"] and len(lines(run / "metrics.jsonl")) == 2
