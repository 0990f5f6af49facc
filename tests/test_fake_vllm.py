"""The fake vllm package (tests/fake_vllm.py) is as strict as vLLM 0.32 at the calls the engine
makes: each refusal of real vLLM is a refusal here, with vLLM's words and exception types (an
adapter with a module the model cannot adapt, a prompt as long as max_model_len too), it samples
from the served model with the request's adapter, honours stop strings, min_tokens, ignore_eos,
max_model_len and temperature as vLLM's sampler does, and its surface is vLLM's stored one
(engines/vllm_surface.json), which is compared with an installed vllm where there is one."""
import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from config import ConfigError
from engines import vllm_startup
from fake_vllm import (
    VERSION,
    FakeLLM,
    LoRAAdapterNotFoundError,
    LoRARequest,
    SamplingParams,
    VLLMValidationError,
    fake_vllm_modules,
)
from tools import vllm_surface

ENGINE = Path(__file__).parents[1] / "engines/vllm_engine.py"


@pytest.fixture
def llm(tiny_llama):
    """The fake sampling from its next-token table (the tests of vLLM's sampler settings)."""
    fake = FakeLLM(model=str(tiny_llama), tokenizer=str(tiny_llama), seed=0, enable_lora=True,
                   max_lora_rank=8, logprobs_mode="processed_logprobs")
    fake.samples_from = "table"
    return fake


Q_PROJ = "base_model.model.model.layers.0.self_attn.q_proj"  # the tiny Llama's: 32 -> 32


def write_adapter(path: Path, module: str = Q_PROJ, id: int = 1, **config) -> LoRARequest:
    """A rank-4 adapter on one module of the tiny Llama (B random: it changes the model)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]} | config))
    g = torch.Generator().manual_seed(id)
    save_file({f"{module}.lora_A.weight": torch.randn(4, 32, generator=g),
               f"{module}.lora_B.weight": torch.randn(32, 4, generator=g)},
              path / "adapter_model.safetensors")
    return LoRARequest("a", id, str(path))


def prompt(ids=(5, 6)) -> list[dict]:
    return [{"prompt_token_ids": list(ids)}]


def test_lora_ids_below_one_and_empty_paths_are_refused():
    assert LoRARequest("a", 1, "/x").lora_int_id == 1
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(AssertionError, match="lora_path cannot be empty"):
        LoRARequest("a", 2)


def test_a_max_lora_rank_outside_vllms_set_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"max_lora_rank must be one of \[1, 8, 16"):
        FakeLLM(model=str(tiny_llama), enable_lora=True, max_lora_rank=4)


def test_an_adapter_without_adapter_config_json_is_refused(llm, tmp_path):
    request = write_adapter(tmp_path / "v1")
    (tmp_path / "v1/adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterNotFoundError,
                       match="Loading lora a failed: No adapter found for"):
        llm.generate(prompt(), SamplingParams(max_tokens=2), lora_request=request)


@pytest.mark.parametrize("config, message", [
    ({"r": 16}, "LoRA rank 16 is greater than max_lora_rank 8."),
    ({"rank_pattern": {"q_proj": 16}}, "LoRA rank 16 is greater than max_lora_rank 8."),
    ({"use_dora": True}, "vLLM does not yet support DoRA."),
    ({"modules_to_save": ["lm_head"]}, "vLLM only supports modules_to_save being either None"),
    ({"bias": "all"}, "Adapter bias is not supported."),
    ({"lora_bias": True}, r"vLLM does not support LoRA bias \(lora_bias\)."),
    ({"init_lora_weights": "pissa"}, "vLLM does not support init_lora_weights='pissa'."),
    ({"alora_invocation_tokens": [5]}, r"vLLM does not support Activated LoRA \(aLoRA\)."),
    ({"layer_replication": [[0, 1]]}, "vLLM does not support layer_replication.")])
def test_adapters_vllms_peft_helper_rejects_are_refused(llm, tmp_path, config, message):
    request = write_adapter(tmp_path / "v1", **config)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt(), SamplingParams(max_tokens=2), lora_request=request)
    # the initialisations that leave the base as it is load
    write_adapter(tmp_path / "v2", init_lora_weights="gaussian")
    llm.generate(prompt(), SamplingParams(max_tokens=2),
                 lora_request=LoRARequest("b", 2, str(tmp_path / "v2")))


def test_an_adapter_with_a_module_the_model_cannot_adapt_is_refused(llm, tmp_path):
    """vLLM adapts the linear layers and the embedding modules the class lists: an adapter on
    a Llama's MLP block (not a layer), as vLLM 0.32's check_unexpected_modules words it."""
    request = write_adapter(tmp_path / "v1", module="base_model.model.model.layers.0.mlp")
    with pytest.raises(ValueError, match=r"While loading .*v1, expected target modules in .*"
                                         r"'q_proj'.* but received \['model.layers.0.mlp'\]"):
        llm.generate(prompt(), SamplingParams(max_tokens=2), lora_request=request)
    assert {"q_proj", "down_proj", "embed_tokens", "lm_head"} <= llm.expected


def test_a_prompt_empty_or_as_long_as_max_model_len_is_refused_and_completions_stop_there(
        tiny_llama):
    llm = FakeLLM(model=str(tiny_llama), max_model_len=6)
    with pytest.raises(VLLMValidationError, match="The decoder prompt cannot be empty"):
        llm.generate(prompt(()), SamplingParams(max_tokens=2))
    with pytest.raises(VLLMValidationError, match=r"The decoder prompt \(length 7\) is longer "
                                                  "than the maximum model length of 6"):
        llm.generate(prompt(range(5, 12)), SamplingParams(max_tokens=2))
    with pytest.raises(VLLMValidationError, match=r"\(length 6\) plus the number of requested "
                                                  r"output tokens \(at least 1\)"):
        llm.generate(prompt(range(5, 11)), SamplingParams(max_tokens=2))
    out = llm.generate(prompt(range(5, 9)), SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].outputs[0].finish_reason == "length"


def test_it_samples_from_the_base_with_the_requests_adapter_added(tiny_llama, tmp_path):
    """Each token's processed log-prob is the adapted model's log-softmax at temperature 1: the
    base's q_proj weight plus (alpha / r) B A, as vLLM's LoRA layer computes x A^T B^T scaled."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    llm = FakeLLM(model=str(tiny_llama), seed=0, enable_lora=True, max_lora_rank=8,
                  logprobs_mode="processed_logprobs")
    request = write_adapter(tmp_path / "v1")
    out = llm.generate(prompt(), SamplingParams(n=2, max_tokens=5, logprobs=0),
                       lora_request=request)[0].outputs
    w = load_file(tmp_path / "v1/adapter_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        model.get_submodule(Q_PROJ.removeprefix("base_model.model.")).weight += (
            2.0 * w[f"{Q_PROJ}.lora_B.weight"] @ w[f"{Q_PROJ}.lora_A.weight"])
        for o in out:
            ids = torch.tensor([[5, 6, *o.token_ids]])
            want = model(ids).logits[0, 1:-1].log_softmax(-1)  # (5, V) the tokens' positions
            want = want.gather(1, ids[0, 2:, None])[:, 0]
            got = [next(iter(step.values())).logprob for step in o.logprobs]
            assert got == pytest.approx(want.tolist(), abs=1e-4)
    base = llm.generate(prompt(), SamplingParams(n=2, max_tokens=5, logprobs=0))[0].outputs
    assert llm.calls[-1][2] is None and base[0].logprobs != out[0].logprobs


def test_the_fault_loses_the_adapter_after_a_sleep_without_a_word(tiny_llama, tmp_path,
                                                                   monkeypatch):
    """FakeLLM.loses_adapter_after_sleep: vLLM issue 53888's report (vLLM 0.27.1), the request
    accepted after wake_up and the base served."""
    monkeypatch.setattr(FakeLLM, "loses_adapter_after_sleep", True)
    llm = FakeLLM(model=str(tiny_llama), enable_lora=True, max_lora_rank=8,
                  enable_sleep_mode=True)
    request = write_adapter(tmp_path / "v1")
    llm.generate(prompt(), SamplingParams(max_tokens=2), lora_request=request)
    assert llm.calls[-1][2] is not None  # served before any sleep
    llm.sleep(level=1)
    llm.wake_up()
    llm.generate(prompt(), SamplingParams(max_tokens=2), lora_request=request)
    assert llm.calls[-1][:2] == (1, "a") and llm.calls[-1][2] is None


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.33.0", "0.32.0rc1"])
def test_versions_outside_the_window_are_refused(monkeypatch, version):
    import sys
    for name, module in fake_vllm_modules(version).items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(ConfigError, match=f"found {version}: pip install -r requirements-vllm.txt"):
        vllm_startup.check_install(8)
    monkeypatch.setattr(sys.modules["vllm"], "__version__", VERSION)
    vllm_startup.check_install(8)


def test_keywords_vllm_lacks_and_keyword_arguments_given_by_position_are_type_errors(llm,
                                                                                     tiny_llama):
    with pytest.raises(TypeError, match="EngineArgs has no field"):
        FakeLLM(model=str(tiny_llama), max_lora_ranks=8)
    with pytest.raises(TypeError, match="LLM.generate"):  # use_tqdm is keyword-only
        llm.generate(prompt(), SamplingParams(), False)
    with pytest.raises(TypeError, match="SamplingParams has no field"):
        SamplingParams(stop_strings=["x"])
    with pytest.raises(TypeError, match="LLM.sleep"):
        llm.sleep(level=1, offload=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 2.5}, "temperature must be in"), ({"top_p": 0.0}, "top_p must be in"),
    ({"top_k": -2}, "top_k must be 0"), ({"max_tokens": 2, "min_tokens": 3}, "min_tokens")])
def test_sampling_params_vllm_refuses_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_end_a_completion_keeping_the_string_but_not_within_min_tokens(llm):
    params = SamplingParams(n=8, max_tokens=40, stop=["e"], include_stop_str_in_output=True)
    outs = llm.generate(prompt(), params)[0].outputs
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped and all(o.text.endswith("e") and o.text.count("e") == 1
                           and o.stop_reason == "e" for o in stopped)
    late = llm.generate(prompt(), SamplingParams(n=8, max_tokens=40, stop=["e"], min_tokens=6))
    assert all(len(o.token_ids) > 6 for o in late[0].outputs)


def test_min_tokens_bans_eos_and_stop_token_ids_and_ignore_eos_leaves_the_stop_ids(llm):
    eos = llm.tokenizer.eos_token_id
    llm.table[:, eos] = 50.0  # EOS next, always
    first = llm.generate(prompt(), SamplingParams(n=2, max_tokens=8, logprobs=0))[0].outputs
    assert all(o.token_ids == [eos] and o.finish_reason == "stop" for o in first)
    late = llm.generate(prompt(), SamplingParams(n=2, max_tokens=8, min_tokens=4, logprobs=0,
                                                 stop_token_ids=[eos]))[0].outputs
    assert all(len(o.token_ids) == 5 and o.token_ids[-1] == eos for o in late)
    for o in late:  # the log-prob of a token drawn under the ban: renormalised without EOS
        banned = llm.table[o.token_ids[2]].clone()
        banned[eos] = float("-inf")
        want = float(banned.log_softmax(-1)[o.token_ids[3]])
        assert next(iter(o.logprobs[3].values())).logprob == pytest.approx(want, abs=1e-5)
    kept = llm.generate(prompt(), SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(kept.token_ids) == 8 and kept.finish_reason == "length"
    stop_id = llm.generate(prompt(), SamplingParams(max_tokens=8, ignore_eos=True,
                                                    stop_token_ids=[eos]))[0].outputs[0]
    assert stop_id.token_ids == [eos] and stop_id.stop_reason == eos  # as vLLM's check_stop


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_samples_and_processed_log_probs_follow_the_temperature(llm, temperature):
    out = llm.generate(prompt(), SamplingParams(n=4, max_tokens=6, temperature=temperature,
                                                logprobs=0))[0].outputs
    for o in out:
        previous = [6] + list(o.token_ids[:-1])
        want = [float((llm.table[p] / temperature).log_softmax(-1)[t])
                for p, t in zip(previous, o.token_ids)]
        got = [next(iter(step.values())).logprob for step in o.logprobs]
        assert got == pytest.approx(want, abs=1e-5)


def engine_calls() -> dict[str, set[str]]:
    """The keywords engines/vllm_engine.py passes to LLM(...), SamplingParams(...) and generate,
    read from its source."""
    calls: dict[str, set[str]] = {"LLM": set(), "SamplingParams": set(), "generate": set()}
    for node in ast.walk(ast.parse(ENGINE.read_text())):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name in calls:
                calls[name] |= {k.arg for k in node.keywords}
    return calls


def accepted(surface: dict) -> dict[str, set[str]]:
    def names(params: str) -> set[str]:
        return {a.arg for a in ast.walk(ast.parse(f"def f({params}): pass")) if
                isinstance(a, ast.arg)}
    return {"LLM": names(surface["LLM.__init__"]) | set(surface["EngineArgs"]),
            "SamplingParams": set(surface["SamplingParams"]),
            "generate": names(surface["LLM.generate"])}


@pytest.mark.parametrize("version", sorted({vllm_startup.MIN_VLLM, VERSION}))
def test_every_keyword_the_engine_passes_exists_at_both_ends_of_the_window(version):
    calls, ok = engine_calls(), accepted(vllm_startup.SURFACE[version])
    assert {"max_lora_rank", "logprobs_mode", "distributed_executor_backend",
            "max_num_seqs"} <= calls["LLM"]
    assert all(calls[k] <= ok[k] for k in calls), {k: calls[k] - ok[k] for k in calls}


def test_the_fake_is_the_stored_vllm_inside_the_window():
    assert vllm_startup.in_window(VERSION) and vllm_startup.surface_of(VERSION)[0] == VERSION
    stored = vllm_startup.SURFACE[VERSION]
    assert stored["LoRARequest"][:3] == ["lora_name", "lora_int_id", "lora_path"]
    assert {"stop", "min_tokens", "ignore_eos", "include_stop_str_in_output"} <= set(
        stored["SamplingParams"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_an_installed_vllm_has_the_stored_surface_or_the_engines_keywords():
    """Read from the installed package's source (no import, no CUDA): its stored surface when its
    version was recorded, else at least every keyword the engine passes."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    files = {str(p.relative_to(root)): p.read_text(errors="replace") for p in root.rglob("*.py")}
    version = vllm_surface.version_of(files)
    got = vllm_surface.surface(files)
    if version in vllm_startup.SURFACE and "LLM.__init__" in vllm_startup.SURFACE[version]:
        assert got == vllm_startup.SURFACE[version]
    calls, ok = engine_calls(), accepted(got)
    assert all(calls[k] <= ok[k] for k in calls), {k: calls[k] - ok[k] for k in calls}


def test_the_docs_name_the_first_vllm_server_that_reads_structured_outputs_for_json_too():
    """Issue 57: docs/rewards-and-judges.md said `guided_json` "before vLLM 0.10.2"; the stored
    servers' source shows 0.10.2 reading guided_json alone and structured_outputs from 0.11.0."""
    from packaging.version import Version
    reads = {v: s["chat_request_fields"] for v, s in vllm_startup.SURFACE.items()}
    first = min((v for v in reads if "structured_outputs" in reads[v]), key=Version)
    assert reads["0.10.2"] == ["guided_regex", "guided_choice", "guided_json"]
    doc = (Path(__file__).parents[1] / "docs/rewards-and-judges.md").read_text()
    assert f"(`guided_json:` before vLLM {first}):" in doc
