"""One-off check: minigrpo runs TRL 1.16's environment classes as TRL's own GRPOTrainer does. The
same classes (the calculator demo's Calculator, docs/multi-turn.md's GuessTheNumber, and a dict of
both keyed by the rows' `environment` column) go through TRL's trainer and through minigrpo, on a
tiny random Llama with TRL's own Qwen2.5 and Qwen3 chat templates, each model turn scripted (the
same replies on both sides). Compared, rollout by rollout: the tools and the schemas each prompt
renders, the prompt's tokens after reset, the episode's tokens after the prompt (the model's and
the tools'), which of them train (TRL's tool_mask, minigrpo's completion_mask), the tool messages
(results and errors), and the get_reward column with its name. TRL is no dependency of
minigrpo: this runs once, in a scratch environment that has it (on top of minigrpo's own).

    python -m venv /tmp/trlvenv
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
        > "$(echo /tmp/trlvenv/lib/python3.*/site-packages)/minigrpo.pth"
    /tmp/trlvenv/bin/pip install --no-deps trl==1.16.0
    /tmp/trlvenv/bin/python bench/trl_env_schema/compare.py > bench/trl_env_schema/compare.log
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import rollout  # noqa: E402
from config import Config, EnvSpec  # noqa: E402
from conftest import make_tokenizer  # noqa: E402
from engines import environments, episodes  # noqa: E402
from sources.plugins import import_function  # noqa: E402

G = 2
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
SCRIPT = {  # turn (tool rounds already in the context) -> the reply, for every rollout
    0: CALL.format("calculator", '{"expression": "1/0"}') + CALL.format("guess", '{"number": "50"}')
    + CALL.format("nope", "{}"),
    1: CALL.format("calculator", '{"expression": "215 * 860"}') + CALL.format(
        "guess", '{"number": 37}'),
    2: "It is 184900."}


def docs_env() -> Path:
    """docs/multi-turn.md's guess_env.py block, written out as the page shows it."""
    text = (ROOT / "docs/multi-turn.md").read_text()
    code = next(b.split("```")[0] for b in text.split("```python\n")[1:]
                if b.startswith("# guess_env.py"))
    path = Path(tempfile.mkdtemp()) / "guess_env.py"
    path.write_text(code)
    return path


def reply_ids(tok, context_ids: list[int]) -> list[int]:
    turn = tok.decode(context_ids).count("<|im_start|>user\n<tool_response>")  # tool rounds
    return tok(SCRIPT[min(turn, 2)] + "<|im_end|>", add_special_tokens=False).input_ids


def trl_side(tok, factory, rows: list[dict]) -> dict:
    """TRL's GRPOTrainer on the rows (each G times, as its sampler repeats them): one call of its
    _generate_and_score_completions, generation replaced by the script."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, vocab_size=len(tok),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=len(rows) * G, num_generations=G,
                      max_completion_length=4000, max_steps=1, logging_steps=1)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, environment_factory=factory)
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (
        [reply_ids(tok, p) for p in prompt_ids], None)
    out = trainer._generate_and_score_completions([r for r in rows for _ in range(G)])
    names = list(trainer.environment_factories)
    from transformers.utils import get_json_schema
    return {"schemas": {str(n): [get_json_schema(t) for t in trainer._env_tools[n]] for n in names},
            "prompt_ids": [[t for t, m in zip(p, pm) if m] for p, pm in
                           zip(out["prompt_ids"].tolist(), out["prompt_mask"].tolist())],
            "tool_messages": [[m["content"] for m in c if m["role"] == "tool"]
                              for c in trainer._logs["completion"]],
            "episode_ids": [[t for t, m in zip(c, cm) if m] for c, cm in
                            zip(out["completion_ids"].tolist(), out["completion_mask"].tolist())],
            "trained_mask": [[t for t, m in zip(tm, cm) if m] for tm, cm in
                             zip(out["tool_mask"].tolist(), out["completion_mask"].tolist())],
            "rewards": {k: [None if v != v else v for v in vals]
                        for k, vals in trainer._logs["rewards"].items()}}


def minigrpo_side(tok, env: EnvSpec, rows: list[dict]) -> dict:
    """minigrpo's episodes on the same rows, the same script standing in for HF generate."""
    from rewards import prepare_rewards
    cfg = Config(env=env)
    cfg.rollout.num_generations, cfg.rollout.max_turns = G, 8
    cfg.rollout.max_new_tokens, cfg.rollout.max_episode_tokens = 200, 4000

    def generate(model, tokenizer, prompts, n, max_new, *a, **k):
        ids, attn = prompts
        contexts = [row[m.bool()].tolist() for row, m in zip(ids, attn) for _ in range(n)]
        drawn = [reply_ids(tok, c) for c in contexts]
        C = max(map(len, drawn))
        return rollout.Rollout(
            ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0),
            torch.tensor([d + [tok.pad_token_id] * (C - len(d)) for d in drawn]),
            torch.tensor([[1.0] * len(d) + [0.0] * (C - len(d)) for d in drawn]),
            torch.zeros(len(drawn), dtype=torch.bool), [tok.decode(d) for d in drawn],
            entropy=torch.zeros(len(drawn), C))
    rollout.generate_rollout = generate
    envs = environments.open_environments(cfg, tok)
    environments.check_environment(cfg)
    model = torch.nn.Linear(1, 1)  # only its device is read: the script samples
    r = episodes.run_episodes(cfg, model, tok, rows, envs)
    samples = [row for row in rows for _ in range(G)]
    rewards = prepare_rewards(cfg.rewards, {}, ("num_tokens", "episode"))  # as a run's
    res = rewards([e.reply for e in r.episodes], samples, episodes=r.episodes)
    return {"schemas": {str(k): v for k, v in envs.schemas.items()
                        if k in envs.factories},
            "prompt_ids": [e.prompt_ids for e in r.episodes],
            "tool_messages": [[m["content"] for m in e.exchanged if m["role"] == "tool"]
                              for e in r.episodes],
            "episode_ids": [e.ids for e in r.episodes],
            "trained_mask": [e.mask for e in r.episodes],
            "rewards": res.per_reward}


def compare(label: str, trl: dict, mini: dict) -> bool:
    same = True
    for key in ("schemas", "prompt_ids", "episode_ids", "trained_mask", "tool_messages",
                "rewards"):
        ok = trl[key] == mini[key]
        same &= ok
        print(f"  {key:15s} {'same' if ok else 'DIFFERENT'}")
        if not ok or key in ("tool_messages", "rewards"):
            print(f"    TRL:      {json.dumps(trl[key])[:600]}")
            print(f"    minigrpo: {json.dumps(mini[key])[:600]}")
    print(f"{label}: {'all the same' if same else 'DIFFERENCES above'}\n")
    return same


def main() -> int:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    warnings.filterwarnings("ignore")  # TRL's and transformers' notes on a tiny random model
    import transformers
    import trl
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}\n")
    guess = docs_env()
    calc_name, guess_name = "configs/tools_calculator.py:Calculator", f"{guess}:GuessTheNumber"
    calc, guess_cls = import_function(calc_name), import_function(guess_name)
    rows = [{"prompt": [{"role": "user", "content": "What is 215 * 860?"}], "answer": "184900"},
            {"prompt": [{"role": "user", "content": "Guess my number."}], "answer": "37"}]
    keyed = [{**r, "environment": e} for r, e in zip(rows, ("calc", "guess"))]
    cases = [("Calculator", calc, EnvSpec(name=calc_name), rows[:1]),
             ("GuessTheNumber", guess_cls, EnvSpec(name=guess_name), rows[1:]),
             ("dict {calc, guess}", {"calc": calc, "guess": guess_cls},
              EnvSpec(names={"calc": calc_name, "guess": guess_name}), keyed)]
    from trl.chat_template_utils import qwen2_5_chat_template, qwen3_chat_template
    same = True
    for template_name, template in (("qwen2_5", qwen2_5_chat_template),
                                    ("qwen3", qwen3_chat_template)):
        for label, factory, spec, case_rows in cases:
            tok = make_tokenizer(template)
            print(f"== {label}, TRL's {template_name} chat template")
            trl_out = trl_side(tok, factory, case_rows)
            if spec.name:  # TRL keys one factory None
                trl_out["schemas"] = {"None": trl_out["schemas"]["None"]}
            same &= compare(f"{label} ({template_name})", trl_out,
                            minigrpo_side(make_tokenizer(template), spec, case_rows))
    print("ALL THE SAME" if same else "SOME DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
