"""The rollout: prompts rendered as in training, G completions sampled per prompt with HF generate.

    prompts = render_rows(tokenizer, rows, cfg.data)  # chat template + forced prefix
    r = generate_rollout(model, tokenizer, prompts, G, max_new_tokens, temperature, ...)   # Rollout
    r.input_ids, r.attention_mask, r.completion_mask  # (N, P + C), ..., (N, C)

Completions are masked by position up to and including the first EOS (pad may equal EOS), cut at
stop strings, and decoded; with grpo.share_prompt each prompt's KV cache is computed once for its G
rows. vLLM rollouts (engines/vllm_engine.py) return the same Rollout.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import jinja2
import torch
from torch import Tensor

from grpo import completion_mask
from logprobs import position_ids, prompt_cache
from settings.typed_config import ConfigError

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class Rollout:
    """B x G sampled completions; rows i*G .. i*G+G-1 share prompt i."""
    prompt_ids: Tensor  # (N, P) left-padded
    prompt_mask: Tensor  # (N, P)
    completion_ids: Tensor  # (N, C) right-padded
    completion_mask: Tensor  # (N, C) 1 up to and including the first EOS (or stop string)
    truncated: Tensor  # (N,) bool: hit max_new_tokens without EOS
    texts: list[str]  # decoded completions, EOS and padding removed (episodes: the conversation)
    sampler_logp: Tensor | None = None  # (N, C) the sampler's own log-probs (vLLM's; HF
    #   generate's with generate_rollout(sampler_logp=True)), for importance weights
    entropy: Tensor | None = None  # (N, C) sampling entropy per token (HF generate, EntropyMeter)
    attended: Tensor | None = None  # (N, C) episodes: every token, the environment's too (the
    #   completion_mask has the model's alone); None: the completion_mask
    episodes: list | None = None  # (N,) episodes.Episode: multi-turn rollouts only

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (N, P + C)

    def num_tokens(self) -> list[int]:
        """Each completion's token count (read before work goes to a thread: no GPU sync there)."""
        return self.completion_mask.sum(1).long().tolist()

    @property
    def attention_mask(self) -> Tensor:
        seen = self.completion_mask if self.attended is None else self.attended  # (N, C)
        return torch.cat([self.prompt_mask, seen.long()], dim=1)  # (N, P + C)


def chat_messages(prompt: str | list[dict], system_prompt: str | None = None) -> list[dict]:
    """A prompt (a user message, or a list of messages) with the system prompt in front."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def render_prompt(tokenizer, prompt: str | list[dict], system_prompt: str | None = None,
                  assistant_prefix: str = "", template_kwargs: dict | None = None) -> str:
    """Chat-template a prompt; the forced assistant prefix is part of the prompt. template_kwargs go
    to the chat template (Qwen3: {"enable_thinking": False}). A template that writes the prefix
    itself (an export's, from a run that forced it: tools/export.py) does not get it a second
    time. A whitespace-only prefix is always added (any template could end with it by chance), so an
    export of a run that forced one renders it twice here: evaluate that run's adapter instead."""
    text = tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True, **(template_kwargs or {}))
    return text + prefix_to_add(text, assistant_prefix)


def prefix_to_add(rendered: str, prefix: str) -> str:
    """The forced prefix still to write after a rendered prompt: none when the template wrote it
    already (a whitespace-only one is always written: any template could end with it by chance)."""
    return "" if prefix.strip() and rendered.endswith(prefix) else prefix


class NonFiniteLogits(ConfigError):
    """Sampling met NaN or inf logits: a setting to change, not a step to retry."""


NON_FINITE = ("in float16 some models overflow (Qwen2 and Qwen2.5 among them), so set "
              "model.dtype: float32, or bfloat16 where the GPU has it (not a T4); if the loss or "
              "grad_norm of the steps before went non-finite, the run diverged: lower optim.lr")


_PROBE = "minigrpo probe 7f3a"  # a user message that no template rewrites


def reply_prefix(tokenizer, data) -> str:
    """The start of every reply that the policy does not write, as the rewards see it: the forced
    data.assistant_prefix, from a think block the chat template's generation prompt opens on
    (DeepSeek-R1's and QwQ's end with "<think>\\n"; with a forced "</think>" the block is whole), so
    that the reply's "</think>" closes a block the rewards see opened. A "</think>" with no opened
    block is not one (answers.answer_part). A template this probe cannot render (one that wants the
    rows' own system message) gets the forced prefix alone."""
    try:
        text = render_prompt(tokenizer, _PROBE, data.system_prompt, data.assistant_prefix,
                             data.chat_template_kwargs)
    except Exception:  # jinja2's TemplateError and whatever a template raises
        return data.assistant_prefix
    at = text.rfind(_PROBE)
    tail = text[at + len(_PROBE):] if at >= 0 else ""
    opened = tail.find("<think>")
    return tail[opened:] if opened >= 0 else data.assistant_prefix


def render_rows(tokenizer, rows: list[dict], data, what: str = "row") -> list[str]:
    """Each row's prompt rendered as the data config says (system prompt, chat template arguments,
    forced assistant prefix); `what` the rows are, for errors."""
    out = []
    for i, r in enumerate(rows):
        try:
            out.append(render_prompt(tokenizer, r["prompt"], data.system_prompt,
                                     data.assistant_prefix, data.chat_template_kwargs))
        except jinja2.TemplateError as e:  # raise_exception("System role not supported")
            raise ConfigError(f"the chat template refused {what} {i}: {e} (check "
                "data.system_prompt, the prompt's roles, or give model.chat_template)") from None
    return out


def with_eos(tokenizer, reply: str) -> str:
    """The reply ending in EOS, once: a reply that carries it already (copied from a chat log, maybe
    with the template's newline after it) gets no second."""
    return reply.rstrip() if reply.rstrip().endswith(tokenizer.eos_token) \
        else reply + tokenizer.eos_token


def eos_token_ids(tokenizer, model) -> list[int]:
    """Where a completion ends: the tokenizer's EOS, the model's generation_config EOS, and the
    token the chat template closes an assistant turn with (turn_end_id) when that is another one: a
    base model's tokenizer (Qwen2.5's <|endoftext|>) under a ChatML template would otherwise run on
    past <|im_end|> into a made-up next turn."""
    ids = {tokenizer.eos_token_id, turn_end_id(tokenizer)}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


_REPLY_PROBE = "minigrpo reply 7f3a"


def turn_end_id(tokenizer) -> int | None:
    """The special token right after an assistant message in the chat template (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>, Gemma's <end_of_turn>), or None (no template, or text there)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
            {"role": "assistant", "content": _REPLY_PROBE}], tokenize=False)
    except Exception:  # a template that wants a system message, or none at all
        return None
    at = text.rfind(_REPLY_PROBE)
    ids = tokenizer(text[at + len(_REPLY_PROBE):], add_special_tokens=False).input_ids \
        if at >= 0 else []
    return ids[0] if ids and ids[0] in set(tokenizer.all_special_ids) else None


def _cut_at_stop_strings(tokenizer, ids: Tensor, mask: Tensor, truncated: Tensor,
                         stops: list[str]) -> None:
    """Shorten masks in place so a completion ends at the token completing its first stop string."""
    for i in range(ids.shape[0]):
        n = int(mask[i].sum())
        text = tokenizer.decode(ids[i, :n], skip_special_tokens=True)
        if not any(s in text for s in stops):
            continue
        lo, hi = 1, n  # smallest prefix length whose text contains a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in tokenizer.decode(ids[i, :mid], skip_special_tokens=True) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        mask[i, lo:] = 0
        truncated[i] = False


STATIC_BUCKET = 64  # rollout.compile: the shortest padded prompt length (prompt_bucket)


def prompt_bucket(n: int) -> int:
    """rollout.compile's padded prompt length for a longest prompt of n tokens: the next of 64, 96,
    128, 192, 256, 384, 512, ..., two lengths a doubling. Each length is one KV-cache shape, so one
    compilation of the sampler: a run's prompts make at most two a doubling of their length (a
    prompt up to 512 tokens, at most 7), and padding costs at most half of the prompt's own length.

    >>> [prompt_bucket(n) for n in (1, 64, 65, 97, 130, 300, 600)]
    [64, 64, 96, 128, 192, 384, 768]
    """
    size = STATIC_BUCKET
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 64 -> 96 -> 128
    return size


class EntropyMeter:
    """A no-op logits processor that records, at each decoding step, every row's entropy in nats of
    the policy at the sampling temperature, H = -sum_v p_v log p_v with p = softmax(logits / T): the
    loss's distribution, and TRL's `entropy` (generate runs custom processors before temperature,
    top-k and top-p, so a top-k / top-p cut is not in it; a token banned before it, as EOS under
    rollout.ignore_eos (benchmarks), is left out). Falling entropy is a policy collapsing onto few
    replies (what DAPO's clip-higher fights); it costs one softmax over (N, V) a step.

    sampler_logp: also each sampled token's log p_v, the sampler's own log-prob of it (sampler_logp
    below). Step t's scores come before its token is drawn; that token is input_ids[:, -1] at step
    t + 1 (and generate's last output token after the last step), so only the previous step's
    (N, V) log-softmax is kept, never all steps'."""

    last: Tensor | None = None  # (N, V) the previous step's log softmax (sampler_logp only)

    def __init__(self, temperature: float, sampler_logp: bool = False):
        # steps: (N,) a step's entropy; picked: (N,) a step's log p(token), with sampler_logp
        self.temperature, self.steps, self.picked = temperature, [], [] if sampler_logp else None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        logp = scores.float() / self.temperature  # (N, V), a new tensor: scores stay as they are
        logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))  # log softmax; -inf where banned
        self.steps.append(-(logp.exp() * logp).nansum(-1))  # (N,); nansum drops banned 0 * -inf
        if self.picked is not None:
            self._pick(input_ids[:, -1], logp)
        return scores

    def _pick(self, drawn: Tensor, logp: Tensor | None) -> None:
        """drawn (N,): the token sampled from self.last; logp (N, V): this step's, for the next."""
        if self.last is not None:
            self.picked.append(self.last.gather(-1, drawn[:, None])[:, 0])  # (N,)
        self.last = logp

    def entropy(self, width: int) -> Tensor:
        """(N, width): the recorded steps, zero past the last."""
        h = torch.stack(self.steps, dim=1) if self.steps else torch.zeros(0, 0)  # (N, steps)
        return torch.nn.functional.pad(h, (0, width - h.shape[1]))[:, :width]

    def sampler_logp(self, completion_ids: Tensor, mask: Tensor) -> Tensor:
        """(N, C): log softmax(logits / T)[token] of each sampled token, the distribution the loss
        uses (untruncated by top-k / top-p), 0 where mask is 0 (past the end). completion_ids,
        mask: (N, C), C the number of steps recorded."""
        self._pick(completion_ids[:, -1], None)  # the last step's token is in generate's output
        logp = torch.stack(self.picked, dim=1)  # (N, C)
        return torch.where(mask.bool(), logp, 0.0)  # where: a banned pad's -inf past the end


def non_finite(e: RuntimeError) -> BaseException:
    """generate's error as NonFiniteLogits when NaN or inf logits are behind it, else itself."""
    if "probability tensor contains" not in str(e) and "device-side assert" not in str(e):
        return e
    cuda = "device-side assert" in str(e)  # CUDA says no more; NaN logits are the likely cause
    return NonFiniteLogits(("a CUDA device-side assert while sampling, most likely from NaN or "
                            "inf logits: " if cuda else "sampling met NaN or inf logits: ")
                           + NON_FINITE)


@torch.no_grad()
def generate_rollout(model, tokenizer, prompts: list[str] | tuple[Tensor, Tensor],
        num_generations: int,
        max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
        stop_strings: Sequence[str] = (), max_prompt_tokens: int = 100_000,
        ignore_eos: bool = False, share_prompt: bool = False, static_cache: bool = False,
        entropy: bool = False, sampler_logp: bool = False,
        eos_ids: list[int] | None = None) -> Rollout:
    """Sample `num_generations` completions per rendered prompt with HF generate (left padding);
    temperature 0 decodes greedily (evaluation). ignore_eos suppresses EOS until max_new_tokens, so
    every completion has the same length (speed benchmarks; such completions count as truncated).
    share_prompt (grpo.share_prompt): each prompt but its last token is run through the model once
    and its KV cache copied to the G rows, instead of G identical prefills (prefill_shared).
    static_cache (rollout.compile): HF generate with a preallocated KV cache, which transformers
    compiles with torch.compile on CUDA; prompts are left-padded to prompt_bucket's length so that
    few distinct cache shapes (each one a compilation) occur. No prompt sharing then.
    entropy: record each token's sampling entropy (EntropyMeter) as the Rollout's `entropy`.
    sampler_logp: record each sampled token's log-prob under the distribution it was drawn from,
    log softmax(logits / T)[token] (the trainer's, with no top-k / top-p cut), as the Rollout's
    `sampler_logp` (N, C), 0 past the end, as vLLM's: the sampler's distance from the trainer
    (rollout.merged_sampling, a 16-bit cache) for step.py's importance weights. Under ignore_eos
    it is that of the distribution without EOS, which the trainer's keeps. None when greedy.
    prompts may be token ids already, (ids, attn) left-padded: engines/episodes.py's
    conversations. eos_ids: where a completion ends (eos_token_ids, when not given)."""
    device = next(model.parameters()).device
    if isinstance(prompts, list):  # text; engines/episodes.py passes its tokens as they stand
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompts = (enc.input_ids.to(device), enc.attention_mask.to(device))
        if static_cache:  # left padding up to the bucket: few shapes, few compilations
            width = prompt_bucket(prompts[0].shape[1])
            prompts = (_pad_to(prompts[0], width, tokenizer.pad_token_id, True),
                       _pad_to(prompts[1], width, 0, True))
    G, (ids, attn) = num_generations, prompts  # ids, attn: (B, P)
    if int(attn.sum(1).max()) > max_prompt_tokens:
        raise ValueError(f"a prompt has {int(attn.sum(1).max())} tokens > "
                         f"rollout.max_prompt_tokens={max_prompt_tokens}")
    eos = eos_token_ids(tokenizer, model) if eos_ids is None else eos_ids
    was_training = model.training
    model.eval()
    decoding = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None) \
        if temperature > 0 else dict(do_sample=False)
    rows = (share_prompt and not static_cache and shared_prompt_rows(model, ids, attn, G)) \
        or dict(input_ids=ids, attention_mask=attn, num_return_sequences=G)  # G rows a prompt
    meter = EntropyMeter(temperature, sampler_logp) \
        if (entropy or sampler_logp) and temperature > 0 else None
    try:
        out = model.generate(
            **rows, **decoding, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if ignore_eos else None,
            use_cache=True, cache_implementation="static" if static_cache else None,
            logits_processor=[meter] if meter else None, stop_strings=list(stop_strings) or None,
            tokenizer=tokenizer if stop_strings else None)
    except RuntimeError as e:  # multinomial on NaN/inf probabilities; on CUDA, a device-side assert
        raise non_finite(e) from None
    model.train(was_training)
    completion_ids = out[:, ids.shape[1]:]  # (N, C)
    mask, truncated = completion_mask(completion_ids, eos)  # (N, C), (N,)
    if stop_strings:
        _cut_at_stop_strings(tokenizer, completion_ids, mask, truncated, list(stop_strings))
    texts = tokenizer.batch_decode(  # EOS and padding left out
        [c[:n] for c, n in zip(completion_ids, mask.sum(1).long().tolist())],
        skip_special_tokens=True)
    return Rollout(prompt_ids=ids.repeat_interleave(G, 0), prompt_mask=attn.repeat_interleave(G, 0),
                   completion_ids=completion_ids, completion_mask=mask,
                   truncated=truncated, texts=texts,
                   sampler_logp=meter.sampler_logp(completion_ids, mask)
                   if meter and sampler_logp else None,
                   entropy=meter.entropy(completion_ids.shape[1]).to(device)
                   if meter and entropy else None)


@dataclass
class Sampler:
    """HF generate as a run samples, its settings read once (run/lifecycle.prepare): G completions
    a prompt, rollout.prompts_per_generate prompts a call, the EOS ids found once.

        sample = Sampler.of(model, tokenizer, cfg)     # at setup
        batch = sample(prompts)                        # each step: a Rollout

    The other samplers take the same call: model.MergedSampler (rollout.merged_sampling),
    vLLM's (engines/vllm_engine.py)."""
    model: object
    tokenizer: object
    per_call: int  # rollout.prompts_per_generate (0: all in one call)
    options: dict  # generate_rollout's keyword arguments

    def __call__(self, prompts: list[str],
                 on_slice: Callable[[int, Rollout], None] | None = None) -> Rollout:
        if self.per_call:  # rollout.prompts_per_generate: a few prompts a call
            return generate_in_slices(self.model, self.tokenizer, prompts, self.per_call,
                                      on_slice=on_slice, **self.options)
        return generate_rollout(self.model, self.tokenizer, prompts, **self.options)

    @classmethod
    def of(cls, model, tokenizer, cfg) -> Sampler:
        """The run's sampler: cfg a config.Config with its "auto" settings chosen."""
        ro = cfg.rollout
        return cls(model, tokenizer, ro.prompts_per_generate, dict(
            num_generations=ro.num_generations, max_new_tokens=ro.max_new_tokens,
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
            stop_strings=ro.stop_strings, max_prompt_tokens=ro.max_prompt_tokens,
            ignore_eos=ro.ignore_eos, share_prompt=cfg.grpo.share_prompt is not False,
            static_cache=ro.compile, entropy=True,
            sampler_logp=ro.merged_sampling or ro.compile,  # its gap: sampler_logp_abs_diff
            eos_ids=eos_token_ids(tokenizer, model)))


def generate_in_slices(model, tokenizer, prompts: list[str], per_call: int, *args,
                       on_slice: Callable[[int, Rollout], None] | None = None, **kwargs) -> Rollout:
    """generate_rollout on `per_call` prompts at a time (0: all in one call), the slices joined in
    order: each call's KV cache holds per_call x num_generations rows (rollout.prompts_per_generate,
    eval.batch_size). on_slice(first prompt's index, slice) runs after each call, before the next
    one samples (scoring/pipelined.py scores the slice there). Further arguments are
    generate_rollout's."""
    k, parts = per_call or len(prompts), []
    for s in range(0, len(prompts), k):
        parts.append(generate_rollout(model, tokenizer, prompts[s:s + k], *args, **kwargs))
        if on_slice is not None:
            on_slice(s, parts[-1])
    return concat_rollouts(parts, tokenizer.pad_token_id)


def shared_prompt_rows(model, ids: Tensor, attn: Tensor, G: int) -> dict | None:
    """generate's rows with each prompt prefilled once (prefill_shared): generate runs only the last
    prompt token, then samples; None where sharing does not apply."""
    cache = prefill_shared(model, ids, attn, G)
    return None if cache is None else dict(input_ids=ids.repeat_interleave(G, 0),
                                           attention_mask=attn.repeat_interleave(G, 0),
                                           past_key_values=cache)


def prefill_shared(model, input_ids: Tensor, attention_mask: Tensor,
                   num_generations: int) -> DynamicCache | None:
    """The KV cache of every prompt but its last token, computed once per prompt and repeated to its
    G rows (B * G, P - 1), for generate to continue from; None where sharing does not apply or pay:
    G = 1, a prompt of one token, or a cache that is not plain keys and values (prompt_cache).
    input_ids, attention_mask: (B, P), left-padded."""
    cache = prompt_cache(model) \
        if num_generations > 1 and int(attention_mask.sum(1).min()) >= 2 else None
    if cache is None:
        return None
    mask = attention_mask[:, :-1]  # (B, P - 1)
    model(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=position_ids(mask),
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(num_generations)  # (B * G, P - 1): row i*G + j holds prompt i
    return cache


def _pad_to(x: Tensor, width: int, value: int, left: bool) -> Tensor:
    pad = x.new_full((x.shape[0], width - x.shape[1]), value)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts of different lengths: prompts stay left-padded, completions right-padded."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)
    return Rollout(
        prompt_ids=torch.cat([_pad_to(r.prompt_ids, P, pad_id, True) for r in parts]),
        prompt_mask=torch.cat([_pad_to(r.prompt_mask, P, 0, True) for r in parts]),
        completion_ids=torch.cat([_pad_to(r.completion_ids, C, pad_id, False) for r in parts]),
        completion_mask=torch.cat([_pad_to(r.completion_mask, C, 0, False) for r in parts]),
        truncated=torch.cat([r.truncated for r in parts]),
        texts=[t for r in parts for t in r.texts],
        sampler_logp=None if parts[0].sampler_logp is None else torch.cat(
            [_pad_to(r.sampler_logp, C, 0, False) for r in parts]),
        entropy=None if parts[0].entropy is None else torch.cat(
            [_pad_to(r.entropy, C, 0, False) for r in parts]),
        attended=None if parts[0].attended is None else torch.cat(
            [_pad_to(r.attended, C, 0, False) for r in parts]),
        episodes=None if parts[0].episodes is None else [e for r in parts for e in r.episodes])


def select_rows(r: Rollout, rows: list[int]) -> Rollout:
    ix = torch.tensor(rows, dtype=torch.long, device=r.prompt_ids.device)
    return Rollout(r.prompt_ids[ix], r.prompt_mask[ix], r.completion_ids[ix], r.completion_mask[ix],
                   r.truncated[ix], [r.texts[i] for i in rows],
                   None if r.sampler_logp is None else r.sampler_logp[ix],
                   None if r.entropy is None else r.entropy[ix],
                   None if r.attended is None else r.attended[ix],
                   None if r.episodes is None else [r.episodes[i] for i in rows])
