"""LoRA adapters and the bases they belong to. Every adapter minigrpo saves carries
minigrpo_base.json: the base it was trained on and the adapters merged into that base first (SFT
merged before GRPO, say). Loading an adapter replays that chain, and an adapter whose recorded
base is not model.name is an error: the MedMCQA seed lost its GRPO phase to an adapter silently
loaded onto the wrong base.

    save_adapter(model, run_dir / "checkpoints/step_000100/adapter")          # checkpoint.py
    model, prov = apply_adapter_chain(base, cfg.model, "runs/sft", merge=True, trainable=False)
    python -m pytest tests/test_sft.py tests/test_export.py                  # the chains, tested

An adapter path may be an adapter directory, a checkpoint (its adapter/) or a run directory (its
newest checkpoint): find_adapter.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from safetensors import SafetensorError

from config import ConfigError, ModelConfig
from sources.hub import resolve_model_path

PROVENANCE = "minigrpo_base.json"


def find_adapter(path: str) -> Path:
    """An adapter directory, checkpoint (its adapter/) or run directory (its newest checkpoint)."""
    p = Path(path).expanduser()
    steps = sorted((p / "checkpoints").glob("step_*"), reverse=True)
    for cand in [p, p / "adapter"] + [c / "adapter" for c in steps if not c.name.endswith(".tmp")]:
        if (cand / "adapter_config.json").is_file():
            return cand
    raise ConfigError(f"{path}: no LoRA adapter there (looked for adapter_config.json in it, its "
                      "adapter/ and its checkpoints)")


def adapter_provenance(adapter: Path) -> dict:
    f = adapter / PROVENANCE
    if f.is_file():
        return json.loads(f.read_text())
    base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return {"base_model": base, "revision": None, "merged": []}  # an adapter from another tool


def check_adapter_base(adapter: Path, mcfg: ModelConfig) -> dict:
    """The adapter's provenance; ConfigError when it was trained on another base than model.name."""
    prov = adapter_provenance(adapter)
    # an adapter saved by plain peft records the path or hub id the base was loaded from
    plain_peft = not (adapter / PROVENANCE).is_file()
    same = prov["base_model"] is not None and prov["base_model"] in (
        mcfg.name, resolve_model_path(mcfg) if plain_peft else None)
    if not same or prov.get("revision") != mcfg.revision:
        raise ConfigError(f"adapter {adapter} was trained on base {prov['base_model']!r} "
                          f"(revision {prov.get('revision')}), but model.name is {mcfg.name!r} "
                          f"(revision {mcfg.revision}); load it on its own base")
    return prov


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_adapter(model, path: Path, trainable: bool = False):
    """peft's PeftModel.from_pretrained; a truncated or corrupt adapter: a ConfigError naming it."""
    from peft import PeftModel
    try:
        return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except (OSError, ValueError, SafetensorError) as e:
        raise ConfigError(f"adapter {path} could not be loaded ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); is it complete?") from None


def apply_adapter_chain(model, mcfg: ModelConfig, adapter_path: str, merge: bool, trainable: bool):
    """Put `adapter_path` on the base `model`, after replaying the merges it was trained on.
    -> (model, provenance of what is now the base). merge folds the adapter into the weights."""
    adapter = find_adapter(adapter_path)
    prov = check_adapter_base(adapter, mcfg)
    if (merge or prov["merged"]) and mcfg.quant == "4bit":
        raise ConfigError("merging an adapter into a 4-bit base is lossy; export the merged model "
                          "first (python -m tools.export), then quantize it")
    merged = []
    for step in prov["merged"]:
        # where it was, else relative to this adapter (a project moved or copied whole)
        places = [Path(step["adapter"])] + (
            [adapter / step["relative"]] if step.get("relative") else [])
        done = next((p for p in places if (p / "adapter_model.safetensors").is_file()
                     and _sha256(p / "adapter_model.safetensors") == step["sha256"]), None)
        if done is None:
            raise ConfigError(f"adapter {adapter} was trained on a base with {step['adapter']} "
                              "merged in, and that adapter is missing or changed; restore it or "
                              "export the merged model")
        model = _load_adapter(model, done).merge_and_unload()
        merged.append({"adapter": str(done.resolve()), "sha256": step["sha256"]})
    if merge:
        model = _load_adapter(model, adapter).merge_and_unload()
        merged.append({"adapter": str(adapter.resolve()),
                       "sha256": _sha256(adapter / "adapter_model.safetensors")})
    else:
        model = _load_adapter(model, adapter, trainable)
    return model, {"base_model": mcfg.name, "revision": mcfg.revision, "merged": merged}


def same_base(a: dict, b: dict) -> bool:
    """Two provenance records name the same base: model, revision and the merged adapters' hashes
    (not where those adapters sat, which a moved project changes)."""
    key = lambda p: (p.get("base_model"), p.get("revision"),  # noqa: E731
                     [m.get("sha256") for m in p.get("merged") or []])
    return key(a) == key(b)


def save_adapter(model, path: Path) -> None:
    """peft's save_pretrained plus the provenance file that makes the chain reloadable.

    An adapter trained on a base with other adapters merged in cannot be loaded onto the base
    alone, yet peft records the bare base in adapter_config.json, where other tools (peft's
    AutoPeftModel, an eval script, the Hub) read it. So there it names no loadable model and says
    why: those tools fail at once instead of loading it onto the wrong base."""
    prov = getattr(model, "minigrpo_base", None)
    # an adapter without its base is the bug this file exists to stop
    if not prov or not prov.get("base_model"):
        raise ValueError("save_adapter: the model carries no minigrpo_base provenance "
                         "(load it with load_policy)")
    model.save_pretrained(path)
    relative = [{**m, "relative": os.path.relpath(m["adapter"], Path(path).resolve())}
                for m in prov["merged"]]
    (path / PROVENANCE).write_text(json.dumps({**prov, "merged": relative}, indent=1))
    if prov["merged"]:
        config = path / "adapter_config.json"
        cfg = json.loads(config.read_text())
        cfg["base_model_name_or_path"] = (
            f"NOT-{prov['base_model']}: {prov['base_model']} with {len(prov['merged'])} adapter(s) "
            f"merged in, see {PROVENANCE}; python -m tools.export makes a loadable model")
        config.write_text(json.dumps(cfg, indent=2))
