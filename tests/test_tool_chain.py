"""The tools read each other's output (issue 56): the rating page's exports (/api/export and
/export?format=json: one JSON list; /export: JSON Lines; ?format=parquet) feed tools.bestofn, whose
picks are eval.py's data, whose predictions bestofn pairs, whose pair sets (JSON Lines or a JSON
list) `bestofn merge` joins, on which train.py's DPO mode trains, and eval.py scores that run on the
page's JSON export. Every text file goes through one reader, files/jsonl.load."""
import json

import pytest
import yaml

import eval as ev
import train
from files import jsonl
from rating_client import queue
from tools import bestofn

CRITERIA = ["relevance", "clarity"]
RATED = [("Ask about Go.", "What is a goroutine?", (5, 4)), ("Ask about Go.", "Hi.", (1, 2)),
         ("Ask about SQL.", "What does an index cost?", (4, 4)), ("Ask about SQL.", "Why?", (2, 1))]


def exports(client, folder, tmp_path) -> dict:
    """The page's four downloads of the same rated replies, saved as a browser saves them."""
    for i, (prompt, reply, _) in enumerate(RATED):
        queue(folder, f"i{i}", 1, prompt, reply, CRITERIA)
    body = {"ratings": [{"id": f"i{i}", "scores": dict(zip(CRITERIA, s))}
                        for i, (_, _, s) in enumerate(RATED)]}
    assert client.post("/api/rate", content=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"}).status_code == 200
    out = {}
    for name, url in (("api.json", "/api/export"), ("list.json", "/export?format=json"),
                      ("rated.jsonl", "/export"), ("rated.parquet", "/export?format=parquet")):
        out[name] = tmp_path / name
        out[name].write_bytes(client.get(url).content)
    assert not out["api.json"].read_text().endswith("\n")  # one line, no newline: not "unfinished"
    return out


def lines(path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_rating_pages_exports_feed_bestofn_eval_merge_dpo_and_eval_again(page, tmp_path,
                                                                             tiny_llama, capsys):
    client, folder = page
    files = exports(client, folder, tmp_path)
    made = {}
    for name, path in files.items():  # bestofn said "no predictions" for the JSON list (issue 56)
        made[name] = (tmp_path / f"pairs_{name}.jsonl", tmp_path / f"best_{name}.jsonl")
        assert bestofn.main([str(path), "--pairs", str(made[name][0]),
                             "--sft", str(made[name][1])]) == 0, capsys.readouterr().err
    texts = {name: (p.read_text(), s.read_text()) for name, (p, s) in made.items()}
    assert len(set(texts.values())) == 1  # the same pairs and picks from every format
    pairs, best = made["api.json"]
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in lines(pairs)] == [
        ("Ask about Go.", "What is a goroutine?", "Hi."),
        ("Ask about SQL.", "What does an index cost?", "Why?")]

    # eval.py samples on bestofn's picks (its data), keeping their reward as a column
    (tmp_path / "varied.py").write_text("def varied(completion, sample):\n"
                                        "    return float(len(set(completion)) % 3)\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name": str(tiny_llama), "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"name": str(best), "prompt": "{prompt}", "answer_key": None, "select": None},
        "rewards": [{"name": f"{tmp_path / 'varied.py'}:varied"}],
        "eval": {"select": None, "num_samples": 3, "temperature": 1.0, "max_new_tokens": 6,
                 "keep_columns": ["reward"], "out_dir": str(tmp_path / "eval")},
        "run": {"steps": 1, "out_dir": str(tmp_path / "dpo")}, "dpo": {"batch_size": 2}}))
    assert ev.main(["--config", str(cfg), "--models", "base", f"--eval.name={best}"]) == 0
    sampled = tmp_path / "eval_pairs.jsonl"
    assert bestofn.main([str(tmp_path / "eval/predictions_base.jsonl"), "--pairs", str(sampled),
                         "--keep-truncated"]) == 0
    assert {p["prompt"] for p in lines(sampled)} <= {"Ask about Go.", "Ask about SQL."}
    assert all(p["columns"]["reward"] > 0.5 for p in lines(sampled))  # the picks' rated reward

    # merge reads bestofn's JSON Lines and a pair set saved as one JSON list
    as_list = tmp_path / "rated_pairs.json"
    as_list.write_text(json.dumps(lines(pairs)))
    merged = tmp_path / "merged.jsonl"
    assert bestofn.main(["merge", str(as_list), str(sampled), "--out", str(merged)]) == 0
    assert sorted(p["prompt"] for p in lines(merged)) == ["Ask about Go.", "Ask about SQL."]

    # DPO trains on the merge, and eval.py scores that run on the page's JSON export as its data
    assert train.main(["--config", str(cfg), "--mode=dpo", f"--data.name={merged}",
                       "--data.prompt=prompt", "--data.chosen=chosen",
                       "--data.rejected=rejected"]) == 0
    assert len(lines(tmp_path / "dpo/metrics.jsonl")) == 1
    assert ev.main(["--config", str(cfg), "--models", "base", f"dpo={tmp_path / 'dpo'}",
                    f"--eval.name={files['api.json']}", "--eval.num_samples=1",
                    "--eval.keep_columns=[scores]", f"--eval.out_dir={tmp_path / 'eval2'}"]) == 0
    preds = lines(tmp_path / "eval2/predictions_dpo.jsonl")
    assert [p["prompt"] for p in preds] == [prompt for prompt, _, _ in RATED]


def test_a_json_list_that_does_not_parse_is_one_line_naming_the_file_never_no_predictions(
        tmp_path, capsys):
    """A JSON list cut short (a download stopped) was read as an unfinished last line: "no
    predictions". Every reader now says where it broke."""
    cut = tmp_path / "rated.json"
    cut.write_text('[{"prompt": "p", "completion": "a", "scores": {}, "reward": 1.0}, {"pro')
    assert bestofn.main([str(cut), "--pairs", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cut}: not valid JSON (") and "no predictions" not in err
    assert bestofn.main(["merge", str(cut), "--out", str(tmp_path / "m.jsonl")]) == 2
    assert f"{cut}: not valid JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"rated.jsonl:2: not valid JSON"):
        jsonl.parse('{"a": 1}\n{"a": \n', "rated.jsonl")
    from config import DataConfig
    from data import DataError, load_raw
    with pytest.raises(DataError, match="not valid JSON"):
        load_raw(DataConfig(name=str(cut)))
