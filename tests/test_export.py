"""export.py on a tiny random Llama: the merged model reloads with plain transformers and gives the
adapter model's logits; bad input exits 2 and writes nothing; the hub token stays secret."""
import json
import shutil

import pytest
import torch
import yaml

from config import ModelConfig
from model import load_base
from sources.adapters import PROVENANCE, save_adapter
from tools import export

PROMPT = "What is 2 + 3? Reply with just the number."


def error_line(err: str) -> str:
    """The one `error: ...` line, which must end stderr (loading progress bars may precede it)."""
    errors = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    return errors[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama):
    return trained_run(tmp_path_factory.mktemp("export"), tiny_llama)


def trained_run(root, tiny_llama) -> dict:
    """A run directory holding one checkpoint whose LoRA adapter has random, nonzero weights,
    plus the logits of that adapter model and of the bare base on PROMPT."""
    from peft import LoraConfig, get_peft_model
    base, tok = load_base(ModelConfig(name=str(tiny_llama)), torch.device("cpu"))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        base_logits = base(ids).logits
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would make the merge a no-op
            p.data = 0.1 * torch.randn_like(p)
    with torch.no_grad():
        adapter_logits = model(ids).logits
    model.minigrpo_base = {"base_model": str(tiny_llama), "revision": None, "merged": []}
    ckpt = root / "run/checkpoints/step_000007"
    save_adapter(model, ckpt / "adapter")
    cfg = {"model": {"name": str(tiny_llama)}, "rewards": [{"name": "answer_match", "weight": 2.0}]}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    (ckpt / "config.yaml").write_text(yaml.safe_dump({**cfg, "run": {"steps": 7},
                                                      "data": {"system_prompt": "Be brief."}}))
    return dict(root=root, run=root / "run", config=root / "cfg.yaml", ids=ids, tok=tok,
                base_logits=base_logits, adapter_logits=adapter_logits)


def run_export(t, out, *extra):
    return export.main(["--config", str(t["config"]), "--adapter", str(t["run"]), "--out", str(out),
                        *extra])


def test_fp32_export_reloads_with_transformers_and_gives_the_adapter_models_logits(
        trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "merged"
    assert run_export(trained, out, "--dtype", "float32") == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(trained["ids"]).logits
    assert torch.allclose(logits, trained["adapter_logits"], atol=1e-5)
    assert not torch.allclose(logits, trained["base_logits"], atol=1e-3)
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "README.md"} <= files
    assert not files & {"adapter_config.json", "adapter_model.safetensors", PROVENANCE}
    assert not (tmp_path / "merged.export-tmp").exists()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    # transformers 4.x (many vLLM installs) reads these spellings, else takes rope_theta = 10000
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] \
        and config["torch_dtype"] == "float32"
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": PROMPT}]
    assert tok.apply_chat_template(messages, tokenize=False) == \
        trained["tok"].apply_chat_template(messages, tokenize=False)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    # any version reads these
    assert "chat_template" in tok_config \
        and tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") \
        and gen["pad_token_id"] == tok.pad_token_id
    assert "temperature" not in gen and "repetition_penalty" not in gen


def test_default_export_is_bfloat16_with_a_model_card_naming_base_adapter_and_training(
        trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "merged"
    assert run_export(trained, out) == 0
    assert "exported" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with torch.no_grad():
        logits = model(trained["ids"]).logits.float()
    assert torch.allclose(logits, trained["adapter_logits"], atol=0.05)
    card = (out / "README.md").read_text()
    # a local base has no hub id
    assert card.startswith("---\nlibrary_name: transformers") and "base_model:" not in card
    assert "tiny_llama" in card and "run/checkpoints/step_000007/adapter` (sha256 " in card
    assert "7 steps" in card and "answer_match x 2" in card and "Be brief." in card \
        and "- weights: bfloat16" in card


def test_an_existing_out_is_refused_unless_overwrite_and_overwrite_replaces_only_an_export(
        trained, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run_export(trained, out) == 2
    assert "--overwrite" in error_line(capsys.readouterr().err)
    # a folder of the user's files is not an export
    assert run_export(trained, out, "--overwrite") == 2
    assert "replaces only that" in error_line(capsys.readouterr().err)
    assert (out / "keep.txt").read_text() == "mine" \
        and not (tmp_path / "merged.export-tmp").exists()
    export_dir = tmp_path / "exported"
    assert run_export(trained, export_dir) == 0
    (export_dir / "stale.txt").write_text("from the last export")
    assert run_export(trained, export_dir, "--overwrite") == 0
    assert not (export_dir / "stale.txt").exists() and (export_dir / "model.safetensors").is_file()
    assert not (tmp_path / "exported.export-old").exists()
    # an export that holds the config being used (or is the base, the adapter, this directory) is
    # kept too
    shutil.copy(trained["config"], export_dir / "cfg.yaml")
    assert export.main(["--config", str(export_dir / "cfg.yaml"), "--adapter", str(trained["run"]),
                        "--out", str(export_dir), "--overwrite"]) == 2
    assert (export_dir / "cfg.yaml").is_file() \
        and "replaces only that" in error_line(capsys.readouterr().err)
    (tmp_path / "empty").mkdir()  # an empty folder has nothing to lose
    assert run_export(trained, tmp_path / "empty", "--overwrite") == 0
    # never the run being exported, a folder holding it, or a folder of runs
    run = trained["run"]
    for target in (run, run / "checkpoints", run.parent, tmp_path):
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        assert run_export(trained, target, "--overwrite") == 2
        assert "replaces only that" in error_line(capsys.readouterr().err)
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_an_adapter_trained_on_another_base_or_a_missing_one_exits_2_and_writes_nothing(
        trained, tmp_path, capsys):
    other = tmp_path / "other_adapter"
    shutil.copytree(trained["run"] / "checkpoints/step_000007/adapter", other)
    (other / PROVENANCE).write_text(json.dumps({"base_model": "someone/else", "revision": None,
                                                "merged": []}))
    # a recipe's config names the recipe's model; the error says which config the run saved
    wrong = export.main(["--config", "configs/bioreasoner_sft.yaml", "--adapter",
                         str(trained["run"]), "--out", str(tmp_path / "x")])
    err = error_line(capsys.readouterr().err)
    assert wrong == 2 and "but model.name is 'Qwen/Qwen2.5-7B-Instruct'" in err \
        and "--config " in err and "config.yaml" in err
    out = tmp_path / "merged"
    corrupt = tmp_path / "corrupt_adapter"
    shutil.copytree(trained["run"] / "checkpoints/step_000007/adapter", corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    for adapter, says in ((other, "trained on base 'someone/else'"),
                          (tmp_path / "nowhere", "no LoRA adapter"),
                          (corrupt, "could not be loaded")):
        code = export.main(["--config", str(trained["config"]), "--adapter", str(adapter), "--out",
                            str(out)])
        err = capsys.readouterr().err
        assert code == 2 and says in error_line(err)
        assert not out.exists() and not (tmp_path / "merged.export-tmp").exists()


def test_a_checkpoint_whose_saved_config_no_longer_loads_is_one_line_not_a_silent_guess(
        trained, tmp_path, capsys):
    """The checkpoint's config.yaml says how its adapter was trained (template, system prompt): one
    that no longer loads (an older minigrpo's key) was silently replaced by --config."""
    old = tmp_path / "old_run"
    shutil.copytree(trained["run"], old)
    saved = old / "checkpoints/step_000007/config.yaml"
    saved.write_text(saved.read_text() + "old_section: {gone: 1}\n")
    out = tmp_path / "merged"
    assert export.main(["--config", str(trained["config"]), "--adapter", str(old), "--out",
                        str(out)]) == 2
    err = error_line(capsys.readouterr().err)
    assert str(saved) in err and "older minigrpo" in err and not out.exists()


def test_push_to_hub_without_hf_token_exits_2_before_writing(trained, tmp_path, capsys,
                                                             monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "merged"
    assert run_export(trained, out, "--push-to-hub", "me/tiny") == 2
    assert "HF_TOKEN" in error_line(capsys.readouterr().err) and not out.exists()


def test_push_to_hub_uploads_the_export_to_the_repo_and_never_shows_the_token(trained, tmp_path,
                                                                              capsys, monkeypatch):
    import huggingface_hub
    secret = "hf_s3cretTOKENvalue"
    monkeypatch.setenv("HF_TOKEN", secret)
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: calls.append(("create", repo_id, kw,
                                                                  self.token)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, **kw: calls.append(("upload", kw["repo_id"], kw, self.token)))
    out = tmp_path / "merged"
    assert run_export(trained, out, "--push-to-hub", "me/tiny-grpo", "--private") == 0
    (create, repo, kw, token), (upload, repo2, kw2, token2) = calls
    assert (create, repo, kw["private"], upload, repo2) == ("create", "me/tiny-grpo", True,
                                                            "upload", "me/tiny-grpo")
    assert kw2["folder_path"] == str(out) and token == token2 == secret
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    assert all(secret not in p.read_bytes().decode("latin-1") for p in out.iterdir())
    card = (out / "README.md").read_text()
    assert "# tiny-grpo" in card and 'from_pretrained("me/tiny-grpo")' in card


def test_the_exported_chat_template_renders_prompts_as_training_did(trained, tmp_path):
    """A forced assistant prefix and chat-template arguments are part of how training rendered
    prompts; a server that only applies the saved template must render the same text."""
    from transformers import AutoTokenizer

    import rollout
    from tools.export import serving_template
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    ckpt = run / "checkpoints/step_000007"
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["data"] = {**cfg["data"], "assistant_prefix": "<think>\n",
                   "chat_template_kwargs": {"enable_thinking": False}}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert export.main(["--config", str(trained["config"]), "--adapter", str(run), "--out",
                        str(out), "--dtype", "float32"]) == 0
    served = AutoTokenizer.from_pretrained(out)
    messages = rollout.chat_messages("What is 2 + 2?", "Be brief.")
    want = rollout.render_prompt(trained["tok"], "What is 2 + 2?", "Be brief.", "<think>\n",
                                 {"enable_thinking": False})
    assert served.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
    # eval.py or a further GRPO run on the export renders the same prompt: no prefix added twice
    assert rollout.render_prompt(served, "What is 2 + 2?", "Be brief.", "<think>\n",
                                 {"enable_thinking": False}) == want
    # a whitespace prefix that the plain template happens to end with is still added
    assert rollout.render_prompt(trained["tok"], "hi", None, "\n").endswith(
        "<|im_start|>assistant\n\n")
    assert "every reply starts with '<think>\\n'" in (out / "README.md").read_text()
    # a template that reads the argument (Qwen3's enable_thinking) sees the value training used
    qwen_like = ("{% if enable_thinking is defined and enable_thinking is false %}NO-THINK "
                 "{% endif %}{{ messages[0]['content'] }}")
    fixed = serving_template(qwen_like, {"enable_thinking": False}, "<think>")
    assert served.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=fixed,
                                      tokenize=False,
                                      add_generation_prompt=True) == "NO-THINK hi<think>"
    assert served.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=fixed,
                                      tokenize=False, add_generation_prompt=False) == "NO-THINK hi"


@pytest.mark.parametrize("template", [
    "{{ messages[0]['content'] }}\n",  # Jinja drops one trailing newline of a source
    "\n{{ messages[0]['content'] }}",  # a leading newline right after the fixed arguments
    "{% for m in messages %}{{ m['content'] }}{% endfor %}  ",
    "{{ flag }}|{{ extra['a'] }}|{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
])
def test_the_serving_template_renders_training_prompts_for_awkward_templates(trained, template):
    """Whitespace at the template's edges, nested none, non-ASCII prefixes: the baked template gives
    exactly training's render plus the prefix."""
    from tools.export import serving_template
    tok, messages = trained["tok"], [{"role": "user", "content": "hi"}]
    kwargs, prefix = {"flag": False, "extra": {"a": None, "b": ["é", 1]}}, "<think>😀 \"{{x}}\"\n"
    want = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=True, **kwargs) + prefix
    got = tok.apply_chat_template(messages,
                                  chat_template=serving_template(template, kwargs, prefix),
                                  tokenize=False, add_generation_prompt=True)
    assert got == want


def test_named_chat_templates_are_each_baked(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    ckpt = run / "checkpoints/step_000007"
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    (ckpt / "config.yaml").write_text(
        yaml.safe_dump({**cfg, "data": {**cfg["data"], "assistant_prefix": "<think>"}}))
    tok_dir = tmp_path / "tok"
    base = trained["tok"]
    base.chat_template = {"default": base.chat_template, "tool_use": "{{ messages[0]['content'] }}"}
    base.save_pretrained(tok_dir)
    base.chat_template = base.chat_template["default"]
    from transformers import AutoTokenizer
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "load_base",
                   lambda *a, **k: (load_base(*a, **k)[0], AutoTokenizer.from_pretrained(tok_dir)))
        assert export.main(["--config", str(trained["config"]), "--adapter", str(run), "--out",
                            str(tmp_path / "out"), "--dtype", "float32"]) == 0
    served = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert served.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="tool_use",
                                      tokenize=False, add_generation_prompt=True) == "hi<think>"


def test_the_model_card_says_how_the_run_trained_sft_grpo_or_dpo_and_names_a_mixture():
    from config import Config, DataSource
    cfg = Config(mode="sft")
    cfg.data.target = "answer"
    cfg.data.mixture = [DataSource("a.jsonl"), DataSource("b.jsonl")]
    card = export.model_card("me/m", cfg, {"merged": []}, "bfloat16")
    assert "An SFT fine-tune" in card and "tags: [minigrpo, sft]" in card and "GRPO" not in card
    assert "supervised on `mixture (a.jsonl + b.jsonl)` (target `answer`)" in card \
        and "temperature" not in card
    cfg.mode = "grpo"
    assert "A GRPO fine-tune" in export.model_card("me/m", cfg, {"merged": []}, "bfloat16")
    cfg.mode, cfg.data.chosen, cfg.data.rejected, cfg.dpo.beta = "dpo", "chosen", "rejected", 0.2
    card = export.model_card("me/m", cfg, {"merged": []}, "bfloat16")
    assert "A DPO fine-tune" in card and "tags: [minigrpo, dpo]" in card \
        and "(`chosen` over `rejected`), beta 0.2" in card

def test_the_model_card_gives_the_final_adapter_s_own_lora_shape(tmp_path):
    """An adapter continued from an SFT run keeps its shape, whatever lora.* said (older runs)."""
    from config import Config
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    card = export.model_card(
        "me/m", Config(), {"merged": [{"adapter": str(tmp_path), "sha256": "0" * 64}]}, "bfloat16")
    assert "LoRA r 8 alpha 16" in card


def test_verify_reloads_the_export_and_refuses_a_template_that_renders_otherwise(
        trained, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    ckpt = run / "checkpoints/step_000007"
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["data"] = {**cfg["data"], "assistant_prefix": "<think>\n"}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    argv = ["--config", str(trained["config"]), "--adapter", str(run), "--dtype", "float32",
            "--verify"]
    assert export.main(argv + ["--out", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "renders the prompt as training did; next-token logits within 0 of" in out \
        and "greedy tokens the same" in out
    # a template that already ends with the forced prefix (R1-style "<think>\n"): written once, as
    # in training
    cfg["data"]["assistant_prefix"] = "assistant\n"  # what ChatML's generation prompt ends with
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert export.main(argv + ["--out", str(tmp_path / "once")]) == 0
    cfg["data"]["assistant_prefix"] = "<think>\n"
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    # the prefix lost
    monkeypatch.setattr(export, "serving_template", lambda template, kwargs, prefix: template)
    assert export.main(argv + ["--out", str(tmp_path / "bad")]) == 1
    assert "where training rendered" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.export-tmp").exists()


def test_a_folder_of_yours_next_to_out_is_left_alone_and_an_unwritable_out_is_one_line(
        trained, tmp_path, capsys):
    """export.py clears only its own leftovers (OUT.export-tmp, OUT.export-old), never a backup such
    as `mv merged merged.old`; an --out under a file fails before the base loads, with one line."""
    for name in ("merged.old", "merged.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.safetensors").write_text("kept")
    assert run_export(trained, tmp_path / "merged") == 0
    assert run_export(trained, tmp_path / "merged", "--overwrite") == 0
    assert all((tmp_path / n / "mine.safetensors").read_text() == "kept"
               for n in ("merged.old", "merged.tmp"))
    capsys.readouterr()
    (tmp_path / "afile").write_text("x")
    assert run_export(trained, tmp_path / "afile" / "merged") == 2
    assert "afile is a file, not a folder" in error_line(capsys.readouterr().err)


def test_an_out_that_is_a_file_or_empty_and_an_empty_verify_prompt_are_one_line(trained, tmp_path,
                                                                                capsys):
    (tmp_path / "afile").write_text("x")
    for out, extra, message in ((tmp_path / "afile", ["--overwrite"],
                                 "is a file; give the directory"), ("", [], "--out is empty"),
                                (tmp_path / "m", ["--verify", ""], "--verify '' has no prompt")):
        assert run_export(trained, out, *extra) == 2
        assert message in error_line(capsys.readouterr().err)
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "m").exists()


def test_the_model_card_of_a_run_that_counted_epochs_says_so_not_the_default_steps():
    """A run with run.epochs saves config.yaml without run.steps (runs.with_epochs makes them), so
    the card, written from it, said "60 steps" (the default) for bioreasoner_dpo.yaml's 105."""
    from config import Config
    cfg = Config(mode="dpo")
    cfg.run.epochs = 3
    card = export.model_card("me/m", cfg, {"merged": []}, "bfloat16")
    assert "3 epochs" in card and "60 steps" not in card


def test_an_export_has_what_servers_read_and_says_how_to_serve_it(trained, tmp_path, capsys,
                                                                  monkeypatch):
    out = tmp_path / "merged"
    assert run_export(trained, out) == 0
    assert export.serving_gaps(out) == []
    # the training config's longest prompt + reply: rollout.max_prompt_tokens + max_new_tokens
    serve = f"vllm serve {out} --max-model-len {512 + 64} --served-model-name merged"
    assert serve in capsys.readouterr().out and serve in (out / "README.md").read_text()
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "generation_config.json").unlink()
    tok = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": None}))
    assert export.serving_gaps(broken) == [
        "a chat template (tokenizer_config.json's chat_template)",
        "generation_config.json with its eos_token_id"]
    # an export that would lack a file is refused, and nothing is written
    real = export.readable_by_older_transformers
    monkeypatch.setattr(export, "readable_by_older_transformers", lambda folder: (
        real(folder), (folder / "tokenizer.json").unlink()))
    assert run_export(trained, tmp_path / "cut") == 1
    assert "lacks tokenizer.json or tokenizer.model" in capsys.readouterr().err
    assert not (tmp_path / "cut").exists() and not (tmp_path / "cut.export-tmp").exists()
