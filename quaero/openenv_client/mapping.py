"""Chat <-> OpenEnv mapping, independent of any model or transport.

MCP envs: tool list -> OpenAI-style `tools`; a parsed assistant tool call -> CallToolAction dict
(validated against the tool's JSON schema first, so a bad call never reaches the env); a
CallToolObservation -> a `tool` message. Plain envs: model text -> Action dict (JSON, fences
stripped, or wrapped for a single string field); observation -> user message via a formatter.
"""
from __future__ import annotations

import json
import re
from typing import Any

_FENCE = re.compile(r"^```[\w-]*\s*\n?(.*?)\n?```$", re.DOTALL)
_TOOL_ERROR_PREFIX = re.compile(r"^Error calling tool '[^']*': ")
QUESTION_KEYS = ("question", "prompt", "task", "instruction", "message", "text")


class Malformed(Exception):
    """The model's action cannot be sent; str(self) is the corrective message for the model."""


# -- MCP tool envs -----------------------------------------------------------------------------------
def tool_specs(tools: list[dict]) -> list[dict]:
    """OpenEnv Tool dicts (name, description, input_schema) -> OpenAI-style function specs."""
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema") or {"type": "object"}}}
            for t in tools]


def _call_parts(call: Any) -> tuple[str, Any]:
    func = call.get("function", call) if isinstance(call, dict) else {}
    return str(func.get("name") or ""), func.get("arguments", {})


def parse_tool_calls(assistant: dict, specs: list[dict],
                     no_call_message: str | None = None) -> list[tuple[str, dict]]:
    """Validated (tool_name, arguments) pairs, or Malformed with a short corrective message. A reply without
    a tool call gets `no_call_message` ([env] no_tool_call_message), by default one naming the env's tools."""
    import jsonschema

    by_name = {s["function"]["name"]: s["function"] for s in specs}
    calls = assistant.get("tool_calls") or []
    if not calls:
        raise Malformed(no_call_message or "Your last message did not call a tool. Call one of the tools: "
                        f"{', '.join(by_name)}.")
    parsed = []
    for call in calls:
        name, args = _call_parts(call)
        if name not in by_name:
            raise Malformed(f"Unknown tool {name!r}. Available tools: {', '.join(by_name)}.")
        if isinstance(args, str):  # some parsers keep raw argument text
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise Malformed(f"Arguments of {name} are not valid JSON; give a JSON object.") from None
        if not isinstance(args, dict):
            raise Malformed(f"Arguments of {name} must be a JSON object, got {type(args).__name__}.")
        schema = by_name[name]["parameters"]
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(args))
        if error is not None:
            where = ".".join(map(str, error.absolute_path)) or "arguments"
            props = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in schema.get("properties", {}).items())
            raise Malformed(f"Invalid arguments for {name} ({where}: {error.message}). Expected {{{props}}}.")
        parsed.append((name, args))
    return parsed


def render_tool_result(observation: dict, shown: str = "") -> str:
    """A CallToolObservation payload -> tool message text: the result's text, JSON of its data, or
    'Error: ...'. A result that is a plain dict, not FastMCP's CallToolResult (`openenv import`'s Verifiers
    wrapper returns its score dict), is JSON of its fields but those whose long texts the model already saw
    (`shown`: the task and its own reply; the wrapper's `state` repeats the whole prompt)."""
    error = observation.get("error")
    if error:
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return "Error: " + _TOOL_ERROR_PREFIX.sub("", message)
    result = observation.get("result")
    if isinstance(result, dict) and not {"content", "data", "structured_content"} & set(result):
        kept = {k: v for k, v in result.items() if not _repeats(v, shown)}
        return json.dumps(kept, ensure_ascii=False, separators=(", ", ": "))
    if isinstance(result, dict):
        texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c,
                                                                                      dict)
                 and c.get("type") == "text"]
        if result.get("is_error"):
            return "Error: " + " ".join(texts)
        if texts:
            return "\n".join(texts)
        if result.get("data") is not None:
            return json.dumps(result["data"], ensure_ascii=False)
        return json.dumps(result.get("structured_content"), ensure_ascii=False)
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


# -- plain envs --------------------------------------------------------------------------------------
def model_action_schema(schema: dict) -> dict:
    """The action JSON schema the model sees: without OpenEnv's internal `metadata` field and titles."""
    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: clean(v) for k, v in node.items() if k != "title"}
        return [clean(v) for v in node] if isinstance(node, list) else node

    out = clean(schema)
    out.get("properties", {}).pop("metadata", None)
    return out


def resolve_field(schema: dict, prop: dict) -> dict:
    """A property's own schema: a `$ref` into `$defs` followed (pydantic writes enums so), Optional's
    `anyOf [X, null]` unwrapped with `nullable` set."""
    ref = prop.get("$ref", "")
    if ref.startswith("#/$defs/"):
        target = schema.get("$defs", {}).get(ref.rsplit("/", 1)[1], {})
        prop = {**target, **{k: v for k, v in prop.items() if k != "$ref"}}
    real = [o for o in prop.get("anyOf", []) if o.get("type") != "null"]
    if len(real) == 1:
        return {**resolve_field(schema, real[0]), "nullable": len(real) < len(prop["anyOf"])}
    return prop


def field_type(schema: dict, name: str) -> str:
    """A field's type for people (`quaero check`): `string`, `one of "UP", "RIGHT"`, `integer or null`, ..."""
    p = resolve_field(schema, schema["properties"][name])
    if "enum" in p:
        text = "one of " + ", ".join(json.dumps(v) for v in p["enum"])
    elif "const" in p:
        text = json.dumps(p["const"])
    elif "anyOf" in p:
        text = " or ".join(resolve_field(schema, o).get("type", "any") for o in p["anyOf"])
    elif p.get("type") == "array":
        text = f"array of {resolve_field(schema, p.get('items', {})).get('type', 'any')}"
    else:
        text = p.get("type", "any")
    return f"{text} or null" if p.get("nullable") else text


def single_text_field(schema: dict) -> str | None:
    """The field raw reply text fills: the one required field, or the only field, when it takes a string
    (an enum of strings too: `RIGHT` for {"direction": "UP" | "RIGHT" | ...})."""
    props = schema.get("properties", {})
    strings = _string_fields(schema)
    required = [k for k in schema.get("required", []) if k in props]
    if len(required) == 1 and required[0] in strings:
        return required[0]
    return strings[0] if len(props) == 1 and strings else None


def chat_text_field(schema: dict) -> str | None:
    """The field a chat env's reply fills as plain text: `single_text_field`'s, or, where no field is
    required, the one field that takes a string (korrel's `content` beside its optional `tool_calls`)."""
    field = single_text_field(schema)
    if field is not None or any(k in schema.get("properties", {}) for k in schema.get("required", [])):
        return field
    strings = _string_fields(schema)
    return strings[0] if len(strings) == 1 else None


def _string_fields(schema: dict) -> list[str]:
    """The fields that take a string (Optional's null unwrapped, an enum of strings too)."""
    props = schema.get("properties", {})
    return [k for k, v in props.items() if resolve_field(schema, v).get("type") == "string"]


def action_instructions(schema: dict) -> str:
    """What the system prompt asks of a plain env's replies (schema: `model_action_schema`'s). An Action whose
    one field takes text gets its reply as plain text (textarena's "[5]"), not a JSON object around it."""
    field, text = single_text_field(schema), json.dumps(schema, separators=(",", ":"))
    if field is not None and list(schema.get("properties", {})) == [field]:
        return (f"\n\nReply with the action itself as plain text: your whole reply becomes its `{field}` "
                f"field ({field_type(schema, field)}).")
    if field is not None:
        return (f"\n\nReply with one JSON object matching this action schema: {text}; or with plain text, "
                f"which becomes its `{field}` field.")
    return f"\n\nRespond with exactly one JSON object matching this action schema: {text}"


def reply_instruction(schema: dict) -> str:
    """The corrective message's ask, in the words `action_instructions` used: plain text for an Action whose
    one field takes text (grid_world's bare `RIGHT`), else one JSON object."""
    field = single_text_field(schema)
    if field is not None and list(schema.get("properties", {})) == [field]:
        return (f"Reply with the action itself as plain text: your whole reply becomes its `{field}` field "
                f"({field_type(schema, field)}).")
    if field is not None:
        return ("Reply with exactly one JSON object matching the action schema in the system prompt, "
                f"or with plain text for its `{field}`.")
    return "Reply with exactly one JSON object matching the action schema in the system prompt."


def parse_plain_action(text: str, schema: dict) -> dict:
    """Model text -> action dict: one JSON object (a surrounding ``` fence is stripped), or the raw
    text wrapped as {field: text} when the action has a single string field, or a bare JSON number
    wrapped when the action has a single required field."""
    stripped = (text or "").strip()
    if m := _FENCE.match(stripped):
        stripped = m.group(1).strip()
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    if (field := single_text_field(schema)) is not None and stripped:
        return {field: stripped}
    required = schema.get("required", [])
    if len(required) == 1 and isinstance(value, (int, float, bool)):  # `7` for {"guess": int}
        return {required[0]: value}
    why = ("it was empty" if not stripped else f"it is JSON but not an object ({type(value).__name__})"
           if value is not None or stripped == "null" else "it is not JSON")
    raise Malformed(f"Your last message was not a valid action: {why}. {reply_instruction(schema)}")


# OpenEnv's base Observation fields: reward and done travel beside the text, metadata is bookkeeping
BOOKKEEPING_FIELDS = ("done", "reward", "metadata")


def _field_line(name: str, value: Any) -> str:
    if isinstance(value, str):
        return f"{name}:\n{value}" if "\n" in value else f"{name}: {value}"
    return f"{name}: {json.dumps(value, ensure_ascii=False, separators=(', ', ': '))}"


def prompt_messages(meta: Any) -> list[dict]:
    """A reset's task as chat messages in `metadata["prompt"]` ([{"role", "content"}], what `openenv import`
    writes for a Verifiers task), else []."""
    prompt = meta.get("prompt") if isinstance(meta, dict) else None
    if not isinstance(prompt, list):
        return []
    return [m for m in prompt if isinstance(m, dict) and isinstance(m.get("content"),
                                                                    str) and m["content"].strip()]


# when the env gives none
DEFAULT_SYSTEM_PROMPT = "You are an agent acting in an environment. Solve the task."
INSTRUCTION_KEYS = ("instructions", "system_prompt")  # fields holding the env's own instructions


def env_instructions(observation: dict) -> tuple[str | None, str | None]:
    """(field, text) of the instructions an env's reset gives for the system prompt: a non-empty
    `instructions` or `system_prompt` field of the observation, else of its metadata; (None, None) without
    one."""
    meta = observation.get("metadata") or {}
    for where in (observation, meta if isinstance(meta, dict) else {}):
        for key in INSTRUCTION_KEYS:
            if isinstance(where.get(key), str) and where[key].strip():
                return key, where[key]
    return None, None


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_turns(observation: dict) -> list[dict] | None:
    """An observation's `messages` when it is a chat ([{"role", "content"}] with known roles and text
    contents, korrel's export), else None."""
    messages = observation.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    if not all(isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)
               for m in messages):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def prompt_system(meta: Any) -> str | None:
    """The system message of a reset's chat prompt (`prompt_messages`), if it has one."""
    return next((m["content"] for m in prompt_messages(meta) if m.get("role") == "system"), None)


class FieldText(str):
    """A formatted observation that remembers its parts: `parts` are (field name or None, line) whose
    lines, joined by newlines, are the text. The episode driver cuts an observation over
    `[env] max_observation_tokens` part by part (quaero/rollout/driver.py `_bounded`): a huge field is
    shortened with its marker and the small ones after it survive whole (atari's screen before
    `legal_actions` and `lives`). Everywhere else it is the plain string it equals."""

    parts: tuple[tuple[str | None, str], ...] = ()

    @classmethod
    def of(cls, parts: list[tuple[str | None, str]]) -> FieldText:
        text = cls("\n".join(line for _, line in parts))
        text.parts = tuple(parts)
        return text


def observation_parts(observation: dict, context: str = "step") -> list[tuple[str | None, str]]:
    """`default_formatter`'s lines with the field each shows (None for a question taken from the metadata)."""
    fields = {k: v for k, v in observation.items() if k not in BOOKKEEPING_FIELDS and v not in (None, "", [],
                                                                                                {})}
    question_key = next((k for k in QUESTION_KEYS if isinstance(fields.get(k), str) and fields[k].strip()),
                                                                                                         None)
    parts: list[tuple[str | None, str]] = [(question_key, fields.pop(question_key))] if question_key else []
    meta = observation.get("metadata") or {}
    if not parts and context == "reset" and isinstance(meta, dict):
        parts += [(None, meta[k]) for k in QUESTION_KEYS
                  if isinstance(meta.get(k), str) and meta[k].strip()][:1]
        if not parts:  # a chat prompt (Verifiers tasks): its non-system messages
            parts += [(None, m["content"]) for m in prompt_messages(meta) if m.get("role") != "system"]
    for k, v in fields.items():
        if not _repeats(v, "\n".join(line for _, line in parts)):
            parts.append((k, _field_line(k, v)))
    return parts


def default_formatter(observation: dict, context: str = "step") -> str:
    """Observation dict -> user message text: its question-like field first (on reset, else the one in
    `metadata`), then every other non-empty field but the bookkeeping ones as `name: value` lines, in the
    observation's declaration order (JSON for structured values), so a reset's trial data reaches the model.
    A FieldText: the driver can cut it field by field."""
    return FieldText.of(observation_parts(observation, context))


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [t for item in items for t in _texts(item)]


def _repeats(value: Any, shown: str, min_chars: int = 16) -> bool:
    """A structured field whose every long text is already shown (textarena's `messages` repeat its `prompt`):
    left out, so the model reads the text once."""
    if isinstance(value, str):
        return False
    long = [t.strip() for t in _texts(value) if len(t.strip()) >= min_chars]
    return bool(long) and all(t in shown for t in long)
