"""bestofn.py: picking each prompt's best completion (SFT / RAFT data) and best-vs-worst pairs (DPO
data) from eval.py's predictions, then training on the picks."""
import json

import pytest
import yaml

import eval as ev
import train
from tools import bestofn


def rec(row, completion, reward, source=None, **more):
    return {"row": row, **({"source": source} if source else {}), "prompt": f"p{row}",
            "completion": completion, "reward": reward, **more}


def test_best_and_worst_per_prompt_with_bars_requirements_and_unscored_completions_left_out():
    records = [rec(0, "a", 0.5), rec(0, "b", 2.0), rec(0, "c", 2.0), rec(0, "x", None),
               rec(0, "y", 9.0, api_failed=True),
               rec(1, "d", 0.2), rec(1, "e", 0.2),  # a tie: no preference, and below the SFT bar
               # the same row of another source is another prompt
               rec(1, "f", 0.9, "other"), rec(1, "g", 0.1, "other")]
    sft, pairs = bestofn.select(records, min_reward=0.5)
    assert [(r["prompt"], r["completion"], r.get("source")) for r in sft] == \
        [("p0", "b", None), ("p1", "f", "other")]
    assert [(p["chosen"], p["rejected"], p["chosen_reward"], p["rejected_reward"])
            for p in pairs] == [("b", "a", 2.0, 0.5), ("f", "g", 0.9, 0.1)]
    # the bar holds for a pair's chosen as for an SFT row: f (0.9) is below 1
    assert [p["chosen"] for p in bestofn.select(records, min_reward=1.0)[1]] == ["b"]
    sft, pairs = bestofn.select(records, min_margin=1.6)
    # no SFT bar; margins 1.5 and 0.8
    assert [r["completion"] for r in sft] == ["b", "d", "f"] and pairs == []
    assert [p["chosen"] for p in bestofn.select(records, min_margin=1.5)[1]] == ["b"]
    # a requirement keeps a completion that misses it from being picked, but it can still be the
    # rejected one
    cut = [rec(0, "cut off", 2.0, truncated=True), rec(0, "whole", 1.0), rec(0, "weak", 0.0)]
    assert bestofn.select(cut)[0][0]["completion"] == "whole"  # a truncated reply is not a pick ...
    assert bestofn.select(cut, keep_truncated=True)[0][0]["completion"] == "cut off"
    assert bestofn.select(cut)[1][0]["rejected"] == "weak"
    think = [rec(0, "no think", 3.0, rewards={"think_format": 0.0}),
             rec(0, "think", 1.0, rewards={"think_format": 1.0}),
             rec(0, "weak think", 0.5, rewards={"think_format": 1.0})]
    sft, pairs = bestofn.select(think, require={"think_format": 1.0})
    assert sft[0]["completion"] == "think" \
        and (pairs[0]["chosen"], pairs[0]["rejected"]) == ("think", "weak think")
    assert bestofn.parse_require(["think_format=1", "a=0.5"]) == {"think_format": 1.0, "a": 0.5}
    kept = [rec(0, "a", 1.0, columns={"completion": "a column, not the pick", "id": "x"}),
            rec(0, "b", 0.0)]
    sft, pairs = bestofn.select(kept)
    assert sft[0]["completion"] == "a" \
        and sft[0]["columns"] == {"completion": "a column, not the pick", "id": "x"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        bestofn.parse_require(["think_format"])


def test_by_ranks_on_the_named_rewards_alone(tmp_path, capsys):
    """BioReasoner's pairs: the judge's logic + novelty decide, not the total's citation counts."""
    def r(c, total, **rw):
        return rec(0, c, total, rewards=rw)
    records = [r("many citations", 5.0, logic=1, novelty=2, cites=4),
               r("sound", 3.0, logic=5, novelty=4, cites=0),
               r("no think", 4.0, logic=2, novelty=0, cites=3),
               r("unjudged", 9.0, logic=None, novelty=2, cites=9)]
    sft, pairs = bestofn.select(records, by=["logic", "novelty"], min_reward=8.0)
    # the bar: the sum
    assert [(x["completion"], x["by_reward"], x["by"]) for x in sft] == \
        [("sound", 9.0, "logic+novelty")]
    # the total, as everywhere else: a DPO or SFT file's reward means one thing
    assert sft[0]["reward"] == 3.0
    assert (pairs[0]["chosen"], pairs[0]["rejected"], pairs[0]["rejected_by_reward"]) == \
        ("sound", "no think", 2.0)
    assert (pairs[0]["chosen_reward"], pairs[0]["rejected_reward"],
            pairs[0]["chosen_by_reward"]) == (3.0, 4.0, 9.0)
    assert bestofn.select(records)[0][0]["completion"] == "unjudged"  # by the total
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps(x) + "\n" for x in records))
    out = tmp_path / "pairs.jsonl"
    assert bestofn.main([str(preds), "--pairs", str(out), "--by", "logic+novelty"]) == 0
    assert json.loads(out.read_text())["chosen"] == "sound"
    assert "1 pairs from 1 prompts (mean logic+novelty of the kept 9.000)" \
        in capsys.readouterr().out
    assert bestofn.main([str(preds), "--sft", str(tmp_path / "sft_by.jsonl"), "--by",
                         "logic+novelty"]) == 0
    # by_reward, not the total (3.0)
    assert "mean logic+novelty of the kept 9.000" in capsys.readouterr().out
    assert bestofn.main([str(preds), "--pairs", str(tmp_path / "twice.jsonl"), "--by",
                         "logic+logic"]) == 2
    assert "--by logic+logic names a reward twice" in capsys.readouterr().err
    assert bestofn.main([str(preds), "--pairs", str(tmp_path / "x.jsonl"), "--by",
                         "logic+clarity"]) == 2
    assert ("--by clarity: no prediction has a reward of that name; they have: cites, logic, "
            "novelty") in capsys.readouterr().err


def test_bad_invocations_are_one_line_errors_and_write_nothing(tmp_path, capsys):
    preds = tmp_path / "predictions_x.jsonl"
    preds.write_text(json.dumps({"row": 0, "prompt": "p", "completion": "c", "reward": 1.0}) + "\n")
    out = tmp_path / "best.jsonl"
    for argv, message in [([str(preds)], "nothing to write"),
                          ([str(tmp_path / "nope.jsonl"), "--sft", str(out)], "no such file"),
                          ([str(preds), "--sft", str(preds)], "never overwritten"),
                          ([str(preds), "--pairs", str(out), "--require", "x"], "NAME=VALUE"),
                          ([str(preds), "--sft", str(out), "--pairs", str(out)],
                           "name the same file")]:
        assert bestofn.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and not out.exists()
    # a judge cache, say
    (tmp_path / "other.jsonl").write_text(json.dumps({"key": "k", "reply": "r"}) + "\n")
    assert bestofn.main([str(tmp_path / "other.jsonl"), "--sft", str(out)]) == 2
    assert "neither eval.py's predictions" in capsys.readouterr().err and not out.exists()


def test_sample_n_with_eval_then_pick_the_best_then_fine_tune_on_it(tmp_path, tiny_llama, capsys):
    """The rejection-sampling loop: eval.py samples n per prompt and scores them, bestofn keeps each
    prompt's best, train.py's SFT mode trains on those picks (whose rows lack the gold column the
    config's rewards read: SFT never scores its training rows), and its DPO mode on the pairs."""
    (tmp_path / "varied.py").write_text("def varied(completion, sample):\n"
                                        "    return float(len(set(completion)) % 3)\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name": str(tiny_llama), "gradient_checkpointing": False},
        "data": {"name": "arithmetic", "num_examples": 20, "select": [0, 10],
                 "assistant_prefix": "Sum:"},
        "rewards": [{"name": f"{tmp_path / 'varied.py'}:varied"},
                    {"name": "answer_match", "weight": 0.0}],
        "eval": {"select": [0, 4], "num_samples": 3, "temperature": 1.0, "max_new_tokens": 6,
                 "out_dir": str(tmp_path / "eval")},
        "run": {"steps": 1, "out_dir": str(tmp_path / "raft")}, "sft": {"batch_size": 2}}))
    assert ev.main(["--config", str(cfg), "--models", "base", "--data.select=null"]) == 0
    preds = [json.loads(ln)
             for ln in (tmp_path / "eval/predictions_base.jsonl").read_text().splitlines()]
    best, pairs = tmp_path / "best.jsonl", tmp_path / "pairs.jsonl"
    assert all(p["truncated"] for p in preds)  # a random model never stops within 6 tokens
    assert bestofn.main([str(tmp_path / "eval/predictions_base.jsonl"), "--sft", str(best),
                         "--pairs", str(pairs)]) == 1
    assert "nothing passed the bars for --sft and --pairs" in capsys.readouterr().err \
        and not best.exists()
    assert bestofn.main([str(tmp_path / "eval/predictions_base.jsonl"), "--sft", str(best),
                         "--pairs", str(pairs), "--keep-truncated"]) == 0
    assert "from 4 prompts" in capsys.readouterr().out
    picks = [json.loads(ln) for ln in best.read_text().splitlines()]
    assert len(picks) == 4 and all(p["assistant_prefix"] == "Sum:" for p in picks)
    for p in picks:
        same = [q["reward"] for q in preds if q["row"] == p["row"]]
        assert len(same) == 3 and p["reward"] == max(same)
    made = [json.loads(ln) for ln in pairs.read_text().splitlines()]
    assert made and all(p["chosen_reward"] > p["rejected_reward"] for p in made)
    # the forced prefix
    assert all(p["chosen"].startswith("Sum:") and p["rejected"].startswith("Sum:") for p in made)
    assert not any(p["completion"].startswith("Sum:") for p in picks)  # SFT puts it back itself
    assert train.main(["--config", str(cfg), "--mode=sft", f"--data.name={best}",
                       "--data.prompt=prompt", "--data.target=completion", "--data.answer_key=null",
                       "--data.select=null", "--data.num_examples=0", "--eval.select=null"]) == 0
    assert (tmp_path / "raft/metrics.jsonl").read_text()
    # DPO on the pairs: their replies carry the forced prefix, so the prompt must not add it again
    dpo = ["--config", str(cfg), "--mode=dpo", f"--data.name={pairs}", "--data.prompt=prompt",
           "--data.chosen=chosen", "--data.rejected=rejected", "--data.answer_key=null",
           "--data.select=null", "--data.num_examples=0",
           "--eval.select=null", "--dpo.batch_size=2", f"--run.out_dir={tmp_path / 'dpo'}"]
    capsys.readouterr()
    assert train.main(dpo) == 2
    assert "data.chosen starts with data.assistant_prefix 'Sum:'" in capsys.readouterr().err
    assert train.main(dpo + ["--data.assistant_prefix="]) == 0
    (m,) = [json.loads(ln) for ln in (tmp_path / "dpo/metrics.jsonl").read_text().splitlines()]
    assert abs(m["loss"] - 0.6931) < 1e-3 and m["tokens"] > 0


def test_a_reply_cut_inside_an_emoji_is_written_as_ascii_json(tmp_path):
    """An API reply may hold a lone surrogate (legal in JSON): written escaped, not a crash."""
    cut = "The answer " + chr(0xD83D)
    preds = tmp_path / "predictions_api.jsonl"
    preds.write_text("".join(json.dumps({"row": 0, "prompt": "p", "completion": c, "reward": r})
                             + "\n" for c, r in ((cut, 1.0), ("plain", 0.0))))
    assert bestofn.main([str(preds), "--sft", str(tmp_path / "sft.jsonl"), "--pairs",
                         str(tmp_path / "pairs.jsonl")]) == 0
    assert json.loads((tmp_path / "sft.jsonl").read_text())["completion"] == cut
    assert json.loads((tmp_path / "pairs.jsonl").read_text())["chosen"] == cut \
        and (tmp_path / "pairs.jsonl").read_bytes().isascii()


def test_odd_predictions_and_outputs_are_one_line_and_nothing_is_half_written(tmp_path, capsys):
    good = {"row": 0, "prompt": "p", "completion": "c", "reward": 1.0,
            "rewards": {"answer_match": 1.0}}
    cases = [([good, {**good, "reward": "high"}], [],
              "p.jsonl:2: the completion must be text and the reward a number"),
             ([good, {**good, "completion": None}], [], "p.jsonl:2: the completion must be text"),
             ([good, {"key": "k"}, good], [], "p.jsonl:2: neither eval.py's predictions"),
             ([good], ["--require", "nosuch=1"],
              "--require nosuch: no prediction has a reward of that name; they have: answer_match"),
             ([good, {**good, "completion": "d", "reward": 0.0}],
              ["--pairs", "/dev/null/pairs.jsonl"], "/dev/null is a file")]
    for recs, extra, message in cases:
        preds = tmp_path / "p.jsonl"
        preds.write_text("".join(json.dumps(r) + "\n" for r in recs))
        out = tmp_path / "sft.jsonl"
        assert bestofn.main([str(preds), "--sft", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and not out.exists(), err


def test_merge_keeps_one_pair_per_prompt_id_the_one_with_the_highest_delta(tmp_path, capsys):
    """BioReasoner's v2.2: two judges' pair sets, "35 unique pairs (deduplicated by prompt_id,
    highest delta)"."""
    def pair(pid, chosen, high, low, **more):
        return {"prompt_id": pid, "prompt": f"p{pid}", "chosen": chosen, "rejected": "r",
                "chosen_reward": high, "rejected_reward": low, **more}
    opus = [pair("a", "opus a", 9, 5), pair("b", "opus b", 6, 5),
            {"prompt_id": "x", "prompt": "px", "chosen": "exemplar", "rejected": "r"}]
    # ranked --by logic+novelty: its by-sums decide, not the totals
    codex = [pair("a", "codex a", 9, 8, chosen_by_reward=9, rejected_by_reward=2),
             pair("b", "codex b", 7, 5), pair("c", "codex c", 3, 1)]
    files = []
    for name, rows in (("opus", opus), ("codex", codex)):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "merged.jsonl"
    assert bestofn.main(["merge", *map(str, files), "--key", "prompt_id", "--out", str(out)]) == 0
    merged = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [(p["prompt_id"], p["chosen"]) for p in merged] == \
        [("a", "codex a"), ("b", "codex b"), ("x", "exemplar"), ("c", "codex c")]
    assert "4 unique pairs (deduplicated by prompt_id, highest delta) from 6 pairs in 2 files" \
        in capsys.readouterr().out
    # by the prompt's text when no key is given; equal deltas: the first file's
    again = tmp_path / "again.jsonl"
    assert bestofn.main(["merge", str(files[0]), str(files[0]), "--out", str(again)]) == 0
    assert [p["chosen"] for p in map(json.loads, again.read_text().splitlines())] == \
        ["opus a", "opus b", "exemplar"]
    for argv, message in [([str(files[0]), "--key", "pair_id", "--out", str(tmp_path / "n.jsonl")],
                           "opus.jsonl:1: no 'pair_id' to merge by"),
                          ([str(files[0]), "--out", str(out)], "never overwritten"),
                          ([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "n.jsonl")],
                           "no such file")]:
        assert bestofn.main(["merge", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "n.jsonl").exists()


def test_merge_by_prompt_id_takes_bestofns_own_pairs_which_keep_it_under_columns(tmp_path, capsys):
    """Two judges' samples of BioReasoner's prompts, eval.py's predictions with
    --eval.keep_columns=[prompt_id] (written under "columns"), paired by bestofn, then merged by
    prompt_id: the merge refused bestofn's own pairs ("no 'prompt_id' to merge by")."""
    def preds(name, scores):
        path = tmp_path / f"predictions_{name}.jsonl"
        path.write_text("".join(json.dumps(rec(row, f"{name} {row} {i}", s,
                                               columns={"prompt_id": f"bio-{row:03d}"})) + "\n"
                                for row, rewards in enumerate(scores)
                                for i, s in enumerate(rewards)))
        return path
    opus = preds("opus", [[4.0, 1.0], [3.0, 2.5]])
    codex = preds("codex", [[3.0, 2.0], [5.0, 1.0]])
    pairs = []
    for path in (opus, codex):
        pairs.append(tmp_path / f"pairs_{path.stem}.jsonl")
        assert bestofn.main([str(path), "--pairs", str(pairs[-1])]) == 0
    first = json.loads(pairs[0].read_text().splitlines()[0])
    assert "prompt_id" not in first and first["columns"] == {"prompt_id": "bio-000"}
    out = tmp_path / "dpo_v22_merged.jsonl"
    assert bestofn.main(["merge", *map(str, pairs), "--key", "prompt_id", "--out", str(out)]) == 0
    merged = [json.loads(ln) for ln in out.read_text().splitlines()]
    # bio-000: opus's delta 3 beats codex's 1; bio-001: codex's 4 beats opus's 0.5
    assert [(p["columns"]["prompt_id"], p["chosen"]) for p in merged] == \
        [("bio-000", "opus 0 0"), ("bio-001", "codex 1 0")]
    assert "2 unique pairs (deduplicated by prompt_id" in capsys.readouterr().out
    assert bestofn.main(["merge", str(pairs[0]), "--key", "pair_id",
                         "--out", str(tmp_path / "n.jsonl")]) == 2
    assert "under columns: prompt_id" in capsys.readouterr().err


def test_pairs_keep_the_seeds_auto_score_bar_as_sft_rows_do(tmp_path):
    """BioReasoner's v2.1 candidates: "REJECT: ... auto_score < 2.5". --min-reward was the SFT
    bar alone: a pair whose chosen reply was below it was kept (issue 46). Its candidates in
    eval.py's predictions shape, kept by prompt_id, their auto_score as the reward and among the
    rewards beside the judge's logic and novelty."""
    def cand(pid, text, auto, logic, novelty):
        return rec(int(pid[1:]), text, auto, columns={"prompt_id": pid},
                   rewards={"auto_score": auto, "logic": logic, "novelty": novelty,
                            "think_format": 1.0})
    preds = tmp_path / "generation_results.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in [
        cand("p1", "weak but novel", 2.0, 5, 5), cand("p1", "flat", 3.0, 1, 1),
        cand("p2", "strong", 3.5, 5, 4), cand("p2", "generic", 2.6, 2, 1),
        cand("p3", "weak", 2.2, 3, 3), cand("p3", "weaker", 1.0, 1, 1)]))

    def pairs(*flags):
        out = tmp_path / f"pairs{len(list(tmp_path.iterdir()))}.jsonl"
        assert bestofn.main([str(preds), "--pairs", str(out), *flags]) == 0
        return [(json.loads(ln)["columns"]["prompt_id"], json.loads(ln)["chosen"])
                for ln in out.read_text().splitlines()]
    # ranked by auto_score, the bar on the chosen: p3's best (2.2) is below it
    assert pairs("--min-reward", "2.5") == [("p1", "flat"), ("p2", "strong")]
    # the seed's pairing: the judge's logic + novelty rank, auto_score bars the chosen (p1's only
    # candidate over the bar ranks below the other: no preference left; p3 has none over it)
    assert pairs("--by", "logic+novelty+think_format", "--require", "auto_score=2.5",
                 "--min-margin", "2") == [("p2", "strong")]
    assert pairs("--by", "logic+novelty+think_format", "--min-margin", "2") == \
        [("p1", "weak but novel"), ("p2", "strong"), ("p3", "weak")]
