"""A fake `vllm` package for the tests (and bench/same_steps.py), as strict as the real one at the
calls engines/vllm_engine.py makes: LLM(...), LLM.generate, SamplingParams, LoRARequest,
sleep/wake_up. Real vLLM needs CUDA and is not installed here.

Strict: every call binds to the real signature of vLLM VERSION, read from its wheel's source and
stored in engines/vllm_surface.json (tools/vllm_surface.py), so a keyword vLLM lacks or a keyword
argument passed by position fails here as there; and it refuses what vLLM refuses, with vLLM's
words: a LoRA id below 1, a max_lora_rank outside vLLM's set, an adapter directory without
adapter_config.json, an adapter PEFTHelper rejects (rank above max_lora_rank, DoRA,
modules_to_save, a bias), SamplingParams out of range.

Honest: it samples token by token from a fixed random next-token table (seeded like the engine),
with vLLM's order of processing (min_tokens bans EOS and stop_token_ids, then temperature, top-k,
top-p), records each token's log-prob as logprobs_mode asks ("processed_logprobs": under that
processed distribution), and stops as vLLM 0.30's check_stop does: EOS (unless ignore_eos), a
stop token id, max_tokens, then a stop string in the decoded text (not within min_tokens).
"""
from __future__ import annotations

import ast
import inspect
import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.vllm_startup import SURFACE

VERSION = "0.30.0"  # inside requirements-vllm.txt's window; its surface is stored
REAL = SURFACE[VERSION]


def signature(params: str) -> inspect.Signature:
    """The stored parameter list ("self, prompts, *, use_tqdm=True") as a Signature to bind calls
    to; defaults become None (only their presence matters for binding)."""
    fn = ast.parse(f"def f({params}): pass").body[0]
    fn.args.defaults = [ast.Constant(None) for _ in fn.args.defaults]
    fn.args.kw_defaults = [d if d is None else ast.Constant(None) for d in fn.args.kw_defaults]
    scope: dict = {}
    tree = ast.fix_missing_locations(ast.Module([fn], []))
    exec(compile(tree, "<vllm signature>", "exec"), scope)
    return inspect.signature(scope["f"])


def bind(name: str, *args, **kwargs) -> inspect.BoundArguments:
    """Bind a call as Python would bind it to the real vLLM's `name` (TypeError otherwise)."""
    try:
        return signature(REAL[name]).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"vllm {VERSION} {name}: {e}") from None


def fields_of(name: str, kwargs: dict) -> None:
    """A msgspec Struct of vLLM takes its fields as keywords; any other is a TypeError."""
    unknown = set(kwargs) - set(REAL[name])
    if unknown:
        raise TypeError(f"vllm {VERSION} {name} has no field(s) {sorted(unknown)}")


class LoRARequest:
    def __init__(self, *args, **kwargs):
        names = REAL["LoRARequest"]
        kwargs |= dict(zip(names, args))
        fields_of("LoRARequest", kwargs)
        self.lora_name, self.lora_int_id = kwargs["lora_name"], kwargs["lora_int_id"]
        self.lora_path = kwargs.get("lora_path", "")
        if self.lora_int_id < 1:  # vllm/lora/request.py's __post_init__
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


class SamplingParams:
    def __init__(self, **kwargs):
        fields_of("SamplingParams", kwargs)
        self.n, self.temperature, self.top_p, self.top_k = 1, 1.0, 1.0, 0
        self.max_tokens, self.min_tokens, self.ignore_eos = 16, 0, False
        self.stop, self.include_stop_str_in_output, self.stop_token_ids = None, False, None
        self.logprobs = None
        vars(self).update(kwargs)
        if not 0 <= self.temperature <= 2:  # vllm/sampling_params.py's _verify_args
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens < 1 or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}.")


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list
    text: str
    logprobs: list | None
    finish_reason: str
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    outputs: list


def load_adapter(request: LoRARequest, max_lora_rank: int) -> dict:
    """What vLLM's worker does with a LoRARequest: PEFTHelper over adapter_config.json, then the
    weights; its errors, in its words."""
    path = Path(request.lora_path)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"Loading lora {request.lora_name} failed: No adapter found for "
                                f"{request.lora_path}")
    pc = json.loads((path / "adapter_config.json").read_text())
    errors = (["vLLM only supports modules_to_save being None."] * bool(pc.get("modules_to_save"))
              + ["vLLM does not yet support DoRA."] * bool(pc.get("use_dora"))
              + [f"LoRA rank {pc['r']} is greater than max_lora_rank {max_lora_rank}."]
              * (pc["r"] > max_lora_rank)
              + ["Adapter bias is not supported."] * (pc.get("bias", "none") != "none"))
    if errors:
        raise ValueError(" ".join(errors))
    return load_file(path / "adapter_model.safetensors")


class FakeLLM:
    """Records the adapter weights each generate() call was given; samples as described above."""
    instances: list = []

    def __init__(self, *args, **kwargs):
        bound = bind("LLM.__init__", self, *args, **kwargs).arguments
        extra = bound.pop("kwargs", {})
        unknown = set(extra) - set(REAL["EngineArgs"])
        if unknown:
            raise TypeError(f"vllm {VERSION} EngineArgs has no field(s) {sorted(unknown)}")
        self.kwargs = {k: v for k, v in bound.items() if k != "self"} | extra
        if extra.get("max_lora_rank", 16) not in REAL["max_lora_ranks"]:
            raise ValueError(f"max_lora_rank must be one of {REAL['max_lora_ranks']}")
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.kwargs.get("tokenizer") or
                                                       self.kwargs["model"])
        self.calls, self.awake = [], True
        self.rng = torch.Generator().manual_seed(self.kwargs.get("seed", 0))
        V = len(self.tokenizer)
        self.table = torch.randn(V, V, generator=self.rng) * 3  # next-token logits by last token
        FakeLLM.instances.append(self)

    def sleep(self, *args, **kwargs):
        bind("LLM.sleep", self, *args, **kwargs)
        self.awake = False

    def wake_up(self, *args, **kwargs):
        bind("LLM.wake_up", self, *args, **kwargs)
        self.awake = True

    def generate(self, *args, **kwargs):
        call = bind("LLM.generate", self, *args, **kwargs).arguments
        prompts, params, lora = call["prompts"], call["sampling_params"], call.get("lora_request")
        assert self.awake or not self.kwargs.get("enable_sleep_mode"), \
            "generate() on a sleeping engine"
        weights = load_adapter(lora, self.kwargs.get("max_lora_rank", 16)) if lora else None
        self.calls.append((lora and lora.lora_int_id, lora and lora.lora_name, weights, prompts))
        return [RequestOutput([self.complete(p["prompt_token_ids"], params)
                               for _ in range(params.n)]) for p in prompts]

    def processed(self, last: int, params: SamplingParams, n: int) -> torch.Tensor:
        """(V,) log-probs of the next token after `last`, vLLM's sampler's order: min_tokens'
        ban of EOS and the stop token ids, temperature, top-k, top-p, renormalised."""
        logits = self.table[last].clone()
        if n < params.min_tokens:
            banned = list(params.stop_token_ids or ()) + [self.tokenizer.eos_token_id]
            logits[banned] = float("-inf")
        logits = logits / params.temperature
        if params.top_k > 0:
            logits[logits < logits.topk(params.top_k).values[-1]] = float("-inf")
        if params.top_p < 1:
            order = logits.argsort(descending=True)
            mass = logits[order].softmax(-1).cumsum(-1)
            drop = order[(mass - logits[order].softmax(-1)) >= params.top_p]
            logits[drop] = float("-inf")
        return logits.log_softmax(-1)

    def complete(self, prompt: list[int], params: SamplingParams) -> CompletionOutput:
        ids, logps, eos = [], [], self.tokenizer.eos_token_id
        finish, stop_reason, text = "length", None, ""
        while True:
            logp = self.processed((prompt + ids)[-1], params, len(ids))
            raw = self.table[(prompt + ids)[-1]].log_softmax(-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=self.rng))
            ids.append(token)
            mode = self.kwargs.get("logprobs_mode", "raw_logprobs")
            logps.append(float((logp if mode == "processed_logprobs" else raw)[token]))
            text = self.tokenizer.decode(ids)
            if len(ids) >= params.min_tokens and token == eos and not params.ignore_eos:
                finish = "stop"
            elif len(ids) >= params.min_tokens and token in (params.stop_token_ids or ()):
                finish, stop_reason = "stop", token
            elif len(ids) >= params.max_tokens:
                finish = "length"
            elif len(ids) > params.min_tokens and any(s in text for s in params.stop or ()):
                finish, stop_reason = "stop", next(s for s in params.stop if s in text)
                cut = text.index(stop_reason)
                text = text[:cut + len(stop_reason) * params.include_stop_str_in_output]
            else:
                continue
            break
        record = [{t: Logprob(lp)} for t, lp in zip(ids, logps)] \
            if params.logprobs is not None else None
        return CompletionOutput(ids, text, record, finish, stop_reason)


def fake_vllm_modules(version: str = VERSION) -> dict[str, types.ModuleType]:
    """The fake `vllm` package, by module name, to put in sys.modules."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = FakeLLM, SamplingParams, version
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    return {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request}
