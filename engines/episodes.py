"""Multi-turn GRPO: G episodes per prompt against an environment, returned as the same Rollout one
reply per prompt gives, whose completion_mask holds the model's tokens alone. step.py trains on it
unchanged: the loss, its normalisations and the log-probs only ever see the mask.

    env: {name: my_env.py:Counter}       # a class written for TRL's environment_factory, and/or
    tools: [my_tools.py:calculator]      # plain functions (TRL's tools=)
    rollout: {max_turns: 4, max_new_tokens: 64, max_episode_tokens: 512}

    r = run_episodes(cfg, model, tokenizer, rows)   # Rollout; r.episodes[i]: row i // G's episode j
    python train.py --config configs/tools_calculator.yaml   # the CPU demo (docs/multi-turn.md)

An environment is a class as TRL's GRPOTrainer takes it (engines/environments.py): one instance per
episode, reset(**row) before the first turn (a string it returns is appended to the last user
message), its public methods the tools, get_reward() one more reward. Each turn the model replies;
the reply's tool calls are run and their results come back as tool messages (a failed call as
TRL's "{'error': ...}"); a reply with no call ends the episode. The configured rewards score each
episode: `completion` is the assistant's last reply, a reward that takes an `episode` parameter
gets the Episode (its messages: the whole conversation; env: the instance), and a TRL reward that
takes `environments` gets the instances. An environment whose reset raises ends its episode: one
warning line, and get_reward gives its fallback.

Tokens are appended, never re-rendered. Each turn the model continues from the episode's tokens as
they stand; its sampled tokens (turn-end token included) go in as they are, and the environment's
message goes in as the chat template renders it after an assistant turn (env_turn_text).
Re-rendering the conversation as text and tokenizing it again could give other tokens than those
sampled (a merge across a turn's edge, a template that rewrites an old turn), and the loss would
then train tokens the policy never chose. rollout.max_new_tokens bounds each turn,
rollout.max_episode_tokens the episode; the forced data.assistant_prefix opens the first turn only.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import rollout
from config import Config
from engines import environments, tool_calls
from rewards import Rewards
from sources.plugins import one_line

log = logging.getLogger("minigrpo.episodes")


@dataclass
class Episode:
    """One conversation: the prompt's tokens, then every token after it, each marked as the model's
    (1: sampled, trained) or the environment's (0: read, never trained)."""
    env: object | None  # the environment instance; None with tools: alone
    messages: list[dict]  # the whole conversation: the first messages, then each turn
    prompt_ids: list[int]
    schemas: list[dict] = field(default_factory=list)  # the tools as the model is shown them
    opening: int = 0  # how many of the messages are the first ones (the prompt's)
    ids: list[int] = field(default_factory=list)  # after the prompt: the model's and the env's
    mask: list[int] = field(default_factory=list)  # 1 where the model sampled the token
    entropy: list[float] = field(default_factory=list)  # the sampling entropy; 0 at env tokens
    turns: int = 0  # assistant turns
    tool_calls: int = 0  # calls the model made
    tool_errors: int = 0  # ... answered with an error
    truncated: bool = False  # cut short: by a token limit, or still going at max_turns
    done: bool = False
    error: str | None = None  # the environment's reset raised: its one line

    @property
    def exchanged(self) -> list[dict]:
        """The messages after the first ones: this episode's turns, the model's and the env's."""
        return self.messages[self.opening:]

    @property
    def reply(self) -> str:
        """The assistant's last message: what the rewards score as `completion`."""
        return next((m["content"] for m in reversed(self.exchanged) if m["role"] == "assistant"),
                    "")


# ---------------------------------------------------------------- the episodes, turn by turn


def sample_and_score(cfg: Config, model, tokenizer, rewards: Rewards,
                     envs: environments.Environments, rows: list[dict],
                     samples: list[dict]) -> tuple:
    """step.score's seam (run.sample_and_score, partial of the first five at setup): G episodes for
    each row, the rewards (prepared with given=("num_tokens", "episode")) seeing each whole (its
    final reply, the episode by name) -> (the rollout, the RewardResult)."""
    batch = run_episodes(cfg, model, tokenizer, rows, envs)
    return batch, rewards([e.reply for e in batch.episodes], samples,
                          num_tokens=batch.num_tokens(), episodes=batch.episodes)


def run_episodes(cfg: Config, model, tokenizer, rows: list[dict],
                 envs: environments.Environments | None = None) -> rollout.Rollout:
    """G episodes for each row, all turns sampled with HF generate (the episodes still going, one
    call a turn), up to rollout.max_turns -> the Rollout of the whole episodes. envs: the run's,
    opened once (its pool of instances); None: opened here."""
    envs = envs or environments.open_environments(cfg, tokenizer)
    eps = open_episodes(cfg, tokenizer, rows, cfg.rollout.num_generations, envs)
    for turn in range(cfg.rollout.max_turns):
        live = [e for e in eps if not e.done]
        if not live:
            break
        sampled = sample_turn(model, tokenizer, cfg, live, first=turn == 0)
        h = sampled.entropy if sampled.entropy is not None \
            else torch.zeros_like(sampled.completion_mask)  # (n, C); greedy decoding has none
        for i, e in enumerate(live):
            n = int(sampled.completion_mask[i].sum())
            take_turn(e, sampled.completion_ids[i, :n].tolist(), h[i, :n].tolist(),
                      bool(sampled.truncated[i]), tokenizer, cfg, envs)
    for e in eps:  # still going after max_turns: cut short
        e.truncated |= not e.done
    return as_rollout(eps, tokenizer, next(model.parameters()).device)


def open_episodes(cfg: Config, tokenizer, rows: list[dict], G: int,
                  envs: environments.Environments | None = None) -> list[Episode]:
    """G episodes for each row, each with its own instance of the row's environment (the pool's),
    reset on the row: the Episodes with their rendered prompts."""
    envs = envs or environments.open_environments(cfg, tokenizer)
    keys = [environments.env_key(envs, row) for row in rows for _ in range(G)]
    made = environments.draw(envs, keys)
    return [open_episode(envs, key, env, rows[i // G], tokenizer, cfg)
            for i, (key, env) in enumerate(zip(keys, made))]


def open_episode(envs: environments.Environments, key: str | None, env, row: dict, tokenizer,
                 cfg: Config) -> Episode:
    """The environment reset on the row (TRL: what it returns is appended to the last user
    message) -> the Episode with its rendered prompt, the tools shown."""
    messages, error, said = rollout.chat_messages(row["prompt"], cfg.data.system_prompt), None, None
    try:
        said = environments.reset(envs, env, row)
    except Exception as e:
        error = _env_failed("reset", e)
    if said:
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + said}]
    schemas = envs.schemas.get(key, envs.schemas[None])
    prompt = render(tokenizer, messages, cfg, schemas, first=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    return Episode(env, messages, ids, schemas=schemas, opening=len(messages), error=error)


def sample_turn(model, tokenizer, cfg: Config, live: list[Episode], first: bool):
    """The next assistant turn of each live episode: one HF generate call (rollout.py's sampler)
    on the episodes' tokens as they stand, left-padded; each turn at most max_new_tokens. The
    first turn is today's single-turn call: G replies to each prompt, the prompt run once (unless
    an environment gave a group different first messages)."""
    ro, pad = cfg.rollout, tokenizer.pad_token_id
    G = ro.num_generations if first and all(
        e.prompt_ids == live[i - i % ro.num_generations].prompt_ids for i, e in enumerate(live)) \
        else 1
    seqs = [e.prompt_ids + e.ids for e in live[::G]]
    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])  # (n, L) left-padded
    attn = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])  # (n, L)
    room = max(ro.max_episode_tokens - len(e.ids) for e in live)
    device = next(model.parameters()).device
    return rollout.generate_rollout(
        model, tokenizer, (ids.to(device), attn.to(device)), G, min(ro.max_new_tokens, room),
        ro.temperature, ro.top_p, ro.top_k, ro.stop_strings,
        ro.max_prompt_tokens if first else math.inf,
        share_prompt=cfg.grpo.share_prompt is not False, entropy=True)


def take_turn(e: Episode, turn: list[int], entropy: list[float], hit_limit: bool, tokenizer,
              cfg: Config, envs: environments.Environments) -> None:
    """Append the model's sampled turn, then the answers to its tool calls (or end the episode)."""
    room = cfg.rollout.max_episode_tokens - len(e.ids)
    cut = len(turn) > room
    turn, entropy = turn[:room], entropy[:room]
    e.ids += turn
    e.mask += [1] * len(turn)
    e.entropy += entropy
    e.turns += 1
    text = tokenizer.decode(turn, skip_special_tokens=True)
    e.messages.append({"role": "assistant", "content": text})
    if cut or hit_limit or e.error:  # a turn without its end, or an env that failed at reset
        e.truncated, e.done = cut or hit_limit, True
        return
    said, failed = tool_calls.answer_calls(text, environments.tools_of(envs, e.env), envs.fmt,
                                           envs.timeout, e.schemas)
    if said is None:
        e.done = True
        return
    e.messages += said
    e.tool_calls, e.tool_errors = e.tool_calls + len(said), e.tool_errors + failed
    closed = bool(turn) and turn[-1] == turn_end(tokenizer)
    env_ids = tokenizer(env_turn_text(tokenizer, said, cfg, e.schemas, closed),
                        add_special_tokens=False).input_ids
    if len(e.ids) + len(env_ids) >= cfg.rollout.max_episode_tokens:  # no room to answer it
        e.truncated, e.done = True, True
        return
    e.ids += env_ids
    e.mask += [0] * len(env_ids)
    e.entropy += [0.0] * len(env_ids)


_WARNED: set[str] = set()


def _env_failed(where: str, err: Exception) -> str:
    """The one line of an environment's failure; the first of each kind is logged."""
    line = f"env.{where}: {one_line(err)}"
    if where not in _WARNED:
        _WARNED.add(where)
        log.warning("%s; the episode ends (get_reward gives its fallback); later failures are "
                    "counted in episodes/env_errors", line)
    return line


# ---------------------------------------------------------------- rendering turns as tokens


def render(tokenizer, messages: list[dict], cfg: Config, tools: list[dict] | None,
           first: bool) -> str:
    """The first messages as the model sees them: the chat template with the tools it declares, or
    (a template that declares none) the tools described in the system message, Hermes-style."""
    kwargs = dict(cfg.data.chat_template_kwargs)
    if tools and tool_calls.declares_tools(tokenizer):
        kwargs["tools"] = tools
    elif tools:
        text = tool_calls.describe_tools(tools, cfg.data.tools_prompt)
        if messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"},
                        *messages[1:]]
        else:
            messages = [{"role": "system", "content": text}, *messages]
    prefix = cfg.data.assistant_prefix if first else ""
    return rollout.render_prompt(tokenizer, messages, None, prefix, kwargs)


_PROBE = "minigrpo turn 7f3a"


def env_turn_text(tokenizer, said: list[dict], cfg: Config, tools: list[dict] | None,
                  closed: bool) -> str:
    """What the chat template writes after an assistant turn for the environment's messages, up to
    and including the next assistant turn's opening: rendered after a probe reply, and taken from
    the probe's end on. closed: the model's turn ended with the template's turn-end token itself
    (else that is written here, as the environment's)."""
    kwargs = dict(cfg.data.chat_template_kwargs) | ({"tools": tools} if tools else {})
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}, *said],
        tokenize=False, add_generation_prompt=True, **kwargs)
    after = text[text.rfind(_PROBE) + len(_PROBE):]
    end = tokenizer.decode([turn_end(tokenizer)])
    return after[len(end):] if closed and after.startswith(end) else after


def turn_end(tokenizer) -> int:
    """The token that closes an assistant turn: the template's (rollout.turn_end_id), else EOS."""
    found = rollout.turn_end_id(tokenizer)
    return tokenizer.eos_token_id if found is None else found


def as_rollout(eps: list[Episode], tokenizer, device) -> rollout.Rollout:
    """The episodes as one Rollout: prompts left-padded, everything after them right-padded;
    completion_mask the model's tokens, attended every token; texts the conversations as the model
    saw them after the prompt (samples.jsonl)."""
    pad, P = tokenizer.pad_token_id, max(len(e.prompt_ids) for e in eps)
    C = max(max(len(e.ids) for e in eps), 1)

    def rows(key: Callable, fill, left: bool = False, dtype=torch.long) -> torch.Tensor:
        out = [[fill] * (P - len(key(e))) + key(e) if left else key(e) + [fill] * (C - len(key(e)))
               for e in eps]
        return torch.tensor(out, dtype=dtype, device=device)
    return rollout.Rollout(
        prompt_ids=rows(lambda e: e.prompt_ids, pad, left=True),  # (N, P)
        prompt_mask=rows(lambda e: [1] * len(e.prompt_ids), 0, left=True),  # (N, P)
        completion_ids=rows(lambda e: e.ids, pad),  # (N, C)
        completion_mask=rows(lambda e: e.mask, 0, dtype=torch.float),  # (N, C) the model's
        truncated=torch.tensor([e.truncated for e in eps], device=device),  # (N,)
        texts=[tokenizer.decode(e.ids) for e in eps],
        entropy=rows(lambda e: e.entropy, 0.0, dtype=torch.float),  # (N, C)
        attended=rows(lambda e: [1] * len(e.ids), 0),  # (N, C) every token of the episode
        episodes=eps)


# ---------------------------------------------------------------- metrics


def episode_metrics(eps: list[Episode] | None) -> dict:
    """episodes/*: means over the step's episodes of turns, tool calls, tool errors and tokens
    (the model's and the environment's), the share cut short, and the environments that raised
    (counted on the Episode: a pooled instance is reset by the step's next draw)."""
    if not eps:
        return {}
    n = len(eps)
    return {"episodes/turns": sum(e.turns for e in eps) / n,
            "episodes/tool_calls": sum(e.tool_calls for e in eps) / n,
            "episodes/tool_errors": sum(e.tool_errors for e in eps) / n,
            "episodes/length": sum(len(e.ids) for e in eps) / n,
            "episodes/truncated_rate": sum(e.truncated for e in eps) / n,
            "episodes/env_errors": sum(e.error is not None for e in eps)}
