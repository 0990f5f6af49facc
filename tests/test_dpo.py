"""DPO (mode: dpo): the loss against the obvious formula, pairs kept whole across micro-batches, a
gradient that does not depend on the split, log 2 at the first step (the reference is the model
DPO starts from, SFT merged in), learning to prefer the chosen replies, and bad input refused."""
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

import logprobs
import rollout
import train
from config import ConfigError, DataConfig, load_config
from data import DataError, load_rows
from modes.dpo import dpo_loss
from run import lifecycle

# "" is a reply too
NO = ["I do not know, sorry.", "No.", "",
      "Maybe a large number; I cannot say for sure which one it is."]
PAIRS = [{"question": f"What is {a} + {b}?", "chosen": f"The answer is {a + b}.",
          "rejected": NO[(a + 2 * b) % 4]} for a in range(5) for b in range(4)]


def slow_dpo_loss(pc, pr, rc, rr, beta):
    """-log sigmoid(beta (pc - rc) - beta (pr - rr)) for one pair, in plain floats."""
    margin = beta * (pc - rc) - beta * (pr - rr)
    return -math.log(1 / (1 + math.exp(-margin)))


def test_dpo_loss_matches_the_formula_and_is_log2_when_policy_is_reference():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(16, generator=g, dtype=torch.float64) * 20 - 40 for _ in range(4))
    for beta in (0.1, 0.5):
        loss, r_w, r_l = dpo_loss(pc, pr, rc, rr, beta)
        want = [slow_dpo_loss(*(float(t[i]) for t in (pc, pr, rc, rr)), beta) for i in range(16)]
        assert torch.allclose(loss, torch.tensor(want, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(r_w, beta * (pc - rc)) and torch.allclose(r_l, beta * (pr - rr))
    loss, r_w, r_l = dpo_loss(pc, pr, pc, pr, 0.1)  # policy == reference
    assert torch.allclose(loss, torch.full_like(loss, math.log(2))) \
        and not r_w.any() and not r_l.any()
    # a huge margin is a loss of 0, not NaN (logsigmoid, not log(sigmoid))
    big = torch.tensor([1000.0])
    assert dpo_loss(big, -big, big * 0, big * 0, 1.0)[0].item() == 0.0
    assert dpo_loss(-big, big, big * 0, big * 0, 1.0)[0].item() == pytest.approx(2000.0)


def slow_variant_loss(pc, pr, rc, rr, beta, loss_type, eps=0.0, lw=1, ll=1):
    """The other losses for one pair in plain floats: cDPO, IPO on per-token means, hinge."""
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        return -(1 - eps) * math.log(1 / (1 + math.exp(-beta * h))) \
            - eps * math.log(1 / (1 + math.exp(beta * h)))
    if loss_type == "ipo":
        return ((pc - rc) / lw - (pr - rr) / ll - 1 / (2 * beta)) ** 2
    return max(0.0, 1 - beta * h)


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0)])
def test_the_other_losses_match_their_formulas(loss_type, eps):
    g = torch.Generator().manual_seed(1)
    pc, pr, rc, rr = (torch.randn(16, generator=g, dtype=torch.float64) * 3 - 40 for _ in range(4))
    lw, ll = (torch.randint(1, 30, (16,), generator=g) for _ in range(2))
    for beta in (0.1, 0.5):
        loss, r_w, r_l = dpo_loss(pc, pr, rc, rr, beta, loss_type, eps, (lw, ll))
        want = [slow_variant_loss(*(float(t[i]) for t in (pc, pr, rc, rr)), beta, loss_type, eps,
                                  int(lw[i]), int(ll[i])) for i in range(16)]
        assert torch.allclose(loss, torch.tensor(want, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(r_w, beta * (pc - rc)) and torch.allclose(r_l, beta * (pr - rr))
    # policy == reference
    at_start = {"sigmoid": math.log(2), "ipo": (1 / (2 * 0.5)) ** 2, "hinge": 1.0}[loss_type]
    assert torch.allclose(dpo_loss(pc, pr, pc, pr, 0.5, loss_type, eps, (lw, ll))[0],
                          torch.full((16,), at_start, dtype=torch.float64))
    with pytest.raises(ValueError, match="token counts" if loss_type == "ipo" else "loss_type"):
        dpo_loss(pc, pr, rc, rr, 0.5, loss_type if loss_type == "ipo" else "robust")


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "sigmoid"])
def test_each_loss_type_learns_the_preference_through_train_py(dpo_config, loss_type):
    path, cfg = dpo_config
    extra = ["--dpo.label_smoothing=0.1"] if loss_type == "sigmoid" else []
    assert train.main(["--config", str(path), f"--dpo.loss_type={loss_type}", *extra]) == 0
    m = metrics(Path(cfg["run"]["out_dir"]))
    assert m[-1]["loss"] < m[0]["loss"] \
        and all(x["rewards/accuracies"] == 1.0 for x in m[-3:]), [x["loss"] for x in m]


def test_micro_batches_cut_only_between_whole_pairs():
    p_len, c_len = [3, 3, 2, 2, 5, 5, 1, 1, 4, 9], [4, 1, 2, 6, 3, 3, 2, 2, 1, 1]  # 5 pairs
    n = len(p_len)
    mask = lambda lens, w: (torch.arange(w)[None]  # noqa: E731
                            < torch.tensor(lens)[:, None]).long()
    batch = rollout.Rollout(torch.zeros(n, 9, dtype=torch.long), mask(p_len, 9),
                            torch.zeros(n, 6, dtype=torch.long),
                            mask(c_len, 6).float(), torch.zeros(n, dtype=torch.bool), [""] * n)
    for size in (1, 2, 3, 4, 7, 10):
        for budget in (0, 1, 12, 20, 40, 1000):
            mbs = logprobs.micro_batches(batch, size, budget, group=2)
            # every row once, in order
            assert [i for mb in mbs for i in range(n)[mb]] == list(range(n))
            assert all(mb.start % 2 == 0 and (mb.stop - mb.start) % 2 == 0
                       for mb in mbs), (size, budget, mbs)
            assert all(mb.stop - mb.start <= max(size // 2, 1) * 2 for mb in mbs)
            for mb in mbs:  # within the budget, unless a single pair is over it on its own
                rows = range(n)[mb]
                padded = len(rows) * (max(p_len[i] for i in rows) + max(c_len[i] for i in rows))
                assert not budget or padded <= budget or len(rows) == 2
    # group 1: as before
    assert logprobs.micro_batches(batch, 3, 0) == [slice(0, 3), slice(3, 6), slice(6, 9),
                                                  slice(9, 10)]


@pytest.fixture
def dpo_config(tmp_path, tiny_llama):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    cfg = {"mode": "dpo", "model": {"name": str(tiny_llama)}, "lora": {"r": 8, "alpha": 16},
           "data": {"name": str(data), "prompt": "question", "chosen": "chosen",
                    "rejected": "rejected",
                    "answer_key": None, "split_seed": 42, "select": [0, 16]},
           "dpo": {"batch_size": 8, "beta": 0.5},
           # GRPO's sampling temperature: DPO's log-probs must not use it
           "rollout": {"temperature": 0.7},
           "optim": {"lr": 0.02, "micro_batch_size": 4, "min_lr_ratio": 1.0, "warmup_steps": 0},
           "eval": {"select": [16, 20]},
           "run": {"out_dir": str(tmp_path / "dpo"), "steps": 8, "save_every": 0}}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_dpo_learns_to_prefer_the_chosen_replies_from_log2(dpo_config):
    path, cfg = dpo_config
    assert train.main(["--config", str(path), "--run.eval_every=8"]) == 0
    m = metrics(Path(cfg["run"]["out_dir"]))
    assert len(m) == 8
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) \
        and m[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert m[0]["rewards/accuracies"] == 0  # a tie is not a win (TRL counts r_w > r_l)
    last = m[-3:]  # a high lr: steps are noisy
    assert sum(x["loss"] for x in last) / 3 < 0.3 \
        and sum(x["rewards/margins"] for x in last) / 3 > 1.0
    assert all(x["rewards/accuracies"] == 1.0 for x in last)
    # held-out pairs (16..20)
    assert m[-1]["eval/rewards/accuracies"] == 1.0 and m[-1]["eval/loss"] < math.log(2)
    saved = load_config(Path(cfg["run"]["out_dir"]) / "config.yaml")
    assert saved.mode == "dpo" and saved.data.chosen == "chosen"


def test_the_reference_is_computed_once_a_run_and_read_back_after(dpo_config, monkeypatch):
    """dpo.cache_reference: the second and third passes over the 16 pairs run no reference forward,
    and train exactly as without the cache (the reference never changes)."""
    from modes import dpo
    path, cfg = dpo_config
    calls = []
    original = dpo.reference_mode
    monkeypatch.setattr(dpo, "reference_mode", lambda *a: calls.append(1) or original(*a))
    runs = {}
    for cache in ("true", "false"):
        calls.clear()
        out = Path(cfg["run"]["out_dir"] + cache)
        assert train.main(["--config", str(path), "--run.steps=6", f"--dpo.cache_reference={cache}",
                           f"--run.out_dir={out}"]) == 0  # 6 steps x 8 pairs: 3 passes over 16
        runs[cache] = (metrics(out), len(calls))
    (cached, n_cached), (plain, n_plain) = runs["true"], runs["false"]
    # 4 micro-batches of 2 pairs a step; the first pass only
    assert n_plain == 6 * 4 and n_cached == 2 * 4
    for a, b in zip(cached, plain):
        for k in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def grads_of_one_step(path, *overrides):
    """The gradient dpo_step computes (its optimizer step swapped for a capture)."""
    args, rest = train.parse_args(["--config", str(path), *overrides])
    r = lifecycle.setup(args, rest)
    got = {}

    def capture(run):
        got["grads"] = [p.grad.clone() for p in run.params]
        return 0.0, 0.0
    from modes import dpo
    original, dpo.optimizer_step = dpo.optimizer_step, capture
    try:
        m, _ = dpo.dpo_step(r)
    finally:
        dpo.optimizer_step = original
    return got["grads"], m


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "cdpo"])
def test_dpo_gradient_does_not_depend_on_the_micro_batch_split(dpo_config, loss):
    """The loss couples a pair's two replies (and, for IPO, their token counts): micro-batches of 2
    rows (one pair), 8 and a token budget all give the full batch's gradient, for every loss type.
    Full fine-tuning, so that it is not zero at the first step (LoRA's B starts at 0), with a frozen
    reference copy."""
    path, _ = dpo_config
    base = ["--lora.enabled=false", "--run.eval_every=0",
            *(["--dpo.label_smoothing=0.2"] if loss == "cdpo" else [f"--dpo.loss_type={loss}"])]
    want, m = grads_of_one_step(path, *base, "--optim.micro_batch_size=16")
    # the copy is the policy before its update
    first = {"ipo": (1 / (2 * 0.5)) ** 2, "hinge": 1.0}.get(loss, math.log(2))
    assert m["loss"] == pytest.approx(first, abs=1e-5)
    assert sum(float(g.abs().sum()) for g in want) > 0
    for split in (["--optim.micro_batch_size=2"], ["--optim.micro_batch_size=1"],
                  ["--optim.micro_batch_tokens=60"]):
        got, m2 = grads_of_one_step(path, *base, "--optim.micro_batch_size=16", *split)
        for k in ("loss", "logps/chosen", "logps/rejected", "tokens"):
            # over the whole step, not one micro-batch
            assert m2[k] == pytest.approx(m[k], rel=1e-5, abs=1e-6), k
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def plain_reply_log_prob(model, tok, prompt: str, reply: str) -> float:
    """log pi(reply + EOS | prompt) by one unpadded forward and a full log-softmax, the obvious
    way."""
    p = tok(prompt, add_special_tokens=False).input_ids
    ids = torch.tensor([p + tok(reply + tok.eos_token, add_special_tokens=False).input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(
            -1, ids[0, 1:, None])[:, 0]
    return float(logp[len(p) - 1:].sum())


def test_held_out_metrics_match_a_plain_forward_of_the_policy_and_reference(dpo_config):
    """After one update (full fine-tuning: the reference is a frozen copy), eval/* on the held-out
    pairs equal the DPO formulas over plain forwards of prompt + reply + EOS at temperature 1:
    padding, the prompt and the sampling temperature (0.7 in this config) left out, EOS counted."""
    import rollout as ro
    from modes import dpo
    path, _ = dpo_config
    r = lifecycle.setup(*train.parse_args(["--config", str(path), "--lora.enabled=false",
                                      "--optim.lr=1e-3",
                                       "--run.eval_every=1", "--optim.micro_batch_size=4"]))
    dpo.dpo_step(r)
    got = dpo.held_out_metrics(r)
    beta, pc, pr, rc, rr = 0.5, [], [], [], []
    for row in r.eval_rows:
        prompt = ro.render_rows(r.tokenizer, [row], r.cfg.data)[0]
        pc.append(plain_reply_log_prob(r.model, r.tokenizer, prompt, row["chosen"]))
        pr.append(plain_reply_log_prob(r.model, r.tokenizer, prompt, row["rejected"]))
        rc.append(plain_reply_log_prob(r.ref_copy, r.tokenizer, prompt, row["chosen"]))
        rr.append(plain_reply_log_prob(r.ref_copy, r.tokenizer, prompt, row["rejected"]))
    losses = [slow_dpo_loss(*v, beta) for v in zip(pc, pr, rc, rr)]
    margins = [beta * (a - c) - beta * (b - d) for a, b, c, d in zip(pc, pr, rc, rr)]
    # the update moved every pair
    assert len(r.eval_rows) == 4 and min(abs(x) for x in margins) > 1e-4
    want = {"eval/loss": sum(losses) / 4, "eval/logps/chosen": sum(pc) / 4,
            "eval/logps/rejected": sum(pr) / 4, "eval/rewards/margins": sum(margins) / 4,
            "eval/rewards/accuracies": sum(x > 0 for x in margins) / 4,
            "eval/rewards/chosen": beta * (sum(pc) - sum(rc)) / 4}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    n_tokens = [len(r.tokenizer(row[k] + r.tokenizer.eos_token, add_special_tokens=False).input_ids)
                for row in r.eval_rows for k in ("chosen", "rejected")]  # each reply and its EOS
    r.cfg.dpo.loss_type = "ipo"  # IPO divides by those counts
    ipo = [slow_variant_loss(a, b, c, d, beta, "ipo", 0.0, n_tokens[2 * i], n_tokens[2 * i + 1])
           for i, (a, b, c, d) in enumerate(zip(pc, pr, rc, rr))]
    assert dpo.held_out_metrics(r)["eval/loss"] == pytest.approx(sum(ipo) / 4, rel=1e-4)


def test_the_reference_is_the_sft_model_merged_in(dpo_config, tmp_path):
    """DPO after SFT: model.init_adapter is merged and a fresh LoRA trained on top, so the reference
    (adapter off) is the SFT model and the first loss is log 2; continuing the SFT adapter itself
    would make the reference the base, which is refused."""
    path, cfg = dpo_config
    sft_dir = tmp_path / "sft"
    assert train.main(["--config", str(path), "--mode=sft", "--data.target=chosen",
                       "--data.chosen=null", "--data.rejected=null", "--run.steps=2",
                       "--run.eval_every=0", f"--run.out_dir={sft_dir}", "--optim.lr=0.05"]) == 0
    out = tmp_path / "dpo_after_sft"
    assert train.main(["--config", str(path), f"--model.init_adapter={sft_dir}",
                       "--model.merge_init_adapter=true",
                       "--run.steps=1", f"--run.out_dir={out}"]) == 0
    m = metrics(out)
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    with pytest.raises(ConfigError, match="dpo.beta > 0 with a continued model.init_adapter"):
        lifecycle.setup(*train.parse_args(["--config", str(path), f"--model.init_adapter={sft_dir}",
                                       f"--run.out_dir={tmp_path / 'x'}"]))


def test_bad_dpo_input_is_refused_with_the_key_named(dpo_config, tmp_path, capsys):
    path, cfg = dpo_config
    assert train.main(["--config", str(path), "--data.rejected=null"]) == 2
    assert "data.chosen over data.rejected" in capsys.readouterr().err
    assert train.main(["--config", str(path), "--dpo.max_length=12"]) == 2
    assert "dpo.max_length=12" in capsys.readouterr().err
    long = tmp_path / "long.jsonl"  # only the rejected reply is too long
    long.write_text(json.dumps({"question": "Hi?", "chosen": "Hello.", "rejected": "no " * 40})
                    + "\n")
    assert train.main(["--config", str(path), f"--data.name={long}", "--data.select=null",
                       "--eval.select=null", "--dpo.max_length=30"]) == 2
    assert "row 0 renders to" in capsys.readouterr().err
    # SFT's reply column, left set
    assert train.main(["--config", str(path), "--data.target=chosen"]) == 2
    assert "set data.target: null" in capsys.readouterr().err
    assert train.main(["--config", str(path), "--mode=sft", "--data.target=chosen"]) == 2
    assert "mode: sft does not read them" in capsys.readouterr().err
    assert train.main(["--config", str(path), "--dpo.beta=0"]) == 2
    assert "dpo.beta must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "dpo").exists()  # nothing written
    with pytest.raises(DataError, match="data.chosen starts with data.assistant_prefix 'The'"):
        load_rows(DataConfig(name=cfg["data"]["name"], prompt="question", chosen="{chosen}",
                             rejected="rejected", answer_key=None, assistant_prefix="The"))
    with pytest.raises(DataError, match="data.rejected starts with data.assistant_prefix 'No'"):
        load_rows(DataConfig(name=cfg["data"]["name"], prompt="question", chosen="chosen",
                             rejected="rejected",
                             answer_key=None, assistant_prefix="No", select=[4, 5]))  # 1 + 0: "No."
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"prompt": [{"role": "user", "content": "Hi"}],
                    "chosen": [{"role": "assistant", "content": "Hello!"}],
                    "rejected": [{"role": "user", "content": "?"}]}) + "\n")
    with pytest.raises(DataError, match="data.rejected=rejected holds a list"):
        load_rows(DataConfig(name=str(tmp_path / "chat.jsonl"), chosen="chosen",
                             rejected="rejected", answer_key=None))


def test_a_mixture_of_pair_files_logs_each_sources_share(dpo_config, tmp_path):
    path, cfg = dpo_config
    for name, rows in (("easy", PAIRS[:10]), ("hard", PAIRS[10:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = json.dumps([{"name": str(tmp_path / "easy.jsonl"), "weight": 3},
                      {"name": str(tmp_path / "hard.jsonl")}])
    assert train.main(["--config", str(path), "--data.name=null", f"--data.mixture={mix}",
                       "--data.select=null", "--data.split_seed=null", "--eval.select=null",
                       "--run.steps=3", "--dpo.batch_size=4"]) == 0
    m = metrics(Path(cfg["run"]["out_dir"]))
    assert all(x["data/easy"] + x["data/hard"] == pytest.approx(1.0) for x in m)
    assert sum(x["data/easy"] for x in m) > sum(x["data/hard"] for x in m)  # drawn 3 to 1


def test_conversational_pairs_and_the_dry_run(dpo_config, tmp_path, capsys):
    """TRL's conversational preference rows: prompt messages, chosen and rejected as assistant
    turns."""
    path, _ = dpo_config
    row = {"prompt": [{"role": "user", "content": "Hi"}],
           "chosen": [{"role": "assistant", "content": "Hello!"}],
           "rejected": [{"role": "assistant", "content": "Go away."}]}
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(row) + "\n")
    (got,) = load_rows(DataConfig(name=str(data), chosen="chosen", rejected="rejected",
                                  answer_key=None))
    assert (got["prompt"], got["chosen"], got["rejected"]) == (row["prompt"], "Hello!", "Go away.")
    # prompt inside
    implicit = {"chosen": row["prompt"] + row["chosen"],
                "rejected": row["prompt"] + row["rejected"]}
    data.write_text(json.dumps(implicit) + "\n")
    (got,) = load_rows(DataConfig(name=str(data), prompt="chosen", chosen="chosen",
                                  rejected="rejected", answer_key=None))
    assert (got["prompt"], got["chosen"], got["rejected"]) == (row["prompt"], "Hello!", "Go away.")
    assert train.main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(dpo)" in out and "chosen reply:\nThe answer is" in out \
        and "rejected reply:\nNo.<|im_end|>" in out
