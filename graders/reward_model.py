"""A trained reward model as a reward: the score a sequence classifier gives prompt + completion.

    rewards:
      - {name: reward_model, args: {model: Skywork/Skywork-Reward-V2-Qwen3-0.6B}}
      - {name: reward_model, weight: 0.5, args: {model: runs/rm, batch_size: 4, max_length: 1024}}

Any `AutoModelForSequenceClassification` checkpoint (a hub id or a local directory) scores each
completion; the reward is its logit `label` (needed with several outputs; a usual reward model has
one), unscaled. A reward model with a chat template sees the conversation [system], user: the row's
prompt (or the row's own conversation), assistant: the completion, rendered by its own template; one
without a template (the DeBERTa reward models) sees the pair (prompt, completion) as its tokenizer
joins them ([CLS] prompt [SEP] completion [SEP]). The completion carries the reply's start the
policy did not write (data.assistant_prefix, a think block the template opens:
rollout.reply_prefix). Rendered chats longer than max_length tokens lose their start (the prompt's
beginning), never the completion's end; a pair over it loses tokens from the end of the longer of
its two texts first (the tokenizer's longest_first). max_length is capped at the model's own limit
(tokenizer.model_max_length, max_position_embeddings); the first cut is reported. The score is read
where the checkpoint reads it scoring one input alone (its own pad_token_id).

The model loads once per process, when train.py or eval.py open their rewards (so a wrong path
stops the run before step 1, with one line), on `device` ("auto": the GPU when there is one) in
`dtype` ("auto": as model.dtype's auto, fp32 on CPU, bf16 or fp16 on a GPU), frozen, without
gradients. It stays resident: on a small GPU, count its weights in the budget.
"""
from __future__ import annotations

import sys

import torch

from rewards import register

_WARNED: set[str] = set()  # models whose inputs past max_length were reported
_LOADED: dict[tuple, tuple] = {}  # (model, revision, device, dtype) -> (classifier, tokenizer)


class _NotAClassifier(Exception):
    """The checkpoint's architecture (named in the message) has no classification head."""


def check_args(model: str | None = None, batch_size: int = 8, max_length: int = 2048,
               device: str = "auto", dtype: str = "auto", label: int | None = None,
               revision: str | None = None, system: str | None = None) -> None:
    """The args' values, checked before any model loads (checks.check_specs); ValueError says what
    to fix."""
    if not isinstance(model, str) or not model:
        raise ValueError("reward_model needs args: {model: a hub id or a local directory of a "
                         "sequence classifier}")
    from sources.hub import local_or_hub
    local_or_hub(model, "reward_model: model")  # ConfigError, a ValueError
    for key, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"reward_model: {key} must be a positive integer, got {value!r}")
    if label is not None and (isinstance(label, bool) or not isinstance(label, int) or label < 0):
        raise ValueError("reward_model: label must be the index of an output logit (0 for one "
                         f"output), got {label!r}")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError("reward_model: dtype must be auto, float32, bfloat16 or float16, "
                         f"got {dtype!r}")


def load(model: str, revision: str | None = None, device: str = "auto", dtype: str = "auto",
         **_) -> tuple:
    """(classifier, tokenizer), loaded once per process; one-line ValueError if it cannot load."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from config import ConfigError
    from model import pick_device, pick_dtype
    from sources.hub import local_or_hub, offline_if_unreachable
    try:
        dev = pick_device(device)
    except ConfigError as e:  # its message names run.device
        raise ValueError(f"reward_model: {str(e).replace('run.device', 'device')} "
                         "(its args)") from None
    key = (model, revision, str(dev), dtype)
    if key not in _LOADED:
        path = local_or_hub(model, "reward_model: model")
        try:
            with offline_if_unreachable():
                kinds = AutoConfig.from_pretrained(path, revision=revision).architectures or []
                # before its weights load
                if kinds and not any(k.endswith("ForSequenceClassification") for k in kinds):
                    raise _NotAClassifier(kinds[0])
                tok = AutoTokenizer.from_pretrained(path, revision=revision)
                clf, info = AutoModelForSequenceClassification.from_pretrained(
                    path, revision=revision, dtype=pick_dtype(dtype, dev), output_loading_info=True)
            # a config without `architectures` (an older save): its head was made up
            if info.get("missing_keys"):
                raise _NotAClassifier("checkpoint without the weights "
                                      f"{', '.join(sorted(info['missing_keys']))[:120]}")
        except _NotAClassifier as e:  # its score head would be random weights
            raise ValueError(f"reward_model: model={model} is a {e}, not a sequence classifier (a "
                             "reward model saved with AutoModelForSequenceClassification); its "
                             "score head would be random weights") from None
        except Exception as e:  # missing file, truncated checkpoint, wrong-shaped head: one line
            raise ValueError(f"reward_model: could not load model={model} as a sequence classifier "
                             f"({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:200]})") from None
        if tok.pad_token is None:  # most decoder reward models: pad with EOS, then _repad
            if tok.eos_token is None:
                raise ValueError(f"reward_model: the tokenizer of {model} has neither a pad nor "
                                 "an EOS token")
            tok.pad_token = tok.eos_token
        # what it skips scoring one input alone
        clf.minigrpo_own_pad = clf.config.get_text_config().pad_token_id
        # a chat loses its start (the prompt's), a pair the end of its longer text (as DeBERTa RMs
        # were trained)
        tok.padding_side, tok.truncation_side = "right", "left" if tok.chat_template else "right"
        limits = [getattr(tok, "model_max_length", None)] + [
            getattr(clf.config.get_text_config(), k, None)
            for k in ("max_position_embeddings", "n_positions")]
        clf.minigrpo_max_length = min([n for n in limits if isinstance(n, int) and 0 < n < 10**7]
                                      or [10**7])
        _LOADED[key] = (clf.to(dev).eval().requires_grad_(False), tok)
    return _LOADED[key]


def open_reward(label: int | None = None, **args) -> None:
    """Load the model now (train.py / eval.py setup), so that a bad path, a checkpoint that is not a
    classifier or a label past its outputs fails before step 1."""
    clf, _ = load(**args)
    _label(clf, label, args["model"])


def _label(clf, label: int | None, model: str) -> int:
    """The output scored: `label`, or the one output of a usual reward model; else ValueError."""
    n = clf.config.num_labels
    if label is None and n > 1:
        raise ValueError(f"reward_model: {model} has {n} outputs "
                         f"({', '.join(f'{i}: {clf.config.id2label[i]}' for i in range(n))}); "
                         "choose one with args: {label: INDEX}")
    if (label or 0) >= n:
        raise ValueError(f"reward_model: label={label} but {model} has {n} output(s)")
    return label or 0


def _repad(clf, enc) -> None:
    """Right padding rewritten to the id the classifier skips looking for each row's last token: the
    checkpoint's own pad_token_id (the token it scores alone; the tokenizer may pad with another, or
    have none); a checkpoint without one scores each input's last token, so its padding gets an id
    that no row ends with (EOS padding would move an EOS-ended row's score one token back)."""
    ids, mask = enc["input_ids"], enc["attention_mask"].bool()
    pad = clf.minigrpo_own_pad
    if pad is None:
        ends = set(ids[torch.arange(len(ids)), mask.sum(1) - 1].tolist())
        pad = next(i for i in range(len(ends) + 1) if i not in ends)
        clf.config.get_text_config().pad_token_id = pad
    ids[~mask] = pad


def conversation(prompt, completion: str, system: str | None) -> list[dict]:
    """The chat a templated reward model scores: [system], the prompt's turns (a text prompt is one
    user turn), then the completion as the assistant's.

    >>> conversation("What is 2 + 2?", "4", None)
    [{'role': 'user', 'content': 'What is 2 + 2?'}, {'role': 'assistant', 'content': '4'}]
    """
    turns = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    head = ([{"role": "system", "content": system}]
            if system and turns[0].get("role") != "system" else [])
    return head + turns + [{"role": "assistant", "content": completion}]


@torch.no_grad()
def reward_model(completions: list[str], samples: list[dict], *, model: str, batch_size: int = 8,
                 max_length: int = 2048, device: str = "auto", dtype: str = "auto",
                 label: int | None = None, revision: str | None = None, system: str | None = None,
                 assistant_prefix: str = "") -> list[float]:
    """Logit `label` of the reward model for each (prompt, completion), in batches of batch_size."""
    clf, tok = load(model, revision, device, dtype)
    label, max_length = _label(clf, label, model), min(max_length, clf.minigrpo_max_length)
    replies = [assistant_prefix + c for c in completions]
    out: list[float] = []
    for lo in range(0, len(replies), batch_size):
        prompts, batch = ([s["prompt"] for s in samples[lo:lo + batch_size]],
                          replies[lo:lo + batch_size])
        if tok.chat_template:
            texts = [tok.apply_chat_template(conversation(p, c, system), tokenize=False)
                     for p, c in zip(prompts, batch)]
            full = [len(x) for x in tok(texts, add_special_tokens=False).input_ids]
            enc = tok(texts, padding=True, truncation=True, max_length=max_length,
                      add_special_tokens=False, return_tensors="pt")
        else:  # a pair model: (prompt, completion), its special tokens around them
            firsts = [p if isinstance(p, str) else "\n".join(t["content"] for t in p)
                      for p in prompts]
            full = [len(x) for x in tok(firsts, batch).input_ids]
            enc = tok(firsts, batch, padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt")
        if (cut := sum(n > max_length for n in full)) and model not in _WARNED:
            _WARNED.add(model)  # once per process: an input past it is scored on what is left
            print(f"[minigrpo] warning: reward_model: {cut} of {len(full)} inputs are longer than "
                  f"its max_length={max_length} tokens (of up to {max(full)}) and were cut "
                  f"({'their start' if tok.chat_template else 'the end of the longer text'}); "
                  "raise args.max_length if the model takes more", file=sys.stderr)
        _repad(clf, enc)
        try:
            scores = clf(**enc.to(clf.device)).logits[:, label].float()  # (b, num_labels) -> (b,)
        except torch.OutOfMemoryError:  # stops the run (scoring re-raises it), with what to lower
            raise torch.OutOfMemoryError(
                f"reward_model: out of GPU memory scoring {len(batch)} completions of up to "
                f"{enc.input_ids.shape[1]} tokens; lower its args batch_size (now {batch_size}) "
                f"or max_length (now {max_length}), or give it dtype: bfloat16") from None
        # every later batch alike: stop, as for NaN logits in sampling
        if not bool(torch.isfinite(scores).all()):
            from api.client import (
                JudgeUnusable,  # the run stops on it (a reward that can only give its fallback)
            )
            raise JudgeUnusable(f"reward_model: model={model} gave a non-finite score "
                                f"({scores.tolist()[:4]}); in float16 many models overflow: "
                                "give it dtype: bfloat16 (or float32)")
        out += scores.tolist()
    return out


reward_model.check_args, reward_model.open = check_args, open_reward
register("reward_model", batched=True)(reward_model)
