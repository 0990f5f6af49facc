"""Environment classes written for TRL's environment_factory run unchanged
(engines/environments.py): the tools are the public methods with the schemas transformers builds,
reset(**row) opens each episode, one instance per rollout from a pool, get_reward is one more
reward under the class's name, a dict of them is keyed by the rows' `environment` column; bad input
is one line and exit 2; and the environment of docs/multi-turn.md trains with no line changed."""
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import rollout
import train
from config import Config, ConfigError, EnvSpec, RewardSpec, load_config
from conftest import make_tokenizer, write_run_config
from engines import environments, episodes
from scripted_turns import ScriptedTurns, scored

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"

ENVS = '''
import itertools

BUILT = itertools.count()


class Shop:
    """Two tools, a private helper, a static tool, and what TRL leaves out of the tools."""
    def __init__(self):
        self.serial, self.seen = next(BUILT), None

    def reset(self, **row):
        self.seen, self.bought = dict(row), 0
        return " (the shop is open)"

    def price(self, item: str) -> float:
        """The price of an item.

        Args:
            item: what to price, e.g. "tea"
        """
        return {"tea": 2.5}[item]

    def buy(self, item: str, count: int = 1) -> str:
        """Buys an item.

        Args:
            item: what to buy
            count: how many
        """
        self.bought += count
        return f"bought {count} {item}"

    @staticmethod
    def hours() -> str:
        """The opening hours."""
        return "9 to 5"

    @classmethod
    def chain(cls) -> str:
        return "not a tool: a classmethod is no function of the class"

    @property
    def open(self) -> bool:
        return True

    def _stock(self) -> int:
        return 3

    def get_reward(self) -> float:
        return float(self.bought)


class Quiet:
    """No tools, no reward: reset only."""
    def reset(self, **row):
        return None


class NoDoc:
    def reset(self, **row):
        return None

    def act(self, x: int) -> int:
        return x


class NoHints:
    def reset(self, **row):
        return None

    def act(self, x):
        """Acts.

        Args:
            x: anything
        """
        return x


class NoReset:
    def act(self, x: int) -> int:
        """Acts.

        Args:
            x: anything
        """
        return x


class Texty:
    def reset(self, **row):
        return None

    def get_reward(self):
        return "great"


def broken():
    raise RuntimeError("no sandbox today")


def budget(amount: float) -> str:
    """A budget check.

    Args:
        amount: the money
    """
    return "ok"
'''


@pytest.fixture
def envs_file(tmp_path):
    path = tmp_path / "shop_env.py"
    path.write_text(ENVS)
    return path


def test_the_tools_are_the_public_methods_with_the_schemas_transformers_builds(envs_file):
    """TRL's rule (inspect.getmembers(type(env), isfunction) but reset, get_reward and _private):
    buy, hours (a staticmethod), price, by name, after the tools: functions; each schema is
    get_json_schema of the bound method, so the prompt reads as apply_chat_template(tools=[...])
    renders it on a template that declares tools."""
    from transformers.utils import get_json_schema
    cfg = Config(env=EnvSpec(name=f"{envs_file}:Shop"), tools=[f"{envs_file}:budget"])
    envs = environments.open_environments(cfg, None)
    shop = envs.pool[None][0]
    assert list(environments.tools_of(envs, shop)) == ["budget", "buy", "hours", "price"]
    methods = [getattr(shop, n) for n in ("buy", "hours", "price")]
    budget = envs.functions["budget"]
    assert envs.schemas[None] == [get_json_schema(f) for f in [budget, *methods]]
    tok = make_tokenizer((TEMPLATES / "hermes-style.jinja").read_text())
    question = [{"role": "user", "content": "What does tea cost?"}]
    assert episodes.render(tok, question, cfg, envs.schemas[None], first=True) == \
        tok.apply_chat_template(question, tools=[budget, *methods], add_generation_prompt=True,
                                tokenize=False)


def test_reset_gets_the_row_and_its_text_is_appended_to_the_last_user_message(envs_file):
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Tea?"}],
           "answer": "2.5", "environment": "shop"}
    cfg = Config(env=EnvSpec(name=f"{envs_file}:Shop"))
    tok = make_tokenizer()
    e, = episodes.open_episodes(cfg, tok, [row], 1)
    assert e.env.seen == row  # every column, TRL's reset(**x)
    assert e.messages[-1] == {"role": "user", "content": "Tea? (the shop is open)"}
    assert e.messages[0] == row["prompt"][0] and e.opening == 2
    keyed = Config(env=EnvSpec(names={"shop": f"{envs_file}:Shop"}))
    e, = episodes.open_episodes(keyed, tok, [row], 1)
    assert e.env.seen == {"prompt": row["prompt"], "answer": "2.5"}  # not `environment`


def test_each_rollout_has_its_own_instance_and_later_batches_reuse_them(envs_file):
    """TRL's pool: G x B instances for a batch, all distinct; the next batch resets the same ones;
    a batch that needs more builds more; the instance built at setup is the first."""
    cfg = Config(env=EnvSpec(name=f"{envs_file}:Shop"))
    envs = environments.open_environments(cfg, None)
    first = envs.pool[None][0]
    a = environments.draw(envs, [None] * 4)
    assert a[0] is first and len({id(x) for x in a}) == 4
    b = environments.draw(envs, [None] * 4)
    assert [id(x) for x in b] == [id(x) for x in a]
    c = environments.draw(envs, [None] * 6)
    assert c[:4] == a and len(envs.pool[None]) == 6
    tok = make_tokenizer()
    eps = episodes.open_episodes(cfg, tok, [{"prompt": "x", "n": 1}, {"prompt": "y", "n": 2}], 2,
                                 envs)
    assert [e.env.seen["n"] for e in eps] == [1, 1, 2, 2]  # each reset on its own row
    assert [e.env for e in eps] == c[:4]


def test_get_reward_is_one_more_reward_under_the_class_name_weighted_like_any(envs_file):
    specs = environments.with_env_rewards([RewardSpec("answer_match")], {None: "Shop"})
    assert specs[1] == RewardSpec("get_reward", weight=1.0, label="Shop",
                                  args={"env_class": "Shop"})
    listed = environments.with_env_rewards([RewardSpec("get_reward", weight=0.5)], {None: "Shop"})
    assert [(s.label, s.weight) for s in listed] == [("Shop", 0.5)]
    two = environments.with_env_rewards([], {"a": "Shop", "b": "Other", "c": "Shop"})
    assert [s.label for s in two] == ["Shop", "Other"]
    # a dict of environments: a rollout of another class gets None from Shop's get_reward
    cfg = Config(env=EnvSpec(names={"shop": f"{envs_file}:Shop", "quiet": f"{envs_file}:Quiet"}))
    environments.check_environment(cfg)
    assert [(s.name, s.label) for s in cfg.rewards] == [("get_reward", "Shop")]
    rows = [{"prompt": "x", "environment": "shop"}, {"prompt": "y", "environment": "quiet"}]
    eps = episodes.open_episodes(cfg, make_tokenizer(), rows, 1)
    eps[0].env.buy("tea", 3)
    res = scored(["a", "b"], rows, cfg.rewards, eps)
    assert res.per_reward["Shop"] == [3.0, None]


def test_a_trl_reward_that_takes_environments_gets_the_instances(envs_file, tmp_path):
    (tmp_path / "trl_rewards.py").write_text(
        "def bought(completions, environments, **kwargs):\n"
        "    return [float(e.bought) for e in environments]\n")
    cfg = Config(env=EnvSpec(name=f"{envs_file}:Shop"))
    eps = episodes.open_episodes(cfg, make_tokenizer(), [{"prompt": "x"}], 2)
    eps[1].env.buy("tea", 2)
    res = scored(["a", "b"], [{"prompt": "x"}] * 2,
                 [RewardSpec(f"{tmp_path / 'trl_rewards.py'}:bought")], eps)
    assert list(res.per_reward.values())[0] == [0.0, 2.0]


def test_a_tool_that_raises_is_answered_as_trl_answers_and_the_episode_goes_on(
        envs_file, tiny_llama, tmp_path, monkeypatch):
    from model import load_policy
    path = write_run_config(tmp_path, tiny_llama, rollout={
        "max_turns": 3, "max_episode_tokens": 200, "max_new_tokens": 64})
    raw = yaml.safe_load(path.read_text())
    raw["env"], raw["data"]["tools_prompt"] = {"name": f"{envs_file}:Shop"}, "Tools: price."
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    model, tok = load_policy(cfg.model, cfg.lora, torch.device("cpu"))
    coffee = '<tool_call>{"name": "price", "arguments": {"item": "coffee"}}</tool_call>'
    tea = '<tool_call>{"name": "price", "arguments": {"item": "tea"}}</tool_call>'
    monkeypatch.setattr(rollout, "generate_rollout", ScriptedTurns(tok, [[coffee], [tea], ["ok"]]))
    r = episodes.run_episodes(cfg, model, tok, [{"prompt": "Tea?", "answer": "1"}])
    for e in r.episodes:
        tools = [m["content"] for m in e.exchanged if m["role"] == "tool"]
        assert tools == ['{\'error\': "\'coffee\'"}', "2.5"]  # str(KeyError('coffee'))
        assert e.turns == 3 and (e.tool_calls, e.tool_errors) == (2, 1) and e.done


@pytest.mark.parametrize("env, says", [
    ({"name": "NoDoc"}, r"env: tool 'NoDoc.act': .*has no docstring"),
    ({"name": "NoHints"}, r"env: tool 'NoHints.act': .*missing a type hint"),
    ({"name": "broken"}, r"env: env '.*:broken': building it raised RuntimeError: no sandbox"),
    ({"name": "NoReset"}, r"built a NoReset, which has no reset method"),
    ({"names": {"shop": "Shop", "quiet": "Quiet"}},
     r"env.names: a row has environment='nope', which env.names does not name")])
def test_bad_environments_stop_the_run_with_one_line_and_exit_2(
        env, says, envs_file, tiny_llama, tmp_path, capsys):
    path = write_run_config(tmp_path, tiny_llama)
    raw = yaml.safe_load(path.read_text())
    raw["env"] = {k: f"{envs_file}:{v}" if k == "name" else {n: f"{envs_file}:{c}"
                                                             for n, c in v.items()}
                  for k, v in env.items()}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Tea?", "answer": "1", "environment": e}) + "\n"
                            for e in ("shop", "quiet", "nope")))
    raw["data"] = {"name": str(data)}
    path.write_text(yaml.safe_dump(raw))
    assert train.main(["--config", str(path), f"--run.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(says, err[0]), err


def test_a_get_reward_that_returns_no_number_stops_the_run_with_one_line_and_exit_2(
        envs_file, tiny_llama, tmp_path, capsys):
    path = write_run_config(tmp_path, tiny_llama)
    raw = yaml.safe_load(path.read_text())
    raw["env"], raw["rewards"] = {"name": f"{envs_file}:Texty"}, []
    path.write_text(yaml.safe_dump(raw))
    assert train.main(["--config", str(path), f"--run.out_dir={tmp_path / 'run'}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Texty.get_reward() returned 'great' (str); it must return a " \
        "number" in err[0]


def test_two_environments_by_row_see_only_their_own_tools(envs_file):
    cfg = Config(env=EnvSpec(names={"shop": f"{envs_file}:Shop", "quiet": f"{envs_file}:Quiet"}))
    rows = [{"prompt": "x", "environment": "quiet"}, {"prompt": "y", "environment": "shop"}]
    eps = episodes.open_episodes(cfg, make_tokenizer(), rows, 2)
    assert [type(e.env).__name__ for e in eps] == ["Quiet", "Quiet", "Shop", "Shop"]
    assert eps[0].schemas == [] and [s["function"]["name"] for s in eps[2].schemas] == \
        ["buy", "hours", "price"]
    with pytest.raises(ConfigError, match="environment='game'"):
        episodes.open_episodes(cfg, make_tokenizer(), [{"prompt": "z", "environment": "game"}], 1)


# ---------------------------------------------------------------- the docs page's environment


def docs_blocks() -> tuple[str, dict]:
    """docs/multi-turn.md's TRL environment (the python block opening `# guess_env.py`) and its
    minigrpo config (the yaml block opening `# guess.yaml`), as the page shows them."""
    text = (ROOT / "docs/multi-turn.md").read_text()
    code = next(b.split("```")[0] for b in text.split("```python\n")[1:]
                if b.startswith("# guess_env.py"))
    config = next(b.split("```")[0] for b in text.split("```yaml\n")[1:]
                  if b.startswith("# guess.yaml"))
    return code, yaml.safe_load(config)


def test_the_docs_page_s_trl_environment_trains_with_no_line_changed(
        tiny_llama, tmp_path, monkeypatch):
    """guess_env.py and guess.yaml as the page shows them, in a folder with the page's rows; only
    the model and the run's size are overridden. The model's turns are scripted (a tiny random
    model calls no tool): two guesses, the second drawn at random, so that groups differ."""
    from transformers import AutoTokenizer
    code, config = docs_blocks()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "guess_env.py").write_text(code)
    (tmp_path / "guess.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "guess.jsonl").write_text("".join(
        json.dumps({"prompt": "I am thinking of a number from 1 to 100.", "answer": n}) + "\n"
        for n in (37, 50, 64, 12)))
    guess = '<tool_call>{{"name": "guess", "arguments": {{"number": {}}}}}</tool_call>'
    turns = ScriptedTurns(AutoTokenizer.from_pretrained(tiny_llama),
                          [[guess.format(50), guess.format('"50"')],
                           [guess.format(n) for n in (37, 64, 12)], ["It is."]])
    monkeypatch.setattr(rollout, "generate_rollout", turns)
    run = tmp_path / "run"
    assert train.main(["--config", "guess.yaml", f"--model.name={tiny_llama}",
                       f"--run.out_dir={run}", "--run.steps=2", "--rollout.prompts_per_step=2",
                       "--rollout.num_generations=2", "--optim.micro_batch_size=4",
                       "--rollout.max_episode_tokens=180", "--data.tools_prompt=Tools: guess.",
                       "--run.save_every=0"]) == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and "rewards/GuessTheNumber/mean" in metrics[0]
    assert metrics[0]["episodes/tool_calls"] >= 2 and metrics[-1]["grad_norm"] > 0
    assert {m["rewards/GuessTheNumber/mean"] for m in metrics} != {0.0}
