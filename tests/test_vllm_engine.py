"""vLLM rollouts against the fake `vllm` package (tests/fake_vllm.py, as strict as vLLM 0.32 at
the calls vllm_engine.py makes): every rollout samples with the adapter of the latest optimizer
step, vLLM's outputs become a well-formed Rollout, truncated importance sampling is wired in, what
vLLM would refuse stops the run before step 1 in one line, and a vLLM that loses the adapter stops
it in one line when the sampler's log-probs drift from the trainer's. Real vLLM is not installed
here (it needs CUDA)."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

import rollout
import train
from config import ConfigError, load_config
from engines import vllm_engine, vllm_startup
from fake_vllm import CompletionOutput, FakeLLM, Logprob, fake_vllm_modules


@pytest.fixture
def fake_vllm(monkeypatch):
    """The fake in sys.modules; the environment as it was afterwards (the engine sets RANK etc.)"""
    for name, module in fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(FakeLLM, "instances", [])
    saved = dict(os.environ)
    yield FakeLLM
    os.environ.clear()
    os.environ.update(saved)


def write_vllm_config(tmp: Path, model: Path, **sections) -> Path:
    """A GRPO config sampling with vLLM (the fake) on 8 "What is a + 1?" rows, 2 prompts x G=3;
    `sections` add to or replace the config's sections (bench/same_steps.py uses it too)."""
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n"
                            for a in range(8)))
    cfg = {"model": {"name": str(model)}, "lora": {"r": 4, "alpha": 8},
           "data": {"name": str(data), "prompt": "{q}"},
           "rollout": {"prompts_per_step": 2, "num_generations": 3, "max_new_tokens": 6,
                       "engine": "vllm"},
           "optim": {"lr": 1e-2, "micro_batch_size": 4},
           "rewards": [{"name": "answer_match"},
                       {"name": "short_answer", "args": {"max_words": 1}}]} | sections
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def cfg_path(tmp_path, tiny_llama):
    return write_vllm_config(tmp_path, tiny_llama, run={
        "out_dir": str(tmp_path / "run"), "steps": 3, "save_every": 1, "keep_checkpoints": 5})


def test_every_rollout_samples_with_the_adapter_of_the_latest_optimizer_step(fake_vllm, cfg_path,
                                                                             tmp_path):
    assert train.main(["--config", str(cfg_path), "--rollout.stop_strings=[STOP]"]) == 0
    (llm,) = fake_vllm.instances
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 8 \
        and llm.kwargs["max_loras"] == 1
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["dtype"] == "float32"
    # a new id per version
    assert [c[0] for c in llm.calls] == [1, 2, 3] and len({c[1] for c in llm.calls}) == 3
    first = llm.calls[0][2]
    # step 1 samples the start
    assert all(float(v.abs().sum()) == 0 for k, v in first.items() if "lora_B" in k)
    run = tmp_path / "run"
    for step, (_, _, used, _) in zip([1, 2], llm.calls[1:]):
        # step k+1 samples with what step k trained
        trained = load_file(run / f"checkpoints/step_{step:06d}/adapter/adapter_model.safetensors")
        assert trained.keys() == used.keys() and all(torch.equal(trained[k], used[k]) for k in used)
    # only the newest version is kept
    assert [p.name for p in (run / "vllm_adapter").iterdir()] == ["v4"]
    prompt = llm.calls[0][3][0]["prompt_token_ids"]
    # token ids, no second BOS
    assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    m = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 3 and all(x["grad_norm"] >= 0 for x in m)
    # resumed at step 3, vLLM is seeded run.seed + 3: new sampling noise, not a replay of step 1's
    assert train.main(["--config", str(cfg_path), "--run.steps=4", "--resume"]) == 0
    assert llm.kwargs["seed"] == 0 and fake_vllm.instances[-1].kwargs["seed"] == 3


def test_truncated_importance_sampling_weights_are_logged(fake_vllm, cfg_path, tmp_path,
                                                          monkeypatch):
    """Against a sampler far from the policy: the fake's next-token table (its log-probs ~-2; the
    tiny model gives ~-log(400) = -6: weights ~e^-4), the gap's stop turned off."""
    monkeypatch.setattr(fake_vllm, "samples_from", "table")
    assert train.main(["--config", str(cfg_path), "--grpo.tis_cap=2.0",
                       "--rollout.vllm_sleep=true", "--health.sampler_gap_max=0"]) == 0
    m = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert 0 < m["tis/weight_mean"] < 1 and m["tis/capped_frac"] == 0.0 \
        and m["sampler_logp_abs_diff"] > 1
    # per completion, the product of its tokens' ratios (~e^-4 each) is far below 1: sequence_mask
    # keeps them
    assert train.main(["--config", str(cfg_path), "--grpo.tis_cap=2.0",
                       "--grpo.tis_mode=sequence_mask", f"--run.out_dir={tmp_path / 'seq'}",
                       "--health.sampler_gap_max=0"]) == 0
    s = json.loads((tmp_path / "seq/metrics.jsonl").read_text().splitlines()[0])
    assert 0 <= s["tis/weight_mean"] < m["tis/weight_mean"] and s["tis/capped_frac"] == 0.0


def test_vllm_outputs_become_a_rollout_with_masks_and_sampler_log_probs(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    outs = [CompletionOutput([5, 6, eos], "a", [{5: Logprob(-0.5)}, {6: Logprob(-1.0)},
                                                {eos: Logprob(-0.25)}], "stop"),
            CompletionOutput([7, 8, 9, 10], "b", [{t: Logprob(-2.0)} for t in (7, 8, 9, 10)],
                             "length"),
            # EOS as the last allowed
            CompletionOutput([11, eos], "c", [{11: Logprob(-1.0)}, {eos: Logprob(-1.0)}], "length")]
    r = vllm_engine.to_rollout(tok, [[1, 2, 3], [4], [5]], outs, G=1, device=torch.device("cpu"),
                               eos_ids=[eos])
    assert r.prompt_ids.tolist() == [[1, 2, 3], [pad, pad, 4], [pad, pad, 5]]
    assert r.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert r.completion_ids.tolist() == [[5, 6, eos, pad], [7, 8, 9, 10], [11, eos, pad, pad]]
    assert r.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    # vLLM <= 0.11 says "length" for the third: it did end
    assert r.truncated.tolist() == [False, True, False]
    assert r.sampler_logp.tolist() == [[-0.5, -1.0, -0.25, 0.0], [-2.0] * 4, [-1.0, -1.0, 0.0, 0.0]]
    assert r.texts == [tok.decode(ids, skip_special_tokens=True)
                       for ids in ([5, 6, eos], [7, 8, 9, 10], [11, eos])]
    both = rollout.concat_rollouts([r, rollout.select_rows(r, [1])], pad)
    assert both.sampler_logp.shape == (4, 4) and both.sampler_logp[3].tolist() == [-2.0] * 4


def test_rollout_engine_vllm_refuses_what_it_cannot_serve(tmp_path, cfg_path, capsys):
    for args, message in ((["--lora.enabled=false"], "full fine-tuning"),
                          (["--model.init_adapter=somewhere", "--model.merge_init_adapter=true"],
                           "export the merged"),
                          (["--model.quant=4bit"], "4-bit"),
                          (["--grpo.tis_cap=2", "--rollout.top_p=0.9"], "top_p 1 and top_k 0"),
                          (["--grpo.tis_cap=2", "--rollout.top_k=5"], "after the top-p/top-k"),
                          (["--rollout.compile=true"], "vLLM compiles its own sampling"),
                          (["--rollout.prompts_per_generate=1"], "vLLM schedules its own batches"),
                          (["--grpo.tis_cap=2", "--rollout.ignore_eos=true"],
                           "use ignore_eos: false with it"),
                          (["--rollout.temperature=2.5"], "temperatures up to 2")):
        assert train.main(["--config", str(cfg_path), *args]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="tis_cap=2.0 weights tokens by the sampler's own "
                                          "log-probs: it needs rollout.engine: vllm, or HF"):
        load_config(cfg_path, ["--rollout.engine=hf", "--grpo.tis_cap=2.0",
                               "--rollout.merged_sampling=false", "--rollout.compile=false"])
    # HF generate's merged sampler records its log-probs before the filter, as the trainer's
    load_config(cfg_path, ["--rollout.engine=hf", "--grpo.tis_cap=2", "--rollout.top_p=0.9",
                           "--rollout.top_k=5", "--rollout.merged_sampling=true"])
    with pytest.raises(ConfigError, match="grpo.tis_mode=sequence_mask acts on the importance "
                                          "weights: set grpo.tis_cap"):
        load_config(cfg_path, ["--grpo.tis_mode=sequence_mask"])


def test_without_the_vllm_package_the_error_says_how_to_install_it(cfg_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    assert train.main(["--config", str(cfg_path)]) == 2
    assert "needs the vllm package (pip install -r requirements-vllm.txt" in capsys.readouterr().err


def test_a_vllm_outside_the_window_or_one_that_cannot_start_is_one_line(fake_vllm, cfg_path,
                                                                        tmp_path, capsys,
                                                                        monkeypatch):
    """A vLLM outside requirements-vllm.txt's window (older: another transformers declared or
    none tested; newer: another torch) is refused in a dry run too, as is a rank
    vLLM cannot serve; when LLM() raises, the line says vLLM's reason from the innermost exception
    (vLLM wraps it in "Engine core initialization failed"): one line, exit 2, nothing left."""
    for version in ("0.11.0", "0.26.0", "0.31.0", "0.33.0"):
        monkeypatch.setattr(sys.modules["vllm"], "__version__", version)
        for extra in ([], ["--dry-run"]):
            assert train.main(["--config", str(cfg_path), *extra]) == 2
            err = capsys.readouterr().err
            assert "needs vllm>=0.32.0,<0.33.0" in err and f"found {version}" in err \
                and "pip install -r requirements-vllm.txt" in err
            assert not (tmp_path / "run").exists()
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.32.1")  # a patch release: 0.32.0's
    assert train.main(["--config", str(cfg_path), "--dry-run"]) == 0
    assert train.main(["--config", str(cfg_path), "--dry-run", "--lora.r=1024"]) == 2
    assert "ranks up to 512" in capsys.readouterr().err

    def refuse(**kwargs):
        try:
            raise ValueError("LlamaForCausalLM does not support LoRA yet.\nmore detail")
        except ValueError as cause:
            raise RuntimeError("Engine core initialization failed. See root cause above.") \
                from cause
    monkeypatch.setattr(sys.modules["vllm"], "LLM", refuse)
    assert train.main(["--config", str(cfg_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "vllm could not start" in last and \
        "(ValueError: LlamaForCausalLM does not support LoRA yet.)" in last
    assert not (tmp_path / "run").exists()


def test_the_engine_runs_in_this_process_on_the_run_devices_gpu_with_a_small_profile(
        fake_vllm, cfg_path, monkeypatch):
    """As TRL's colocate mode: distributed_executor_backend="external_launcher" with the
    environment of a one-process torchrun whose LOCAL_RANK is run.device's index,
    max_num_batched_tokens=4096 and max_num_seqs the step's B x G completions."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = vllm_engine.one_process_launch(torch.device("cuda", 2))
    assert env["LOCAL_RANK"] == "2" and env["RANK"] == "0" and env["WORLD_SIZE"] == "1"
    assert int(env["MASTER_PORT"]) > 0
    assert vllm_engine.one_process_launch(torch.device("cuda"))["LOCAL_RANK"] == "0"
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert "MASTER_PORT" not in vllm_engine.one_process_launch(torch.device("cuda", 1))
    assert train.main(["--config", str(cfg_path), "--run.steps=1"]) == 0
    (llm,) = fake_vllm.instances
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.kwargs["max_num_batched_tokens"] == 4096 and os.environ["LOCAL_RANK"] == "0"
    assert llm.kwargs["max_num_seqs"] == 2 * 3  # B x G, as TRL: not vLLM's 1024 on an H100


def test_free_gpu_memory_below_the_share_or_below_what_vllm_holds_in_it_is_refused():
    """Before vLLM starts: the share must be free, and hold vLLM's weights, LoRA buffers,
    profiling peak, CUDA graphs and one sequence's KV cache (startup_costs), each said."""
    gib = 2 ** 30
    vllm_startup.check_memory(0.3, free=30 * gib, total=80 * gib, device="cuda:0")
    with pytest.raises(ConfigError, match=r"asks vLLM for 24.0 GiB of cuda:1's 80.0 GiB, but 20.0 "
                                          r"GiB are free .*set it to at most 0.25"):
        vllm_startup.check_memory(0.3, free=20 * gib, total=80 * gib, device="cuda:1")
    costs = {"weights": 16 * gib, "LoRA buffers": gib // 10, "profiling peak": 2 * gib,
             "CUDA graphs": gib // 2, "one sequence's KV cache": gib}
    vllm_startup.check_memory(0.3, free=30 * gib, total=80 * gib, device="cuda:0", costs=costs)
    with pytest.raises(ConfigError, match=r"=0.2 gives vLLM 16.00 GiB of cuda:0's 80.0 GiB, less "
                                          r"than it holds before any batch: weights 16.00 \+ LoRA "
                                          r"buffers 0.10 \+ profiling peak 2.00 \+ CUDA graphs "
                                          r"0.50 \+ one sequence's KV cache 1.00 = 19.60 GiB "
                                          r"\(estimated\): set it to at least 0.25, or shorten"):
        vllm_startup.check_memory(0.2, free=30 * gib, total=80 * gib, device="cuda:0", costs=costs)
    with pytest.raises(ConfigError, match=r"at least 0.25 \(at most 0.22 is free\)"):
        vllm_startup.check_memory(0.2, free=18 * gib, total=80 * gib, device="cuda:0", costs=costs)


def test_startup_costs_are_the_bases_weights_lora_buffers_activations_and_one_sequence(
        tiny_llama):
    """The tiny Llama by hand: hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 K/V heads (q 32,
    kv 16); its linear layers' in + out, per layer: q 64, k 48, v 48, o 64, gate 96, up 96,
    down 96 = 512; one layer's activations a token: 2 x 64 + 32 + 2 x 16 + 32 = 224."""
    from model import load_policy
    cfg = load_config(write_vllm_config(Path(tiny_llama).parent, tiny_llama))
    policy = load_policy(cfg.model, cfg.lora, torch.device("cpu"))[0]
    V = policy.config.vocab_size
    base = sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n)
    got = vllm_startup.startup_costs(policy, 2, lora_rank=8, seqs=6, batched_tokens=4096,
                                     max_model_len=518)
    assert got == {"weights": base * 2, "LoRA buffers": 8 * 2 * 512 * 2,
                   "profiling peak": 4096 * 224 * 2 + 6 * V * 4 * 2,
                   "CUDA graphs": 12 * 224 * 2, "one sequence's KV cache": 2 * 2 * 16 * 518 * 2}
    # a sliding-window layer keeps its window, a linear-attention layer no K/V
    for kinds, tokens in ((["full_attention", "sliding_attention"], 518 + 100),
                          (["linear_attention", "sliding_attention"], 100)):
        policy.config.layer_types, policy.config.sliding_window = kinds, 100
        got = vllm_startup.startup_costs(policy, 2, 8, 6, 4096, 518)
        assert got["one sequence's KV cache"] == 2 * 16 * tokens * 2


def test_on_a_gpu_the_engine_checks_the_share_against_its_costs_before_vllm_starts(
        fake_vllm, cfg_path, tmp_path, tiny_llama, monkeypatch):
    """The CUDA branch of VllmEngine, with torch.cuda's memory reading faked: a GPU of 10 MiB
    (a 0.3 share of it holds less than the tiny model's profiling batch) is refused before LLM()
    with the costs named; one of 8 GiB starts the engine."""
    from model import load_policy
    cfg = load_config(cfg_path)
    policy = load_policy(cfg.model, cfg.lora, torch.device("cpu"))[0]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def start():
        return vllm_engine.VllmEngine(cfg, str(tiny_llama), tmp_path, torch.float32, policy,
                                      torch.device("cuda", 0))
    for total in (10 * 2 ** 20, 8 * 2 ** 30):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, t=total: (t, t))
        if total < 2 ** 30:
            with pytest.raises(ConfigError, match=r"less than it holds before any batch: weights "
                                                  r"0.00 \+ LoRA buffers 0.00 \+ profiling peak"):
                start()
            assert fake_vllm.instances == []
        else:
            assert start().llm.kwargs["max_num_seqs"] == 6


def test_a_prompt_longer_than_max_prompt_tokens_is_an_error_as_on_the_hf_path(
        fake_vllm, cfg_path, tmp_path, tiny_llama):
    """vLLM would take it (up to max_model_len) and cut its completion short instead."""
    from model import load_policy
    cfg = load_config(cfg_path, ["--rollout.max_prompt_tokens=8"])
    policy, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    engine = vllm_engine.VllmEngine(cfg, str(tiny_llama), tmp_path, torch.float32, policy,
                                    torch.device("cpu"))
    engine.sync(policy)
    with pytest.raises(ValueError, match=r"a prompt has \d+ tokens > rollout.max_prompt_tokens=8"):
        engine.generate(tok, ["What is 2 + 3? " * 4], [tok.eos_token_id], torch.device("cpu"))
    assert engine.generate(tok, ["What is 2"], [tok.eos_token_id], torch.device("cpu")).texts


def test_vllms_reason_is_the_innermost_exception_s_first_line():
    try:
        try:
            raise ValueError("\nFree memory on device cuda:0 (1.0/80.0 GiB) on startup is less\n..")
        except ValueError as cause:
            raise RuntimeError("Engine core initialization failed. See root cause above.") \
                from cause
    except RuntimeError as e:
        assert vllm_startup.reason(e) == ("ValueError: Free memory on device cuda:0 (1.0/80.0 GiB) "
                                          "on startup is less")
    assert vllm_startup.reason(KeyError("x")) == "KeyError: 'x'"


def peft_model(pc=None, arch="LlamaForCausalLM", merged=(), **modules):
    """A stand-in for a peft model: its LoraConfig, architecture and LoRA-wrapped modules."""
    from types import SimpleNamespace
    plain = SimpleNamespace(use_dora=False, modules_to_save=None, rank_pattern={},
                            alpha_pattern={}, bias="none", lora_bias=False, init_lora_weights=True,
                            layer_replication=None)
    wrapped = {name: SimpleNamespace(base_layer=base, lora_A={}) for name, base in modules.items()}
    return SimpleNamespace(peft_config={"default": SimpleNamespace(**{**vars(plain),
                                                                      **(pc or {})})},
                           minigrpo_base={"merged": list(merged)},
                           config=SimpleNamespace(architectures=[arch]),
                           named_modules=lambda: list(wrapped.items()))


def test_adapters_vllm_would_refuse_or_serve_otherwise_are_refused_before_it_starts():
    linear = torch.nn.Linear(2, 2)
    vllm_startup.check_policy(peft_model(**{"model.layers.0.q_proj": linear,
                                            "model.embed_tokens": torch.nn.Embedding(4, 2)}))
    vllm_startup.check_policy(peft_model({"init_lora_weights": "gaussian", "use_rslora": True}))
    with pytest.raises(ConfigError, match="export that chain"):
        vllm_startup.check_policy(peft_model(merged=[{"path": "sft"}]))
    for pc, named in (({"use_dora": True}, "use_dora"),
                      ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                      ({"bias": "lora_only"}, "bias=lora_only"),
                      ({"lora_bias": True}, "lora_bias"),
                      ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights=pissa_niter_4"),
                      ({"init_lora_weights": "olora"}, "init_lora_weights=olora"),
                      ({"init_lora_weights": "loftq"}, "init_lora_weights=loftq"),
                      ({"init_lora_weights": "corda"}, "init_lora_weights=corda"),
                      ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication"),
                      ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
                      ({"use_qalora": True}, "use_qalora"),
                      ({"use_bdlora": {"q_proj": 2}}, "use_bdlora"),
                      ({"trainable_token_indices": [3]}, "trainable_token_indices")):
        with pytest.raises(ConfigError, match=f"serves plain LoRA adapters.*uses {named}"):
            vllm_startup.check_policy(peft_model(pc))
    # per-module ranks: read by 0.32's PEFTHelper as peft applies them, ignored by 0.30's
    for pc in ({"rank_pattern": {"q_proj": 8}}, {"alpha_pattern": {"q_proj": 4}}):
        vllm_startup.check_policy(peft_model(pc), "0.32.0")
        with pytest.raises(ConfigError, match=f"uses {next(iter(pc))}"):
            vllm_startup.check_policy(peft_model(pc), "0.30.0")
    with pytest.raises(ConfigError, match="vllm 0.32.0 serves no LoRA adapter on GPT2LMHeadModel"):
        vllm_startup.check_policy(peft_model(arch="GPT2LMHeadModel"))
    from transformers.pytorch_utils import Conv1D
    with pytest.raises(ConfigError, match=r"linear layers of LlamaForCausalLM \(and these "
                                          r"embedding modules: embed_tokens, lm_head\), not "
                                          r"c_attn \(Conv1D\)"):
        vllm_startup.check_policy(peft_model(**{"x.c_attn": Conv1D(2, 2)}))
    with pytest.raises(ConfigError, match=r"embedding modules: none\), not lm_head \(Linear\)"):
        vllm_startup.check_policy(peft_model(arch="Qwen2ForCausalLM", lm_head=linear))
    # an architecture outside vLLM's registry (its transformers backend): linear layers only
    vllm_startup.check_policy(peft_model(arch="SomeNewForCausalLM", lm_head=linear))


def test_the_architecture_checks_read_the_installed_versions_surface():
    """Issue 57: vLLM 0.27 served LoRA on DeepseekV32ForCausalLM and no adapter on
    Qwen3_5ForCausalLM's lm_head; 0.30 and 0.32 the other way round. A patch release is read as
    the release below it, a version older than any stored as the oldest."""
    deepseek = peft_model(arch="DeepseekV32ForCausalLM")
    qwen = peft_model(arch="Qwen3_5ForCausalLM", lm_head=torch.nn.Linear(2, 2))
    vllm_startup.check_policy(deepseek, "0.27.0")
    with pytest.raises(ConfigError, match="vllm 0.32.0 serves no LoRA adapter on Deepseek"):
        vllm_startup.check_policy(deepseek, "0.32.1")
    vllm_startup.check_policy(qwen, "0.32.0")
    with pytest.raises(ConfigError, match=r"vllm 0.27.0 adapts.*embedding modules: none\)"):
        vllm_startup.check_policy(qwen, "0.27.1")
    assert vllm_startup.surface_of("0.20.0")[0] == "0.27.0"


def test_an_import_that_fails_is_reported_with_its_reason(monkeypatch):
    import builtins
    real = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "vllm":
            raise OSError("libcudart.so.13: cannot open shared object file")
        return real(name, *args, **kwargs)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ConfigError, match=r"vllm is installed but does not import \(OSError: "
                                          r"libcudart.so.13: cannot open shared object file\)"):
        vllm_startup.check_install(8)


def test_a_dora_init_adapter_is_refused_in_a_dry_run(fake_vllm, cfg_path, tmp_path, tiny_llama,
                                                     capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sources.adapters import save_adapter
    dora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                          LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                     target_modules=["q_proj", "v_proj"]))
    dora.minigrpo_base = {"base_model": str(tiny_llama), "revision": None, "merged": []}
    save_adapter(dora, tmp_path / "dora")
    # its own shape: only DoRA is wrong
    assert train.main(["--config", str(cfg_path), "--dry-run",
                       f"--model.init_adapter={tmp_path / 'dora'}", "--lora.r=4",
                       "--lora.alpha=8", "--lora.target_modules=[q_proj, v_proj]"]) == 2
    assert "serves plain LoRA adapters" in capsys.readouterr().err


def test_a_final_eos_is_not_truncation_whichever_eos_id_it_is(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    # the second EOS id
    outs = [CompletionOutput([5, 0], "", [{5: Logprob(-1.0)}, {0: Logprob(-1.0)}], "length")]
    r = vllm_engine.to_rollout(tok, [[1]], outs, G=1, device=torch.device("cpu"),
                               eos_ids=[tok.eos_token_id, 0])
    assert r.truncated.tolist() == [False]


def test_a_vllm_that_loses_the_adapter_after_sleep_stops_the_run_in_one_line(
        fake_vllm, cfg_path, tmp_path, capsys, monkeypatch):
    """Issue 57: vLLM issue 53888 reported the LoRA adapter silently lost after wake_up (vLLM
    0.27.1). The fake does that: the samples come from the bare base, the trainer's log-probs move
    away from them as the adapter trains, and the step whose sampler_logp_abs_diff passes
    health.sampler_gap_max stops the run with one line (exit 2, its checkpoint kept). The same run
    whose vLLM keeps its adapter samples the policy exactly (the fake computes in fp32) and ends."""
    args = ["--config", str(cfg_path), "--rollout.vllm_sleep=true", "--optim.lr=0.1",
            "--health.sampler_gap_max=0.05"]
    assert train.main(args) == 0
    kept = [json.loads(ln) for ln in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(kept) == 3 and all(m["sampler_logp_abs_diff"] < 1e-4 for m in kept)
    capsys.readouterr()
    monkeypatch.setattr(fake_vllm, "loses_adapter_after_sleep", True)
    assert train.main([*args, f"--run.out_dir={tmp_path / 'lost'}"]) == 2
    (llm,) = fake_vllm.instances[1:]
    assert all(weights is None for _, _, weights, _ in llm.calls)  # every rollout: the base
    lost = [json.loads(ln) for ln in (tmp_path / "lost/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lost] == [1, 2] and lost[0]["sampler_logp_abs_diff"] < 1e-4 \
        and lost[1]["sampler_logp_abs_diff"] > 0.05  # step 1 samples the zero adapter: the base
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err[-1].startswith("error: the sampler is not sampling the policy being trained: "
                              "sampler_logp_abs_diff 0.") and "at step 2 (> health." in err[-1]
    assert "stopped at step 2, the last checkpoint in" in err[-1] and "--resume" in err[-1]
    assert not any("Traceback" in ln or "sampler_logp_abs_diff" in ln for ln in err[:-1])
