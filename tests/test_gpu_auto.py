"""gpu/auto.py: the "auto" settings, chosen for the device. On a CPU they are what they were before
"auto" existed; on a GPU (faked here: a cuda device object, its capability and free memory given,
the memory estimate and the attention swap replaced) the fast sampler and the memory levers."""
import json
import sys
import types

import pytest
import torch
import yaml

import train
from config import Config, load_config
from gpu import auto

CUDA = torch.device("cuda")  # only named: nothing below touches a GPU


def test_on_a_cpu_every_auto_is_what_it_was_before_and_only_the_speed_levers_are_said():
    cfg, line = auto.resolve(Config(), torch.nn.Linear(1, 1), torch.device("cpu"), lambda: 1 / 0)
    assert [auto.get(cfg, k) for k in auto.AUTO_KEYS] == [False, False, 8, False]
    assert [auto.get(cfg, k) for k in auto.SPEED] == [True, True]
    assert line == ("[minigrpo] chosen for this CPU: grpo.share_prompt=true, "
                    "grpo.logprob_kernel=true (write a value in the config to choose it yourself)")
    assert Config().optim.micro_batch_size == "auto"  # the copy was changed, not the original


def test_a_written_value_is_kept_on_a_cpu_and_on_a_gpu(monkeypatch):
    cfg = Config()
    cfg.rollout.compile, cfg.rollout.merged_sampling = False, True
    cfg.optim.micro_batch_size, cfg.model.gradient_checkpointing = 2, True
    cfg.grpo.share_prompt, cfg.grpo.logprob_kernel = False, False
    for device in (torch.device("cpu"), CUDA):
        out, line = auto.resolve(cfg, torch.nn.Linear(1, 1), device, lambda: 1 / 0,
                                 free_bytes=2**30, capability=(9, 0))
        assert [auto.get(out, k) for k in auto.AUTO_KEYS] == [False, True, 2, True]
        assert line == ""


@pytest.mark.parametrize("change, why", [
    ({}, ""),
    ({"capability": (7, 5)}, "compute capability 7.5 < 8.0"),
    ({"quant": "4bit"}, "a 4-bit base is not compiled by transformers"),
    ({"engine": "vllm"}, "vLLM samples"),
    ({"env": "my_env"}, "multi-turn episodes' prompts are not bucketed"),
])
def test_the_fast_sampler_is_on_for_ampere_and_newer_and_off_where_it_cannot_pay(change, why):
    cfg = Config()
    cfg.model.quant = change.get("quant")
    cfg.rollout.engine = change.get("engine", "hf")
    cfg.env = change.get("env")
    assert auto.fast_sampler(cfg, change.get("capability", (8, 0))) == (not why, why)


@pytest.fixture
def fake_gpu_modules(monkeypatch):
    """gpu.memory and gpu.attention replaced: what choose_levers was asked, what it answers."""
    asked = {}

    def choose_levers(model, cfg, prompt_tokens, free_bytes, micro_batch_size=None,
                      checkpointing=None):
        asked.update(prompt=prompt_tokens, free=free_bytes, mb=micro_batch_size, ck=checkpointing)
        return types.SimpleNamespace(
            micro_batch_size=micro_batch_size or 4,
            checkpointing=True if checkpointing is None else checkpointing,
            why="micro-batch 4 with checkpointing: ~9.0 of 10.0 GiB free")
    memory = types.SimpleNamespace(choose_levers=choose_levers,
                                   enable_checkpointing=lambda m: asked.update(enabled=True))
    attention = types.SimpleNamespace(use_gqa_decode=lambda m: asked.update(gqa=True) or True)
    import gpu
    for name, mod in (("memory", memory), ("attention", attention)):
        monkeypatch.setitem(sys.modules, f"gpu.{name}", mod)
        monkeypatch.setattr(gpu, name, mod, raising=False)
    return asked


def test_on_a_gpu_the_fast_sampler_and_the_levers_are_chosen_and_said(fake_gpu_modules):
    cfg, line = auto.resolve(Config(), torch.nn.Linear(1, 1), CUDA, lambda: 77,
                             free_bytes=10 * 2**30, capability=(9, 0))
    assert [auto.get(cfg, k) for k in auto.AUTO_KEYS] == [True, True, 4, True]
    assert fake_gpu_modules == {"prompt": 77, "free": 10 * 2**30, "mb": None, "ck": None,
                                "enabled": True, "gqa": True}
    assert line.startswith("[minigrpo] chosen for this GPU: rollout.compile=true, "
                           "rollout.merged_sampling=true, optim.micro_batch_size=4, "
                           "model.gradient_checkpointing=true, grpo.share_prompt=prefill, "
                           "grpo.logprob_kernel=true; micro-batch 4 with checkpointing")
    assert "GQA decode without repeated K/V" in line


def test_on_a_gpu_a_written_micro_batch_is_kept_and_checkpointing_chosen_around_it(
        fake_gpu_modules):
    cfg = Config()
    cfg.optim.micro_batch_size = 16
    cfg, line = auto.resolve(cfg, torch.nn.Linear(1, 1), CUDA, lambda: 5, free_bytes=1,
                             capability=(7, 5))  # a T4: no compiled sampler
    assert fake_gpu_modules["mb"] == 16 and fake_gpu_modules["ck"] is None
    assert [auto.get(cfg, k) for k in auto.AUTO_KEYS] == [False, False, 16, True]
    assert "optim.micro_batch_size" not in line and "fast sampler off: compute capability 7.5" \
        in line and "gqa" not in fake_gpu_modules


def test_sft_on_a_gpu_keeps_the_cpu_levers(fake_gpu_modules):
    cfg = Config()
    cfg.mode = "sft"
    cfg, _ = auto.resolve(cfg, torch.nn.Linear(1, 1), CUDA, lambda: 1 / 0, free_bytes=1,
                          capability=(9, 0))
    assert (cfg.optim.micro_batch_size, cfg.model.gradient_checkpointing) == (8, False)
    assert "mb" not in fake_gpu_modules


def test_auto_is_written_in_yaml_and_rejected_when_misspelt(tmp_path, tiny_llama):
    from config import ConfigError
    from conftest import write_run_config
    config = write_run_config(tmp_path, tiny_llama, optim={"micro_batch_size": "auto"})
    assert load_config(config).optim.micro_batch_size == "auto"
    with pytest.raises(ConfigError, match="optim.micro_batch_size: expected int or one of "
                                          "'auto', got 'automatic'"):
        load_config(config, ["--optim.micro_batch_size=automatic"])


def test_a_run_saves_the_values_chosen_and_a_resume_written_auto_is_no_change(
        tmp_path, tiny_llama, capsys):
    from conftest import write_run_config
    config = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(tmp_path / "run"),
                                                         "save_every": 1, "threads": 1,
                                                         "device": "cpu"},  # what a CPU chooses
                              optim={"micro_batch_size": "auto"})
    assert train.main(["--config", str(config)]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["optim"]["micro_batch_size"] == 8 and saved["rollout"]["compile"] is False
    assert saved["model"]["gradient_checkpointing"] is False
    capsys.readouterr()
    assert train.main(["--config", str(config), "--resume", "--run.steps=3"]) == 0
    err = capsys.readouterr().err
    assert "changed settings: run.steps" in err and "micro_batch_size" not in err
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]


def test_the_merged_sampler_logs_its_gap_to_the_trainer_and_the_default_cpu_run_does_not(
        tmp_path, tiny_llama):
    from conftest import write_run_config
    gaps = {}
    for merged in (False, True):
        out = tmp_path / f"run{merged}"
        config = write_run_config(tmp_path, tiny_llama, run={"out_dir": str(out), "threads": 1,
                                                             "device": "cpu"},  # fp32 on a GPU box
                                  rollout={"merged_sampling": merged})
        assert train.main(["--config", str(config)]) == 0
        gaps[merged] = [json.loads(x).get("sampler_logp_abs_diff") for x in
                        (out / "metrics.jsonl").open()]
    assert gaps[False] == [None, None]
    # fp32: folding the adapter in is exact to rounding, after an update moved it too
    assert all(0 < g < 1e-4 for g in gaps[True]), gaps  # measured, and small


def test_an_estimate_that_fails_leaves_the_cpu_levers_and_says_why(monkeypatch):
    from gpu import memory

    def fails(*a, **k):
        raise RuntimeError("Params4bit under FakeTensorMode")
    monkeypatch.setattr(memory, "choose_levers", fails)
    cfg, line = auto.resolve(Config(), torch.nn.Linear(1, 1), CUDA, lambda: 5, free_bytes=1,
                             capability=(7, 5))
    assert (cfg.optim.micro_batch_size, cfg.model.gradient_checkpointing) == (8, False)
    assert "no memory estimate (RuntimeError: Params4bit under FakeTensorMode)" in line


def test_on_a_gpu_the_real_estimate_chooses_for_a_tiny_model(tiny_llama):
    """The real gpu/memory.choose_levers on a CPU-held model, as if its GPU had 4 GiB free."""
    from config import LoraConfig, ModelConfig
    from model import load_policy
    model, _ = load_policy(ModelConfig(name=str(tiny_llama)), LoraConfig(r=4, alpha=8),
                           torch.device("cpu"))
    cfg = Config()
    cfg.rollout.compile = False  # keeps the attention swap out of it
    cfg, line = auto.resolve(cfg, model, CUDA, lambda: 20, free_bytes=4 * 2**30, capability=(9, 0))
    assert (cfg.optim.micro_batch_size, cfg.model.gradient_checkpointing) == (16, False)
    assert "micro-batch 16, no checkpointing: ~0.0 of 4.0 GiB free" in line


def test_tis_cap_with_hf_generate_needs_a_sampler_that_records_its_log_probs(fake_gpu_modules):
    from config import ConfigError
    cfg = Config()
    cfg.grpo.tis_cap = 2.0
    with pytest.raises(ConfigError, match="grpo.tis_cap=2.0: rollout.merged_sampling and "
                                          "rollout.compile are off here"):
        auto.resolve(cfg, torch.nn.Linear(1, 1), torch.device("cpu"), lambda: 1 / 0)
    on_gpu, _ = auto.resolve(cfg, torch.nn.Linear(1, 1), CUDA, lambda: 5, free_bytes=1,
                             capability=(9, 0))
    cfg.rollout.merged_sampling = True
    on_cpu, _ = auto.resolve(cfg, torch.nn.Linear(1, 1), torch.device("cpu"), lambda: 1 / 0)
    assert on_gpu.rollout.merged_sampling is True and on_cpu.rollout.merged_sampling is True
