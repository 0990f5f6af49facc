"""Serving an export: a Hugging Face Inference Endpoint for the pushed model, and a check that a
server answers what the adapter answers.

    HF_TOKEN=hf_... python -m tools.export --config configs/qgen.yaml --adapter runs/qgen \\
        --out exported/qgen --dtype float16 --push-to-hub me/qgen --create-endpoint qgen
    python -m tools.export check --config configs/qgen.yaml --adapter runs/qgen \\
        --url https://xyz.endpoints.huggingface.cloud/v1 --model qgen --api-key-env HF_TOKEN

--create-endpoint NAME (export.py runs it after a successful push) is the original project's
`--create_endpoint`: vLLM (vllm/vllm-openai:v0.30.0, the newest release in requirements-vllm.txt's
window, read against its source; it still serves Turing, a T4, in float16) on one NVIDIA T4, at most
one replica and none while idle (scaled to zero after 60 idle minutes), through
huggingface_hub.create_inference_endpoint, pinned to the uploaded commit and started with
--max-model-len (default 8192, the original's, within the model's max_position_embeddings and
never under the run's longest prompt + reply) and the repo's name as the served model's. A T4 has
no bfloat16: vLLM refuses such weights there, so the export must be --dtype float16. The token is
$HF_TOKEN's, never printed.

`check` is the original's test_endpoint.py made a comparison: the first --limit held-out prompts of
the config (eval.select or eval.name, rendered as eval.py renders them), each answered greedily by
the adapter (eval.py's local generation) and by the served model (eval.py's API client: chat
completions, temperature 0, the same --max-new-tokens), and the replies compared. A served model
that renders prompts otherwise (a lost chat template, thinking turned on), or another model, should
agree on few or none; rounding to bf16 or fp16 changes a few. Exit 0 when at least --min-agreement
of the answered prompts get the adapter's reply, 1 below it; bad input (no held-out rows, a URL that
does not answer) is one line and exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
from pathlib import Path

import eval as ev
from api.client import Judge, JudgeConfig
from config import ConfigError, JudgeUnusable, load_config
from files import command
from model import load_tokenizer, pick_device
from sources.entries import parse_model_entries
from sources.hub import resolve_model_path

# the original project's endpoint (then vLLM 0.8.5), a T4, scaled to zero after an hour; the vLLM
# release the trainer was checked against (engines/vllm_surface.json), whose platforms/cuda.py keeps
# float16 for Turing and whose FlashInfer and Triton attention serve it
ENDPOINT_IMAGE = "vllm/vllm-openai:v0.30.0"
ENDPOINT_INSTANCE = "nvidia-t4"
ENDPOINT_REGION = "aws/us-east-1"
ENDPOINT_IDLE_MINUTES = 60
NO_BF16 = ("nvidia-t4",)  # compute capability below 8.0: vLLM serves float16 there, not bfloat16


def add_endpoint_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--create-endpoint", metavar="NAME",
                    help="after --push-to-hub, create a Hugging Face Inference Endpoint NAME "
                         f"serving the repo with vLLM ({ENDPOINT_IMAGE}), scaled to zero when idle")
    ap.add_argument("--endpoint-instance", default=ENDPOINT_INSTANCE, metavar="TYPE[:SIZE]",
                    help=f"GPU instance (default {ENDPOINT_INSTANCE}:x1; nvidia-l4 for larger "
                         "models)")
    ap.add_argument("--endpoint-region", default=ENDPOINT_REGION, metavar="VENDOR/REGION",
                    help=f"where it runs (default {ENDPOINT_REGION})")
    ap.add_argument("--endpoint-image", default=ENDPOINT_IMAGE, help="the vLLM container image")
    ap.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                    help="the context the server takes (the endpoint's and the printed vllm serve "
                         "command's); default 8192, the original project's, as far as the model's "
                         "positions reach and never under the run's longest prompt + reply")
    ap.add_argument("--endpoint-idle-minutes", type=int, default=ENDPOINT_IDLE_MINUTES,
                    help="scale to zero after this many idle minutes "
                         f"(default {ENDPOINT_IDLE_MINUTES})")


def check_endpoint_args(args: argparse.Namespace) -> None:
    """--create-endpoint's settings, checked before the base loads (ConfigError: exit 2)."""
    if args.create_endpoint is None:
        return
    if not args.push_to_hub:
        raise ConfigError("--create-endpoint serves the pushed repo; add --push-to-hub ORG/NAME")
    # the endpoints API's names: lowercase letters, digits and hyphens, 4 to 32 characters
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{2,30}[a-z0-9]", args.create_endpoint):
        raise ConfigError(f"--create-endpoint {args.create_endpoint!r} is not an endpoint name: "
                          "4-32 lowercase letters, digits and hyphens, e.g. qgen-t4")
    instance, _, size = args.endpoint_instance.partition(":")
    if not re.fullmatch(r"nvidia-[a-z0-9-]+", instance) or not re.fullmatch(r"x\d+", size or "x1"):
        raise ConfigError(f"--endpoint-instance {args.endpoint_instance!r}: give a GPU instance "
                          "type and size such as nvidia-t4, nvidia-l4 or nvidia-a10g:x4 (vLLM "
                          "needs a GPU)")
    if not re.fullmatch(r"[a-z]+/[a-z0-9-]+", args.endpoint_region):
        raise ConfigError(f"--endpoint-region {args.endpoint_region!r}: give VENDOR/REGION, e.g. "
                          "aws/us-east-1")
    if args.endpoint_idle_minutes < 1:
        raise ConfigError("--endpoint-idle-minutes must be at least 1")
    if instance in NO_BF16 and args.dtype == "bfloat16":
        raise ConfigError(f"--endpoint-instance {instance} has no bfloat16 (vLLM refuses such "
                          "weights there); export with --dtype float16")


def create_endpoint(args: argparse.Namespace, revision: str | None, max_model_len: int,
                    token: str) -> str:
    """Create the endpoint -> the line that says so. It starts (minutes) on the hub's side."""
    import huggingface_hub
    instance, _, size = args.endpoint_instance.partition(":")
    vendor, region = args.endpoint_region.split("/")
    served = args.push_to_hub.split("/")[1]
    endpoint = huggingface_hub.create_inference_endpoint(
        args.create_endpoint, repository=args.push_to_hub, revision=revision,
        framework="pytorch", task="text-generation", accelerator="gpu", instance_type=instance,
        instance_size=size or "x1", vendor=vendor, region=region, min_replica=0, max_replica=1,
        scale_to_zero_timeout=args.endpoint_idle_minutes,
        custom_image={"vLLM": {"url": args.endpoint_image, "port": 8000}},
        container_args=["--max-model-len", str(max_model_len), "--served-model-name", served],
        token=token)
    url = getattr(endpoint, "url", None) or "URL"  # known once it runs
    return (f"[minigrpo] endpoint {args.create_endpoint} created ({getattr(endpoint, 'status', '')}"
            f"): {args.push_to_hub} on {instance}:{size or 'x1'} ({args.endpoint_region}), "
            f"{args.endpoint_image}, at most 1 replica, none after {args.endpoint_idle_minutes} "
            f"idle minutes. Once it runs, check it: python -m tools.export check --config "
            f"{args.config} --adapter {args.adapter} --url {url}/v1 --model {served} "
            "--api-key-env HF_TOKEN")


def parse_check_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m tools.export check",
                                 description="compare a served model's greedy replies with its "
                                             "adapter's on held-out prompts",
                                 epilog="Any config field: --section.key=value")
    ap.add_argument("--config", required=True, help="the YAML config the adapter was trained with")
    ap.add_argument("--adapter", required=True, help="run directory, checkpoint or adapter")
    ap.add_argument("--url", required=True,
                    help="the server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="the served model's name (--served-model-name)")
    ap.add_argument("--api-key-env", default=None, metavar="NAME",
                    help="environment variable holding the server's key (HF_TOKEN for an "
                         "Inference Endpoint); none is sent without it")
    ap.add_argument("--limit", type=int, default=8, help="held-out prompts compared (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="tokens of each reply compared (default 32)")
    ap.add_argument("--min-agreement", type=float, default=0.75,
                    help="share of prompts that must get the adapter's reply (default 0.75)")
    return ap.parse_known_args(argv)


def first_difference(a: str, b: str, tokenizer) -> int | None:
    """The first token at which two replies part (in the model's tokens), None when they agree.

    Whitespace at the ends is not compared: a server may strip it."""
    a, b = a.strip(), b.strip()
    if a == b:
        return None
    ta, tb = (tokenizer(t, add_special_tokens=False).input_ids for t in (a, b))
    return next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))


@command.one_line(ConfigError, JudgeUnusable, stopped="before the check ended (it writes nothing)")
def check_served(argv: list[str]) -> int:
    args, overrides = parse_check_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or not 0 <= args.min_agreement <= 1:
        raise ConfigError("need --limit >= 1, --max-new-tokens >= 1 and --min-agreement in "
                          "[0, 1]")
    if not Path(args.adapter).expanduser().exists():
        raise ConfigError(f"--adapter {args.adapter}: no such run, checkpoint or adapter")
    cfg = load_config(args.config, overrides)
    ev.check_eval_config(cfg)
    adapter, served = parse_model_entries([f"adapter={args.adapter}",
                                           f"served=api:{args.model}"], cfg.model)
    if adapter.kind not in ("adapter", "full"):
        raise ConfigError(f"--adapter {args.adapter}: give a run, checkpoint or adapter")
    try:
        client = Judge(JudgeConfig(base_url=args.url, model=args.model,
                                   # no key: the client sends "EMPTY"
                                   api_key_env=args.api_key_env or "MINIGRPO_NO_KEY",
                                   temperature=0.0, max_tokens=args.max_new_tokens,
                                   max_retries=2), label="--url", key="--url")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with tempfile.TemporaryDirectory() as tmp:  # eval.py keeps partial replies: none here
        cfg.eval = dataclasses.replace(cfg.eval, temperature=0.0, num_samples=1,
                                       max_new_tokens=args.max_new_tokens, limit=args.limit,
                                       out_dir=tmp)
        rows = ev.held_out_rows(cfg)[: args.limit]
        plan = ev.Plan(cfg, [adapter, served], rows, [], pick_device(cfg.run.device), {},
                       {"served": client},
                       load_tokenizer(cfg.model, resolve_model_path(cfg.model)))
        print(f"[minigrpo] check: {len(rows)} held-out prompts, greedy, {args.max_new_tokens} "
              f"tokens: {args.adapter} here, {args.model} at {client.masked(args.url)}",
              file=sys.stderr)
        theirs, _, _ = ev.generate(served, plan)  # first: a wrong URL fails fast
        mine, _, _ = ev.generate(adapter, plan)
    answered = [i for i, failed in enumerate(theirs.failed) if not failed]
    parts = {i: first_difference(mine.texts[i], theirs.texts[i], plan.tokenizer) for i in answered}
    same = sum(p is None for p in parts.values())
    share = same / len(answered)
    print(f"[minigrpo] check: {same} of {len(answered)} prompts get the adapter's greedy reply "
          f"from {args.model} ({share:.0%}; at least {args.min_agreement:.0%} wanted)"
          + (f"; {len(rows) - len(answered)} requests failed" if len(answered) < len(rows) else ""))
    for i, p in parts.items():
        if p is not None:
            print(f"  prompt {i}: they part at token {p}: adapter {mine.texts[i][:80]!r}, served "
                  f"{theirs.texts[i][:80]!r}")
    return 0 if share >= args.min_agreement else 1
