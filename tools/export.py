"""Export a trained LoRA adapter as a standalone model: the base with its adapter chain merged in,
saved as a plain transformers directory that AutoModelForCausalLM and vLLM load as they are.

    python -m tools.export --config configs/quickstart.yaml --adapter runs/quickstart --out exported
    HF_TOKEN=hf_... python -m tools.export ... --dtype float16 --push-to-hub org/model --private

--adapter is a run directory (its newest checkpoint), a checkpoint or an adapter directory. The base
is loaded per the config's model section (`--section.key=value` overrides work) on CPU in fp32,
whatever model.dtype and model.quant say (merging into 4-bit is lossy; RAM: 4 bytes a parameter).
adapters.apply_adapter_chain replays the merges the adapter was trained on and refuses an adapter of
another base. The sum is cast to --dtype, by default bfloat16: half of fp32's size with its range,
what vLLM serves on Ampere and newer (float16 for a T4). OUT gets model.safetensors, config.json,
generation_config.json (bos/eos/pad only: training sampled from logits / T alone), the tokenizer
with its chat template (rendering prompts as training did: the checkpoint config's
data.chat_template_kwargs fixed and its data.assistant_prefix written after the generation prompt)
and README.md, a model card naming the base and each adapter's sha256.
--verify [PROMPT] reloads OUT.export-tmp as a server would and checks it against the merged model
before it is kept (the saved template must render the prompt as training did: else exit 1, nothing
written); it holds a second copy of the model in fp32 meanwhile.
Written to OUT.export-tmp and renamed; an existing OUT is refused unless --overwrite. --push-to-hub
uploads OUT with the token in $HF_TOKEN, never printed or written; --create-endpoint NAME then
serves the upload on a Hugging Face Inference Endpoint (vLLM on a T4, scaled to zero when idle), and
`python -m tools.export check --url URL ...` compares a served model's greedy replies with the
adapter's (both in tools/deploy.py). Bad input: one line, exit 2, nothing written; a failed upload
or endpoint exits 1 and keeps OUT.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch

import rollout
from config import Config, ConfigError, data_label, length_limit, load_config
from files import command
from model import load_base
from settings.typed_config import check_writable
from sources import seen_prompts
from sources.adapters import apply_adapter_chain, check_adapter_base, find_adapter
from sources.hub import BUILTIN
from tools import deploy


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m tools.export",
                                 description=__doc__.split("\n\n")[0],
                                 epilog="Any config field: --section.key=value. A served model "
                                        "against its adapter: python -m tools.export check --help")
    ap.add_argument("--config", required=True,
                    help="the YAML config the adapter was trained with (its model section)")
    ap.add_argument("--adapter", required=True,
                    help="run directory, checkpoint or adapter directory")
    ap.add_argument("--out", required=True, help="directory to write the merged model to")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="weights dtype")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("--push-to-hub", metavar="REPO_ID",
                    help="upload to this hub repo (token from $HF_TOKEN)")
    ap.add_argument("--private", action="store_true", help="create the hub repo private")
    ap.add_argument("--verify", nargs="?", const="What is 2 + 2?", metavar="PROMPT",
                    help="reload the export as a server would and check it against the merged "
                         "model (default prompt: 'What is 2 + 2?'); a template that renders the "
                         "prompt otherwise than training fails the export")
    deploy.add_endpoint_args(ap)
    return ap.parse_known_args(argv)


def model_card(name: str, cfg: Config, prov: dict, dtype: str, serve_len: int | None = None) -> str:
    """README.md: hub metadata, the weights' origin, how they were trained, how to use them
    (serve_len: vLLM's --max-model-len; None: max_model_len(cfg))."""
    m, r = cfg.model, cfg.rollout
    hub_base = (m.name not in BUILTIN and not Path(m.name).expanduser().exists()
                and m.name.count("/") == 1)
    base = f"`{m.name}`" + (f" (revision `{m.revision}`)" if m.revision else "") + (
        f" (minigrpo's built-in model, de-quantized from `{BUILTIN[m.name][1]}`)"
        if m.name in BUILTIN else "")
    rewards = ", ".join(f"{s.name} x {s.weight:g}" for s in cfg.rewards)
    last = Path(prov["merged"][-1]["adapter"]) / "adapter_config.json" if prov["merged"] else None
    # the adapter's own shape (a continued one kept it)
    shape = json.loads(last.read_text()) if last and last.is_file() else {}
    lora_r, lora_alpha = shape.get("r", cfg.lora.r), shape.get("lora_alpha", cfg.lora.alpha)
    if cfg.mode == "sft":
        kind, training = "An SFT fine-tune", (f"supervised on `{data_label(cfg.data)}` "
                                              f"(target `{cfg.data.target}`)")
    elif cfg.mode == "dpo":
        kind, training = "A DPO fine-tune", (
            f"preference pairs `{data_label(cfg.data)}` (`{cfg.data.chosen}` over "
            f"`{cfg.data.rejected}`), beta {cfg.dpo.beta:g}, loss `{cfg.dpo.loss_type}`"
            + (f", label smoothing {cfg.dpo.label_smoothing:g}" if cfg.dpo.label_smoothing else ""))
    else:
        kind, training = "A GRPO fine-tune", (
            f"data `{data_label(cfg.data)}`, rewards {rewards}; loss `{cfg.grpo.loss_type}`, "
            f"beta {cfg.grpo.beta:g}, G = {r.num_generations}, temperature {r.temperature:g}")
    return "\n".join(["---", "library_name: transformers", f"tags: [minigrpo, {cfg.mode}]"]
                     + [f"base_model: {m.name}"] * hub_base + [
        "---", f"# {Path(name).name}", "", f"{kind} trained with minigrpo and exported by its "
        "`python -m tools.export`: the LoRA adapters below are merged into the base, so this is "
        "a plain transformers model.", "",
        f"- base: {base}", "- adapters merged, in order:",
        *[f"  {i}. `{os.path.relpath(a['adapter'])}` (sha256 `{a['sha256'][:16]}`)"
          for i, a in enumerate(prov["merged"], 1)],
        f"- weights: {dtype}", f"- training (the final adapter's config): {training}; "
        f"{f'{cfg.run.epochs:g} epochs' if cfg.run.epochs else f'{cfg.run.steps} steps'}, "
        f"lr {cfg.optim.lr:g}, LoRA r {lora_r} alpha {lora_alpha}"
        + (f", system prompt {cfg.data.system_prompt!r}" if cfg.data.system_prompt else ""), "",
        "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```", "",
        f"or serve it: `{serve_command(name, cfg, serve_len)}`. The chat template renders prompts "
        "as training did"
        + (f": chat template arguments {cfg.data.chat_template_kwargs} are fixed in it"
           if cfg.data.chat_template_kwargs else "")
        + (f"{' and' if cfg.data.chat_template_kwargs else ':'} every reply starts with "
           f"{cfg.data.assistant_prefix!r}, which the template writes after the generation prompt "
           "(it is part of the prompt, not of the reply)" if cfg.data.assistant_prefix else "")
        + ".", ""])


def serving_template(template: str, kwargs: dict, prefix: str) -> str:
    """The chat template that renders prompts as training did, for servers that only apply the
    template (vLLM, TGI, AutoTokenizer): data.chat_template_kwargs fixed at its top (Qwen3's
    enable_thinking: false, say) and data.assistant_prefix (a forced "<think>") after its generation
    prompt. Without them a served Qwen3 would think before its JSON, and BioReasoner's model would
    lose the prefix it was trained behind."""
    def literal(v) -> str:  # a Jinja literal: JSON's, but none/true/false and unescaped non-ASCII
        if v is None:
            return "none"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(literal(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{literal(str(k))}: {literal(x)}" for k, x in v.items()) + "}"
        return json.dumps(v, ensure_ascii=False)  # strings and numbers
    if bad := [k for k in kwargs if not str(k).isidentifier()
               or k in ("true", "false", "none", "True", "False", "None")]:
        raise ConfigError(f"data.chat_template_kwargs: {bad[0]!r} is not a template variable name")
    # `+%}` and `{%+` keep transformers' trim_blocks/lstrip_blocks off the template's own first and
    # last whitespace, and Jinja drops one trailing newline of a source, no longer last here
    head = "".join(f"{{%- set {k} = {literal(v)} +%}}" for k, v in kwargs.items())
    tail = (f"{{%+ if add_generation_prompt %}}{{{{ {literal(prefix)} }}}}{{% endif %}}"
            if prefix else "")
    body = template[:-1] if tail and template.endswith("\n") else template
    return head + body + tail


class ExportCheckFailed(Exception):
    """--verify found the saved model rendering prompts otherwise than training did."""


@torch.no_grad()
def greedy(model, tokenizer, text: str,
           new_tokens: int = 16) -> tuple[str, list[int], torch.Tensor]:
    """(the rendered prompt, its first greedy tokens, the first next-token logits) of `model`."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    logits = model(ids).logits[0, -1].float()
    # eos_token_id: where training stopped
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=rollout.eos_token_ids(tokenizer, model),
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return text, out[0, ids.shape[1]:].tolist(), logits


def verify(folder: Path, reference: tuple, prompt: str, system_prompt: str | None) -> str:
    """--verify: load `folder` as a server would (AutoTokenizer, AutoModelForCausalLM) and compare
    it with the merged model before the cast. The saved template must render the prompt as training
    did (else ExportCheckFailed); the logits and greedy tokens are reported (a bf16 cast moves them
    a little)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(rollout.chat_messages(prompt, system_prompt), tokenize=False,
                                   add_generation_prompt=True)
    want_text, want_tokens, want_logits = reference
    if text != want_text:
        raise ExportCheckFailed(f"--verify: the saved chat template renders {text[-80:]!r} "
                                f"where training rendered {want_text[-80:]!r}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _, tokens, logits = greedy(model, tok, text, len(want_tokens))
    same = sum(a == b for a, b in zip(tokens, want_tokens))
    return (f"[minigrpo] verify: the saved template renders the prompt as training did; next-token "
            f"logits within {float((logits - want_logits).abs().max()):.3g} of the merged model's; "
            f"{same}/{len(want_tokens)} greedy tokens the same ({tok.decode(tokens)!r})")


def serving_gaps(folder: Path) -> list[str]:
    """What transformers' Auto classes or vLLM's OpenAI-compatible server would miss in an export:
    the config's architecture, the weights, the tokenizer, a chat template (their chat endpoints
    apply it) and the generation config's stop tokens. [] when nothing is missing."""
    def read(name: str) -> dict:
        return json.loads((folder / name).read_text()) if (folder / name).is_file() else {}
    gaps = ["config.json with its architectures"] * (not read("config.json").get("architectures"))
    gaps += ["*.safetensors weights"] * (not any(folder.glob("*.safetensors")))
    gaps += ["tokenizer.json or tokenizer.model"] * (
        not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")))
    gaps += ["a chat template (tokenizer_config.json's chat_template)"] * (
        not read("tokenizer_config.json").get("chat_template")
        and not (folder / "chat_template.jinja").is_file())
    gaps += ["generation_config.json with its eos_token_id"] * (
        read("generation_config.json").get("eos_token_id") is None)
    return gaps


SERVE_LEN = 8192  # the seed's --max_model_len: room for longer prompts than training's


def run_length(cfg: Config) -> int:
    """The training run's longest prompt plus reply: what a server must take at the least."""
    return length_limit(cfg)[1] + (cfg.rollout.max_new_tokens if cfg.mode == "grpo" else 0)


def max_model_len(cfg: Config, asked: int | None = None, positions: int | None = None) -> int:
    """vLLM's --max-model-len for the export: `asked` (--max-model-len), else the seed's 8192 as
    far as the model's positions reach (max_position_embeddings), and never under run_length.

    >>> from config import Config
    >>> cfg = Config()
    >>> max_model_len(cfg), max_model_len(cfg, positions=2048), max_model_len(cfg, asked=1024)
    (8192, 2048, 1024)
    """
    return asked or max(run_length(cfg), min(SERVE_LEN, positions or SERVE_LEN))


def check_serve_len(asked: int | None, cfg: Config, positions: int | None) -> None:
    """--max-model-len between the run's longest prompt + reply and the model's positions: else the
    server refuses the prompts it was trained on, or the endpoint fails as it starts."""
    if asked is None:
        return
    if asked < run_length(cfg):
        raise ConfigError(f"--max-model-len {asked} is under the training run's longest prompt + "
                          f"reply ({run_length(cfg)} tokens): the server would refuse them")
    if positions and asked > positions:
        raise ConfigError(f"--max-model-len {asked} is over the model's max_position_embeddings "
                          f"({positions}): vLLM would refuse to start; give at most {positions}")


def serve_command(out: str, cfg: Config, length: int | None = None) -> str:
    """vLLM's OpenAI-compatible server for the export (length: --max-model-len)."""
    return (f"vllm serve {out} --max-model-len {length or max_model_len(cfg)} "
            f"--served-model-name {Path(out).name}")


def readable_by_older_transformers(folder: Path) -> None:
    """transformers 5 writes `dtype`, `rope_parameters` and tokenizer_class TokenizersBackend; 4.x
    (many vLLM installs) reads `torch_dtype`, `rope_theta`, `rope_scaling`, fails on that class, and
    silently takes rope_theta = 10000 without the key (SmolLM2 uses 100000). Add the old spellings;
    5.x reads both the same."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # not the per-layer-type form
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    cfg.setdefault("torch_dtype", cfg.get("dtype"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"  # the same class in 5.x, known to 4.x
    (folder / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")


def push_to_hub(folder: Path, repo_id: str, private: bool, token: str) -> str | None:
    """-> the upload's commit, which an endpoint is pinned to."""
    from huggingface_hub import HfApi
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                               commit_message="Upload model exported by minigrpo")
    return getattr(commit, "oid", None)


def check_args(args, cfg: Config) -> str | None:
    """Cheap checks first: bad input fails before the base loads. -> the hub token, if pushing."""
    check_writable(args.out, "--out")
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out} is a file; give the directory the model should be "
                          "written to")
    if args.verify is not None and not args.verify.strip():
        raise ConfigError("--verify '' has no prompt to check; give one, or --verify alone for "
                          "the default")
    deploy.check_endpoint_args(args)
    if out.exists() and not args.overwrite:
        raise ConfigError(f"--out {args.out} already exists; pass --overwrite to replace it or "
                          "choose another directory")
    # --overwrite deletes it: only an earlier export
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        keep = [Path(args.adapter).resolve(), find_adapter(args.adapter).resolve(),
                Path(args.config).resolve(), Path.cwd(),
                Path(cfg.model.name).expanduser().resolve()]  # the base (itself an export, maybe)
        card = out / "README.md"
        an_export = (out / "config.json").is_file() and any(out.glob("*.safetensors")) and \
            card.is_file() and "tags: [minigrpo," in card.read_text(errors="replace")[:2000] \
            and not any((out / n).exists() for n in
                        ("metrics.jsonl", "checkpoints", "adapter_config.json", "config.yaml"))
        if not an_export or any(p == out or out in p.parents for p in keep):
            raise ConfigError(f"--out {args.out} is not an earlier export of tools.export (its "
                              "model card, config.json and *.safetensors, holding nothing you "
                              "train with); --overwrite replaces only that, so choose another "
                              "directory")
    if not args.push_to_hub:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(args.push_to_hub)
    except HFValidationError:
        raise ConfigError(f"--push-to-hub {args.push_to_hub!r} is not a hub repo id; "
                          "use org/name") from None
    if not os.environ.get("HF_TOKEN"):
        raise ConfigError("--push-to-hub needs a hub token with write access in the HF_TOKEN "
                          "environment variable")
    return os.environ["HF_TOKEN"]


@dataclasses.dataclass
class Merged:
    """The base with its adapter chain merged in, ready to save, and what it was made from."""
    cfg: Config  # the --config given, whose model section loaded the base
    train_cfg: Config  # the checkpoint's own config (else cfg): how the adapter was trained
    adapter: Path
    model: torch.nn.Module
    tokenizer: object  # its chat template rendering prompts as training did
    prov: dict  # apply_adapter_chain's record of the adapters merged
    serve_len: int  # vLLM's --max-model-len
    reference: tuple | None  # --verify: greedy() of the merged model before the cast


def find_trained_adapter(args, cfg: Config) -> tuple[Path, Config]:
    """-> (the adapter, the config it was trained with), checked against the base before it loads:
    a recipe's config names its model, the run may have trained another."""
    adapter = find_adapter(args.adapter)
    saved = adapter.parent / "config.yaml"
    try:
        check_adapter_base(adapter, cfg.model)
    except ConfigError as e:
        raise ConfigError(f"{e}" + (f" (pass the run's own config: --config {saved})"
                                    if saved.is_file() else "")) from None
    try:  # the checkpoint's own config describes its training best
        return adapter, load_config(saved) if saved.is_file() else cfg
    except ConfigError as e:
        raise ConfigError(f"{saved} does not load ({e}): saved by an older minigrpo? export it "
                          "with the minigrpo that trained it") from None


def render_as_trained(tokenizer, data) -> None:
    """Rewrite the tokenizer's chat template so a server renders prompts as training did
    (serving_template): data.chat_template_kwargs fixed, data.assistant_prefix after the generation
    prompt, unless the template already ends with it (R1-style "<think>\\n", written in training
    too)."""
    if not tokenizer.chat_template:
        return
    probe = rollout.render_prompt(tokenizer, "x", None, "", data.chat_template_kwargs)
    prefix = rollout.prefix_to_add(probe, data.assistant_prefix)
    if data.chat_template_kwargs or prefix:
        t = tokenizer.chat_template  # a string, or named templates (default, tool_use, ...)
        tokenizer.chat_template = ({k: serving_template(v, data.chat_template_kwargs, prefix)
                                    for k, v in t.items()} if isinstance(t, dict)
                                   else serving_template(t, data.chat_template_kwargs, prefix))


def merge(args, cfg: Config) -> Merged:
    """Load the base in fp32 on CPU, merge the adapter chain, check the serving length, take
    --verify's reference and fix the chat template; ConfigError on bad input."""
    adapter, train_cfg = find_trained_adapter(args, cfg)
    mcfg = dataclasses.replace(cfg.model, dtype="float32", quant=None)
    model, tokenizer = load_base(mcfg, torch.device("cpu"))
    if getattr(model.config, "quantization_config", None) is not None:
        raise ConfigError(f"model.name={mcfg.name} is a pre-quantized checkpoint; export needs "
                          "a base in full precision")
    model, prov = apply_adapter_chain(model, mcfg, str(adapter), merge=True, trainable=False)
    positions = getattr(model.config, "max_position_embeddings", None)
    check_serve_len(args.max_model_len, train_cfg, positions)
    serve_len = max_model_len(train_cfg, args.max_model_len, positions)
    data = train_cfg.data
    # before the template is rewritten and the weights cast
    reference = greedy(model, tokenizer, rollout.render_prompt(
        tokenizer, args.verify, data.system_prompt, data.assistant_prefix,
        data.chat_template_kwargs)) if args.verify else None
    render_as_trained(tokenizer, data)
    return Merged(cfg, train_cfg, adapter, model, tokenizer, prov, serve_len, reference)


def cast_for_serving(m: Merged, dtype: str) -> None:
    """The weights in `dtype`, the KV cache on, and the stop tokens training stopped at (vLLM,
    generate): the tokenizer's EOS and the template's end of turn too."""
    m.model = m.model.to(getattr(torch, dtype))
    m.model.config.use_cache = True  # load_base turned it off for training
    gen = m.model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    eos = [e for e in eos if e is not None] + [
        e for e in rollout.eos_token_ids(m.tokenizer, m.model) if e not in eos]
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos


def save(folder: Path, args, m: Merged) -> None:
    """The export in `folder`: weights, tokenizer, model card, the prompts it trained on; checked
    for what servers read and, with --verify, reloaded as one would (ExportCheckFailed)."""
    m.model.save_pretrained(folder)
    m.tokenizer.save_pretrained(folder, save_jinja_files=False)
    readable_by_older_transformers(folder)
    # eval.py finds held-out rows the merged model trained on
    if seen := seen_prompts.recorded_file(m.adapter):
        shutil.copy(seen, folder / seen_prompts.FILE)
    (folder / "README.md").write_text(model_card(args.push_to_hub or args.out, m.train_cfg, m.prov,
                                                 args.dtype, m.serve_len))
    if gaps := serving_gaps(folder):
        raise ExportCheckFailed(f"the export lacks {', '.join(gaps)}, which servers read")
    if m.reference is not None:
        print(verify(folder, m.reference, args.verify, m.train_cfg.data.system_prompt))


def write_export(args, m: Merged) -> int:
    """Save to OUT.export-tmp, then rename it to OUT (with --overwrite, the old OUT is dropped
    after) -> 0; a failed check 1, a write error 2, each one line with nothing written."""
    out = Path(args.out)
    # the export's own names: clearing what a killed export left never touches a folder of yours
    tmp, old = out.with_name(out.name + ".export-tmp"), out.with_name(out.name + ".export-old")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed export
    try:
        save(tmp, args, m)
    except ExportCheckFailed as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return command.error(f"{e}; nothing was written", code=1)
    except OSError as e:  # a full disk, a folder made read-only meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        return command.error(f"cannot write --out {args.out} ({e.strerror or e}); nothing was "
                             "written")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # --overwrite: swap, then drop the old one
        shutil.rmtree(old, ignore_errors=True)  # left by a killed export
        out.replace(old)
    tmp.replace(out)
    shutil.rmtree(old, ignore_errors=True)
    n = sum(p.numel() for p in m.model.parameters())
    print(f"[minigrpo] exported {out} ({n / 1e6:.1f}M params, {args.dtype}): {m.cfg.model.name} + "
          f"{len(m.prov['merged'])} merged adapter(s); serve it: "
          f"{serve_command(args.out, m.train_cfg, m.serve_len)}")
    return 0


def publish(args, m: Merged, token: str) -> int:
    """--push-to-hub, then --create-endpoint -> 0; a failure is one line (the token masked) and
    exit 1, the export kept."""
    out = Path(args.out)

    def why(e: Exception) -> str:
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}".replace(token, "***")
    try:
        commit = push_to_hub(out, args.push_to_hub, args.private, token)
    except Exception as e:  # network, permissions: the export itself is done and kept
        return command.error(f"upload to {args.push_to_hub} failed ({why(e)}); the export is kept "
                             f"in {out}", code=1)
    print(f"[minigrpo] uploaded to https://huggingface.co/{args.push_to_hub}")
    if not args.create_endpoint:
        return 0
    try:
        print(deploy.create_endpoint(args, commit, m.serve_len, token).replace(token, "***"))
    except Exception as e:  # a name taken, no payment method, no quota for the instance
        return command.error(f"creating endpoint {args.create_endpoint} failed ({why(e)}); the "
                             f"model is uploaded to {args.push_to_hub} and kept in {out}", code=1)
    return 0


@command.one_line(ConfigError, stopped="before the export was whole; nothing was written")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        return deploy.check_served(argv[1:])
    args, overrides = parse_args(argv)
    cfg = load_config(args.config, overrides)
    token = check_args(args, cfg)
    m = merge(args, cfg)
    cast_for_serving(m, args.dtype)
    if code := write_export(args, m):
        return code
    if not token:
        return 0
    try:
        return publish(args, m, token)
    except KeyboardInterrupt as e:  # the export is whole by now
        return command.said_interrupted(e, f"during the upload; the export is kept in {args.out}")


if __name__ == "__main__":
    sys.exit(main())
