"""Evaluate models side by side on held-out rows: the base, adapters, merged exports, API models.

    # your own config
    python eval.py --config my_task.yaml --models base sft=runs/sft grpo=runs/grpo api:gpt-4o-mini
    # any --section.key=value
    python eval.py --config configs/quickstart.yaml --models base runs/quickstart --eval.limit=50

The config is the training YAML; its `eval` section picks the held-out rows (eval.select, after
the data.split_seed shuffle; or eval.name, a test file of its own) and the decoding. Model entries:
  base             model.name as configured
  [NAME=]PATH      a run directory (newest checkpoint), checkpoint or adapter directory, loaded on
                   its run's recorded base (model.name, or e.g. a merged SFT phase) with the merges
                   it was trained on; or a full model directory with config.json (a merged export)
  [NAME=]hf:ORG/REPO[@REV] a hub model or adapter, downloaded, then read as PATH is
  [NAME=]api:MODEL chat completions from the eval.api endpoint (model field replaced by MODEL), or
                   from eval.apis.MODEL (a named endpoint with its own model and settings)
Names default to `base`, the directory or repo name, or MODEL. Writes eval.out_dir/results.json (the
config and per-model metrics; never overwritten without --overwrite) and predictions_<name>.jsonl
(one line per completion: its row, the prompt, the forced assistant_prefix, the completion, its
rewards, and under "columns" the row's eval.keep_columns), and prints the metrics as a table.

Each model is scored (judge requests) in the background while the next one generates; `seconds` is
a model's time from the start of its generation until it was scored. A local model's completions
are also appended batch by batch to partial_<name>.jsonl: an eval that was killed, run again with
the same eval.out_dir, generates only what is missing (generate_resumable); judge and API replies
come back from their caches when those have a cache_path.

Local models see the prompt exactly as in training (chat template, system prompt, forced
assistant_prefix) and decode greedily when eval.temperature is 0, else sample eval.num_samples
completions per prompt (seeded with run.seed). API models get the same messages without the forced
prefix (rewards then see assistant_prefix=""), eval.num_samples completions per prompt at the
endpoint's own temperature and max_tokens (each sample cached under its own index); their length is
counted in the base model's tokens. A prompt with a failed request is left out whole.

Metrics: see scoring/metrics.py, which computes them (formulas in its docstring).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors import SafetensorError

import rollout
from api.client import Judge, JudgeConfig
from config import (
    Config,
    ConfigError,
    EvalConfig,
    JudgeUnusable,
    ModelConfig,
    RewardSpec,
    active_mixture,
    data_label,
    load_config,
    saved_dict,
)
from data import Source, check_not_data_file, load_sources
from files import command, jsonl
from files.command import interrupted, is_write_error
from judge import judges_stats
from model import load_inference, load_tokenizer, pick_device, pick_dtype
from parallel import seeds
from rewards import (
    RewardResult,
    answer_key,
    compute_rewards,
    in_background,
    reward_context,
    reward_keys,
)
from scoring.checks import check_rows, open_rewards, open_scoring
from scoring.metrics import failed_prompts, majority_accuracy, model_metrics, per_source_metrics
from settings.typed_config import check_writable
from sources import seen_prompts
from sources.entries import ModelEntry, parse_model_entries, trained_on_held_out
from sources.hub import resolve_model_path


@dataclass
class Generated:
    texts: list[str]  # (N,) completions, prompt-major: prompt i's samples are i*n .. i*n+n-1
    num_tokens: list[int]  # (N,) completion tokens up to and including the first EOS
    truncated: list[bool] | None  # (N,) no EOS within max_new_tokens (API: cut at their max_tokens)
    failed: list[bool] | None = None  # (N,) API requests with no reply: not scored, not in metrics


def check_eval_config(cfg: Config) -> None:
    e = cfg.eval
    if e.select is None and not e.name:
        raise ConfigError("eval.select is not set: give the held-out rows [start, end), e.g. "
                          "--eval.select=[1500,1700], or a held-out file of their own, eval.name")
    ranges = {"num_samples": e.num_samples >= 1, "batch_size": e.batch_size >= 1,
              "max_new_tokens": e.max_new_tokens >= 1, "limit": e.limit >= 0,
              "temperature": e.temperature >= 0, "top_p": 0 < e.top_p <= 1}
    if bad := [k for k, ok in ranges.items() if not ok]:
        raise ConfigError(f"eval.{bad[0]}={getattr(e, bad[0])} is out of range (num_samples, "
                          "batch_size, max_new_tokens >= 1; limit, temperature >= 0; "
                          "top_p in (0, 1])")
    if e.temperature == 0 and e.num_samples > 1:
        raise ConfigError("eval.num_samples > 1 needs eval.temperature > 0: "
                          "greedy decoding repeats one completion")
    if bad := [k for k in e.pass_k if not 1 <= k <= e.num_samples]:
        raise ConfigError(f"eval.pass_k {bad}: each k must be in "
                          f"[1, eval.num_samples={e.num_samples}]")
    keys = dict(zip(reward_keys(cfg.rewards), cfg.rewards))
    for pair in e.agreement:
        if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(keys):
            raise ConfigError(f"eval.agreement {pair}: each entry is two different reward labels "
                              f"of {list(keys)}")
        # a failed call must not count as a score
        if bad := [k for k in pair if keys[k].fallback != "skip"]:
            raise ConfigError(f"eval.agreement {pair}: set fallback: skip on reward {bad[0]!r}, "
                              "so that a failed judge call is left out rather than compared as "
                              "a score")


@torch.no_grad()
def generate_local(model, tokenizer, prompts: list[str], max_new_tokens: int, num_samples: int = 1,
                   temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 16,
                   share_prompt: bool = True,
                   on_batch: Callable[[int, Generated], None] | None = None,
                   stop_strings: list[str] = ()) -> Generated:
    """num_samples completions per rendered prompt, batch_size prompts per generate call (left
    padded); greedy when temperature == 0. Completions end at (and include) the first EOS, or a stop
    string (rollout.stop_strings: they end training's completions, so they end these too).
    share_prompt: each prompt is prefilled once for its num_samples rows (rollout.prefill_shared).
    on_batch(first prompt's index, that batch's completions) runs after each call."""
    as_gen = lambda r: Generated(r.texts, r.num_tokens(),  # noqa: E731
                                 r.truncated.tolist())
    r = rollout.generate_in_slices(model, tokenizer, prompts, batch_size, num_samples,
                                max_new_tokens, temperature, top_p, share_prompt=share_prompt,
                                stop_strings=list(stop_strings),
                                on_slice=on_batch and (lambda s, part: on_batch(s, as_gen(part))))
    return as_gen(r)


def _weights_stamp(path: str | None) -> list:
    """A local model or adapter directory's weight files by name, size and time: changed weights,
    another key."""
    p = Path(path).expanduser() if path else None
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(p.glob("*.safetensors"))] if p and p.is_dir() else []


def generation_key(entry: ModelEntry, mcfg: ModelConfig, cfg: Config, prompts: list[str],
                   device: torch.device) -> str:
    """What a local model's completions depend on: its weights, the device and the dtype used there
    (model.dtype auto is bf16 on a GPU, fp32 on a CPU), the prompts, the decoding and the seed; not
    eval.batch_size, which a rerun after running out of memory may lower."""
    e = cfg.eval
    what = [entry.kind, entry.target, mcfg.name, mcfg.revision, str(device),
            str(pick_dtype(mcfg.dtype, device)), mcfg.quant, _weights_stamp(entry.target),
            _weights_stamp(mcfg.name), e.max_new_tokens, e.num_samples, e.temperature, e.top_p,
            cfg.run.seed, prompts]
    # (keys from before they applied stay valid)
    what += [cfg.rollout.stop_strings] if cfg.rollout.stop_strings else []
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def generate_resumable(model, tok, entry: ModelEntry, mcfg: ModelConfig, plan: Plan) -> Generated:
    """generate_rows, each batch appended to eval.out_dir/partial_<name>.jsonl as it is done; an
    interrupted eval run again reads the batches of the same model, prompts and decoding (its
    generation_key; lines of another key stay, unused) from there and generates only the rest. main
    deletes the file once results.json is written. Sampled completions after the resume point come
    from a fresh seed (run.seed + the prompts done), so they differ from those of an uninterrupted
    run; greedy ones do not."""
    cfg, e = plan.cfg, plan.cfg.eval
    prompts = rollout.render_rows(tok, plan.rows, cfg.data, what="held-out row")
    path, key, n = (Path(e.out_dir) / f"partial_{entry.name}.jsonl",
                    generation_key(entry, mcfg, cfg, prompts, plan.device), e.num_samples)
    done = Generated([], [], [])
    for _, _, rec in jsonl.read(path) if path.is_file() else ():
        if rec and rec.get("key") == key and rec.get("start") == len(done.texts) // n:
            done.texts += rec["texts"]
            done.num_tokens += rec["num_tokens"]
            done.truncated += rec["truncated"]
    p = len(done.texts) // n
    if p:
        print(f"[eval] {entry.name}: {p} of {len(prompts)} prompts' completions from {path} "
              "(an interrupted run)", file=sys.stderr)
        seeds.seed_everything(cfg.run.seed + p)
    if p < len(prompts):
        t0 = time.monotonic()

        def save(s: int, g: Generated) -> None:  # each batch kept, and where the model stands
            jsonl.append(path, [{"key": key, "start": p + s, "texts": g.texts,
                                 "num_tokens": g.num_tokens, "truncated": g.truncated}])
            print(batch_line(entry.name, p, p + s + len(g.texts) // n, len(prompts),
                             time.monotonic() - t0), file=sys.stderr, flush=True)
        rest = generate_prompts(model, tok, prompts[p:], cfg, on_batch=save)
        done = Generated(done.texts + rest.texts, done.num_tokens + rest.num_tokens,
                         done.truncated + rest.truncated)
    return done


def batch_line(name: str, start: int, done: int, total: int, seconds: float) -> str:
    """The line after each batch of a model's prompts: how many are done, and the time left at the
    pace of this run's batches (those from an interrupted run, before `start`, took none).

    >>> batch_line("base", 0, 32, 100, 20.0)
    '[eval] base: 32/100 prompts generated (20 s, about 42 s left)'
    """
    left = seconds / max(done - start, 1) * (total - done)
    return (f"[eval] {name}: {done}/{total} prompts generated ({seconds:.0f} s"
            + (f", about {left:.0f} s left)" if done < total else ")"))


def generate_api(client: Judge, messages: list[list[dict]], tokenizer, n: int = 1) -> Generated:
    """n chat completions per prompt through Judge.complete_many (cache, retries, concurrency,
    cost); a failed request leaves an empty completion, marked failed."""
    replies = client.complete_many(messages, n)
    if replies and all(r is None for r in replies):  # a model that never answered: no finished eval
        why = client.first_failure[:300] or "see the warnings above"
        raise JudgeUnusable(client.masked(f"{client.label}: all {len(replies)} requests failed "
                                          f"({why}); nothing was scored"))
    texts = [r or "" for r in replies]
    num_tokens = [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
    return Generated(texts, num_tokens, client.was_cut(messages, n),
                     failed=[r is None for r in replies])


def held_out_sources(cfg: Config) -> list[Source]:
    """eval.select's rows (from eval.split) of each data source, or of the file eval.name (in its
    own order), the first eval.limit of each when set."""
    e, data = cfg.eval, cfg.data
    if e.name:
        # num_examples: eval.limit caps it; revision: data.revision is the training set's commit
        data = dataclasses.replace(data, name=e.name, config_name=e.config_name or data.config_name,
                                   revision=None, mixture=None, presets={}, preset=None,
                                   split_seed=None, select=None, num_examples=0)
    sources = load_sources(data, select=e.select, hub_split=e.split,
                           key="eval.name" if e.name else "data.name")
    return [dataclasses.replace(s, rows=s.rows[: e.limit], positions=s.positions[: e.limit])
            for s in sources] if e.limit else sources


def held_out_rows(cfg: Config) -> list[dict]:
    return [row for src in held_out_sources(cfg) for row in src.rows]


def generate_prompts(model, tok, prompts: list[str], cfg: Config, on_batch=None) -> Generated:
    """A local model's eval.num_samples completions of each rendered prompt, decoded as the eval
    section says."""
    e = cfg.eval
    return generate_local(model, tok, prompts, e.max_new_tokens, e.num_samples, e.temperature,
                          e.top_p, e.batch_size, cfg.grpo.share_prompt is not False,
                          on_batch=on_batch, stop_strings=cfg.rollout.stop_strings)


def generate_rows(model, tok, rows: list[dict], cfg: Config) -> Generated:
    """generate_prompts of the rows, rendered as training renders them."""
    return generate_prompts(model, tok,
                            rollout.render_rows(tok, rows, cfg.data, what="held-out row"), cfg)


def score_rows(gen: Generated, rows: list[dict], n: int, cfg: Config, assistant_prefix: str,
               judges: dict[str, Judge],
               forced_prefix: str | None = None) -> tuple[list[dict], RewardResult, dict]:
    """-> (the row of each of the n-per-row completions, their rewards, model_metrics). Completions
    whose API request failed are not scored (no judge is paid for them) and are left out of the
    metrics, which count them as api_failures instead: an outage must not read as wrong answers."""
    samples = [r for r in rows for _ in range(n)]
    left_out = failed_prompts(gen.failed, n)
    answered = [p for p in range(len(rows)) if p not in left_out]
    # API entries only; a prompt with a failed sample is left out whole (pass@k needs all n)
    if len(answered) < len(rows):
        keep = [i for p in answered for i in range(p * n, (p + 1) * n)]
        sub = Generated([gen.texts[i] for i in keep], [gen.num_tokens[i] for i in keep], None)
        _, res, metrics = score_rows(sub, [rows[p] for p in answered], n, cfg, assistant_prefix,
                                     judges, forced_prefix) if keep \
            else (None, RewardResult([], {}, {}), {"n": 0})
        per_reward = {k: [None] * len(samples) for k in res.per_reward}
        total = [math.nan] * len(samples)
        for j, i in enumerate(keep):
            total[i] = res.total[j]
            for k in per_reward:
                per_reward[k][i] = res.per_reward[k][j]
        return samples, RewardResult(total, per_reward, res.errors), metrics
    res = compute_rewards(gen.texts, samples, cfg.rewards, num_tokens=gen.num_tokens,
                          context=reward_context(assistant_prefix, judges, forced_prefix, n))
    metrics = model_metrics(res, gen.num_tokens, gen.truncated, n,
                            cfg.eval.pass_k if n > 1 else [], cfg.eval.agreement)
    spec = next((s for s, k in zip(cfg.rewards, reward_keys(cfg.rewards))
                 if k == "answer_match" and s.name == "answer_match"), None)
    if spec is not None and n > 1:  # self-consistency: the answer most samples give, against gold
        args = {k: v for k, v in spec.args.items() if k != "assistant_prefix"}
        votes = [answer_key(t, assistant_prefix, **args) for t in gen.texts]
        metrics[f"maj@{n}"] = majority_accuracy(votes, res.per_reward["answer_match"], n)
    return samples, res, metrics


def api_section(e: EvalConfig, target: str) -> tuple[str, JudgeConfig]:
    """(config key, client settings) of an api:TARGET entry: eval.apis.TARGET as written, else
    eval.api asking for model TARGET."""
    if target in e.apis:
        if not e.apis[target].model:
            raise ConfigError(f"eval.apis.{target}.model is not set: name the model this endpoint "
                              "should answer with")
        return f"eval.apis.{target}", e.apis[target]
    if e.api is None:
        raise ConfigError(f"model entry api:{target}: {target!r} is not one of eval.apis "
                          f"({', '.join(e.apis) or 'none'}) and there is no eval.api section "
                          "(base_url, api_key_env; the model comes from the entry)")
    return "eval.api", dataclasses.replace(e.api, model=target)


@dataclass
class Plan:
    """Everything checked before any model loads or any file is written."""
    cfg: Config
    entries: list[ModelEntry]
    rows: list[dict]  # the held-out rows, after eval.limit
    where: list[dict]  # each row's position in its source ("row": after the split's shuffle,
    #   before data.map) and, with several, its source
    device: torch.device
    judges: dict[str, Judge]  # for judge-based rewards, by name ("judge": the judge: section)
    api: dict[str, Judge]  # entry name -> client, for api: entries
    tokenizer: object  # the base's tokenizer, counts API completion tokens (None if no api entries)
    # entry name -> held-out rows its runs trained on (sources/seen_prompts.py)
    trained_on: dict[str, int] = field(default_factory=dict)


def setup(args: argparse.Namespace, overrides: list[str]) -> Plan:
    """The Plan: the config, the model entries, judges and API clients, the held-out rows and
    their places, all checked before any model loads or any file is written."""
    cfg = load_config(args.config, overrides)
    check_eval_config(cfg)
    check_out_dir(cfg.eval.out_dir, args.overwrite)
    entries = parse_model_entries(args.models, cfg.model)  # hf: entries download here
    judges = open_scoring(cfg)
    api = open_api_entries(cfg, entries)
    sources = held_out_sources(cfg)
    rows = [row for s in sources for row in s.rows]
    trained_on = held_out_seen(cfg, entries, rows)
    check_rows(cfg.rewards, rows, "held-out")
    check_keep_columns(cfg.eval.keep_columns, sources)
    where = row_places(cfg, sources, rows)
    tokenizer = load_tokenizer(cfg.model, resolve_model_path(cfg.model)) if api else None
    open_rewards(cfg.rewards)  # a reward model loads last, once everything cheaper is checked
    return Plan(cfg, entries, rows, where, pick_device(cfg.run.device), judges, api, tokenizer,
                trained_on)


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """eval.out_dir is a writable directory without a results.json (unless --overwrite)."""
    check_writable(out_dir, "eval.out_dir")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"eval.out_dir={out_dir} is a file; give a directory")
    if (Path(out_dir) / "results.json").exists() and not overwrite:
        raise ConfigError(f"{Path(out_dir) / 'results.json'} exists; pass --overwrite or "
                          "set another eval.out_dir")


def open_api_entries(cfg: Config, entries: list[ModelEntry]) -> dict[str, Judge]:
    """entry name -> its client, for each api: entry, its section's cache and temperature
    checked."""
    api = {}
    for e in [e for e in entries if e.kind == "api"]:
        key, section = api_section(cfg.eval, e.target)
        check_not_data_file(cfg.data, section.cache_path, f"{key}.cache_path")
        if section.cache_path:
            check_writable(section.cache_path, f"{key}.cache_path")
        if cfg.eval.num_samples > 1 and section.temperature == 0:
            raise ConfigError(
                f"{key}.temperature is 0 but eval.num_samples={cfg.eval.num_samples}: the samples "
                "would repeat one answer; set a temperature (or null: the model's default)")
        try:
            api[e.name] = Judge(section, label=f"{key} ({section.model})", key=key)
        except ValueError as err:
            raise ConfigError(str(err)) from None  # it names the section
    return api


def held_out_seen(cfg: Config, entries: list[ModelEntry], rows: list[dict]) -> dict[str, int]:
    """entry name -> how many held-out rows its runs trained on (sources/seen_prompts.py), with a
    warning for each, and one for the entries with no record when the rows may overlap."""
    trained_on, unknown = {}, []  # entries with no record
    for e in [e for e in entries if e.kind in ("adapter", "full")]:
        if (record := seen_prompts.recorded_file(e.target)) is None:
            unknown.append(e.name)
            # another tool's: by config
            if e.kind == "adapter" and (seen := trained_on_held_out(Path(e.target), cfg)):
                print(f"[eval] warning: {e.name} {seen}", file=sys.stderr)
        elif k := seen_prompts.count(rows, seen_prompts.read(record)):  # by content
            trained_on[e.name] = k
            print(f"[eval] warning: {e.name} was trained on {k} of the {len(rows)} held-out "
                  f"prompts (the same text, {record}): its numbers on them overstate what "
                  "it learned", file=sys.stderr)
    if unknown and cfg.data.select is None and cfg.eval.split in (None, cfg.data.split) and \
            not (cfg.eval.name or active_mixture(cfg.data)[1]):
        print(f"[eval] warning: data.select is not set, so the training of {', '.join(unknown)} "
              "may have used these rows too", file=sys.stderr)
    return trained_on


def check_keep_columns(keep_columns: list[str], sources: list[Source]) -> None:
    """Every source's rows have each of eval.keep_columns."""
    for col in keep_columns:
        if missing := [s for s in sources if col not in s.rows[0]]:
            raise ConfigError(f"eval.keep_columns: the rows of {missing[0].label} have no column "
                              f"{col!r}; they have: {', '.join(missing[0].rows[0])}")


def row_places(cfg: Config, sources: list[Source], rows: list[dict]) -> list[dict]:
    """Each held-out row's place: its row in its source, the source (with several) and its
    eval.group_by group ("<column>=<value>")."""
    start = cfg.eval.select[0] if cfg.eval.select else 0
    where = [{"row": start + j, **({"source": s.label} if len(sources) > 1 else {})}
             for s in sources for j in s.positions]
    if col := cfg.eval.group_by:  # each held-out row's group: "<column>=<value>"
        first: dict[str, int] = {}  # group -> its first row, for values printing alike (1 and "1")
        for j, (w, r) in enumerate(zip(where, rows)):
            if r.get(col) in (None, "") or isinstance(r[col], (list, dict)):
                raise ConfigError(f"eval.group_by: held-out row {j} has no value (text or a "
                                  f"number) in column {col!r}; its columns: {', '.join(r)}")
            w["group"] = f"{col}={r[col]}"
            k = first.setdefault(w["group"], j)
            if type(rows[k][col]) is not type(r[col]):
                raise ConfigError(f"eval.group_by: column {col!r} holds {rows[k][col]!r} (held-out "
                                  f"row {k}) and {r[col]!r} (row {j}), one group by name; make "
                                  "them one type in the data (or with a data.map)")
    return where


def generate(entry: ModelEntry, plan: Plan) -> tuple[Generated, int, str]:
    """One model's completions of every held-out row -> (them, samples per row, the start of each
    reply that the rewards put back, rollout.reply_prefix: none for API models)."""
    cfg = plan.cfg
    if entry.kind == "api":
        messages = [rollout.chat_messages(r["prompt"], cfg.data.system_prompt) for r in plan.rows]
        return (generate_api(plan.api[entry.name], messages, plan.tokenizer, cfg.eval.num_samples),
                cfg.eval.num_samples, "")
    try:
        if entry.kind == "full":  # a merged export: its directory is model, config and tokenizer
            mcfg = dataclasses.replace(cfg.model, name=entry.target, revision=None)
            model, tok = load_inference(mcfg, plan.device)
        else:
            mcfg = (dataclasses.replace(cfg.model, name=entry.base, revision=entry.revision)
                    if entry.base else cfg.model)
            model, tok = load_inference(mcfg, plan.device,
                                        adapter=entry.target if entry.kind == "adapter" else None)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # truncated, corrupt weights
        if isinstance(e, ConfigError) or "out of memory" in str(e).lower():
            raise
        raise ConfigError(f"model entry {entry.spec!r}: could not load it: {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:300]}") from None
    seeds.seed_everything(cfg.run.seed)  # every model samples from the same seed
    gen = generate_resumable(model, tok, entry, mcfg, plan)
    prefix = rollout.reply_prefix(tok, cfg.data)  # an export's own template may open a think block
    del model, tok
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
    return gen, cfg.eval.num_samples, prefix


def score_model(entry: ModelEntry, plan: Plan, gen: Generated, n: int, prefix: str,
                t0: float) -> dict:
    """Score one model's completions, write its predictions_<name>.jsonl at once (a later model's
    failure loses nothing paid for) -> its metrics. Runs in the background while the next model
    generates (main), one model at a time, so the judge counters it reads are this model's alone."""
    cfg = plan.cfg
    # recorded: what tools/bestofn.py's SFT rows put back
    forced = "" if entry.kind == "api" else cfg.data.assistant_prefix
    samples, res, metrics = score_rows(gen, plan.rows, n, cfg, prefix, plan.judges, forced)
    for key in ("source", "group"):
        if plan.where and key in plan.where[0]:
            metrics |= per_source_metrics(plan.where, n, res, gen.failed, key)
    if entry.kind == "api":
        metrics |= api_metrics(entry.name, plan.api[entry.name], gen.failed, n)
    metrics |= {k: v for k, v in judges_stats(plan.judges).items()
                if k.endswith(("failures", "cost_usd"))}
    warn_reward_errors(entry.name, metrics, cfg.rewards)
    if entry.name in plan.trained_on:  # in results.json and the table, not only in a warning
        metrics["trained_on_held_out"] = plan.trained_on[entry.name]
    metrics["seconds"] = round(time.time() - t0, 2)
    jsonl.write_records(Path(cfg.eval.out_dir) / f"predictions_{entry.name}.jsonl",
                        prediction_records(plan, gen, n, samples, res, forced), default=str)
    return metrics


def api_metrics(name: str, client: Judge, failed: list[bool], n: int) -> dict:
    """An API model's failed requests and cost, with a warning when some failed."""
    stats = client.pop_step_stats()
    failures = sum(failed)
    if failures:
        left = len(failed_prompts(failed, n))
        print(f"[eval] {name}: {failures} of {len(failed)} API requests failed; its "
              f"metrics leave out the {left} prompt(s) they belong to (see the warnings above "
              "for why)", file=sys.stderr)
    return {"api_failures": failures, "api_cost_usd": stats["judge_cost_usd"]}


def warn_reward_errors(name: str, metrics: dict, rewards: list[RewardSpec]) -> None:
    """A warning for each reward that could not score some completions: a judge outage must not
    read as bad answers."""
    # "judge#2" for a repeated name, as the metrics
    specs = dict(zip(reward_keys(rewards), rewards))
    for key in (k for k in metrics if k.startswith("reward_errors/")):
        reward = key.split("/", 1)[1]
        spec = specs.get(reward)
        fate = ("were left out of it" if spec and spec.fallback == "skip"
                else f"got its fallback ({spec.fallback if spec else '?'})")
        print(f"[eval] {name}: reward {reward} could not score {metrics[key]} completion(s), "
              f"which {fate}; see the warnings above", file=sys.stderr)


def prediction_records(plan: Plan, gen: Generated, n: int, samples: list[dict],
                       res: RewardResult, forced: str) -> list[dict]:
    """predictions_<name>.jsonl's lines: one a completion, with its row's place, prompt, rewards
    and flags (module docstring)."""
    cfg = plan.cfg
    keys = list(res.per_reward)
    kept = lambda s: ({"columns": {k: s.get(k) for k in cfg.eval.keep_columns}}  # noqa: E731
                      if cfg.eval.keep_columns else {})
    return [{**plan.where[i // n], **kept(s), "sample": i % n, "prompt": s["prompt"],
             **({"assistant_prefix": forced} if forced else {}), "completion": text,
             **({"gold": s.get(cfg.data.answer_key)} if cfg.data.answer_key else {}),
             "num_tokens": nt, "reward": None if math.isnan(total) else total,
             "rewards": {k: res.per_reward[k][i] for k in keys},
             **({"api_failed": True} if gen.failed and gen.failed[i] else {}),
             **({"truncated": True} if gen.truncated and gen.truncated[i] else {})}
            for i, (s, text, nt, total)
            in enumerate(zip(samples, gen.texts, gen.num_tokens, res.total))]


def _fmt(v) -> str:
    """A table cell: 3 decimals, or 3 significant digits if small and nonzero (a cost of $0.00027).

    >>> _fmt(0.75), _fmt(0.00027), _fmt(0.0), _fmt(None), _fmt(12)
    ('0.750', '0.00027', '0.000', '-', '12')
    """
    if not isinstance(v, float):
        return "-" if v is None else str(v)
    return f"{v:.3g}" if 0 < abs(v) < 0.001 else f"{v:.3f}"


def render_table(results: dict[str, dict], title: str = "held-out evaluation") -> Table:
    """A rich Table: one row per metric, one column per model ("-" where a model lacks it)."""
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for name in results:
        table.add_column(name, justify="right")
    for key in dict.fromkeys(k for m in results.values() for k in m):
        table.add_row(key, *(_fmt(m.get(key)) for m in results.values()))
    return table


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Any config field: --section.key=value", allow_abbrev=False)
    ap.add_argument("--config", required=True,
                    help="the training YAML (its eval section drives this script)")
    ap.add_argument("--models", nargs="+", required=True,
                    help="base, [NAME=]PATH, [NAME=]hf:ORG/REPO or [NAME=]api:MODEL entries")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing eval.out_dir/results.json")
    # --section.key=value overrides are taken out first: argparse reads one holding a space
    # ("--eval.agreement=[[a, b]]") as another --models entry
    own = {a.option_strings[0] for a in ap._actions}
    overrides = [a for a in argv
                 if a.startswith("--") and "=" in a and a.split("=", 1)[0] not in own]
    args, unknown = ap.parse_known_args([a for a in argv if a not in overrides])
    return args, overrides + unknown


@command.one_line(ConfigError)
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    plan = setup(args, overrides)
    try:
        return run(plan)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM
        signame, code = interrupted(e)
        print(f"\n[eval] interrupted ({signame}): the completions generated so far are kept in "
              f"{plan.cfg.eval.out_dir}/partial_*.jsonl, judge and API replies in their caches; "
              "run the same command again to go on from there", file=sys.stderr)
        return code
    except OSError as e:  # a full disk, a folder made read-only meanwhile
        if not is_write_error(e):
            raise
        print(f"error: cannot write in {plan.cfg.eval.out_dir}: {e.strerror or e}"
              + (f" ({e.filename})" if e.filename else "") + "; free space and run the same "
              "command again (what was generated is kept)", file=sys.stderr)
        return 2


def run(plan: Plan) -> int:
    """Generate and score every model, write results.json, print the table; -> the exit code."""
    cfg, out_dir, results = plan.cfg, Path(plan.cfg.eval.out_dir), {}
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # Each model is scored (judge requests: mostly waiting) in the background while the next one
    # generates; scoring runs one model at a time, in order, each writing its predictions once done.
    scoring: list[tuple[ModelEntry, concurrent.futures.Future]] = []
    errors, crash = [], None
    try:
        for entry in plan.entries:
            on = f", on its run's base {entry.base}" if entry.base else ""
            print(f"[eval] {entry.name}: {len(plan.rows)} prompts ({entry.spec}{on})",
                  file=sys.stderr)
            t0 = time.time()
            gen, n, prefix = generate(entry, plan)
            scoring.append((entry, in_background(
                functools.partial(score_model, entry, plan, gen, n, prefix, t0),
                after=scoring[-1][1] if scoring else None)))
    # an adapter merged into the base was moved since training; a refused key
    except (ConfigError, JudgeUnusable) as e:
        errors.append(e)
        command.error(e)
    # a crash (out of memory, say): raised once what was generated is scored and written
    except Exception as e:
        crash = e
    for entry, future in scoring:
        try:
            results[entry.name] = {"kind": entry.kind, "source": entry.target,
                                   "metrics": future.result()}
        except (ConfigError, JudgeUnusable) as e:
            errors.append(e)
            print(f"error: scoring {entry.name}: {e}", file=sys.stderr)
        except Exception as e:  # a bug: raised once every other model is written
            crash = crash or e
    if crash is not None:
        raise crash
    if errors:
        return 2
    summary = {"config": saved_dict(cfg),
               "held_out": {"select": cfg.eval.select, "rows": len(plan.rows)}, "models": results}
    jsonl.write_atomic(out_dir / "results.json", json.dumps(summary, indent=1, default=str) + "\n")
    for entry in plan.entries:  # every model's completions are in its predictions file now
        (out_dir / f"partial_{entry.name}.jsonl").unlink(missing_ok=True)
    title = (f"{cfg.eval.name or data_label(cfg.data)}: held-out rows {cfg.eval.select or 'all'}, "
             f"{len(plan.rows)} prompts" + (" (eval.limit per source)" if cfg.eval.limit else ""))
    Console().print(render_table({name: r["metrics"] for name, r in results.items()}, title))
    print(f"[eval] wrote {out_dir / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
