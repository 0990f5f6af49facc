"""YAML to typed dataclasses: the generic half of config.py (which holds the fields).

    raw = read_yaml(Path("configs/x.yaml"))            # the file, with those it `extends` under it
    apply_overrides(raw, ["--grpo.beta=0.04"], Config)  # --section.key=value, values parsed as YAML
    cfg = from_dict(Config, raw)                        # types checked, unknown keys named

Every problem is a ConfigError of one line that names the key: the entry points print it and exit 2.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem the user must fix: one line, says what and where."""


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# ${NAME} or ${NAME:-default}: a value from the environment, read by one function (expand_env),
# once a field: every field by expand_refs when the config loads, but those an API client fills in
# when it is built (a section's FILLED_BY_CLIENT: a judge's URL, model and headers), which keep the
# reference so that a secret in them is never saved.
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(text: str, key: str) -> str:
    """text with each ${NAME} as that environment variable's value, and each ${NAME:-default} as
    its value or, when it is unset or empty, the default (the shell's meaning). One pass: what a
    variable holds is never read again. A ${NAME} that is not set, or whose value names itself, is
    a ConfigError naming `key` and the variable.

    >>> os.environ["MINIGRPO_DOC_HOST"] = "judge.example"
    >>> expand_env("https://${MINIGRPO_DOC_HOST}/v1 ${MINIGRPO_DOC_NOPE:-gpt-4o-mini}", "k")
    'https://judge.example/v1 gpt-4o-mini'
    """
    def value(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if default is not None and not os.environ.get(name):
            return default
        if name not in os.environ:
            raise ConfigError(f"{key} reads ${{{name}}}, which is not set in the environment; "
                              f"export it, write ${{{name}:-default}}, or give the value")
        if any(ref.group(1) == name for ref in ENV_REF.finditer(os.environ[name])):
            raise ConfigError(f"{key} reads ${{{name}}}, whose value {os.environ[name]!r} names "
                              "itself; export the value itself")
        return os.environ[name]
    return ENV_REF.sub(value, text)


@dataclasses.dataclass(frozen=True)
class FromEnv:
    """A field that is not text, written whole as ${NAME}: the variable's value read as YAML, and
    where it came from, which a wrong type's error names."""
    value: Any
    source: str  # "${X}='abc' from the environment", or "the default of ${X:-1}"


def expand_refs(raw: dict, cls: type, prefix: str = "") -> dict:
    """The config's mapping (YAML and overrides merged) with every ${NAME} read, once, before the
    types are checked: in text, where it stands; a field that is not text written whole as ${NAME}
    becomes its YAML value (`weight: ${REWARD_LAMBDA_FORMAT:-0.0}`). Fields that cls (a section)
    lists in FILLED_BY_CLIENT keep theirs; keys that are not fields are left for from_dict."""
    hints, kept = typing.get_type_hints(cls), getattr(cls, "FILLED_BY_CLIENT", ())
    return {k: v if k in kept or k not in hints else _expand_value(v, hints[k], f"{prefix}{k}")
            for k, v in raw.items()}


def _expand_value(value: Any, tp: Any, key: str) -> Any:
    """expand_refs for one field's value, of the annotation tp, through sections, lists, maps."""
    options = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(options) == 1:
        tp = options[0]  # X | None
    if isinstance(value, str):
        return _expand_text(value, tp, key)
    if isinstance(value, dict) and dataclasses.is_dataclass(tp):
        return expand_refs(value, tp, f"{key}.")
    item = typing.get_args(tp)[-1] if typing.get_args(tp) else Any  # list[X]: X; dict[K, V]: V
    if isinstance(value, dict):
        return {k: _expand_value(v, item, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def _expand_text(text: str, tp: Any, key: str) -> Any:
    """One string of field `key` expanded; written whole as ${NAME} in a field that is not plain
    text, the value read as YAML (a FromEnv where the type is checked later)."""
    ref = ENV_REF.fullmatch(text.strip())
    out = expand_env(text, key)
    if ref is None or tp is str:
        return out
    try:
        read = yaml.safe_load(out)
    except yaml.YAMLError:
        read = out
    if tp is Any:
        return read
    name, default = ref.groups()
    return FromEnv(read, f"the default of {text.strip()}" if default is not None
                   and not os.environ.get(name) else f"${{{name}}}={os.environ[name]!r} from the "
                   "environment")


def _convert_env(value: FromEnv, tp: Any, key: str) -> Any:
    """convert() of a value read from the environment; a wrong one names the variable (or says
    the default is wrong): "rewards[1].weight reads ${REWARD_LAMBDA_FORMAT}='abc' ...", not 'abc'
    alone."""
    try:
        return convert(value.value, tp, key)
    except ConfigError as e:
        why = str(e).removeprefix(f"{key}: ")
        raise ConfigError(f"{key} reads {value.source}: {why}; fix the variable or the "
                          "config") from None


def convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; returns it (ints widened to float). A value
    expand_refs read from the environment is checked as such (FromEnv)."""
    if isinstance(value, FromEnv):
        return _convert_env(value, tp, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, tp, key)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return _convert_section(value, tp, key)
    if origin is list:
        return _convert_list(value, tp, key)
    if origin is dict or tp is dict:
        return _convert_mapping(value, tp, key)
    return _convert_plain(value, tp, key)


def _convert_union(value: Any, tp: Any, key: str) -> Any:
    """convert() for `X | Y | None`: None where allowed, else the first option that takes it."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # X | None: let X's own, more precise error through
        return convert(value, options[0], key)
    for a in options:
        try:
            return convert(value, a, key)
        except ConfigError:
            pass
    raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, "
                      f"got {value!r}")


def _convert_section(value: Any, tp: type, key: str) -> Any:
    """convert() for a nested dataclass (a config section): built from its mapping."""
    # `run:` with every key commented out: it would also hide an extended file's section
    if value is None:
        raise ConfigError(f"{key} is empty (null); remove the line, or give it keys")
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
    return from_dict(tp, value, key)


def _convert_list(value: Any, tp: Any, key: str) -> list:
    """convert() for `list[X]`: each item checked, named `key[i]`."""
    args = typing.get_args(tp)
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list, got {value!r}")
    return [convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value


def _convert_mapping(value: Any, tp: Any, key: str) -> dict:
    """convert() for `dict[K, V]`: each value checked, named `key.k`; null is empty."""
    args = typing.get_args(tp)
    if value is None:  # `extra_body: null`: none (in a child: the parent's cleared, _merge)
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return {k: convert(v, args[1], f"{key}.{k}") for k, v in value.items()} if args else value


def _convert_plain(value: Any, tp: Any, key: str) -> Any:
    """convert() for a plain type (str, int, bool, float: finite, ints and 1e-4 read as float)."""
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is Any or (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def from_dict(cls: type, d: dict, prefix: str = "") -> Any:
    """The dataclass `cls` built from the mapping `d`: unknown keys (with the closest valid ones),
    missing required keys and wrong types raise ConfigError naming the key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for f in dataclasses.fields(cls):
        if (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                and f.name not in d):
            raise ConfigError(f"{prefix or cls.__name__}: missing required key '{f.name}'")
    kwargs = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=3, cutoff=0.5)
            hint = (f"; did you mean {', '.join(f'{prefix}.{c}' if prefix else c for c in close)}?"
                    if close else "")
            raise ConfigError(f"unknown config key '{key}'{hint} (valid: {', '.join(names)})")
        kwargs[k] = convert(v, hints[k], key)
    return cls(**kwargs)


def check_writable(path: str | Path, key: str) -> None:
    """A file or folder a command will write (create, append to, or replace by a rename): the
    nearest of its parents that exists must be a folder this process can write in, and the path
    itself, if it exists, writable. Else the failure would come late, as a traceback, maybe after
    paid-for work. ConfigError names `key`."""
    if not str(path).strip():
        raise ConfigError(f"{key} is empty; give a path")
    p = Path(path).expanduser().absolute()
    there = next(q for q in p.parents if q.exists())
    if not there.is_dir():
        raise ConfigError(f"{key}={path}: {there} is a file, not a folder; choose another path")
    if not os.access(there, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{key}={path}: {p if p.exists() else there} is not writable; "
                          "choose another path")
    inside = p if p.is_dir() else there  # os.access says yes to root: try what the command will do
    try:
        made = tempfile.mkdtemp(prefix=".minigrpo-check-", dir=inside)
    except OSError as e:  # /proc, a read-only mount, a full disk
        raise ConfigError(f"{key}={path}: cannot create anything in {inside} ({e.strerror or e}); "
                          "choose another path") from None
    with contextlib.suppress(OSError):
        os.rmdir(made)


def _entry(items: list, part: str, dotted: str) -> int:
    """The place in a config list (rewards:) that an override's part names: an index from 0, or an
    entry's label or name ("--rewards.accuracy.weight=2")."""
    # isascii: "²".isdigit() too, and int() refuses it
    if part.isascii() and part.isdigit() and int(part) < len(items):
        return int(part)
    named = [i for i, x in enumerate(items)
             if isinstance(x, dict) and part in (x.get("label"), x.get("name"))]
    if len(named) == 1:
        return named[0]
    names = [str(x.get("label") or x.get("name")) for x in items if isinstance(x, dict)]
    raise ConfigError(f"override --{dotted}: '{part}' is " + (
        f"the name of {len(named)} entries; give their label or index" if named
        else f"neither an index (0 to {len(items) - 1}) nor a label or name of the list's entries "
        f"({', '.join(names) or 'none'})" + ("; a name with a dot (file.py:fn) is reached by its "
                                             "index, or by a label: you give it"
                                             if any("." in n for n in names) else "")))


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for n, p in enumerate(parents):
        if isinstance(d, list):
            d = d[_entry(d, p, dotted)]
            if not isinstance(d, dict):
                raise ConfigError(f"override --{dotted}: '{p}' is not a section")
            continue
        if p not in d and (nxt := (parents[n + 1:] + [last])[0]).isascii() and nxt.isdigit():
            raise ConfigError(f"override --{dotted}: the config has no list '{p}' to index; "
                              "write it in the config file")
        node = d.setdefault(p, {})
        # `run:` with every key commented out: its own defaults, or an extended file's? unclear
        if node is None:
            raise ConfigError(f"override --{dotted}: '{p}' is empty (null) in the config; "
                              "remove that line or give it keys")
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override --{dotted}: '{p}' is not a section")
        d = node
    if isinstance(d, list):
        d[_entry(d, last, dotted)] = value
    else:
        d[last] = value


def _text_field(root: type, dotted: str) -> str | None:
    """"text" when the field takes text (str), "optional" for str | None, else None. A text
    override is kept verbatim, so "{question}" stays text; only null / ~ mean None for an optional
    one, and an empty value (--data.assistant_prefix=) is empty text for a plain one."""
    tp: Any = root
    for part in dotted.split("."):
        # X | None: X
        if set(typing.get_args(tp)) - {type(None)} and type(None) in typing.get_args(tp):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) in (dict, list):  # sections by name (judges): part is a name; a
            tp = typing.get_args(tp)[-1]  # list of them (rewards): part is an index, label or name
        elif not dataclasses.is_dataclass(tp) or part not in typing.get_type_hints(tp):
            return None
        else:
            tp = typing.get_type_hints(tp)[part]
    return ("text" if tp is str
            else "optional" if set(typing.get_args(tp)) == {str, type(None)} else None)


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge key by key, but an empty one (or null) replaces the
    parent's, so a child can clear one (`judge: {extra_body: {}}` drops a parent's grammar);
    anything else (lists too) is replaced.

    >>> _merge({"judge": {"model": "m", "extra_body": {"grammar": "g"}}},
    ...        {"judge": {"extra_body": {}}})
    {'judge': {'model': 'm', 'extra_body': {}}}
    """
    out = dict(base)
    for k, v in over.items():
        merge = isinstance(v, dict) and v and isinstance(out.get(k), dict)
        out[k] = _merge(out[k], v) if merge else v
    return out


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _on(value) -> bool:
    """Set to something other than 0 or null (also as text: "0e0", which convert reads as 0)."""
    if isinstance(value, str):
        try:
            return float(value) != 0
        except ValueError:
            return True
    return bool(value)


def exclusive_layers(base: dict, over: dict, exclusive: tuple[tuple[str, str, bool], ...],
                     where: str) -> None:
    """For each pair of settings of which one decides (run.steps, run.epochs): the one `over` sets
    (to something other than 0 or null) drops the other from `base`, so a later layer (a file that
    extends, the command line) replaces the earlier one's choice; both set in `over` is an error.
    With the pair's flag, `over` turning off the second that `base` set (run.epochs: 0) must set the
    first, which an earlier layer's choice of the second dropped (else it would default, unsaid)."""
    for first, second, needs_first in exclusive:
        pair = (first, second)
        set_here = [k for k in pair if _on(_get(over, k))]
        if len(set_here) == 2:
            raise ConfigError(f"{where} sets both {first}={_get(over, first)} and "
                              f"{second}={_get(over, second)}: keep one")
        if needs_first and not set_here and _has(over, second) and _on(_get(base, second)):
            raise ConfigError(f"{where} turns off {second}={_get(base, second)}, which an earlier "
                              f"layer set: give {first} too (it would fall back to its default)")
        for k in set_here:
            *parents, last = next(x for x in pair if x != k).split(".")
            section = _get(base, ".".join(parents))
            if isinstance(section, dict):
                section.pop(last, None)


def _has(d: dict, dotted: str) -> bool:  # the key is written in d (with any value, null too)
    *parents, last = dotted.split(".")
    section = _get(d, ".".join(parents))
    return isinstance(section, dict) and last in section


def read_yaml(p: Path, seen: tuple[Path, ...] = (),
              exclusive: tuple[tuple[str, str, bool], ...] = ()) -> dict:
    """A config file as a dict, with its `extends: other.yaml` (a path relative to the file) merged
    under it (`exclusive`: pairs of settings of which this file's choice replaces its parent's,
    exclusive_layers)."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}"
                          + (f" (extended by {seen[-1]})" if seen else ""))
    if p.resolve() in seen:
        raise ConfigError(f"{p}: `extends` makes a cycle "
                          f"({' -> '.join(str(s) for s in seen + (p,))})")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {str(e).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p} is not UTF-8 text; is it a config file?") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    parent = raw.pop("extends", None)
    if parent is None:
        exclusive_layers({}, raw, exclusive, str(p))
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{p}: extends: expected the path of another config file, got {parent!r}")
    base = read_yaml(p.parent / parent, seen + (p.resolve(),), exclusive)
    exclusive_layers(base, raw, exclusive, str(p))
    return _merge(base, raw)


def apply_overrides(raw: dict, overrides: list[str], root: type) -> None:
    """Set each `--section.key=value` of `overrides` in `raw`, the value parsed as YAML, but a text
    field of `root` keeps its text verbatim ("{question}", "1e-4" as written, "" as empty text)."""
    for o in overrides:
        if not o.startswith("--") or "=" not in o:
            raise ConfigError(f"'{o}' is neither an option of this command (see --help) nor an "
                              "override --section.key=value")
        dotted, text = o[2:].split("=", 1)
        try:
            value = yaml.safe_load(text)
            kind = _text_field(root, dotted)
            if kind and (value is not None or (text == "" and kind == "text")):
                value = text
        except yaml.YAMLError:
            value = text
        _set_dotted(raw, dotted, value)
