"""A fake `vllm` package for the tests (and bench/same_steps.py), as strict as the real one at the
calls engines/vllm_engine.py makes: LLM(...), LLM.generate, SamplingParams, LoRARequest,
sleep/wake_up. Real vLLM needs CUDA and is not installed here.

Strict: every call binds to the real signature of vLLM VERSION, read from its wheel's source and
stored in engines/vllm_surface.json (tools/vllm_surface.py), so a keyword vLLM lacks or a keyword
argument passed by position fails here as there; and it refuses what vLLM 0.32 refuses, with its
words and exception types: a LoRA id below 1, a max_lora_rank outside vLLM's set, an adapter
directory without adapter_config.json (LoRAAdapterNotFoundError), an adapter PEFTHelper rejects
(rank above max_lora_rank, DoRA, modules_to_save, biases, base-changing inits, aLoRA, ...), an
adapter with a module the model cannot adapt (not a linear layer, nor an embedding module its
class lists), a prompt empty or as long as max_model_len (VLLMValidationError), SamplingParams out
of range.

Honest: it samples token by token (seeded like the engine) from the served model, the base at
`model` with the request's adapter added (W + scale * B @ A, as vLLM's LoRA layers compute it), or
with `FakeLLM.samples_from = "table"` from a fixed random next-token table; with vLLM's order of
processing (min_tokens bans EOS and stop_token_ids, then temperature, top-k, top-p), records each
token's log-prob as logprobs_mode asks ("processed_logprobs": under that processed distribution),
and stops as vLLM 0.32's check_stop does: EOS (unless ignore_eos), a stop token id, max_tokens or
max_model_len, then a stop string in the decoded text (not within min_tokens).

A fault to test against: `FakeLLM.loses_adapter_after_sleep = True` serves the bare base once the
engine has slept and woken, accepting the LoRARequest without a word, as vLLM issue 53888 reported
of vLLM 0.27.1.
"""
from __future__ import annotations

import ast
import copy
import inspect
import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.vllm_startup import SURFACE

VERSION = "0.32.0"  # inside requirements-vllm.txt's window; its surface is stored
REAL = SURFACE[VERSION]
SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")  # PEFTHelper's, 0.32


class VLLMError(Exception):
    """vllm/exceptions.py's base class (0.32)."""


class VLLMValidationError(VLLMError):
    """A request vLLM refuses (vllm/exceptions.py, under VLLMClientError)."""


class LoRAAdapterNotFoundError(VLLMError):
    def __init__(self, lora_name: str, lora_path: str):
        self.message = f"Loading lora {lora_name} failed: No adapter found for {lora_path}"

    def __str__(self):
        return self.message


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


def peft_errors(pc: dict, max_lora_rank: int) -> list[str]:
    """vLLM 0.32's PEFTHelper.validate_legal over an adapter_config.json, in its words."""
    init = pc.get("init_lora_weights", True)
    saved = [m for m in pc.get("modules_to_save") or () if m not in ("classifier", "score")]
    rank = max([pc["r"], *(pc.get("rank_pattern") or {}).values()])
    return ([f'vLLM only supports modules_to_save being either None or ["classifier", "score"] '
             f"for classification models. Unsupported modules_to_save: {saved}"] * bool(saved)
            + ["vLLM does not yet support DoRA."] * bool(pc.get("use_dora"))
            + ["vLLM does not support LoRA bias (lora_bias)."] * bool(pc.get("lora_bias"))
            + [f"vLLM does not support init_lora_weights={init!r}."]
            * (isinstance(init, str) and init.lower() not in SUPPORTED_INITS)
            + ["vLLM does not support Activated LoRA (aLoRA)."]
            * bool(pc.get("alora_invocation_tokens"))
            + ["vLLM does not support layer_replication."] * bool(pc.get("layer_replication"))
            + ["vLLM does not support block-diagonal LoRA (BD-LoRA)."] * bool(pc.get("use_bdlora"))
            + ["vLLM does not support QALoRA."] * bool(pc.get("use_qalora"))
            + [f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}."]
            * (rank > max_lora_rank)
            + ["Adapter bias is not supported."] * (pc.get("bias", "none") != "none"))


def module_of(key: str) -> str:
    """A saved adapter tensor's module: base_model.model.<module>.lora_A.weight -> <module>."""
    name = key.removeprefix("base_model.model.")
    for tail in (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B"):
        name = name.removesuffix(tail)
    return name


def load_adapter(request: LoRARequest, max_lora_rank: int, expected: set[str]) -> dict:
    """What vLLM's worker does with a LoRARequest: PEFTHelper over adapter_config.json, then the
    weights, each of a module the model can adapt (`expected`: its linear layers and the embedding
    modules its class lists); its errors, in its words."""
    path = Path(request.lora_path)
    if not (path / "adapter_config.json").is_file():
        raise LoRAAdapterNotFoundError(request.lora_name, request.lora_path)
    pc = json.loads((path / "adapter_config.json").read_text())
    errors = peft_errors(pc, max_lora_rank)
    if errors:
        raise ValueError(" ".join(errors))
    tensors = load_file(path / "adapter_model.safetensors")
    unexpected = sorted({module_of(k) for k in tensors
                         if module_of(k).rsplit(".", 1)[-1] not in expected})
    if unexpected:  # vllm/lora/lora_model.py's check_unexpected_modules
        raise ValueError(f"While loading {path}, expected target modules in {expected} but "
                         f"received {unexpected}. Please verify that the loaded LoRA module is "
                         "correct")
    return {"config": pc, "weights": tensors}


class FakeLLM:
    """Records the adapter weights each generate() call was given; samples as described above."""
    instances: list = []
    samples_from = "model"  # or "table"
    loses_adapter_after_sleep = False

    def __init__(self, *args, **kwargs):
        bound = bind("LLM.__init__", self, *args, **kwargs).arguments
        extra = bound.pop("kwargs", {})
        unknown = set(extra) - set(REAL["EngineArgs"])
        if unknown:
            raise TypeError(f"vllm {VERSION} EngineArgs has no field(s) {sorted(unknown)}")
        self.kwargs = {k: v for k, v in bound.items() if k != "self"} | extra
        if extra.get("max_lora_rank", 16) not in REAL["max_lora_ranks"]:
            raise ValueError(f"max_lora_rank must be one of {REAL['max_lora_ranks']}")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.kwargs.get("tokenizer") or
                                                       self.kwargs["model"])
        self.base = AutoModelForCausalLM.from_pretrained(self.kwargs["model"],
                                                         dtype=torch.float32).eval()
        self.max_model_len = (self.kwargs.get("max_model_len")
                              or self.base.config.max_position_embeddings)
        arch = self.base.config.architectures[0]
        self.expected = {n.rsplit(".", 1)[-1] for n, m in self.base.named_modules()
                         if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
        self.expected |= set(REAL["lora_archs"].get(arch, []))
        self.calls, self.awake, self.slept, self.served = [], True, False, {}
        self.rng = torch.Generator().manual_seed(self.kwargs.get("seed", 0))
        V = len(self.tokenizer)
        self.table = torch.randn(V, V, generator=self.rng) * 3  # next-token logits by last token
        FakeLLM.instances.append(self)

    def sleep(self, *args, **kwargs):
        bind("LLM.sleep", self, *args, **kwargs)
        self.awake, self.slept = False, True

    def wake_up(self, *args, **kwargs):
        bind("LLM.wake_up", self, *args, **kwargs)
        self.awake = True

    def generate(self, *args, **kwargs):
        call = bind("LLM.generate", self, *args, **kwargs).arguments
        prompts, params, lora = call["prompts"], call["sampling_params"], call.get("lora_request")
        assert self.awake or not self.kwargs.get("enable_sleep_mode"), \
            "generate() on a sleeping engine"
        for p in prompts:
            self.check_prompt(len(p["prompt_token_ids"]))
        adapter = load_adapter(lora, self.kwargs.get("max_lora_rank", 16), self.expected) \
            if lora else None
        if self.loses_adapter_after_sleep and self.slept:
            adapter = None  # the request is taken, its adapter not applied
        model = self.model_for(lora and lora.lora_int_id, adapter)
        self.calls.append((lora and lora.lora_int_id, lora and lora.lora_name,
                           adapter and adapter["weights"], prompts))
        return [RequestOutput([self.complete(p["prompt_token_ids"], params, model)
                               for _ in range(params.n)]) for p in prompts]

    def check_prompt(self, n: int) -> None:
        """vllm/v1/engine/input_processor.py's _validate_prompt_len for a prompt of n tokens."""
        if n == 0:
            raise VLLMValidationError("The decoder prompt cannot be empty")
        if n > self.max_model_len:
            raise VLLMValidationError(
                f"The decoder prompt (length {n}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens.")
        if n == self.max_model_len:
            raise VLLMValidationError(
                f"The decoder prompt (length {n}) plus the number of requested output tokens (at "
                f"least 1) is longer than the maximum model length of {self.max_model_len}. Make "
                "sure that `max_model_len` is no smaller than the number of text tokens (prompt "
                "+ requested output tokens).")

    def model_for(self, lora_id: int | None, adapter: dict | None):
        """The base with the adapter's update added to each adapted weight, kept by LoRA id as
        vLLM keeps a loaded adapter; the base itself without one."""
        if adapter is None:
            return self.base
        if lora_id not in self.served:
            pc, weights = adapter["config"], adapter["weights"]
            scale = pc["lora_alpha"] / (pc["r"] ** 0.5 if pc.get("use_rslora") else pc["r"])
            served = copy.deepcopy(self.base)
            with torch.no_grad():
                for key, A in weights.items():
                    if key.endswith(".lora_A.weight"):
                        B = weights[key.replace(".lora_A.", ".lora_B.")]
                        served.get_submodule(module_of(key)).weight += scale * B @ A
            self.served = {lora_id: served}  # max_loras=1: a new adapter evicts the last
        return self.served[lora_id]

    def next_logits(self, context: list[int], model) -> torch.Tensor:
        """(V,) the next token's logits after `context`: the served model's, or the table's."""
        if self.samples_from == "table":
            return self.table[context[-1]].clone()
        with torch.no_grad():
            return model(torch.tensor([context])).logits[0, -1, :len(self.tokenizer)]

    def processed(self, logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
        """(V,) log-probs of the next token from its logits, vLLM's sampler's order: min_tokens'
        ban of EOS and the stop token ids, temperature, top-k, top-p, renormalised."""
        logits = logits.clone()
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

    def complete(self, prompt: list[int], params: SamplingParams, model) -> CompletionOutput:
        ids, logps, eos = [], [], self.tokenizer.eos_token_id
        finish, stop_reason, text = "length", None, ""
        while True:
            logits = self.next_logits(prompt + ids, model)
            logp = self.processed(logits, params, len(ids))
            raw = logits.log_softmax(-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=self.rng))
            ids.append(token)
            mode = self.kwargs.get("logprobs_mode", "raw_logprobs")
            logps.append(float((logp if mode == "processed_logprobs" else raw)[token]))
            text = self.tokenizer.decode(ids)
            if len(ids) >= params.min_tokens and token == eos and not params.ignore_eos:
                finish = "stop"
            elif len(ids) >= params.min_tokens and token in (params.stop_token_ids or ()):
                finish, stop_reason = "stop", token
            elif len(ids) >= params.max_tokens or len(prompt) + len(ids) >= self.max_model_len:
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
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMValidationError = VLLMValidationError
    exceptions.LoRAAdapterNotFoundError = LoRAAdapterNotFoundError
    return {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request,
            "vllm.exceptions": exceptions}
