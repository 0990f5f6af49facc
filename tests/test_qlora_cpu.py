"""model.quant=4bit on a CPU, through bitsandbytes' CPU backend: the LoRA gradients of a real
training update over NF4 base weights equal those of a twin that holds the same weights
dequantized in fp32, on every path the step can take, after the step's own sampling (which is what
bitsandbytes 0.49+'s CPU inference repack broke: model.trainable_4bit_layout); the NF4 bytes the
memory estimate counts are the loaded model's; only LoRA weights train; DPO over it in fp16.

    python -m pytest tests/test_qlora_cpu.py
"""
import json

import bitsandbytes as bnb
import pytest
import torch

import step
import train
from conftest import write_run_config
from gpu.memory import weight_bytes
from test_step import make_run

PATHS = {  # the step's paths: each a set of overrides
    "plain": ["--grpo.share_prompt=false", "--grpo.logprob_kernel=false"],
    "share_prompt": ["--grpo.share_prompt=true", "--grpo.logprob_kernel=false"],
    "logprob_kernel": ["--grpo.share_prompt=false", "--grpo.logprob_kernel=true"],
    "one_row_micro_batches": ["--optim.micro_batch_size=1"],
    "gradient_checkpointing": ["--model.gradient_checkpointing=true"],
}


def nf4_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def dequantized_twin(tmp_path, tiny_llama, quantized, overrides):
    """The same run without model.quant, its base Linear weights the NF4 ones dequantized to fp32
    and its LoRA weights the quantized run's."""
    twin = make_run(tmp_path / "twin", tiny_llama, *overrides)
    layers = nf4_layers(quantized.model)
    with torch.no_grad():
        for n, m in twin.model.named_modules():
            if n in layers:
                w = layers[n].weight
                m.weight.copy_(bnb.functional.dequantize_4bit(w.data, w.quant_state).float())
        mine = dict(quantized.model.named_parameters())
        for n, p in twin.model.named_parameters():
            if p.requires_grad:
                p.copy_(mine[n])
    return twin


def recording(run, grads: dict):
    """An optimizer_step that keeps the update's gradients by parameter name, and takes no step."""
    names = {id(p): n for n, p in run.model.named_parameters()}

    def optimizer_step(r):
        grads.update({names[id(p)]: p.grad.clone() for p in r.params if p.grad is not None})
        return 1.0, 0.0
    return optimizer_step


@pytest.mark.parametrize("path", PATHS)
def test_nf4_lora_gradients_equal_a_dequantized_fp32_twins_on_every_step_path(
        tmp_path, tiny_llama, monkeypatch, path, recwarn):
    """A real step over NF4 weights (its sampling first: the step's own order) against the twin's
    update on the same batch: the gradients agree to float rounding, since bitsandbytes computes
    with the dequantized weights. Before trainable_4bit_layout they were 113% off after the first
    sampling (the repacked layers passed no gradient to their inputs), with torch's warning."""
    torch.manual_seed(0)
    overrides = ["--rollout.max_new_tokens=6", "--rollout.temperature=1.0", *PATHS[path]]
    q = make_run(tmp_path / "nf4", tiny_llama, "--model.quant=4bit", *overrides)
    assert nf4_layers(q.model)
    with torch.no_grad():  # LoRA B is zero at the start: give the gradients paths through it
        for p in q.params:
            p.normal_(0, 0.2)
    twin = dequantized_twin(tmp_path, tiny_llama, q, overrides)
    got, want, batches, real_update = {}, {}, [], step.update
    monkeypatch.setattr(step, "update", lambda run, batch: batches.append(batch) or
                        real_update(run, batch))
    monkeypatch.setattr(step, "optimizer_step", recording(q, got))
    step.train_step(q)  # samples through the NF4 layers in eval mode, then updates
    monkeypatch.setattr(step, "optimizer_step", recording(twin, want))
    real_update(twin, batches[0])
    assert want and got.keys() == want.keys()
    assert all(want[n].abs().max() > 0 for n in want)
    for n, g in got.items():
        assert (g - want[n]).norm() <= 1e-4 * want[n].norm(), n
    assert not [w for w in recwarn if "autograd kernel was not registered" in str(w.message)]


def test_only_the_lora_weights_train_over_an_nf4_base(tmp_path, tiny_llama):
    q = make_run(tmp_path, tiny_llama, "--model.quant=4bit")
    trained = {n for n, p in q.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert all(not m.weight.requires_grad for m in nf4_layers(q.model).values())


def test_the_estimates_nf4_bytes_are_the_loaded_models_storage(tmp_path, tiny_llama):
    """gpu/memory.weight_bytes traces a 4-bit base from the unquantized model (NF4_BYTES a frozen
    Linear weight, NF4_LAYER_BYTES a layer); bitsandbytes' own storage (packed weights, absmax,
    double quantization's absmax and code books) matches it to 0.5%."""
    q = make_run(tmp_path / "nf4", tiny_llama, "--model.quant=4bit")
    plain = make_run(tmp_path / "plain", tiny_llama)
    layers = nf4_layers(q.model)
    loaded = sum(p.numel() * p.element_size() for p in q.model.parameters()) + sum(
        t.numel() * t.element_size() for m in layers.values()
        for t in quant_state_tensors(m.weight.quant_state))
    assert weight_bytes(plain.model, "4bit") == pytest.approx(loaded, rel=0.005)


def quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors a QuantState holds beside the packed weight: absmax, and with double
    quantization the second level's absmax and code."""
    out = [state.absmax, state.code]
    if state.nested:
        out += [state.state2.absmax, state.state2.code, state.offset]
    return [t for t in out if isinstance(t, torch.Tensor)]


def test_dpo_over_an_nf4_base_in_fp16_starts_at_log2_and_trains(tmp_path, tiny_llama):
    """mode: dpo over a 4-bit base with fp16's GradScaler, on a CPU (tests/test_gpu.py runs the same
    on CUDA): the reference (adapter off) is the policy at the first step, so the loss is log 2 up
    to half-precision rounding; every step is scaled and some update applied."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "chosen": str(a + 1),
                                         "rejected": "No idea."}) + "\n" for a in range(8)))
    out = tmp_path / "run"
    cfg = write_run_config(tmp_path, tiny_llama,
                           model={"quant": "4bit", "dtype": "float16",
                                  "gradient_checkpointing": True},
                           data={"name": str(pairs), "prompt": "prompt", "chosen": "chosen",
                                 "rejected": "rejected", "answer_key": None},
                           dpo={"batch_size": 4}, optim={"micro_batch_size": 2})
    assert train.main(["--config", str(cfg), "--mode=dpo", "--run.steps=3",
                       f"--run.out_dir={out}"]) == 0
    ms = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert ms[0]["loss"] == pytest.approx(0.6931, abs=2e-3)
    assert all("loss_scale" in m for m in ms) and any(m.get("grad_norm", 0) > 0 for m in ms)
