"""CUDA-only checks: bf16 training through train.py, prompt sharing and the fused head on the GPU,
QLoRA through bitsandbytes, and a reward model in bf16. Each test skips cleanly where there is no
CUDA GPU (CI, CPUs); the lent GPU machine runs them with `pytest -q tests/test_gpu.py`
(bench/RESULTS.md, "GPU")."""
import json
import math

import pytest
import torch

import logprobs
import train
from config import LoraConfig, ModelConfig
from conftest import write_run_config as run_config
from model import load_policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def trained(ms: list[dict]) -> bool:
    """Some update was applied: a step whose every update fp16's loss scaling skipped logs no
    grad_norm (its finiteness checks above pass on nothing)."""
    return any("grad_norm" in m for m in ms)


def test_bf16_training_run_on_cuda(tmp_path, tiny_llama):
    """dtype auto picks bf16 on an Ampere+ GPU; two steps train, log GPU memory, save an adapter."""
    out = tmp_path / "run"
    assert train.main(["--config", str(run_config(tmp_path, tiny_llama)),
                       f"--run.out_dir={out}"]) == 0
    ms = metrics(out)
    assert len(ms) == 2 \
        and all(m["peak_memory_mb"] > 0 and math.isfinite(m.get("grad_norm", 0.0)) for m in ms)
    assert trained(ms)
    assert any(out.rglob("adapter_model.safetensors"))


def test_prompt_sharing_matches_one_pass_on_cuda(tiny_llama):
    """Shared-prompt log-probs and LoRA gradients equal the one-pass path's on the GPU (fp32)."""
    from test_share_prompt import grouped_batch, log_probs_and_grads
    model, tok = load_policy(ModelConfig(name=str(tiny_llama), dtype="float32"),
                             LoraConfig(r=4, alpha=8), CUDA)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    ids, attn, C = grouped_batch(tok, ["What is 2 + 3? Reply with just the number.", "Hello"],
                                 [3, 2],
                                 ["5", "The answer is 5.", "42 0 1", "world", "0 1 2 3 4 5 6"])
    ids, attn = ids.to(CUDA), attn.to(CUDA)
    weights = torch.linspace(-1, 1, ids.shape[0] * C, device=CUDA).view(-1, C)
    for fused in (False, True):
        a, ga = log_probs_and_grads(model, ids, attn, C, weights, fused_head=fused)
        b, gb = log_probs_and_grads(model, ids, attn, C, weights, fused_head=fused,
                                    share_prompt=True)
        assert torch.allclose(a, b, atol=1e-4) and ga.keys() == gb.keys() and ga
        assert all((ga[k] - gb[k]).abs().max() <= 1e-3 * ga[k].abs().max() for k in ga)


def test_fused_head_matches_the_logits_path_in_bf16():
    """A vocabulary of Qwen's size in bf16: the fused head's log-probs match the full logits' (fp32
    softmax)."""
    torch.manual_seed(0)
    N, C, H, V = 4, 64, 256, 151936
    hidden = torch.randn(N, C, H, device=CUDA, dtype=torch.bfloat16)
    weight = (torch.randn(V, H, device=CUDA) / H**0.5).to(torch.bfloat16)
    targets = torch.randint(0, V, (N, C), device=CUDA)
    head = torch.nn.Linear(H, V, bias=False, device=CUDA, dtype=torch.bfloat16)
    head.weight.data.copy_(weight)
    want = torch.log_softmax((hidden @ weight.T).float() / 0.7, -1).gather(
        -1, targets[..., None])[..., 0]
    got = logprobs.fused_head_log_probs(hidden, head, targets, 0.7, 1024)
    assert got.shape == (N, C) and (got.float() - want).abs().max() < 0.05


def test_qlora_4bit_trains_on_cuda(tmp_path, tiny_llama):
    """model.quant=4bit loads NF4 base weights through bitsandbytes and trains fp32 LoRA weights
    over them."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    cfg = run_config(tmp_path, tiny_llama,
                     model={"quant": "4bit", "dtype": "float16", "gradient_checkpointing": True},
                     optim={"micro_batch_size": 2})
    assert train.main(["--config", str(cfg), f"--run.out_dir={out}"]) == 0
    ms = metrics(out)
    assert len(ms) == 2 and all(math.isfinite(m.get("grad_norm", 0.0)) for m in ms) and trained(ms)


@pytest.mark.parametrize("model", [{"dtype": "bfloat16"}, {"quant": "4bit", "dtype": "float16",
                                                           "gradient_checkpointing": True}],
                         ids=["bf16", "qlora_fp16"])
def test_dpo_starts_at_log2_and_trains_on_cuda(tmp_path, tiny_llama, model):
    """mode: dpo in bf16 and over a 4-bit base with fp16's GradScaler: the reference (adapter off)
    is the policy at the first step, so the loss is log 2 up to half-precision rounding."""
    if model.get("quant"):
        pytest.importorskip("bitsandbytes")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "chosen": str(a + 1),
                                         "rejected": "No idea."}) + "\n" for a in range(8)))
    out = tmp_path / "run"
    cfg = run_config(tmp_path, tiny_llama, model=model,
                     data={"name": str(pairs), "prompt": "prompt", "chosen": "chosen",
                           "rejected": "rejected", "answer_key": None}, dpo={"batch_size": 4},
                     optim={"micro_batch_size": 2})
    assert train.main(["--config", str(cfg), "--mode=dpo", "--run.steps=3",
                       f"--run.out_dir={out}"]) == 0
    ms = metrics(out)
    assert ms[0]["loss"] == pytest.approx(0.6931, abs=2e-3) \
        and all(math.isfinite(m.get("grad_norm", 0.0)) for m in ms)
    assert trained(ms)
    assert ms[-1]["peak_memory_mb"] > 0


def test_reward_model_scores_in_bf16_on_cuda_as_in_fp32_on_cpu(tmp_path):
    """device auto puts the reward model on the GPU, dtype auto in bf16 there; scores stay close to
    the CPU's fp32 ones (bf16 rounding only)."""
    from graders import reward_model as rm
    from test_reward_model import PROMPTS, REPLIES, write_classifier
    path = str(write_classifier(tmp_path / "rm"))
    samples = [{"prompt": p} for p in PROMPTS]
    rm._LOADED.clear()
    gpu = rm.reward_model(REPLIES, samples, model=path, batch_size=2)
    clf, _ = rm.load(path)
    assert clf.device.type == "cuda" and clf.dtype in (torch.bfloat16, torch.float16)
    cpu = rm.reward_model(REPLIES, samples, model=path, device="cpu", dtype="float32")
    assert gpu == pytest.approx(cpu, abs=0.05)
    rm._LOADED.clear()


def test_the_gpu_defaults_choose_the_fast_sampler_and_the_levers_and_log_the_gap(
        tmp_path, tiny_llama, capsys):
    """Nothing written: gpu/auto.py chooses (and says, and saves) the compiled, merged sampler on
    an Ampere+ GPU and the micro-batch from the estimate; every step logs the sampler's gap."""
    import yaml
    out = tmp_path / "run"
    assert train.main(["--config", str(run_config(tmp_path, tiny_llama)), f"--run.out_dir={out}",
                       "--optim.micro_batch_size=auto"]) == 0
    err = capsys.readouterr().err
    fast = torch.cuda.get_device_capability() >= (8, 0)
    assert f"[minigrpo] chosen for this GPU: rollout.compile={str(fast).lower()}, " \
           f"rollout.merged_sampling={str(fast).lower()}, optim.micro_batch_size=" in err
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert isinstance(saved["optim"]["micro_batch_size"], int) \
        and saved["rollout"]["compile"] is fast
    ms = metrics(out)
    assert len(ms) == 2 and trained(ms)
    if fast:  # bf16 merged and compiled: small, not zero
        assert all(0 < m["sampler_logp_abs_diff"] < 0.2 for m in ms), ms
