"""eval.py's --models entries: what each names and where its weights come from (the forms,
base, PATH, hf:ORG/REPO and api:MODEL, are listed in eval.py's docstring).

    entries = parse_model_entries(["base", "sft=runs/sft", "hf:ORG/REPO", "api:gpt-4o-mini"],
                                  cfg.model)

Every check that needs no model loaded is here: the entry's form, the base an adapter's run
recorded (own_base), and whether that run trained on the rows eval.select holds out
(trained_on_held_out).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from config import Config, ConfigError, ModelConfig, active_mixture, load_config
from sources.adapters import PROVENANCE, adapter_provenance, check_adapter_base, find_adapter
from sources.hub import hub_unreachable, offline_if_unreachable


@dataclass
class ModelEntry:
    name: str  # column in the table, suffix of predictions_<name>.jsonl
    kind: str  # "base" | "adapter" | "full" | "api"
    target: str | None  # adapter directory, model directory or API model name (None for base)
    spec: str  # the entry as given on the command line
    base: str | None = None  # an adapter's base as its run recorded it, when that is not model.name
    revision: str | None = None  # ... and its revision


def hub_download(spec: str, repo: str) -> Path:
    """hf:ORG/REPO[@REVISION]: a hub model or adapter (a pushed SFT phase, say), downloaded (or
    found in the hub cache) and then read as a local directory."""
    from huggingface_hub import snapshot_download
    repo_id, _, revision = repo.partition("@")
    try:
        with offline_if_unreachable():
            return Path(snapshot_download(repo_id, revision=revision or None))
    except Exception as e:  # offline, private without HF_TOKEN, no such repo: one line
        why = (hub_unreachable(repo_id)
               or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise ConfigError(f"model entry {spec!r}: could not download {repo_id} from the hub "
                          f"({why})") from None


def parse_model_entries(specs: list[str], mcfg: ModelConfig) -> list[ModelEntry]:
    """Command-line entries -> ModelEntry list; ConfigError names the first bad one.

    >>> [(e.name, e.kind, e.target)
    ...  for e in parse_model_entries(["base", "mini=api:gpt-4o-mini"], ModelConfig())]
    [('base', 'base', None), ('mini', 'api', 'gpt-4o-mini')]
    """
    usage = ("use base, [NAME=]PATH (run, checkpoint, adapter or model directory), "
             "[NAME=]hf:ORG/REPO or [NAME=]api:MODEL")
    entries: list[ModelEntry] = []
    for spec in specs:
        name, _, what = spec.partition("=") if "=" in spec else (None, "", spec)
        base = None  # an adapter's own base, when its run recorded another than model.name
        if name is not None and not re.fullmatch(r"[\w.-]+", name):
            raise ConfigError(f"model entry {spec!r}: the name must be letters, digits, '.', '_' "
                              f"or '-'; {usage}")
        if what == "base":  # a directory called base: write ./base
            kind, target = "base", None
        elif what.startswith("api:"):
            kind, target = "api", what[4:]
            if not target:
                raise ConfigError(f"model entry {spec!r} names no API model; write api:MODEL, "
                                  "e.g. api:gpt-4o-mini")
        else:
            p = hub_download(spec, what[3:]) if what.startswith("hf:") else Path(what).expanduser()
            if not what or not p.exists():
                raise ConfigError(f"model entry {spec!r}: no such file or directory {what!r}; "
                                  f"{usage}")
            if (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
                kind, target = "full", str(p)
                if not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
                    raise ConfigError(f"model entry {spec!r}: {p} has a config.json but no weights "
                                      "(*.safetensors); is the export or download complete?")
            else:
                kind, target = "adapter", str(find_adapter(str(p)))
                base = own_base(Path(target), mcfg)
                try:
                    check_adapter_base(Path(target),
                                       dataclasses.replace(mcfg, **base) if base else mcfg)
                except ConfigError as e:
                    raise ConfigError(f"model entry {spec!r}: {e}") from None
        default = {"base": "base", "api": target}.get(kind) or (
            what[3:].partition("@")[0].split("/")[-1] if what.startswith("hf:")
            else Path(what).expanduser().resolve().name)
        name = name or re.sub(r"[^\w.-]", "_", default)
        if name in [e.name for e in entries]:
            raise ConfigError(f"model name {name!r} appears twice; give each entry its own NAME=")
        entries.append(ModelEntry(name, kind, target, spec,
                                  *((base["name"], base["revision"]) if base else ())))
    return entries


def own_base(adapter: Path, mcfg: ModelConfig) -> dict | None:
    """{name, revision} of the base a minigrpo adapter was trained on, when that is not model.name
    (a GRPO phase trained on an SFT phase pushed as a merged model, say); None when it is, or when
    the adapter is another tool's, whose recorded base is only a hint (check_adapter_base then holds
    it to model.name)."""
    if not (adapter / PROVENANCE).is_file():
        return None
    prov = adapter_provenance(adapter)
    if ((prov.get("base_model"), prov.get("revision")) == (mcfg.name, mcfg.revision)
            or not prov.get("base_model")):
        return None
    return {"name": prov["base_model"], "revision": prov.get("revision")}


def trained_on_held_out(adapter: Path, cfg: Config) -> str | None:
    """What is wrong, when the run that saved `adapter` (its checkpoint's config.yaml) trained on
    rows of the data eval.select holds out: same file or dataset, split, shuffle and size, and an
    overlapping data.select (or none). None when they are apart, or when it cannot tell (a mixture,
    eval.name, no saved config)."""
    saved = adapter.parent / "config.yaml"
    if cfg.eval.name or cfg.eval.select is None or not saved.is_file():
        return None
    try:
        d = load_config(saved).data
    except (ConfigError, OSError):
        return None
    here = cfg.data
    if active_mixture(d)[1] is not None or active_mixture(here)[1] is not None or \
            (d.name, d.split, d.split_seed, d.num_examples) != (
                here.name, cfg.eval.split or here.split, here.split_seed, here.num_examples):
        return None
    sel, held = d.select, cfg.eval.select
    if sel is None:
        return (f"was trained on every row of {d.name}, the held-out rows {held} included "
                f"(see {saved})")
    if sel[0] < held[1] and held[0] < sel[1]:
        return (f"was trained on rows {sel} of {d.name}, which overlap the held-out rows {held} "
                f"(see {saved})")
    return None
