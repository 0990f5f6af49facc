"""Tool calls in the model's text: the format a chat template declares, the tools described to the
model, and each call run with a time limit, answered as TRL's GRPOTrainer answers it. The turns of
engines/episodes.py are what use them.

    fmt = call_format(tokenizer)                          # "hermes" or "json"
    calls = parse_calls(reply, fmt)                       # [ToolCall(name, arguments, error)]
    said, failed = answer_calls(reply, tools, fmt, 10.0)  # the tool messages; None: no call
    python -m pytest -q tests/test_episodes.py

Two formats: Hermes/Qwen's, which Qwen2.5, Qwen3 and Hermes templates declare (and minigrpo's
default for templates that declare none, SmolLM2's among them):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

and Llama 3.1's bare JSON object {"name": ..., "parameters": {...}} as the whole reply. A call that
does not parse is a ToolCall with `error` set: the tool message then says what was wrong.

A result comes back as TRL 1.16 writes it (trainer/grpo_trainer.py, _tool_call_loop): str(result);
a tool that raises, or a name no tool has, as str({"error": str(e)}), e.g. "{'error': 'division by
zero'}" and "{'error': 'Tool nope not found.'}"; minigrpo's own cases (a call that does not parse,
a tool past its time limit) in the same form.
"""
from __future__ import annotations

import inspect
import json
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from sources.plugins import on_reward_loop, one_line


@dataclass
class ToolCall:
    name: str  # "" when the call did not parse
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call is malformed; None: it parsed


def template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else json.dumps(template or "")


def declares_tools(tokenizer) -> bool:
    """Does the chat template render a `tools=` list (else minigrpo describes the tools itself)?"""
    return "tools" in template_source(tokenizer)


def call_format(tokenizer) -> str:
    """"hermes" (<tool_call> JSON </tool_call>: Qwen, Hermes, and every template that declares no
    tools) or "json" (a bare JSON object: Llama 3.1's templates, which declare tools untagged)."""
    src = template_source(tokenizer)
    return "json" if declares_tools(tokenizer) and "<tool_call>" not in src else "hermes"


# shorter than Qwen2.5's own words: a small model's prompt stays short
HERMES_SYSTEM = """You can call these tools:
{tools}
To call one, write <tool_call>{{"name": <tool name>, "arguments": {{<argument>: <value>}}}}\
</tool_call> and its result comes back."""


def describe_tools(schemas: list[dict], text: str | None = None) -> str:
    """The system text that tells a model without a tool-aware template about the tools: `text`
    (data.tools_prompt) or HERMES_SYSTEM, its {tools} the schemas, one JSON object a line."""
    tools = "\n".join(json.dumps(s) for s in schemas)
    return HERMES_SYSTEM.format(tools=tools) if text is None else text.replace("{tools}", tools)


def tool_schema(fn: Callable, label: str) -> dict:
    """The JSON schema transformers builds from the function's signature and Google-style docstring
    (what apply_chat_template(tools=[fn]) renders); ValueError naming the tool when it cannot."""
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {label!r}: {one_line(e)} (a tool needs type hints and a "
                         "docstring with an Args: section describing each argument)") from None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_calls(reply: str, fmt: str = "hermes") -> list[ToolCall]:
    """The tool calls in an assistant reply, in order; a reply without one gives []."""
    if fmt == "hermes":
        bodies = [m.group(1) for m in _HERMES.finditer(reply)]
    else:  # the whole reply a JSON object (or objects separated by ";", as Llama 3.2 writes)
        text = reply.strip()
        bodies = [b for b in text.split(";") if b.strip()] if text.startswith("{") else []
    return [_one_call(body) for body in bodies]


def _one_call(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", error='the tool call needs a "name" (a string)')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(call["name"], error='"arguments" must be a JSON object')
    return ToolCall(call["name"], args)


def answer_calls(reply: str, tools: dict[str, Callable], fmt: str, timeout: float,
                 schemas: list[dict] = ()) -> tuple[list[dict] | None, int]:
    """The tool messages answering a reply's calls, in order, and how many of them are errors; None
    when the reply makes no call (the episode is over). schemas: the tools' (typed_arguments)."""
    calls = parse_calls(reply, fmt)
    if not calls:
        return None, 0
    said, failed = [], 0
    for call in calls:
        fn = tools.get(call.name)
        if call.error or fn is None:  # TRL's words for a name no tool has
            text, bad = error_text(call.error or f"Tool {call.name} not found."), True
        else:
            text, bad = run_tool(fn, typed_arguments(call, schemas), timeout)
        failed += bad
        said.append({"role": "tool", "name": call.name or "unknown", "content": text})
    return said, failed


def typed_arguments(call: ToolCall, schemas: list[dict]) -> dict:
    """The call's arguments cast to the types its tool's schema declares, as transformers' response
    parser casts them for TRL ("7" is 7 for an integer parameter, stays "7" for a string one);
    transformers' own casting, where this transformers has it.

    >>> schema = {"function": {"name": "guess", "parameters": {"properties": {
    ...     "n": {"type": "integer"}, "s": {"type": "string"}}}}}
    >>> typed_arguments(ToolCall("guess", {"n": "7", "s": "7"}), [schema])
    {'n': 7, 's': '7'}
    """
    try:
        from transformers.utils.chat_parsing.response_parser import _coerce, _schema_types
    except ImportError:  # a transformers before 5.15 casts nothing either
        return call.arguments
    properties = next((s["function"].get("parameters", {}).get("properties", {})
                       for s in schemas if s["function"]["name"] == call.name), {})
    out = dict(call.arguments)
    for key, value in out.items():
        types = _schema_types(properties.get(key))
        if types and isinstance(value, str):
            out[key] = _coerce(value, types)
        elif types and isinstance(value, list) and "array" not in types:
            out[key] = [_coerce(v, types) if isinstance(v, str) else v for v in value]
    return out


def error_text(message: str) -> str:
    """A failed call's tool message, as TRL writes it.

    >>> error_text("division by zero")
    "{'error': 'division by zero'}"
    """
    return str({"error": message})


def run_tool(fn: Callable, arguments: dict, timeout: float) -> tuple[str, bool]:
    """fn(**arguments) in a daemon thread (an async tool awaited on the reward loop, as TRL awaits
    it), waited for at most `timeout` seconds -> (the tool message's text, whether it is an error).
    A tool that raises or runs past its limit gives an error message the model reads; nothing stops
    the run. A thread cannot be killed: a tool that hangs keeps its thread until it returns (a
    daemon, so it never holds the process open)."""
    out: queue.Queue = queue.Queue(maxsize=1)

    def call() -> None:
        try:
            result = fn(**arguments)
            if inspect.isawaitable(result):
                result = on_reward_loop(result)
            out.put((str(result), False))
        except Exception as e:
            out.put((error_text(str(e)), True))
    threading.Thread(target=call, daemon=True, name="minigrpo-tool").start()
    try:
        return out.get(timeout=timeout)
    except queue.Empty:
        return error_text(f"the tool ran past its {timeout:g} s limit"), True
