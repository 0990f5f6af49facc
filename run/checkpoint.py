"""Checkpoints: atomic saves, loading for --resume, and trimming the run's logs (jsonl.py) back to
the checkpoint.

    checkpoints/step_NNNNNN/   adapter/ (or model/), trainer_state.pt (optimizer, scheduler, scaler,
                               RNG states, step, data position, the judges' run totals and
                               whether each has answered; under torchrun each process's own in
                               "ranks"), config.yaml
    (run.keep_checkpoints newest are whole; older keep adapter/ and config.yaml, run.keep_adapters)

A checkpoint is written into step_NNNNNN.tmp/, every file fsynced, then renamed: a kill leaves the
last complete checkpoint and at most a .tmp directory, which is ignored and cleaned up. Used by
train.py (run.save_every, --resume); eval.py and tools/export.py find the newest one through
model.py.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from config import ConfigError, save_config
from files import jsonl
from model import is_peft
from parallel import distributed
from sources.adapters import PROVENANCE, save_adapter

if TYPE_CHECKING:
    from run.state import Run


def checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints that --resume can continue from, oldest first: complete (a .tmp directory is an
    interrupted write) and holding their trainer state (an older one may keep only its adapter)."""
    d = run_dir / "checkpoints"
    return sorted(p for p in d.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "trainer_state.pt").is_file()) if d.is_dir() else []


def prune(ckpt: Path, keep_adapter: bool) -> None:
    """An old checkpoint: keep only its adapter/ and config.yaml (for eval.py: RL runs often peak
    before their last step), or delete it. The trainer state goes first, so a kill mid-way leaves a
    checkpoint that --resume ignores, never one it would take as complete."""
    # full fine-tuning saves whole models: too big to keep
    if not (keep_adapter and (ckpt / "adapter").is_dir()):
        shutil.rmtree(ckpt, ignore_errors=True)
        return
    (ckpt / "trainer_state.pt").unlink(missing_ok=True)
    shutil.rmtree(ckpt / "model", ignore_errors=True)


def save_checkpoint(r: Run, step: int, own: dict | None = None) -> Path:
    """checkpoints/step_NNNNNN/: adapter (or model), trainer_state.pt, config.yaml; atomic via
    .tmp + rename. Under torchrun every rank calls it (each sends its own state) and rank 0
    writes. `own`: this process's rank_state as `step` ended (a stop's checkpoint, written after
    the next step's sampling has moved it: run/interrupts.py); None: as it is now."""
    cfg, ranks = r.cfg, distributed.gather(rank_state(r) if own is None else own)
    final = r.run_dir / "checkpoints" / f"step_{step:06d}"
    if distributed.rank() > 0:
        return final
    tmp = final.with_name(final.name + ".tmp")
    for stale in final.parent.glob("step_*.tmp"):  # from a kill or failed write: their space first
        shutil.rmtree(stale, ignore_errors=True)
    try:
        _write(r, tmp, step, ranks)
    except BaseException as e:  # Ctrl-C, a full disk: no half checkpoint left, holding the space
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):  # Ctrl-C, SIGTERM: never a disk error, whatever it stopped
            raise
        cause = _os_error(e)  # torch.save wraps it in a RuntimeError
        if cause is None:  # a bug: its own traceback
            raise
        free = shutil.disk_usage(final.parent).free / 2**20 if final.parent.is_dir() else 0
        raise OSError(cause.errno, f"cannot write checkpoint {final} ({cause.strerror or cause}; "
                      f"{free:.0f} MiB free there)") from e
    shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    for old in checkpoints(r.run_dir)[: -cfg.run.keep_checkpoints]:
        prune(old, cfg.run.keep_adapters)
    return final


def _os_error(e: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError (a full disk, a read-only folder) in e or what it was raised from, if any."""
    if e is None or depth > 5:
        return None
    if isinstance(e, OSError):
        return e
    if m := re.search(r"\(os error (\d+)\)", str(e)):  # safetensors' Rust I/O error, as text
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    return _os_error(e.__cause__ or e.__context__, depth + 1)


def rank_state(r: Run) -> dict:
    """What each process has of its own: RNG states, data position, its judges' run totals and
    whether each has answered (a resumed run then waits for one that is down: scoring/outage.py)."""
    return {"data_position": r.sampler.state(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "judge_totals": {name: dict(j.totals) for name, j in r.judges.items()},
            "judge_answered": {name: j.has_answered for name, j in r.judges.items()}}


def _write(r: Run, tmp: Path, step: int, ranks: list[dict]) -> None:
    model, optimizer, scheduler, scaler, cfg = r.model, r.optimizer, r.scheduler, r.scaler, r.cfg
    tmp.mkdir(parents=True)
    if is_peft(model):
        save_adapter(model, tmp / "adapter")
    else:
        model.save_pretrained(tmp / "model")
        r.tokenizer.save_pretrained(tmp / "model")  # a full model directory: eval.py, export
        # --resume checks the base
        (tmp / "model" / PROVENANCE).write_text(json.dumps(model.minigrpo_base, indent=1))
    if r.ref_copy is not None and cfg.mode == "grpo" and cfg.grpo.sync_ref_model:  # it moved
        with open(tmp / "reference.pt", "wb") as f:  # load_checkpoint puts it back
            torch.save(r.ref_copy.state_dict(), f)
    state = {  # rank 0's own state at the top (judge_*_total goes on from here), all in "ranks"
        "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler else None, **ranks[0],
        **({"world_size": len(ranks), "ranks": ranks} if len(ranks) > 1 else {})}
    with open(tmp / "trainer_state.pt", "wb") as f:  # a file object: a write error raises OSError
        torch.save(state, f)
    save_config(cfg, tmp / "config.yaml")
    for f in tmp.rglob("*"):  # on disk before the rename makes the checkpoint visible
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())


def load_checkpoint(ckpt: Path, model, optimizer, scaler) -> dict:
    """Weights, optimizer, scaler and RNG states back in place; the returned state holds the step
    and the data position (the caller rebuilds the schedule from the step and the config; the saved
    scheduler state is kept for inspection only)."""
    from safetensors.torch import load_file
    if is_peft(model):
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(model, load_file(ckpt / "adapter" / "adapter_model.safetensors"))
    else:
        state = {}
        for f in sorted((ckpt / "model").glob("*.safetensors")):
            state.update(load_file(f))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(k for k in missing if "lm_head" not in k):
            raise ConfigError(f"checkpoint {ckpt} does not match the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if "judge_answered" not in state:  # the judges' state as kept since b005882 (2026-11-28)
        raise ConfigError(f"{ckpt} was saved by an older minigrpo (before commit b005882); resume "
                          "it with the minigrpo that wrote it, or start a new run.out_dir")
    distributed.check_world(state.get("world_size", 1), ckpt)
    state |= state["ranks"][distributed.rank()] if "ranks" in state else {}  # this rank's own
    optimizer.load_state_dict(state["optimizer"])
    if scaler and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def keep_lines_up_to(path: Path, step: int) -> None:
    """On resume, drop log lines of steps after the checkpoint (they will be redone), and lines torn
    by a kill. Atomic rewrite."""
    if not path.exists():
        return
    kept = [rec for _, _, rec in jsonl.read(path)
            if rec is not None and isinstance(rec.get("step"), int) and rec["step"] <= step]
    jsonl.write_records(path, kept)
