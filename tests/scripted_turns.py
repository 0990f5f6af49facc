"""A stand-in for HF generate in multi-turn tests: each episode's turn is "sampled" from a script,
so that a tiny random model calls tools and engines/episodes.py runs every turn as it does on a
real model's replies. The one forward, the loss and the training step stay real.

    monkeypatch.setattr(rollout, "generate_rollout", ScriptedTurns(tokenizer, script))

script[t]: the replies turn t may give (t: the tool messages already in the context; the last
entry serves every later turn), each text, or a list of token ids (sampled as they are, however the
tokenizer would split the text); one is drawn with torch's generator, so a seeded run repeats. Each
reply ends with the template's turn-end token. Every call is kept in `calls`: (the context each row
was given, unpadded; the tokens drawn for it). scored(...) scores episodes as a run's rewards do.
"""
from __future__ import annotations

import torch

import rollout
from rewards import RewardResult, prepare_rewards


class ScriptedTurns:
    def __init__(self, tokenizer, script: list[list[str | list[int]]]):
        self.tokenizer, self.script = tokenizer, script
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[tuple[list[list[int]], list[list[int]]]] = []

    def reply(self, context: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
        turn = self.tokenizer.decode(context).count("<|im_start|>tool")
        options = self.script[min(turn, len(self.script) - 1)]
        chosen = options[int(torch.randint(len(options), ()))]
        ids = chosen if isinstance(chosen, list) else \
            self.tokenizer(chosen, add_special_tokens=False).input_ids
        ids = ids + [self.end]
        return ids[:max_new_tokens], len(ids) > max_new_tokens

    def __call__(self, model, tokenizer, prompts, num_generations: int, max_new_tokens: int,
                 *args, **kwargs) -> rollout.Rollout:
        ids, attn = prompts  # (n, L) left-padded
        contexts = [row[mask.bool()].tolist() for row, mask in zip(ids, attn)]
        drawn = [self.reply(c, max_new_tokens) for c in contexts for _ in range(num_generations)]
        self.calls.append(([c for c in contexts for _ in range(num_generations)],
                           [d for d, _ in drawn]))
        C = max(len(d) for d, _ in drawn)
        pad = tokenizer.pad_token_id
        return rollout.Rollout(
            prompt_ids=ids.repeat_interleave(num_generations, 0),  # (N, L)
            prompt_mask=attn.repeat_interleave(num_generations, 0),  # (N, L)
            completion_ids=torch.tensor([d + [pad] * (C - len(d)) for d, _ in drawn]),  # (N, C)
            completion_mask=torch.tensor([[1.0] * len(d) + [0.0] * (C - len(d))
                                          for d, _ in drawn]),  # (N, C)
            truncated=torch.tensor([cut for _, cut in drawn]),  # (N,)
            texts=[tokenizer.decode(d, skip_special_tokens=True) for d, _ in drawn],
            entropy=torch.zeros(len(drawn), C))  # (N, C)


def scored(completions: list[str], samples: list[dict], specs: list,
           episodes: list) -> RewardResult:
    """The rewards over episodes, prepared as a multi-turn run prepares them (run/lifecycle.py)."""
    rewards = prepare_rewards(specs, {}, ("num_tokens", "episode"))
    return rewards(completions, samples, episodes=episodes)
