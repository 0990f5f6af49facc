"""The memory levers chosen for the user: micro-batch size and gradient checkpointing, from an
estimate of the run's peak (traced on the CPU, without arithmetic) against the GPU's free memory.
An explicit setting always wins; the choice comes with a phrase for the run's first line.

    free = allocatable_bytes(device)  # after loading; less under a per-process cap
    levers = choose_levers(model, cfg, prompt_tokens, free, micro_batch_size=None,
                           checkpointing=None)  # None: choose; a value: the user's, kept
    if levers.checkpointing and not is_checkpointing(model):
        enable_checkpointing(model)  # on the loaded (peft-wrapped) model
    print(levers.why)  # "micro-batch 16, no checkpointing: ~21.3 of 70.2 GiB free"

The estimate (bench/memory_estimate.py prints it for any config): one training micro-batch
(logprobs.sequence_log_probs and its backward, under logprobs.mixed_precision) runs under torch's
FakeTensorMode, where every operator computes only its output's shape, and LiveBytes adds up the
bytes of tensor storage the operators create, minus what autograd and Python freed. Its peak is
what torch.cuda.max_memory_allocated would show above the weights, before the allocator's rounding,
cuBLAS workspaces and kernels' scratch memory (6% under the H100 run of bench/RESULTS.md). Sampling
is computed: the KV cache plus three fp32 (rows, vocab) buffers of the sampler.

The rule (choose_levers), all in bytes above the loaded weights:

    budget = free - (free / 10 + 1 GiB) - 2 x trained      (AdamW's two moments, allocated later)
    need(rows, ckpt) = max(train(rows, ckpt) + trained, sample)

train is the traced forward + backward peak at prompt_tokens + max_new_tokens (the episode's
tokens with env or tools) with grpo.logprob_chunk and fused_lm_head; + trained: the gradients an
earlier micro-batch of the step left. sample: (prompts_per_generate or prompts_per_step) x G rows
(0 with rollout.engine: vllm, which samples in memory it reserved itself). The margin: 10% for the
allocator's rounding and fragmentation (reserved above allocated) and the estimate's own error;
1 GiB for what no trace sees: cuBLAS workspaces, kernels' scratch, a compiled sampler's CUDA graph
pools. The first candidate that fits wins:

    1. no checkpointing, 16 or 8 rows: no recompute, and a GPU kept busy
    2. checkpointing, 16, 8, 4, 2 or 1 rows: recomputing costs ~30% of the pass, but 8-16 rows keep
       the GPU busy where 4 rows did not (a lean run at micro-batch 4: a training pass 2.65x TRL's)
    3. no checkpointing, 4, 2 or 1 rows (reached only by models that cannot checkpoint)
    none: 1 row with checkpointing, and a `why` that says it will likely run out of memory

Sampling's need is the same for every candidate: a candidate fits when its training need does and
sampling's fits too. When sampling alone does not, no micro-batch helps: the candidate chosen is the
first whose training fits, and `why` says sampling will likely run out of memory, and what to do.

Rows never exceed the completions a step trains (prompts_per_step x G / num_mini_batches), nor
optim.micro_batch_tokens' cap, nor, when that is unset, BUSY_TOKENS (8,192) padded tokens rounded
down to a power of two rows: 8 rows of 64 + 512 tokens, 16 of a short task's. Past that a GPU's
matmuls are large already and more rows cost memory for little speed (a rule, not yet timed).
Each candidate is traced when reached, once: a trace takes ~0.5 s for a 2-layer model and 3-7 s
for Qwen3-0.6B's shape on 2 shared CPU cores, whatever the rows (its time goes to operators, not
to arithmetic). Fitting a line through 1 and 2 rows would save traces, but the peak is not affine
in rows everywhere: 34% under at 16 rows (0.6B, 24 new tokens, checkpointing). A candidate is
skipped when one that did not fit implies it cannot (more rows, or as many rows without
checkpointing).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BUSY_TOKENS = 8192  # padded tokens a chosen micro-batch holds at most (optim.micro_batch_tokens: 0)

GiB = 2**30
ROWS = (16, 8, 4, 2, 1)  # micro-batch sizes tried, largest first
NO_CHECKPOINTING_ROWS = (16, 8)  # rule 1: large enough to keep a GPU busy without recompute


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage that operators create inside the mode and that are still referenced;
    `peak` is their maximum. Outputs that share an input's storage (views, in-place) are not new."""

    def __init__(self, preexisting=()):
        super().__init__()
        self.cur = self.peak = 0
        # alive, so a fake tensor's storage keeps its identity (the converter's memo is weak)
        self.keep = list(preexisting)
        self.live: dict[int, object] = {t.untyped_storage()._cdata: None for t in self.keep}

    def _freed(self, key: int, n: int) -> None:
        self.cur -= n
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in inputs:
                continue
            n = storage.nbytes()
            self.cur += n
            self.peak = max(self.peak, self.cur)
            self.live[key] = weakref.ref(storage, lambda _, key=key, n=n: self._freed(key, n))
        return out


# ------------------------------------------------------------ gradient checkpointing, switched


def _base(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    from model import is_peft
    return model.get_base_model() if is_peft(model) else model


def is_checkpointing(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def can_checkpoint(model) -> bool:
    return bool(getattr(_base(model), "supports_gradient_checkpointing", False))


def enable_checkpointing(model) -> None:
    """What model.load_policy does for model.gradient_checkpointing, on a model already loaded
    (peft-wrapped or not): non-reentrant checkpoints around each decoder layer, and a hook that
    makes the embeddings' output require grad (transformers' activation_checkpointing_enable adds
    it)."""
    from model import checkpoint_layers
    checkpoint_layers(_base(model))


def disable_checkpointing(model) -> None:
    from model import checkpoint_layers
    base = _base(model)
    checkpoint_layers(base, on=False)
    base.disable_input_require_grads()  # which enabling turned on, and disabling leaves (5.23)


@contextlib.contextmanager
def checkpointing_set(model, on: bool):
    """Checkpointing on or off inside the block, as it was after."""
    was = is_checkpointing(model)
    if on != was:
        (enable_checkpointing if on else disable_checkpointing)(model)
    try:
        yield
    finally:
        if on != was:
            (enable_checkpointing if was else disable_checkpointing)(model)


# ------------------------------------------------------------------------------- the estimate


def micro_batch_peak(model, rows: int, prompt: int, completion: int, chunk: int = 0,
                     fused_head: bool = False, autocast: bool = True,
                     checkpointing: bool = False) -> tuple[int, int]:
    """(forward peak, forward + backward peak) bytes above the weights for one micro-batch of
    (rows, prompt + completion) tokens, traced with checkpointing on or off (the model is left as
    it was; its gradients are dropped); the backward's peak includes the trained weights'
    gradients. Weights on the meta device are traced as CPU tensors, others on their own device:
    real CUDA weights as fake CUDA tensors (nothing allocated), under CUDA autocast; that path is
    not tested on a CPU, where the CPU and meta ones are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import logprobs
    from logprobs import mixed_precision
    device = next(model.parameters()).device
    device = torch.device("cpu") if device.type == "meta" else device
    was_training = model.training
    # train mode, as train.py's loss forward: checkpointing needs it
    model.train().zero_grad(set_to_none=True)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with checkpointing_set(model, checkpointing), fake:
            conv = fake.fake_tensor_converter  # its memo is weak: the mode keeps the fakes alive
            fake.meta_fakes = [conv.from_meta_and_device(fake, t, device)
                               for t in [*model.parameters(), *model.buffers()] if t.is_meta]
            weights = [fake.from_tensor(p) for p in model.parameters()]
            ids = torch.zeros(rows, prompt + completion, dtype=torch.long, device=device)
            with LiveBytes(weights) as mem:
                with (mixed_precision(model, device.type) if autocast
                      else contextlib.nullcontext()):
                    logp = logprobs.sequence_log_probs(  # the kernel: what auto runs
                        model, ids, torch.ones_like(ids), completion, 1.0, chunk, fused_head,
                        kernel=True)  # (rows, C)
                forward = mem.peak
                logp.sum().backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return forward, mem.peak


def kv_cache_bytes(cfg, rows: int, positions: int, dtype: torch.dtype) -> int:
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * rows * positions * heads * head_dim * 2 * dtype.itemsize


# a 4-bit weight, its 8-bit block absmax (64 weights) and the fp32 absmax of those (256 blocks)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# and each layer's own code books, fp32: the 256 values of the absmax's 8-bit code, the 16 of NF4,
# the absmax's offset (tests/test_qlora_cpu.py holds both against a loaded model's storage)
NF4_LAYER_BYTES = 4 * (256 + 16 + 1)


def weight_bytes(model, quant: str | None) -> int:
    """Bytes of all weights; with quant="4bit" the frozen Linear weights other than the output head
    count as NF4 with double quantization, as bitsandbytes stores them (model.load_base's QLoRA)."""
    if quant != "4bit":
        return sum(p.numel() * p.element_size() for p in model.parameters())
    quantized = {id(m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                 and not m.weight.requires_grad and not n.endswith("lm_head")}
    return int(sum(p.numel() * (NF4_BYTES if id(p) in quantized else p.element_size())
                   for p in model.parameters()) + NF4_LAYER_BYTES * len(quantized))


def sampling_bytes(cfg, rows: int, positions: int, dtype: torch.dtype) -> int:
    """Sampling's peak above the weights: the KV cache plus a few fp32 (rows, vocab) buffers of the
    sampler (logits, processed scores, probabilities)."""
    return kv_cache_bytes(cfg, rows, positions, dtype) + 3 * rows * cfg.vocab_size * 4


# ------------------------------------------------------------------------------- the choice


@dataclass
class Levers:
    micro_batch_size: int  # completions per forward/backward
    checkpointing: bool  # gradient checkpointing on
    peak_bytes: int  # estimated need above weights and AdamW state: max(training, sampling)
    budget_bytes: int  # what free memory leaves for it (module docstring)
    why: str  # for the run's first line: "micro-batch 16, no checkpointing: ~21.3 of 70.2 GiB free"


def allocatable_bytes(device) -> int:
    """What this process may still allocate on the GPU: the card's free memory, or less where
    torch.cuda.set_per_process_memory_fraction caps the process (bench/memory_cap.py's budget):
    then the cap minus what the caching allocator already reserved."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    if fraction < 1.0:
        free = min(free, int(fraction * total) - torch.cuda.memory_reserved(device))
    return max(free, 0)


def margin_bytes(free_bytes: int) -> int:
    """Free memory kept back: 10% (allocator rounding and fragmentation, the estimate's error) and
    1 GiB (cuBLAS workspaces, kernels' scratch, CUDA graph pools)."""
    return free_bytes // 10 + GiB


def candidates(micro_batch_size: int | None, checkpointing: bool | None,
               can: bool) -> list[tuple[int, bool]]:
    """(rows, checkpointing) in the order tried; explicit settings fix their part."""
    if micro_batch_size is not None and checkpointing is not None:
        return [(micro_batch_size, checkpointing)]
    if micro_batch_size is not None:
        return [(micro_batch_size, False)] + ([(micro_batch_size, True)] if can else [])
    if checkpointing is not None:
        return [(r, checkpointing) for r in ROWS]
    return ([(r, False) for r in NO_CHECKPOINTING_ROWS] + [(r, True) for r in ROWS if can]
            + [(r, False) for r in ROWS if r not in NO_CHECKPOINTING_ROWS])


def choose_levers(model, cfg, prompt_tokens: int, free_bytes: int,
                  micro_batch_size: int | None = None,
                  checkpointing: bool | None = None) -> Levers:
    """The micro-batch size and checkpointing for a GRPO run of `cfg` (config.Config) on `model`
    as loaded, with free_bytes free on the GPU after loading; prompt_tokens: the longest rendered
    prompt. micro_batch_size, checkpointing: the user's settings, returned as given (None: chosen
    by the module docstring's rule); the estimate is reported either way. Sampling's need does not
    depend on either: when it alone exceeds the budget, the levers are chosen for training alone
    and `why` says that sampling will likely run out of memory."""
    ro, g = cfg.rollout, cfg.grpo
    completion = ro.max_episode_tokens if (cfg.env or cfg.tools) else ro.max_new_tokens
    length = prompt_tokens + completion
    cap = _row_cap(cfg, length)
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    budget = free_bytes - margin_bytes(free_bytes) - 2 * trained
    sampled, sample = _sampling_need(model, cfg, length)
    traced: dict[tuple[int, bool], int] = {}

    def training(rows: int, ckpt: bool) -> int:
        """The micro-batch's traced peak and the gradients an earlier one left."""
        rows = min(rows, cap)
        if (rows, ckpt) not in traced:
            _, both = micro_batch_peak(model, rows, prompt_tokens, completion, g.logprob_chunk,
                                       g.fused_lm_head, checkpointing=ckpt)
            traced[rows, ckpt] = both + trained
        return traced[rows, ckpt]

    tried = candidates(micro_batch_size, checkpointing, can_checkpoint(model))
    if micro_batch_size is None:  # chosen: no more rows than a micro-batch can hold
        tried = list(dict.fromkeys((min(r, cap), c) for r, c in tried))
    chosen = _first_fit(tried, training, budget)
    rows, ckpt = chosen or min(tried, key=lambda t: (t[0], not t[1]))  # the smallest
    peak = max(training(rows, ckpt), sample)
    why = (f"micro-batch {rows}{' (set)' if micro_batch_size is not None else ''}, "
           f"{'checkpointing' if ckpt else 'no checkpointing'}"
           f"{' (set)' if checkpointing is not None else ''}: "
           f"~{(peak + 2 * trained) / GiB:.1f} of {free_bytes / GiB:.1f} GiB free")
    if peak > budget:
        fixes = [f"a lower rollout.prompts_per_generate ({sampled} rows sampled need "
                 f"~{sample / GiB:.1f} GiB)"] if sample > budget else []
        if chosen is None:  # training does not fit either
            fixes += _training_fixes(micro_batch_size, checkpointing, g.fused_lm_head)
        why += (", likely out of memory: try " + ", ".join(fixes)
                + ", a shorter rollout.max_new_tokens or model.quant: 4bit")
    return Levers(rows, ckpt, peak, budget, why)


def _row_cap(cfg, length: int) -> int:
    """The most rows a micro-batch of `length` tokens may hold: the completions a step trains,
    optim.micro_batch_tokens' cap or, when that is unset, BUSY_TOKENS' (module docstring)."""
    ro = cfg.rollout
    step_rows = max(1, ro.prompts_per_step * ro.num_generations // cfg.grpo.num_mini_batches)
    tokens = cfg.optim.micro_batch_tokens  # a cap on a micro-batch's padded tokens, 0: none
    cap = max(1, min(step_rows, tokens // length)) if tokens else step_rows
    if not tokens:  # past BUSY_TOKENS a micro-batch keeps a GPU busy: more rows only cost memory
        cap = min(cap, 2 ** int(math.log2(max(1, BUSY_TOKENS // length))))
    return cap


def _sampling_need(model, cfg, length: int) -> tuple[int, int]:
    """(rows sampled at once, sampling's bytes for them at `length` tokens: 0 under vLLM)."""
    ro = cfg.rollout
    # the KV cache's: the frozen weights' (not a 4-bit base's packed uint8), else fp32
    dtype = next((p.dtype for p in model.parameters()
                  if not p.requires_grad and p.is_floating_point()), torch.float32)
    sampled = (ro.prompts_per_generate or ro.prompts_per_step) * ro.num_generations
    sample = 0 if ro.engine == "vllm" else sampling_bytes(model.config, sampled, length, dtype)
    return sampled, sample


def _first_fit(tried: list[tuple[int, bool]], training: Callable[[int, bool], int],
               budget: int) -> tuple[int, bool] | None:
    """The first candidate whose training need fits the budget, or None; a candidate that one
    which did not fit rules out is skipped, not traced."""
    too_big: list[tuple[int, bool]] = []
    for rows, ckpt in tried:
        # more rows, or no checkpointing at as many rows, than a candidate that did not fit
        if any(r <= rows and (c == ckpt or c) for r, c in too_big):
            continue
        if training(rows, ckpt) <= budget:
            return rows, ckpt
        too_big.append((rows, ckpt))
    return None


def _training_fixes(micro_batch_size: int | None, checkpointing: bool | None,
                    fused_lm_head: bool) -> list[str]:
    """The settings to try when no micro-batch's training fits."""
    return (["a lower optim.micro_batch_size"] if (micro_batch_size or 1) > 1 else []) + (
        ["model.gradient_checkpointing: true"] if checkpointing is False else []) + (
        ["grpo.fused_lm_head: true"] if not fused_lm_head else [])
