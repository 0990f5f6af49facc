"""The T4 user's path, run for real on a CPU: float16 compute with fp16's loss scaling (torch's
GradScaler takes device "cpu"), its overflow and its checkpointed state; and configs/t4.yaml (NF4
with fp16) for 3 steps on the built-in SmolLM2-135M and the GSM8K fixture (configs/colab_t4.yaml,
fp16 alone, trains in tests/test_notebook.py's run of the notebook): model, data and sizes made
small, and two test props (small() says why); every other setting as written. Bad T4 input: one
line, exit 2. Only a GPU's speed needs a GPU: nothing here skips on a CPU.

    python -m pytest tests/test_t4.py
"""
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
from run import policy
from test_interrupts import lines, same_as_uninterrupted, uninterrupted
from test_step import make_run

ROOT = Path(__file__).resolve().parent.parent
GSM8K = ROOT / "tests" / "fixtures" / "gsm8k_sample.jsonl"


def lora_weights(run_dir: Path, step_n: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"checkpoints/step_{step_n:06d}/adapter/adapter_model.safetensors")


def rules(r) -> policy.Policy:
    return policy.Policy(r.cfg.run, 0, held_out=False, clock=policy.Clock(time.monotonic()))


def test_float16_on_a_cpu_scales_the_loss_and_logs_the_scale(tmp_path, tiny_llama):
    """model.dtype=float16 makes the GradScaler on any device (it was made on CUDA only, so a CPU
    trained fp16 unscaled and the T4's scaled path never ran); loss_scale is on every step line."""
    r = make_run(tmp_path, tiny_llama, "--model.dtype=float16")
    assert isinstance(r.scaler, torch.amp.GradScaler) and r.scaler.get_scale() == 65536.0
    assert {p.dtype for p in r.params} == {torch.float32}  # LoRA weights fp32, the base fp16
    m, _ = train.step_metrics(r, step.train_step, rules(r))
    assert m["loss_scale"] == 65536.0 and m["grad_norm"] > 0
    assert make_run(tmp_path / "fp32", tiny_llama).scaler is None


def test_an_fp16_overflow_halves_the_scale_skips_the_update_and_counts_it(tmp_path, tiny_llama):
    """A loss scale so large that the backward through the float16 layers overflows: GradScaler
    finds inf gradients, skips the optimizer step (no trained weight moves), halves its scale, and
    the step logs skipped_updates; the next step, at a scale that fits, trains."""
    r = make_run(tmp_path, tiny_llama, "--model.dtype=float16", "--optim.lr=0.01")
    r.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    before = [p.detach().clone() for p in r.params]
    m, _ = train.step_metrics(r, step.train_step, rules(r))
    assert m["skipped_updates"] == 1 and "grad_norm" not in m and m["loss_scale"] == 2.0**99
    assert all(torch.equal(a, p) for a, p in zip(before, r.params))
    r.scaler.update(2.0**10)
    r.step += 1
    m, _ = train.step_metrics(r, step.train_step, rules(r))
    assert "skipped_updates" not in m and m["grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, r.params))


@pytest.mark.parametrize("model", [{"dtype": "float16"}, {"dtype": "float16", "quant": "4bit"}],
                         ids=["fp16", "nf4_fp16"])
def test_kill_9_then_resume_under_fp16_ends_as_the_uninterrupted_run(tmp_path, tiny_llama, model):
    """A real process killed (SIGKILL, nothing of its own runs) after its step-2 checkpoint, then
    --resume: the scaler's state comes back with the weights, optimizer and RNG, so the later steps
    and the final weights equal an uninterrupted run's (fp16, and fp16 over an NF4 base as
    configs/t4.yaml)."""
    cfg = write_run_config(tmp_path, tiny_llama, model=model,
                           run={"steps": 4, "save_every": 1, "threads": 1},
                           rollout={"max_new_tokens": 16})
    whole, cut = uninterrupted(["--config", str(cfg)], tmp_path), tmp_path / "cut"
    cmd = [sys.executable, "train.py", "--config", str(cfg), f"--run.out_dir={cut}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (cut / "checkpoints/step_000002/trainer_state.pt").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "no step-2 checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = max(int(p.name[5:]) for p in (cut / "checkpoints").glob("step_*[0-9]"))
    assert kept < 4, "the kill came after the run's end: nothing was interrupted"
    assert subprocess.run(cmd + ["--resume"], cwd=ROOT, capture_output=True).returncode == 0
    b = lines(cut / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4] and all("loss_scale" in m for m in b)
    same_as_uninterrupted(cut, whole)  # metrics but timings, and the last adapter, equal
    state = torch.load(cut / "checkpoints/step_000004/trainer_state.pt", weights_only=False)
    assert state["scaler"]["scale"] == whole[0][-1]["loss_scale"]


# ------------------------------------------------------------- the T4 configs, 3 steps each


def small(config: str, out: Path) -> Path:
    """configs/<config>.yaml as written, but for the model, data and sizes, and two test props (as
    bench/t4_profile/colab_check.yaml has on a GPU): GSM8K's rewards are 0 on every completion of a
    135M model, so a reward that varies on any text (vowel_share) gives the groups spread and the
    gradients something to carry; and the built-in model seldom closes its <think> within a test's
    12 tokens, so "." also ends a completion (gsm8k.yaml masks the truncated ones out of the loss).
    """
    child = out.parent / f"{config}_small.yaml"
    child.write_text(f"""extends: {ROOT / "configs" / f"{config}.yaml"}
model: {{name: smollm2-135m}}
data: {{name: {GSM8K}, select: [0, 30]}}
eval: {{split: null, select: [30, 40]}}
rollout: {{prompts_per_step: 1, num_generations: 2, max_new_tokens: 16, stop_strings: [".", ","]}}
optim: {{micro_batch_size: 8}}
run: {{out_dir: {out}, steps: 3, save_every: 1, max_minutes: 0, sample_every: 1}}
rewards: [{{name: bench/t4_profile/t4_check.py:vowel_share, weight: 1.0}}]
""")
    return child


@pytest.mark.parametrize("config", ["t4"])  # colab_t4 (fp16 alone): tests/test_notebook.py's run
def test_the_t4_configs_train_three_steps_on_the_built_in_model_and_checkpoint_the_scaler(
        tmp_path, config, monkeypatch):
    """The T4 config (an NF4 base under fp16, gradient checkpointing) for 3 steps: the completions
    end, gradients reach the LoRA weights and only them, the loss scale is logged, and the
    checkpoints hold the scaler. (That a checkpoint resumes exactly under both is the kill -9
    test's, on the tiny model: a resumed step here would cost CI another ~15 s of fp16 on a CPU.)"""
    out = tmp_path / config
    args = ["--config", str(small(config, out))]
    graded, trainable, real_step = set(), set(), step.optimizer_step

    def optimizer_step(r):  # the parameters a gradient reached, at each update
        graded.update(n for n, p in r.model.named_parameters()
                      if p.grad is not None and p.grad.abs().max() > 0)
        trainable.update(n for n, p in r.model.named_parameters() if p.requires_grad)
        return real_step(r)
    monkeypatch.setattr(step, "optimizer_step", optimizer_step)
    assert train.main(args) == 0
    # B starts at 0, so A's gradient is 0 until an update moves B (fp16's first may be skipped)
    assert {n for n in trainable if "lora_B" in n} <= graded <= trainable
    assert all(".lora_" in n for n in trainable)
    monkeypatch.undo()
    ms = lines(out / "metrics.jsonl")
    assert [m["step"] for m in ms] == [1, 2, 3]
    assert all(m["completions/clipped_ratio"] < 1 for m in ms)  # some completions ended
    assert all(m["loss_scale"] > 0 for m in ms) and any(m.get("grad_norm", 0) > 0 for m in ms)
    start, end = lora_weights(out, 1), lora_weights(out, 3)
    assert end and all(".lora_" in k for k in end)  # the trained weights saved: LoRA's alone
    assert all(not torch.equal(start[k], end[k]) for k in end if "lora_B" in k)
    saved = yaml_of(out / "config.yaml")["model"]
    assert saved["dtype"] == "float16" and saved["quant"] == ("4bit" if config == "t4" else None)
    state = torch.load(out / "checkpoints/step_000003/trainer_state.pt", weights_only=False)
    assert state["scaler"]["scale"] == ms[-1]["loss_scale"]


def yaml_of(path: Path) -> dict:
    import yaml
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("flags, said", [
    (["--model.quant=4bit", "--lora.enabled=false"], "model.quant=4bit trains through LoRA only"),
    (["--model.dtype=float16", "--lora.enabled=false"], "needs fp32 master weights"),
    (["--model.quant=4bit", "no bitsandbytes"], "needs the bitsandbytes package: pip install"),
    (["--model.quant=4bit", "bitsandbytes 0.45.5"], "on a CPU needs bitsandbytes >= 0.46.0"),
], ids=["4bit_full", "fp16_full", "no_bnb", "old_bnb"])
def test_a_t4_setting_this_machine_cannot_run_is_one_line_and_exit_2(tmp_path, tiny_llama,
                                                                     monkeypatch, capsys, flags,
                                                                     said):
    import importlib.metadata
    import importlib.util
    real_spec, real_version = importlib.util.find_spec, importlib.metadata.version
    if "no bitsandbytes" in flags:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                            if name == "bitsandbytes" else real_spec(name, *a))
    if "bitsandbytes 0.45.5" in flags:
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.45.5"
                            if name == "bitsandbytes" else real_version(name))
    out = tmp_path / "run"
    cfg = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(out)})
    assert train.main(["--config", str(cfg), *(f for f in flags if f.startswith("--"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert said in err[-1] and err[-1].startswith("error: ") and not out.exists()
