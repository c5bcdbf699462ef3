"""Tool-call formats a chat template renders, one registered class each, read back from sampled text.

Which one a template uses is not guessed from its name: `TemplateRenderer` renders a known call (and two
calls in one message) through the template and keeps the first format here whose parser returns them exactly
(`round_trip`). The formats, as the major families' templates write them (vLLM ships a parser of each):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen, Hermes; quaero's own text
  format for templates that take no `tools`, `quaero/chat/toolcalls.py`);
- `llama3_json`: the whole reply one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3; several
  joined by `;`), after an optional `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of calls (or, in newer templates, `NAME[ARGS]{...}` per call);
- `pythonic`: `[get_weather(city="Paris"), search(q="x")]` (Llama 3.2/4's and Gemma 3's tool prompts), read
  with `ast` (never evaluated): keyword arguments of literals only;
- `granite`: `<|tool_call|>` then a JSON list of calls (IBM Granite 3);
- `json`: the generic fallback, any JSON value of calls (an object, a list, `{"tool_calls": [...]}`, OpenAI's
  `{"function": {...}}` nesting), optionally fenced as ```json.

A parser returns None when the text holds no call of its format (the text is then content), or raises
`MalformedToolCall` when it holds that format's marker but not a readable call: the reply goes to the env as
text without a call (counted as `unparsable_actions`; the env's corrective message follows). Adding a format
is one class with `@register`.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from quaero.chat.toolcalls import parse_tool_calls

Calls = list[dict[str, Any]]


class MalformedToolCall(ValueError):
    """Text in a tool-call format that is not a readable call (the message says what is wrong)."""


FORMATS: dict[str, type[ToolFormat]] = {}


def register(cls: type[ToolFormat]) -> type[ToolFormat]:
    FORMATS[cls.name] = cls
    return cls


def call(name: Any, arguments: Any) -> dict[str, Any]:
    """One parsed call, as renderers' parsers give it (`arguments` a dict; a JSON string is read)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(f"the arguments of {name!r} are a string, not JSON ({e})") from None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise MalformedToolCall(f"a call needs a name and an object of arguments, got name {name!r} and "
                                f"arguments {type(arguments).__name__}")
    return {"function": {"name": name, "arguments": arguments}}


def _json_call(obj: Any) -> dict[str, Any]:
    """A call of a JSON object `{"name", "arguments" | "parameters"}`, or OpenAI's `{"function": {...}}`."""
    if not isinstance(obj, dict):
        raise MalformedToolCall(f"a call must be a JSON object, got {type(obj).__name__}")
    obj = obj.get("function", obj) if isinstance(obj.get("function"), dict) else obj
    return call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))


def _json_list(body: str, what: str) -> Calls:
    try:
        value = json.JSONDecoder().raw_decode(body.strip())[0]
    except json.JSONDecodeError as e:
        raise MalformedToolCall(f"{what} is not followed by JSON ({e})") from None
    return [_json_call(v) for v in (value if isinstance(value, list) else [value])]


class ToolFormat:
    name: ClassVar[str]

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        """(content, calls) of `text`; None where it holds no call of this format. `tools`: the tool specs,
        whose parameter types the XML formats read a value by (they write a string and a number alike)."""
        raise NotImplementedError


@register
class Hermes(ToolFormat):
    """Lenient as renderers' Qwen3 parser and vLLM's hermes parser: a block that is not JSON is skipped; one
    whose JSON is no object is a malformed call."""
    name = "hermes"

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        try:
            content, calls = parse_tool_calls(text)
        except TypeError as e:
            raise MalformedToolCall(str(e)) from e
        return (content, calls) if calls else None


@register
class Llama3Json(ToolFormat):
    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        body = text.strip()
        body = body[len(self._TAG):].lstrip() if body.startswith(self._TAG) else body
        if not body.startswith("{") or '"name"' not in body:
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError as e:
                raise MalformedToolCall(f"a JSON call that does not parse ({e})") from None
            calls.append(_json_call(obj))
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return "", calls


@register
class Mistral(ToolFormat):
    name = "mistral"
    _MARK, _ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        start = text.find(self._MARK)
        if start < 0:
            return None
        parts = [p for p in text[start:].split(self._MARK) if p.strip()]
        if not parts:
            raise MalformedToolCall(f"{self._MARK} is followed by no call")
        calls: Calls = []
        for part in parts:
            if self._ARGS in part:  # v11+: NAME[ARGS]{...}
                name, _, args = part.partition(self._ARGS)
                calls.append(call(name.strip(), _json_value(args, f"{self._ARGS} of {name.strip()!r}")))
            else:
                calls += _json_list(part, self._MARK)
        return text[:start], calls


def _json_value(body: str, what: str) -> Any:
    try:
        return json.JSONDecoder().raw_decode(body.strip())[0]
    except json.JSONDecodeError as e:
        raise MalformedToolCall(f"{what} is not JSON ({e})") from None


@register
class Pythonic(ToolFormat):
    name = "pythonic"
    _START = re.compile(r"^\[\s*[A-Za-z_][\w.]*\s*\(")
    _WRAP = (("<|python_start|>", "<|python_end|>"), ("```tool_code", "```"), ("```python", "```"))

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        body = text.strip()
        for head, tail in self._WRAP:
            if body.startswith(head):
                body = body[len(head):].strip()
                body = body[:-len(tail)].strip() if body.endswith(tail) else body
        if not self._START.match(body):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List):
                raise MalformedToolCall("a pythonic reply must be one list of calls")
            return "", [self._call(node) for node in tree.elts]
        except SyntaxError as e:
            raise MalformedToolCall(f"a pythonic call list that is not Python ({e.msg})") from None
        except (TypeError, ValueError, RecursionError, MemoryError) as e:  # `{[1]}`, 3,000 nested `-`
            if isinstance(e, MalformedToolCall):
                raise
            raise MalformedToolCall(f"a pythonic call list quaero cannot read ({type(e).__name__})") from None

    @staticmethod
    def _call(node: ast.expr) -> dict[str, Any]:
        if not isinstance(node, ast.Call) or node.args:
            raise MalformedToolCall("each item of a pythonic call list is a call with keyword arguments only")
        if not isinstance(node.func, (ast.Name, ast.Attribute)) or not all(
                isinstance(n, (ast.Name, ast.Attribute, ast.expr_context)) for n in ast.walk(node.func)):
            raise MalformedToolCall("a pythonic call's function must be a (dotted) name")
        name = ast.unparse(node.func)
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:
            raise MalformedToolCall(f"the arguments of {name!r} must be literals") from None
        if any(k.arg is None for k in node.keywords):
            raise MalformedToolCall(f"the call of {name!r} unpacks arguments (**)")
        if len(args) != len(node.keywords):
            raise MalformedToolCall(f"the call of {name!r} names an argument twice")
        try:  # a set, bytes, a complex number or inf are Python literals, not JSON arguments
            json.dumps(args, allow_nan=False)
        except (TypeError, ValueError):
            raise MalformedToolCall(f"the arguments of {name!r} must be JSON values") from None
        return call(name, args)


@register
class Granite(ToolFormat):
    name = "granite"
    _MARK = "<|tool_call|>"

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        start = text.find(self._MARK)
        if start < 0:
            return None
        return text[:start], _json_list(text[start + len(self._MARK):], self._MARK)


@register
class GenericJson(ToolFormat):
    name = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        body = text.strip()
        fenced = self._FENCE.match(body)
        body = fenced.group(1) if fenced else body
        if not body.startswith(("{", "[")) or '"name"' not in body:
            return None
        value = _json_value(body, "a JSON reply")
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            value = value["tool_calls"]
        return "", [_json_call(v) for v in (value if isinstance(value, list) else [value])]


def parser(name: str) -> ToolFormat:
    return FORMATS[name]()


def same_calls(parsed: Calls | None, calls: Calls) -> bool:
    """Whether `parsed` are `calls` (OpenAI style), names and arguments, in order."""
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed or []] == want


def _strings(tools: list[dict] | None, name: str) -> set[str]:
    """The parameters of tool `name` whose JSON-schema type is "string" in `tools` (OpenAI-style specs)."""
    for spec in tools or []:
        fn = spec.get("function", spec) if isinstance(spec, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def _xml_values(pairs: list[tuple[str, str]], strings: set[str]) -> dict[str, Any]:
    """Parameters as XML-style templates write them: a string raw, anything else as JSON (`tojson`), so
    "178.1" and 178.1 are the same text. A parameter the tool's schema types "string" is that text (what
    vLLM's qwen3_coder parser does); any other is JSON where it reads as JSON, else the text itself."""
    out: dict[str, Any] = {}
    for key, text in pairs:
        key = key.strip()
        try:
            out[key] = text if key in strings else json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


@register
class QwenXml(ToolFormat):
    """`<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`
    (Qwen3.5, Qwen3-Coder, Nemotron 3): vLLM's qwen3_coder parser."""
    name = "qwen_xml"
    _FN = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        start = text.find("<tool_call>\n<function=")
        if start < 0:
            return None
        calls = [call(name.strip(), _xml_values(self._PARAM.findall(body), _strings(tools, name.strip())))
                 for name, body in self._FN.findall(text, start)]
        if not calls:
            raise MalformedToolCall("a <tool_call> block holds no <function=...>")
        return text[:start], calls


@register
class GlmXml(ToolFormat):
    """`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>` (GLM-4.5/4.6)."""
    name = "glm_xml"
    _BLOCK = re.compile(r"<tool_call>([^\n<]+)\n?(.*?)(?:</tool_call>|$)", re.DOTALL)
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, Calls] | None:
        found = self._BLOCK.search(text)
        if found is None or found.group(1).lstrip().startswith("{"):
            return None
        calls = [call(name.strip(), _xml_values(self._ARG.findall(body), _strings(tools, name.strip())))
                 for name, body in self._BLOCK.findall(text, found.start())]
        return text[:found.start()], calls
