"""Multi-turn episodes (engines/episodes.py, engines/tool_calls.py): the trainer scores exactly the
tokens that were sampled, over several turns, in the context they were sampled from; only the
model's tokens train; the episode's log-probs are a turn-by-turn forward's; tool calls parse on the
chat templates the project loads and are answered as TRL answers them; a broken tool or environment
is a message or a fallback, never a crash; and a run trains and resumes. The model's turns come from
a script (tests/scripted_turns.py), so that a tiny random model calls tools."""
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

import grpo
import rollout
import train
from config import Config, RewardSpec, load_config
from conftest import CHATML, make_tokenizer, write_run_config
from engines import episodes, tool_calls
from logprobs import sequence_log_probs
from model import load_policy
from scripted_turns import ScriptedTurns, scored

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TIMING = {"step_time", "rollout_time", "rollout_tokens_per_s", "peak_memory_mb"}

LOOKUP = '''
class Lookup:
    """Looks keys up in a table; its reward: how many lookups found one. Written for TRL."""
    def __init__(self, fail_reset=False):
        self.fail_reset = fail_reset

    def reset(self, **row):
        if self.fail_reset:
            raise RuntimeError("the scripted env broke")
        self.found = 0

    def lookup(self, key: str) -> str:
        """Looks a key up.

        Args:
            key: the key, e.g. "a"
        """
        if key not in ("a", "b"):
            raise KeyError(key)
        self.found += 1
        return "result 42"

    def get_reward(self) -> float:
        return float(self.found)
'''
CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
BAD_KEY = '<tool_call>{"name": "lookup", "arguments": {"key": "zzz"}}</tool_call>'
# turns 0 and 1: a call or an answer; turn 2: an answer, its tokens one character each (a split
# the tokenizer would never make, as a model may sample it: scripted_turns)
SCRIPT = [[CALL, BAD_KEY, "The answer is 5."], [CALL, "The answer is 42"]]


def char_tokens(tok, text: str) -> list[int]:
    return [tok(c, add_special_tokens=False).input_ids[0] for c in text]


def scripted_config(tmp_path, model_path, **env_args):
    (tmp_path / "lookup_env.py").write_text(LOOKUP)
    path = write_run_config(tmp_path, model_path, rollout={
        "max_turns": 3, "max_episode_tokens": 200, "max_new_tokens": 64, "temperature": 1.0})
    raw = yaml.safe_load(path.read_text())
    raw["data"]["tools_prompt"] = "Tools: lookup."  # the tiny model reads 256 positions
    raw["env"] = {"name": f"{tmp_path / 'lookup_env.py'}:Lookup", "args": env_args}
    raw["rewards"] = [{"name": "get_reward", "fallback": 0.5}]
    path.write_text(yaml.safe_dump(raw))
    return path


def scripted_turns(tok) -> ScriptedTurns:
    return ScriptedTurns(tok, [*SCRIPT, [char_tokens(tok, "The answer is 42")]])


@pytest.fixture
def scripted(tmp_path, tiny_llama, monkeypatch):
    cfg = load_config(scripted_config(tmp_path, tiny_llama))
    model, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    sampler = scripted_turns(tok)
    monkeypatch.setattr(rollout, "generate_rollout", sampler)
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Hello world", "answer": "1"}]
    torch.manual_seed(0)
    return cfg, model, tok, episodes.run_episodes(cfg, model, tok, rows), sampler


def env_tokens(r):
    return (r.completion_mask == 0) & (r.attended == 1)  # (N, C) read by the model, not written


def turns_of(e) -> list[tuple[int, int]]:
    """[start, end) of each of the model's turns in e.ids."""
    spans, j = [], 0
    while j < len(e.mask):
        if e.mask[j]:
            end = j
            while end < len(e.mask) and e.mask[end]:
                end += 1
            spans.append((j, end))
            j = end
        else:
            j += 1
    return spans


def test_episodes_interleave_the_model_s_tokens_with_the_tool_s_answers(scripted):
    cfg, _, tok, r, _ = scripted
    assert r.completion_ids.shape[0] == 2 * cfg.rollout.num_generations
    assert env_tokens(r).any() and r.completion_mask.sum() > 0
    for e, text in zip(r.episodes, r.texts):
        assert len(e.ids) == len(e.mask) == len(e.entropy) <= cfg.rollout.max_episode_tokens
        assert e.turns <= cfg.rollout.max_turns and e.tool_calls == e.turns - 1
        env_text = tok.decode([t for t, m in zip(e.ids, e.mask) if not m])
        if "result 42" in text:  # the tool message, rendered as the chat template renders it
            assert "<|im_start|>tool\nresult 42<|im_end|>" in env_text
    m = episodes.episode_metrics(r.episodes)
    assert m["episodes/turns"] > 1.5 and m["episodes/tool_calls"] > 0.5
    assert m["episodes/length"] > 0


def test_over_several_turns_the_trainer_scores_exactly_the_sampled_tokens(scripted):
    """Trap 12: each episode's trained tokens (completion_mask 1) are, turn by turn, the tokens the
    sampler drew, in the very context it drew them from (its input, unpadded, is the episode's
    tokens before the turn), so the one forward scores what was sampled. The appended text is what
    the chat template renders for the whole conversation; yet tokenizing that render again would
    change a scored token: the turn sampled one character a token is merged."""
    cfg, _, tok, r, sampler = scripted
    given = {}  # (context, tokens drawn) by the context's tokens
    for contexts, drawn in sampler.calls:
        for c, d in zip(contexts, drawn):
            given.setdefault(tuple(c), []).append(d)
    retokenized_differs = 0
    for e in r.episodes:
        spans = turns_of(e)
        assert len(spans) == e.turns >= 1
        for s, end in spans:
            assert e.ids[s:end] in given[tuple(e.prompt_ids + e.ids[:s])]  # drawn there, as is
        system = [{"role": "system", "content": "Tools: lookup."}]
        whole = tok.apply_chat_template(system + e.messages, tokenize=False)
        text = tok.decode(e.prompt_ids + e.ids)
        assert whole.startswith(text) and whole[len(text):].strip() == ""
        again = tok(text, add_special_tokens=False).input_ids[len(e.prompt_ids):]
        retokenized_differs += again != e.ids
    assert r.completion_mask.sum() == sum(end - s for e in r.episodes for s, end in turns_of(e))
    assert max(e.turns for e in r.episodes) == 3 and retokenized_differs > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_gradient_is_zero_at_every_environment_token(scripted, loss_type):
    """d loss / d logits is zero at the logits that score an environment token, for every loss
    normalisation, and not zero at the model's tokens."""
    _, model, _, r, _ = scripted
    mask, N, C = r.completion_mask, r.completion_ids.shape[0], r.completion_ids.shape[1]
    kept = []

    def keep(mod, args, out):  # the logits, their gradient kept
        out.retain_grad()
        kept.append(out)
    hook = model.get_output_embeddings().register_forward_hook(keep)
    try:
        logp = sequence_log_probs(model, r.input_ids, r.attention_mask, C)  # (N, C)
    finally:
        hook.remove()
    norm = grpo.LossNorm(loss_type, N, int(mask.sum()), 6, 1)
    adv = torch.linspace(-1, 1, N)
    loss, _ = grpo.grpo_loss(logp, None, None, adv, mask, norm)
    loss.backward()
    grad = kept[0].grad  # (N, C, V): row j scores completion token j
    assert grad[env_tokens(r)].abs().max() == 0
    assert grad[mask.bool()].abs().sum() > 0


def test_the_loss_counts_the_model_s_tokens_only(scripted):
    """The step's normaliser (step.mini_batches) counts the model's tokens, and no loss_type's
    value moves when the environment tokens' log-probs change."""
    import step
    cfg, model, _, r, _ = scripted
    mask, N = r.completion_mask, r.completion_ids.shape[0]
    (_, norm), = step.mini_batches(cfg, r, mask, torch.zeros(N), torch.zeros(N))
    assert norm.num_tokens == int(r.completion_mask.sum()) < int(r.attended.sum())
    logp = torch.randn(mask.shape)
    moved = torch.where(env_tokens(r), logp + 100.0, logp)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        n = grpo.LossNorm(loss_type, N, norm.num_tokens, 6, 1)
        old = logp - 0.1
        a, _ = grpo.grpo_loss(logp, old, None, torch.linspace(-1, 1, N), mask, n)
        b, _ = grpo.grpo_loss(moved, old, None, torch.linspace(-1, 1, N), mask, n)
        assert torch.equal(a, b), loss_type


def test_the_episode_s_log_probs_equal_a_turn_by_turn_forward(scripted):
    """One forward over the whole padded episode gives each sampled token the log-prob that a
    forward over exactly what the model saw when it sampled that turn gives."""
    _, model, _, r, _ = scripted
    with torch.no_grad():
        logp = sequence_log_probs(model, r.input_ids, r.attention_mask,
                                  r.completion_ids.shape[1])  # (N, C)
        checked = 0
        for i, e in enumerate(r.episodes):
            for s, end in turns_of(e):
                seen = torch.tensor([e.prompt_ids + e.ids[:end]])  # the turn's context, unpadded
                out = model(input_ids=seen).logits[0, -(end - s) - 1:-1].log_softmax(-1)
                turn = out.gather(1, torch.tensor(e.ids[s:end])[:, None])[:, 0]
                torch.testing.assert_close(logp[i, s:end], turn, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked > len(r.episodes)  # later turns were checked too


def test_an_environment_whose_reset_raises_ends_its_episode_with_one_line_and_the_fallback(
        tmp_path, tiny_llama, caplog, monkeypatch):
    cfg = load_config(scripted_config(tmp_path, tiny_llama, fail_reset=True))
    model, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    monkeypatch.setattr(rollout, "generate_rollout", scripted_turns(tok))
    samples = [{"prompt": "Hello world"}] * cfg.rollout.num_generations
    with caplog.at_level(logging.WARNING):
        r = episodes.run_episodes(cfg, model, tok, samples[:1])
    assert all(e.turns == 1 and e.done and e.tool_calls == 0 for e in r.episodes)
    assert all(e.error == "env.reset: RuntimeError: the scripted env broke" for e in r.episodes)
    warned = [rec for rec in caplog.records if "scripted env broke" in rec.getMessage()]
    assert len(warned) <= 1 and all("\n" not in w.getMessage() for w in warned)
    assert episodes.episode_metrics(r.episodes)["episodes/env_errors"] == len(r.episodes)
    res = scored([e.reply for e in r.episodes], samples, [RewardSpec("get_reward", fallback=0.5)],
                 r.episodes)
    assert res.per_reward["get_reward"] == [0.5] * len(r.episodes)
    assert res.errors["get_reward"] == len(r.episodes)


# ---------------------------------------------------------------- tools


def calculator(expression: str) -> str:
    """Evaluate a product.

    Args:
        expression: two integers and a *, e.g. "12 * 34"
    """
    a, b = expression.split("*")
    return str(int(a) * int(b))


def broken(x: int) -> int:
    """Always raises.

    Args:
        x: anything
    """
    raise ZeroDivisionError("division by zero")


def hangs(seconds: float) -> str:
    """Sleeps past any limit.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "late"


TOOLS = {f.__name__: f for f in (calculator, broken, hangs)}


def test_a_raising_tool_an_unknown_tool_and_a_malformed_call_answer_as_trl_does():
    """TRL 1.16 answers a tool that raises, or a name no tool has, with str({"error": str(e)})
    ("Tool nope not found."); minigrpo answers a call that does not parse the same way."""
    said, failed = tool_calls.answer_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call> and '
        '<tool_call>{"name": "calculator", "arguments": {"expression": 12 * 34}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call><tool_call>{"name": '
        '"nope"}</tool_call><tool_call>{"arguments": {}}</tool_call>', TOOLS, "hermes", 5.0)
    assert [m["content"] for m in said[:1]] == ["408"]
    assert said[1]["content"] == str({"error": "the tool call is not valid JSON (Expecting ',' "
                                               "delimiter at char 54)"})
    assert said[2]["content"] == "{'error': 'division by zero'}"
    assert said[3] == {"role": "tool", "name": "nope",
                       "content": "{'error': 'Tool nope not found.'}"}
    assert said[4]["content"] == str({"error": 'the tool call needs a "name" (a string)'})
    assert all(m["role"] == "tool" for m in said) and failed == 4
    assert tool_calls.answer_calls("The answer is 408.", TOOLS, "hermes", 5.0) == (None, 0)


def test_a_tool_that_hangs_past_its_limit_is_an_error_message_in_time():
    t0 = time.monotonic()
    said, failed = tool_calls.answer_calls(
        '<tool_call>{"name": "hangs", "arguments": {"seconds": 30}}</tool_call>', TOOLS, "hermes",
        0.3)
    assert time.monotonic() - t0 < 3
    assert said == [{"role": "tool", "name": "hangs",
                     "content": "{'error': 'the tool ran past its 0.3 s limit'}"}]
    assert failed == 1


def test_an_async_tool_is_awaited_and_a_result_is_its_str():
    async def fetch(key: str) -> dict:
        return {"key": key}
    assert tool_calls.run_tool(fetch, {"key": "a"}, 5.0) == ("{'key': 'a'}", False)


def test_llama_style_json_calls_parse_and_text_without_a_call_gives_none():
    llama_like = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}" \
                 "{{ m['content'] }}{% endfor %}"  # declares tools, no <tool_call> tags
    assert tool_calls.call_format(make_tokenizer(llama_like)) == "json"
    calls = tool_calls.parse_calls('{"name": "calculator", "parameters": {"expression": "2*3"}}',
                                   "json")
    assert calls == [tool_calls.ToolCall("calculator", {"expression": "2*3"})]
    assert tool_calls.parse_calls("The answer is {6}.", "json") == []
    assert tool_calls.parse_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}',
                                  "hermes") == [tool_calls.ToolCall("f", {"a": 1})]


def test_a_tool_without_a_described_argument_is_refused_with_one_line(tmp_path):
    from engines.environments import check_environment
    (tmp_path / "t.py").write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
    cfg = Config(tools=[f"{tmp_path / 't.py'}:add"])
    with pytest.raises(Exception, match=r"tools: tool 'add': .*Args: section"):
        check_environment(cfg)


@pytest.mark.parametrize("template, fmt, declares", [
    ("smollm2-135m-instruct.jinja", "hermes", False), ("hermes-style.jinja", "hermes", True),
    (CHATML, "hermes", False)])
def test_appended_turns_are_what_the_chat_template_renders_for_the_whole_conversation(
        template, fmt, declares):
    """Over three turns (a call, its answer, a second call, its answer, the reply), the prompt, the
    model's turns as sampled (each ending in its turn-end token) and the tool messages as
    env_turn_text writes them read exactly as the template renders the whole conversation, on the
    built-in model's template (no tools declared: minigrpo describes them), a Hermes one and
    ChatML."""
    tok = make_tokenizer(template if template == CHATML else (TEMPLATES / template).read_text())
    assert tool_calls.call_format(tok) == fmt and tool_calls.declares_tools(tok) == declares
    cfg, schemas = Config(), [tool_calls.tool_schema(calculator, "calculator")]
    question = [{"role": "user", "content": "What is 12 * 34 * 2?"}]
    text = episodes.render(tok, question, cfg, schemas, first=True)
    conversation = list(question)
    for reply in ('<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}'
                  '</tool_call>', '<tool_call>{"name": "calculator", "arguments": '
                  '{"expression": "408 * 2"}}</tool_call>', "It is 816."):
        sampled = tok(reply + "<|im_end|>", add_special_tokens=False).input_ids
        assert sampled[-1] == episodes.turn_end(tok)
        text += tok.decode(sampled)
        conversation.append({"role": "assistant", "content": reply})
        said, _ = tool_calls.answer_calls(reply, TOOLS, fmt, 5.0)
        if said:
            text += episodes.env_turn_text(tok, said, cfg, schemas, True)
            conversation += said
    system = [] if declares else [{"role": "system",
                                   "content": tool_calls.describe_tools(schemas)}]
    whole = tok.apply_chat_template([*system, *conversation],
                                    tools=schemas if declares else None, tokenize=False)
    assert "408" in text and "816" in text and whole.startswith(text)
    assert whole[len(text):].strip() == ""


# ---------------------------------------------------------------- end to end


def test_an_environment_run_trains_logs_episodes_and_resumes_after_a_kill(
        tmp_path, tiny_llama, monkeypatch):
    path = scripted_config(tmp_path, tiny_llama)
    from transformers import AutoTokenizer
    monkeypatch.setattr(rollout, "generate_rollout",
                        scripted_turns(AutoTokenizer.from_pretrained(tiny_llama)))
    run = tmp_path / "run"
    args = ["--config", str(path), f"--run.out_dir={run}", "--run.steps=3", "--run.save_every=2",
            "--run.sample_every=1"]
    assert train.main(args) == 0
    whole = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"episodes/turns", "episodes/tool_calls", "episodes/length", "episodes/truncated_rate",
            "rewards/Lookup/mean"} <= set(whole[0])
    assert max(m["episodes/turns"] for m in whole) > 1 and whole[-1]["grad_norm"] > 0
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert "<|im_start|>tool\nresult 42" in "".join(
        json.loads(x)["completion"] for x in (run / "samples.jsonl").read_text().splitlines())
    assert {"prompt", "completion", "reward"} <= set(sample)
    # a kill during step 3: its checkpoint never landed and its log line is torn
    shutil.rmtree(run / "checkpoints/step_000003")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2]) + '\n{"step": 3, "loss"')
    assert train.main(args + ["--resume"]) == 0
    resumed = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in m.items() if k not in TIMING} for m in resumed] == \
        [{k: v for k, v in m.items() if k not in TIMING} for m in whole]


@pytest.mark.parametrize("override, says", [
    ("--rollout.engine=vllm", "episodes sample with HF generate"),
    ("--rollout.max_episode_tokens=10", "max_episode_tokens=10 bounds a whole episode"),
    ("--run.eval_every=5", "held-out scoring (run.eval_every) runs single replies"),
    ("--env.names={a: x.py:E}", "give name (one environment class) or names"),
    ("--env.name=", "env: give name: path/to/file.py:Class"),
    ("--env={names: {a: x.py:E}, args: {k: 1}}", "env.args goes with env.name"),
    ("--env.name=Calculator", "must be 'path/to/file.py:name'"),
    ("--tools=[calculator]", "must be 'path/to/file.py:name'")])
def test_episode_settings_that_cannot_run_are_refused_with_one_line(override, says):
    from config import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(Path(__file__).parents[1] / "configs/tools_calculator.yaml", [override])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_dry_run_shows_the_first_turn_with_its_tools_described(tmp_path, tiny_llama, capsys):
    (tmp_path / "calc.py").write_text(
        'def calculator(expression: str) -> str:\n'
        '    """Evaluates arithmetic.\n\n    Args:\n        expression: e.g. 2 + 3\n    """\n'
        '    return str(eval(expression))\n')
    path = write_run_config(tmp_path, tiny_llama)
    raw = yaml.safe_load(path.read_text())
    raw["tools"] = [f"{tmp_path / 'calc.py'}:calculator"]
    raw["data"] = {**raw.get("data", {}), "tools_prompt": "You may call the calculator tool."}
    path.write_text(yaml.safe_dump(raw))
    assert train.main(["--config", str(path), "--dry-run"]) == 0
    shown = capsys.readouterr().out.split("as the model sees it")[1]
    assert "You may call the calculator tool." in shown
