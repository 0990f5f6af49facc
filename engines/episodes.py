"""Multi-turn GRPO: G episodes per prompt against an environment, returned as the same Rollout one
reply per prompt gives, whose completion_mask holds the model's tokens alone. step.py trains on it
unchanged: the loss, its normalisations and the log-probs only ever see the mask.

    env: {name: my_env.py:Guess, args: {low: 1, high: 100}}   # your environment, or
    tools: [my_tools.py:calculator]                          # plain functions, run by ToolEnv
    rollout: {max_turns: 4, max_new_tokens: 64, max_episode_tokens: 512}

    r = run_episodes(cfg, model, tokenizer, rows)   # Rollout; r.episodes[i]: row i // G's episode j
    python train.py --config configs/tools_calculator.yaml   # the CPU demo (docs/multi-turn.md)

An environment is any object with these methods (no base class), one object per episode:

    class Guess:
        def __init__(self, **args): ...           # env.args from the config
        def reset(self, row) -> list[dict] | None:  # the first messages; None: the row's prompt
        def step(self, reply: str) -> str | dict | list[dict] | None:
            # what the environment says to the assistant's reply: a user message (str), one or
            # more messages ({"role": "tool" or "user", "content": ...}); None ends the episode
        reward: float | None                      # optional: read when the episode ends; the
                                                  # `env_reward` reward returns it
        tools: list[dict]                         # optional: JSON schemas the chat template shows

The G episodes of a row are one GRPO group: reset must give them the same first messages. The
configured rewards score each episode: `completion` is the assistant's last reply, and a reward
that takes an `episode` parameter gets the Episode (its messages: the whole conversation). An
environment that raises ends its episode: one warning line, and `env_reward` gives its fallback.

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
from config import Config, ConfigError
from engines import tool_calls
from rewards import Rewards, register
from sources.plugins import import_function, one_line

log = logging.getLogger("minigrpo.episodes")


@dataclass
class Episode:
    """One conversation: the prompt's tokens, then every token after it, each marked as the model's
    (1: sampled, trained) or the environment's (0: read, never trained)."""
    env: object | None
    messages: list[dict]  # the whole conversation: the first messages, then each turn
    prompt_ids: list[int]
    opening: int = 0  # how many of the messages are the first ones (the prompt's)
    ids: list[int] = field(default_factory=list)  # after the prompt: the model's and the env's
    mask: list[int] = field(default_factory=list)  # 1 where the model sampled the token
    entropy: list[float] = field(default_factory=list)  # the sampling entropy; 0 at env tokens
    turns: int = 0  # assistant turns
    truncated: bool = False  # cut short: by a token limit, or still going at max_turns
    done: bool = False
    error: str | None = None  # the environment raised: its one line

    @property
    def exchanged(self) -> list[dict]:
        """The messages after the first ones: this episode's turns, the model's and the env's."""
        return self.messages[self.opening:]

    @property
    def reply(self) -> str:
        """The assistant's last message: what the rewards score as `completion`."""
        return next((m["content"] for m in reversed(self.exchanged) if m["role"] == "assistant"),
                    "")

    @property
    def reward(self) -> float | None:
        return getattr(self.env, "reward", None)


# ---------------------------------------------------------------- the episodes, turn by turn


def sample_and_score(cfg: Config, model, tokenizer, rewards: Rewards, rows: list[dict],
                     samples: list[dict]) -> tuple:
    """step.score's seam (run.sample_and_score, partial of the first four at setup): G episodes for
    each row, the rewards (prepared with given=("num_tokens", "episode")) seeing each whole (its
    final reply, the episode by name) -> (the rollout, the RewardResult)."""
    batch = run_episodes(cfg, model, tokenizer, rows)
    return batch, rewards([e.reply for e in batch.episodes], samples,
                          num_tokens=batch.num_tokens(), episodes=batch.episodes)


def run_episodes(cfg: Config, model, tokenizer, rows: list[dict]) -> rollout.Rollout:
    """G episodes for each row, all turns sampled with HF generate (the episodes still going, one
    call a turn), up to rollout.max_turns -> the Rollout of the whole episodes."""
    make_env, G = environment(cfg, tokenizer), cfg.rollout.num_generations
    eps = [open_episode(make_env, row, tokenizer, cfg) for row in rows for _ in range(G)]
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
                      bool(sampled.truncated[i]), tokenizer, cfg)
    for e in eps:  # still going after max_turns: cut short
        e.truncated |= not e.done
    return as_rollout(eps, tokenizer, next(model.parameters()).device)


def open_episode(make_env: Callable, row: dict, tokenizer, cfg: Config) -> Episode:
    """A new environment object, reset on the row -> the Episode with its rendered prompt."""
    env, messages, error = None, None, None
    try:
        env = make_env()
        messages = env.reset(row)
    except Exception as e:
        error = _env_failed("reset", e)
    messages = rollout.chat_messages(row["prompt"] if messages is None else messages,
                                     cfg.data.system_prompt)
    prompt = render(tokenizer, messages, cfg, getattr(env, "tools", None), first=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    return Episode(env, messages, ids, opening=len(messages), error=error)


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
              cfg: Config) -> None:
    """Append the model's sampled turn, then the environment's answer to it (or end the episode)."""
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
    try:
        said = as_messages(e.env.step(text))
    except Exception as err:
        e.error, e.done = _env_failed("step", err), True
        return
    if said is None:
        e.done = True
        return
    e.messages += said
    closed = bool(turn) and turn[-1] == turn_end(tokenizer)
    env_ids = tokenizer(env_turn_text(tokenizer, said, cfg, getattr(e.env, "tools", None),
                                      closed), add_special_tokens=False).input_ids
    if len(e.ids) + len(env_ids) >= cfg.rollout.max_episode_tokens:  # no room to answer it
        e.truncated, e.done = True, True
        return
    e.ids += env_ids
    e.mask += [0] * len(env_ids)
    e.entropy += [0.0] * len(env_ids)


def as_messages(said) -> list[dict] | None:
    """An environment's answer as messages: a str is a user message; None ends the episode.

    >>> as_messages("Higher."), as_messages({"role": "tool", "content": "408"}), as_messages(None)
    ([{'role': 'user', 'content': 'Higher.'}], [{'role': 'tool', 'content': '408'}], None)
    """
    if said is None or isinstance(said, list):
        return said
    if isinstance(said, str):
        return [{"role": "user", "content": said}]
    if isinstance(said, dict):
        return [said]
    raise TypeError(f"step returned {type(said).__name__}; expected str, dict, list or None")


_WARNED: set[str] = set()


def _env_failed(where: str, err: Exception) -> str:
    """The one line of an environment's failure; the first of each kind is logged."""
    line = f"env.{where}: {one_line(err)}"
    if where not in _WARNED:
        _WARNED.add(where)
        log.warning("%s; the episode ends (env_reward gives its fallback); later failures are "
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


# ---------------------------------------------------------------- environments


class ToolEnv:
    """The built-in environment for `tools:`: each assistant reply's tool calls (in the format the
    chat template declares, engines/tool_calls.py) are run, each with a time limit, and their
    results come back as tool messages; a reply without a call ends the episode. A malformed call,
    an unknown tool, a tool that raises or hangs: its tool message says so, and the episode goes
    on. Leaves scoring to the configured rewards."""

    def __init__(self, tools: dict[str, Callable], schemas: list[dict], fmt: str,
                 timeout: float):
        self.functions, self.tools, self.fmt, self.timeout = tools, schemas, fmt, timeout
        self.tool_calls = self.tool_errors = 0

    def reset(self, row: dict) -> None:
        return None  # the row's prompt, with the tools shown (render)

    def step(self, reply: str) -> list[dict] | None:
        calls = tool_calls.parse_calls(reply, self.fmt)
        if not calls:
            return None
        out = []
        for call in calls:
            self.tool_calls += 1
            fn = self.functions.get(call.name)
            if call.error or fn is None:
                text = f"error: {call.error or f'no tool named {call.name!r}'}; tools: " \
                       f"{', '.join(self.functions)}"
                failed = True
            else:
                text, failed = tool_calls.run_tool(fn, call.arguments, self.timeout)
            self.tool_errors += failed
            out.append({"role": "tool", "name": call.name or "?", "content": text})
        return out


def environment(cfg: Config, tokenizer) -> Callable[[], object]:
    """A function that makes a new environment object, one an episode: env: by name, with its args;
    or, with tools:, a ToolEnv over them. ValueError with one line when it cannot be loaded."""
    if cfg.env:
        cls = import_function(cfg.env.name, what="env")
        return lambda: cls(**cfg.env.args)
    functions = {}
    for name in cfg.tools:
        fn = import_function(name, what="tool")
        functions[fn.__name__] = fn
    schemas = [tool_calls.tool_schema(fn, name) for name, fn in functions.items()]
    fmt, limit = tool_calls.call_format(tokenizer), cfg.rollout.tool_timeout
    return lambda: ToolEnv(functions, schemas, fmt, limit)


def check_environment(cfg: Config) -> None:
    """Before any model loads: the environment (or every tool and its schema) loads, or
    ConfigError."""
    if cfg.env or cfg.tools:
        try:
            environment(cfg, None)
        except ValueError as e:
            raise ConfigError(f"{'env' if cfg.env else 'tools'}: {e}") from None


def episode_metrics(eps: list[Episode] | None) -> dict:
    """episodes/*: means over the step's episodes of turns, tool calls, tool errors and tokens
    (the model's and the environment's), the share cut short, and the environments that raised."""
    if not eps:
        return {}
    n = len(eps)
    return {"episodes/turns": sum(e.turns for e in eps) / n,
            "episodes/tool_calls": sum(getattr(e.env, "tool_calls", 0) for e in eps) / n,
            "episodes/tool_errors": sum(getattr(e.env, "tool_errors", 0) for e in eps) / n,
            "episodes/length": sum(len(e.ids) for e in eps) / n,
            "episodes/truncated_rate": sum(e.truncated for e in eps) / n,
            "episodes/env_errors": sum(e.error is not None for e in eps)}


@register("env_reward")
def env_reward(completion: str, sample: dict, episode: Episode) -> float | None:
    """The environment's own reward for the episode (its `reward` attribute; None: it gives none).
    An environment that raised has none to give: ValueError, so the spec's fallback applies."""
    if episode.error:
        raise ValueError(episode.error)
    return episode.reward
