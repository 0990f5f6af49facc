"""vLLM rollouts against a fake `vllm` package that implements the calls vllm_engine.py makes
(LLM(...), LLM.generate, SamplingParams, LoRARequest, sleep/wake_up): every rollout samples with the
adapter of the latest optimizer step, vLLM's outputs become a well-formed Rollout, and truncated
importance sampling is wired in. Real vLLM is not installed here (it needs CUDA)."""
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoTokenizer

import rollout
import train
from config import ConfigError, load_config
from engines import vllm_engine


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list
    text: str
    logprobs: list | None
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list = field(default_factory=list)
    logprobs: int | None = None


# vLLM's EngineArgs fields that vllm_engine.py may pass (all exist in vLLM >= 0.10.2), so a typo
# fails here
ENGINE_ARGS = {"model", "tokenizer", "revision", "tokenizer_revision", "trust_remote_code", "dtype",
               "seed", "gpu_memory_utilization", "enable_sleep_mode", "max_model_len",
               "enable_prefix_caching", "enable_lora", "max_loras", "max_lora_rank",
               "logprobs_mode"}


class FakeLLM:
    """Samples random tokens; records the adapter weights each generate() call was given."""
    instances: list = []

    def __init__(self, **kwargs):
        assert set(kwargs) <= ENGINE_ARGS, \
            f"not a vLLM engine argument: {set(kwargs) - ENGINE_ARGS}"
        self.kwargs, self.calls, self.awake = kwargs, [], True
        self.rng = torch.Generator().manual_seed(kwargs["seed"])
        FakeLLM.instances.append(self)

    def sleep(self, level: int = 1):
        self.awake = False

    def wake_up(self):
        self.awake = True

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        assert self.awake or not self.kwargs["enable_sleep_mode"], "generate() on a sleeping engine"
        weights = load_file(Path(lora_request.lora_path) / "adapter_model.safetensors")
        self.calls.append((lora_request.lora_int_id, lora_request.lora_name, weights, prompts))
        out = []
        for _ in prompts:
            completions = []
            for _ in range(params.n):
                n = int(torch.randint(1, params.max_tokens + 1, (1,), generator=self.rng))
                ids = torch.randint(3, 300, (n,), generator=self.rng).tolist()
                finish = "length" if n == params.max_tokens else "stop"
                if finish == "stop":
                    ids[-1] = params.stop_token_ids[0]  # vLLM keeps the EOS it stopped on
                completions.append(CompletionOutput(ids, "fake", [{t: Logprob(-2.0)} for t in ids],
                                                    finish))
            out.append(RequestOutput(completions))
        return out


def fake_vllm_modules() -> dict[str, types.ModuleType]:
    """The fake `vllm` package, by module name, to put in sys.modules (bench/same_steps.py too)."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = FakeLLM, SamplingParams, "0.11.0"
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    return {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request}


@pytest.fixture
def fake_vllm(monkeypatch):
    for name, module in fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances = []
    return FakeLLM


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


def test_truncated_importance_sampling_weights_are_logged(fake_vllm, cfg_path, tmp_path):
    assert train.main(["--config", str(cfg_path), "--grpo.tis_cap=2.0",
                       "--rollout.vllm_sleep=true"]) == 0
    m = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    # the fake says every token had log-prob -2; the tiny model gives ~-log(400) = -6: weights ~e^-4
    assert 0 < m["tis/weight_mean"] < 1 and m["tis/capped_frac"] == 0.0 \
        and m["sampler_logp_abs_diff"] > 1
    # per completion, the product of its tokens' ratios (~e^-4 each) is far below 1: sequence_mask
    # keeps them
    assert train.main(["--config", str(cfg_path), "--grpo.tis_cap=2.0",
                       "--grpo.tis_mode=sequence_mask", f"--run.out_dir={tmp_path / 'seq'}"]) == 0
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
                          (["--rollout.compile=true"], "vLLM compiles its own sampling"),
                          (["--rollout.prompts_per_generate=1"], "vLLM schedules its own batches"),
                          (["--grpo.tis_cap=2", "--rollout.ignore_eos=true"],
                           "use ignore_eos: false with it")):
        assert train.main(["--config", str(cfg_path), *args]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="tis_cap=2.0 weights tokens by the sampler's own "
                                          "log-probs: it needs rollout.engine: vllm, or HF"):
        load_config(cfg_path, ["--rollout.engine=hf", "--grpo.tis_cap=2.0",
                               "--rollout.merged_sampling=false", "--rollout.compile=false"])
    with pytest.raises(ConfigError, match="grpo.tis_mode=sequence_mask acts on the importance "
                                          "weights: set grpo.tis_cap"):
        load_config(cfg_path, ["--grpo.tis_mode=sequence_mask"])


def test_without_the_vllm_package_the_error_says_how_to_install_it(cfg_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    assert train.main(["--config", str(cfg_path)]) == 2
    assert "needs the vllm package (pip install vllm" in capsys.readouterr().err


def test_an_old_vllm_or_one_that_cannot_start_is_one_line(fake_vllm, cfg_path, tmp_path, capsys,
                                                          monkeypatch):
    """Before 0.10.2 vLLM's log-probs come before temperature (or logprobs_mode does not exist); a
    model vLLM cannot serve with LoRA makes LLM() raise: each one line, exit 2, nothing left behind.
    The version and the rank are checked in a dry run too; 0.10.2 itself is enough."""
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.10.1.1")
    for extra in ([], ["--dry-run"]):
        assert train.main(["--config", str(cfg_path), *extra]) == 2
        assert "needs vllm >= 0.10.2" in capsys.readouterr().err and not (tmp_path / "run").exists()
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.10.2")
    assert train.main(["--config", str(cfg_path), "--dry-run"]) == 0
    assert train.main(["--config", str(cfg_path), "--dry-run", "--lora.r=1024"]) == 2
    assert "ranks up to 512" in capsys.readouterr().err
    monkeypatch.setattr(sys.modules["vllm"], "__version__", "0.12.0")

    def refuse(**kwargs):
        raise ValueError("GPT2LMHeadModel does not support LoRA yet.")
    monkeypatch.setattr(sys.modules["vllm"], "LLM", refuse)
    assert train.main(["--config", str(cfg_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "vllm could not start" in last and "does not support LoRA yet" in last \
        and not (tmp_path / "run").exists()


def test_adapters_vllm_would_serve_otherwise_are_refused():
    from types import SimpleNamespace
    plain = SimpleNamespace(use_dora=False, modules_to_save=None, rank_pattern={}, alpha_pattern={},
                            bias="none")
    vllm_engine.check_policy(SimpleNamespace(peft_config={"default": plain},
                                             minigrpo_base={"merged": []}))
    odd = [SimpleNamespace(**{**vars(plain), k: v})
           for k, v in (("use_dora", True), ("modules_to_save", ["lm_head"]),
                        ("rank_pattern", {"q_proj": 8}), ("alpha_pattern", {"q_proj": 4}),
                        ("bias", "lora_only"))]
    for model, message in ((SimpleNamespace(peft_config={"default": plain},
                                            minigrpo_base={"merged": [{"path": "sft"}]}),
                            "export that chain"),
                           *((SimpleNamespace(peft_config={"default": pc}, minigrpo_base={}),
                              "plain LoRA adapters") for pc in odd)):
        with pytest.raises(ConfigError, match=message):
            vllm_engine.check_policy(model)


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
