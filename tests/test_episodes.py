"""Multi-turn episodes (engines/episodes.py, engines/tool_calls.py): only the model's tokens train,
the
episode's log-probs are a turn-by-turn forward's, tool calls parse on the chat templates the project
loads, a broken tool or environment is a message or a fallback, never a crash, and a run with a
scripted environment trains and resumes."""
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

import grpo
import train
from config import Config, RewardSpec, load_config
from conftest import make_tokenizer, write_run_config
from engines import episodes, tool_calls
from logprobs import sequence_log_probs
from model import load_policy
from rewards import compute_rewards

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TIMING = {"step_time", "rollout_time", "rollout_tokens_per_s", "peak_memory_mb"}

SCRIPTED = '''
class Scripted:
    """Answers every reply with a tool message, `turns` times; its reward: the reply's length."""
    def __init__(self, turns=2, fail_on=None):
        self.turns, self.fail_on, self.seen, self.reward = turns, fail_on, 0, None
        self.tool_calls = self.tool_errors = 0

    def reset(self, row):
        return None

    def step(self, reply):
        self.seen += 1
        self.reward = float(len(reply) % 5)
        if self.seen == self.fail_on:
            raise RuntimeError("the scripted env broke")
        if self.seen > self.turns:
            return None
        self.tool_calls += 1
        return {"role": "tool", "content": "result 42"}
'''


def scripted_config(tmp_path, tiny_llama, **env_args):
    (tmp_path / "scripted_env.py").write_text(SCRIPTED)
    path = write_run_config(
        tmp_path, tiny_llama, rollout={"max_turns": 3, "max_episode_tokens": 40,
                                       "max_new_tokens": 6, "temperature": 1.0,
                                       # a random model seldom samples EOS: turns end here
                                       "stop_strings": ["e", "o", "a", " "]})
    raw = yaml.safe_load(path.read_text())
    raw["env"] = {"name": f"{tmp_path / 'scripted_env.py'}:Scripted", "args": env_args}
    raw["rewards"] = [{"name": "env_reward", "fallback": 0.5}]
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def scripted(tmp_path, tiny_llama):
    cfg = load_config(scripted_config(tmp_path, tiny_llama))
    model, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "Hello world", "answer": "1"}]
    torch.manual_seed(0)
    return cfg, model, tok, episodes.run_episodes(cfg, model, tok, rows)


def env_tokens(r):
    return (r.completion_mask == 0) & (r.attended == 1)  # (N, C) read by the model, not written


def test_episodes_interleave_the_model_s_tokens_with_the_environment_s(scripted):
    cfg, _, tok, r = scripted
    assert r.completion_ids.shape[0] == 2 * cfg.rollout.num_generations
    assert env_tokens(r).any() and r.completion_mask.sum() > 0
    for e, text in zip(r.episodes, r.texts):
        assert len(e.ids) == len(e.mask) == len(e.entropy) <= cfg.rollout.max_episode_tokens
        assert e.turns <= cfg.rollout.max_turns
        env_text = tok.decode([t for t, m in zip(e.ids, e.mask) if not m])
        if e.turns > 1:  # the tool message, rendered as the chat template renders it
            assert "<|im_start|>tool\nresult 42<|im_end|>" in env_text and "result 42" in text
    m = episodes.episode_metrics(r.episodes)
    assert 1 <= m["episodes/turns"] <= 3 and m["episodes/length"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_gradient_is_zero_at_every_environment_token(scripted, loss_type):
    """d loss / d logits is zero at the logits that score an environment token, for every loss
    normalisation, and not zero at the model's tokens."""
    _, model, _, r = scripted
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
    cfg, model, _, r = scripted
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
    _, model, _, r = scripted
    with torch.no_grad():
        logp = sequence_log_probs(model, r.input_ids, r.attention_mask,
                                  r.completion_ids.shape[1])  # (N, C)
        checked = 0
        for i, e in enumerate(r.episodes):
            starts = [j for j in range(len(e.mask)) if e.mask[j] and (j == 0 or not e.mask[j - 1])]
            for s in starts:
                end = s
                while end < len(e.mask) and e.mask[end]:
                    end += 1
                seen = torch.tensor([e.prompt_ids + e.ids[:end]])  # the turn's context, unpadded
                out = model(input_ids=seen).logits[0, -(end - s) - 1:-1].log_softmax(-1)
                turn = out.gather(1, torch.tensor(e.ids[s:end])[:, None])[:, 0]
                torch.testing.assert_close(logp[i, s:end], turn, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked > len(r.episodes)  # later turns were checked too


def test_an_environment_that_raises_ends_its_episode_with_one_line_and_the_fallback(
        tmp_path, tiny_llama, caplog):
    cfg = load_config(scripted_config(tmp_path, tiny_llama, fail_on=1))
    model, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    samples = [{"prompt": "Hello world"}] * cfg.rollout.num_generations
    with caplog.at_level(logging.WARNING):
        r = episodes.run_episodes(cfg, model, tok, samples[:1])
    failed = [e.error is not None for e in r.episodes]  # the others' first turn was cut short
    assert any(failed) and all(e.turns == 1 and e.done for e in r.episodes)
    assert all(e.error == "env.step: RuntimeError: the scripted env broke"
               for e, f in zip(r.episodes, failed) if f)
    warned = [rec for rec in caplog.records if "scripted env broke" in rec.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0].getMessage()
    assert episodes.episode_metrics(r.episodes)["episodes/env_errors"] == sum(failed)
    res = compute_rewards([e.reply for e in r.episodes], samples,
                          [RewardSpec("env_reward", fallback=0.5)], episodes=r.episodes)
    assert [v for v, f in zip(res.per_reward["env_reward"], failed) if f] == [0.5] * sum(failed)
    assert res.errors["env_reward"] == sum(failed)


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


def tool_env(fmt: str = "hermes", timeout: float = 0.3) -> episodes.ToolEnv:
    fns = {f.__name__: f for f in (calculator, broken, hangs)}
    return episodes.ToolEnv(fns, [tool_calls.tool_schema(f, n) for n, f in fns.items()], fmt,
                            timeout)


def test_a_malformed_call_a_raising_tool_and_an_unknown_tool_are_tool_messages():
    env = tool_env()
    said = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}'
                    '</tool_call> and <tool_call>{"name": "calculator", "arguments": '
                    '{"expression": 12 * 34}}</tool_call><tool_call>{"name": "broken", '
                    '"arguments": {"x": 1}}</tool_call><tool_call>{"name": "nope"}</tool_call>'
                    '<tool_call>{"arguments": {}}</tool_call>')
    assert [m["content"] for m in said[:1]] == ["408"]
    assert said[1]["content"].startswith("error: the tool call is not valid JSON")
    assert said[2]["content"] == "error: ZeroDivisionError: division by zero"
    assert said[3]["content"].startswith("error: no tool named 'nope'; tools: calculator")
    assert said[4]["content"].startswith('error: the tool call needs a "name"')
    assert all(m["role"] == "tool" for m in said) and (env.tool_calls, env.tool_errors) == (5, 4)
    assert env.step("The answer is 408.") is None  # no call: the episode is over


def test_a_tool_that_hangs_past_its_limit_is_an_error_message_in_time():
    env = tool_env(timeout=0.3)
    t0 = time.monotonic()
    said = env.step('<tool_call>{"name": "hangs", "arguments": {"seconds": 30}}</tool_call>')
    assert time.monotonic() - t0 < 3
    assert said == [{"role": "tool", "name": "hangs",
                     "content": "error: the tool ran past its 0.3 s limit"}]
    assert env.tool_errors == 1


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
    (tmp_path / "t.py").write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
    cfg = Config(tools=[f"{tmp_path / 't.py'}:add"])
    with pytest.raises(Exception, match=r"tools: tool 'add': .*Args: section"):
        episodes.check_environment(cfg)


@pytest.mark.parametrize("template, fmt, declares", [
    ("smollm2-135m-instruct.jinja", "hermes", False), ("hermes-style.jinja", "hermes", True)])
def test_appended_turns_are_what_the_chat_template_renders_for_the_whole_conversation(
        template, fmt, declares):
    """The prompt, the model's turn as sampled (ending in its turn-end token) and the tool message
    as env_turn_text writes it read exactly as the template renders the whole conversation, on the
    built-in model's template (no tools declared: minigrpo describes them) and a Hermes one."""
    tok = make_tokenizer((TEMPLATES / template).read_text())
    assert tool_calls.call_format(tok) == fmt and tool_calls.declares_tools(tok) == declares
    cfg, schemas = Config(), [tool_calls.tool_schema(calculator, "calculator")]
    question = [{"role": "user", "content": "What is 12 * 34?"}]
    prompt = episodes.render(tok, question, cfg, schemas, first=True)
    reply = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'
    sampled = tok(reply + "<|im_end|>", add_special_tokens=False).input_ids
    assert sampled[-1] == episodes.turn_end(tok)
    env = tool_env(fmt)
    said = env.step(reply)
    assert said[0]["content"] == "408"
    appended = prompt + tok.decode(sampled) + episodes.env_turn_text(tok, said, cfg, schemas, True)
    system = [] if declares else [{"role": "system",
                                   "content": tool_calls.describe_tools(schemas)}]
    whole = tok.apply_chat_template([*system, *question, {"role": "assistant", "content": reply},
                                     *said], tools=schemas if declares else None,
                                    add_generation_prompt=True, tokenize=False)
    assert appended == whole
    assert "408" in episodes.env_turn_text(tok, said, cfg, schemas, False)


# ---------------------------------------------------------------- end to end


def test_a_scripted_environment_run_trains_logs_episodes_and_resumes_after_a_kill(
        tmp_path, tiny_llama):
    path = scripted_config(tmp_path, tiny_llama)
    run = tmp_path / "run"
    args = ["--config", str(path), f"--run.out_dir={run}", "--run.steps=3", "--run.save_every=2",
            "--run.sample_every=1"]
    assert train.main(args) == 0
    whole = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"episodes/turns", "episodes/tool_calls", "episodes/length", "episodes/truncated_rate",
            "rewards/env_reward/mean"} <= set(whole[0])
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
    ("--env={name: x.py:E}", "give env: or tools:, not both"),
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
