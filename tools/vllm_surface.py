"""What a real vLLM wheel offers the trainer, read from its source without importing it (no CUDA
needed): the signatures of LLM(...), generate, sleep and wake_up, the fields of EngineArgs,
SamplingParams, LoRARequest and PEFTHelper (the adapter_config.json keys it reads: any other it
ignores), the LoRA ranks vLLM accepts, the structured-output fields its OpenAI server reads, and
which text-generation architectures it serves with LoRA (and which of their embedding modules).

    pip download --no-deps vllm==0.32.0 -d /tmp/w      # a wheel of each version to record
    python -m tools.vllm_surface /tmp/w/vllm-0.27.0-*.whl /tmp/w/vllm-0.30.0-*.whl \\
        /tmp/w/vllm-0.32.0-*.whl --server /tmp/w/vllm-0.10.2-*.whl \\
        --server /tmp/w/vllm-0.11.0-*.whl --out engines/vllm_surface.json

--server wheels (versions outside the window) record only their server's structured-output fields
(docs/rewards-and-judges.md states from which version `structured_outputs` is read).

engines/vllm_surface.json, written so, is what the trainer checks an adapter against before vLLM
starts (engines/vllm_startup.py: the installed version's, the newest stored at or below it) and
what the test fake's surface is compared with (tests/test_vllm_engine.py). Only vllm/*.py is read
(ast), never executed.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

from files.jsonl import write_atomic

CALLS = {"LLM.__init__": ("entrypoints/llm.py", "LLM", "__init__"),
         "LLM.generate": ("entrypoints/llm.py", "LLM", "generate"),
         "LLM.sleep": ("entrypoints/llm.py", "LLM", "sleep"),
         "LLM.wake_up": ("entrypoints/llm.py", "LLM", "wake_up")}
FIELDS = {"EngineArgs": ("engine/arg_utils.py", "EngineArgs"),
          "SamplingParams": ("sampling_params.py", "SamplingParams"),
          "LoRARequest": ("lora/request.py", "LoRARequest"),
          "PEFTHelper": ("lora/peft_helper.py", "PEFTHelper")}  # the adapter_config.json keys read
OUTPUT_FIELDS = ("structured_outputs", "guided_regex", "guided_choice", "guided_json")


def read_wheel(path: Path) -> dict[str, str]:
    """{path under vllm/: source} of the wheel's Python files."""
    with zipfile.ZipFile(path) as z:
        return {n.removeprefix("vllm/"): z.read(n).decode("utf-8", "replace")
                for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")}


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def params(fn: ast.FunctionDef) -> str:
    """The parameter list as written, without annotations: "self, prompts, *, use_tqdm=True"."""
    a = fn.args
    for p in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
        if p is not None:
            p.annotation = None
    return ast.unparse(a)


def fields(cls: ast.ClassDef) -> list[str]:
    """The annotated class attributes: a dataclass's, msgspec Struct's or pydantic model's."""
    return [n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and not n.target.id.startswith("_")
            and "ClassVar" not in ast.unparse(n.annotation)]


def lora_ranks(src: str) -> list[int]:
    """config/lora.py's MaxLoRARanks = Literal[...]."""
    m = re.search(r"MaxLoRARanks\s*=\s*Literal\[([^\]]*)\]", src)
    return [int(x) for x in m.group(1).split(",")]


def chat_fields(files: dict[str, str]) -> list[str]:
    """The structured-output fields of the OpenAI server's ChatCompletionRequest."""
    for path, src in files.items():
        if path.startswith("entrypoints/") and "class ChatCompletionRequest(" in src:
            got = set(fields(find_class(ast.parse(src), "ChatCompletionRequest")))
            return [f for f in OUTPUT_FIELDS if f in got]
    return []


def lora_archs(files: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
    """The text-generation architectures of vLLM's registry -> ({architecture with LoRA: the
    embedding modules its LoRA may adapt, e.g. embed_tokens, lm_head}, [those without LoRA]).
    A class serves LoRA when it or a base class (by name, anywhere under model_executor/models/)
    lists SupportsLoRA; its embedding_modules is its own dict or its nearest base class's."""
    bases: dict[str, set[str]] = {}
    embedding: dict[str, list[str]] = {}
    for path, src in files.items():
        if path.startswith("model_executor/models/"):
            for n in ast.walk(ast.parse(src)):
                if isinstance(n, ast.ClassDef):
                    names = {ast.unparse(b).rsplit(".", 1)[-1].split("[")[0] for b in n.bases}
                    bases.setdefault(n.name, set()).update(names)
                    for a in n.body:
                        if isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(
                                a.value, ast.Dict) and "embedding_modules" in ast.unparse(
                                a.targets[0] if isinstance(a, ast.Assign) else a.target):
                            embedding[n.name] = sorted(k.value for k in a.value.keys
                                                       if isinstance(k, ast.Constant))

    def find(name: str, want, seen: frozenset = frozenset()):
        if want(name):
            return name
        return next((hit for b in sorted(bases.get(name, ())) if b not in seen
                     for hit in [find(b, want, seen | {name})] if hit), None)
    tree = ast.parse(files["model_executor/models/registry.py"])
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "_TEXT_GENERATION_MODELS")
    served, refused = {}, []
    for arch, (_, cls) in ast.literal_eval(table).items():
        if find(cls, lambda c: c == "SupportsLoRA"):
            owner = find(cls, lambda c: c in embedding)
            served[arch] = embedding[owner] if owner else []
        else:
            refused.append(arch)
    return served, sorted(refused)


def surface(files: dict[str, str]) -> dict:
    """The trainer-facing surface of one vLLM source tree."""
    out: dict = {}
    for key, (path, cls, fn) in CALLS.items():
        c = find_class(ast.parse(files[path]), cls)
        out[key] = params(next(n for n in c.body if isinstance(n, ast.FunctionDef)
                               and n.name == fn))
    for key, (path, cls) in FIELDS.items():
        out[key] = fields(find_class(ast.parse(files[path]), cls))
    out["max_lora_ranks"] = lora_ranks(files["config/lora.py"])
    out["chat_request_fields"] = chat_fields(files)
    out["lora_archs"], out["no_lora_archs"] = lora_archs(files)
    return out


def version_of(files: dict[str, str]) -> str:
    return re.search(r"__version__ = version = '([^']+)'", files["_version.py"]).group(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", nargs="+", type=Path, help="vllm-X-*.whl files")
    ap.add_argument("--server", type=Path, action="append", default=[], metavar="WHEEL",
                    help="a wheel of which to record only the server's structured-output fields")
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    versions = {}
    for wheel, full in [(w, False) for w in args.server] + [(w, True) for w in args.wheels]:
        files = read_wheel(wheel)
        versions[version_of(files)] = (surface(files) if full
                                       else {"chat_request_fields": chat_fields(files)})
        print(f"{wheel.name}: read", file=sys.stderr)
    doc = {"about": "tools/vllm_surface.py's reading of these vLLM wheels", "versions": versions}
    text = json.dumps(doc, indent=1, sort_keys=True)
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)
    write_atomic(args.out, text + "\n")  # a list of names on one line
    return 0


if __name__ == "__main__":
    sys.exit(main())
