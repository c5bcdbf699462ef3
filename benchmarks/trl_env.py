"""An OpenEnv MCP environment as TRL's `environment_factory` class, for `quaero bench peers-trl`.

TRL's `GRPOTrainer(environment_factory=Cls)` makes one `Cls()` per rollout, calls `reset(**dataset_row)`
(a returned string is appended to the last user message), exposes every public method as a tool (its
JSON schema read from the signature and a Google-style docstring) and calls `get_reward()` once the
rollout ends. `trl_environment(...)` builds such a class for any OpenEnv MCP env served over OpenEnv's
WebSocket protocol, the way a TRL user wraps an OpenEnv client (`MCPToolClient`): one method per tool of
the server's own `list_tools`, so the model sees the same tools, names and descriptions as under quaero.

What differs from quaero's session, by TRL's design (benchmarks/FIELDS.md says so, under peers-trl):
- TRL's tool schema adds a per-argument description (the docstring needs one: the argument's name here)
  and leaves out `additionalProperties: false`, so the system prompts differ by a few tokens;
- TRL has no `done`: after `submit_answer` the model may go on calling tools (the env answers "the episode
  is over") until it stops calling tools or `max_tool_calling_iterations` is reached;
- a reply without a tool call ends a TRL rollout; quaero answers it with the env's corrective message.
The tool message text is quaero's `render_tool_result` of the same observation, so both see the same text.
"""
from __future__ import annotations

import inspect
import time
from typing import Any

from quaero.openenv_client.mapping import render_tool_result

_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool}


class EnvTimes:
    """Seconds spent in env calls (reset and tool steps), summed over every instance: one step's share
    is read and cleared by the benchmark (`take`)."""

    seconds = 0.0
    calls = 0

    @classmethod
    def add(cls, seconds: float) -> None:
        cls.seconds += seconds
        cls.calls += 1

    @classmethod
    def take(cls) -> tuple[float, int]:
        out = (cls.seconds, cls.calls)
        cls.seconds, cls.calls = 0.0, 0
        return out


def _tool_method(name: str, description: str, schema: dict):
    """A method `name(self, **arguments)` whose signature, annotations and docstring give transformers'
    `get_json_schema` the tool's parameters (each described by its name: the docstring must describe every
    argument); calling it steps the env and returns the tool message text."""
    props, required = schema.get("properties") or {}, set(schema.get("required") or [])
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for arg, spec in props.items():
        kind = _JSON_TYPES.get(spec.get("type"), str)
        default = inspect.Parameter.empty if arg in required else None
        params.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=kind))
        annotations[arg] = kind

    def method(self, **arguments):
        return self._call_tool(name, arguments)

    method.__name__ = method.__qualname__ = name
    method.__signature__ = inspect.Signature(params)  # no return type: TRL would list it in the tool's schema
    method.__annotations__ = annotations
    args_doc = "".join(f"\n    {arg}: {arg}" for arg in props)
    method.__doc__ = description + ("\n\nArgs:" + args_doc if props else "")
    return method


class _OpenEnvTools:
    """The per-rollout part: one OpenEnv client session, the episode's reward and its tool calls."""

    base_url: str = ""
    timeout_s: float = 60.0
    # the env's own (reset metadata `system_prompt`), for the dataset's prompts
    system_prompt: str | None = None

    def __init__(self) -> None:
        from openenv.core.mcp_client import MCPToolClient

        self._client = MCPToolClient(base_url=self.base_url, message_timeout_s=self.timeout_s).sync()
        self._client.connect()
        self.reward = 0.0
        self.done = False
        self.tool_calls = 0

    def reset(self, **row) -> str:
        """Start the row's task (its `seed`, `split` and `index` columns); the question joins the user
        message."""
        t0 = time.perf_counter()
        result = self._client.reset(seed=row["seed"], split=row["split"], index=row["index"])
        EnvTimes.add(time.perf_counter() - t0)
        self.reward, self.done, self.tool_calls = 0.0, False, 0
        return result.observation.metadata["question"]

    def get_reward(self) -> float:
        return self.reward

    def _call_tool(self, name: str, arguments: dict) -> str:
        from openenv.core.env_server.mcp_types import CallToolAction

        t0 = time.perf_counter()
        result = self._client.step(CallToolAction(tool_name=name, arguments=arguments))
        EnvTimes.add(time.perf_counter() - t0)
        self.tool_calls += 1
        self.reward += float(result.reward or 0.0)
        self.done = self.done or bool(result.done)
        return render_tool_result(result.observation.model_dump())


def trl_environment(base_url: str, *, timeout_s: float = 60.0) -> type:
    """A TRL environment class over the OpenEnv MCP server at `base_url` (http://HOST:PORT), with one
    method per tool the server lists."""
    from openenv.core.mcp_client import MCPToolClient

    probe = MCPToolClient(base_url=base_url, message_timeout_s=timeout_s).sync()
    probe.connect()
    try:
        tools = probe.list_tools()
        system = (probe.reset().observation.metadata or {}).get("system_prompt")  # what quaero's session uses
    finally:
        probe.close()
    methods = {t.name: _tool_method(t.name, t.description or t.name, t.input_schema or {}) for t in tools}
    clash = sorted(set(methods) & {"reset", "get_reward"})
    if clash:
        raise ValueError(f"{base_url}: tool name(s) {clash} clash with TRL's environment methods")
    return type("OpenEnvToolEnv", (_OpenEnvTools,), {"base_url": base_url, "timeout_s": timeout_s,
                                                     "system_prompt": system, **methods})
