"""Transports: one OpenEnv session each, speaking the dict protocol of OpenEnv's WebSocket server.

Every transport returns the server's observation payload, `{"observation": {...}, "reward", "done"}`,
so the three launchers are interchangeable: `InProcessTransport` runs the same code path as the
server (signature-filtered reset kwargs, `deserialize_action`, `step_async` when overridden, the
same JSON serialization); `WebSocketTransport` talks to a real server on /ws.

Faults raise `EnvFault` (the session is gone: reconnect); a rejected action raises `ActionRejected`
(the session is intact, the env state unchanged); a reply that is not a usable observation raises
`InvalidReply` (`check_reply`, on every launcher).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import math
import queue
import re
import threading
from typing import Any

from quaero.config import ConfigError

from .loading import EnvSpec


def endpoints(url: str) -> tuple[str, str]:
    """An OpenEnv server's (http base, ws endpoint) from any of ws://h:p, ws://h:p/ws, http://h:p."""
    base = url.rstrip("/").removesuffix("/ws")
    if base.startswith("ws"):
        base = "http" + base[2:]
    if not base.startswith("http"):
        raise ConfigError(f"[env] url={url!r}: expected ws://HOST:PORT or http://HOST:PORT")
    return base, "ws" + base[4:] + "/ws"


class EnvFault(Exception):
    """The session is lost or unusable (timeout, dropped connection, server error frame)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind  # timeout | connection | server_error | capacity


class EnvRaised(EnvFault):
    """The env's own code raised answering a call (OpenEnv's EXECUTION_ERROR frame; an exception in-process);
    the server answered, so the session may be healthy. `detail`: the env's message. Whether it is a fault of
    the session or a property of the action is decided in quaero/openenv_client/session.py
    (`ChatEnv._call`)."""

    def __init__(self, detail: str, message: str | None = None) -> None:
        super().__init__("server_error", message or detail)
        self.detail = detail


class ActionRejected(Exception):
    """The env refused the action before running it (schema validation); the session is intact."""


class InvalidReply(Exception):
    """The env answered, but not with a usable observation; the message names the field and value.
    Asking again gets the same answer, so the episode is dropped, not retried."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# metadata flags the episode driver reads (quaero/rollout/driver.py): present, they must be true or false
JUDGED_FLAGS = ("success", "truncated")


def check_reply(payload: Any) -> dict:
    """`payload` if it is an OpenEnv observation reply, `{"observation": {...}, "reward": a finite number
    or null (no reward), "done": true|false}`, whose metadata, if any, is an object with boolean
    `success`/`truncated` where present; else InvalidReply. A NaN or infinite reward is refused, never
    read as 0 (quaero's own server and the in-process launcher keep it as NaN/Infinity on the wire)."""
    if not isinstance(payload, dict):
        raise InvalidReply(f"reply={_shown(payload)} is not a JSON object")
    observation = payload.get("observation")
    if not isinstance(observation, dict):
        raise InvalidReply(f"observation={_shown(observation)} is not a JSON object")
    metadata = observation.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidReply(f"observation.metadata={_shown(observation['metadata'])} is not a JSON object")
    for flag in JUDGED_FLAGS:  # the driver judges the episode by them: "false" or NaN must not read as true
        if flag in metadata and not isinstance(metadata[flag], bool):
            raise InvalidReply(f"observation.metadata.{flag}={_shown(metadata[flag])} is not a boolean")
    if "done" not in payload:
        raise InvalidReply("done is missing")
    if not isinstance(payload["done"], bool):
        raise InvalidReply(f"done={_shown(payload['done'])} is not a boolean")
    reward = payload.get("reward")
    # True is no reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise InvalidReply(f"reward={_shown(reward)} is not a number")
    if reward is not None and not math.isfinite(reward):
        raise InvalidReply(f"reward={reward} is not finite")
    return payload


@functools.cache
def observation_reply_model() -> type:
    """OpenEnv's observation frame, except that NaN and +-inf go on the wire as NaN/Infinity instead of
    null (pydantic's default), which a client would read as "no reward"; `check_reply` refuses them."""
    from openenv.core.env_server.types import WSObservationResponse
    from pydantic import ConfigDict

    class ObservationReply(WSObservationResponse):
        model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    return ObservationReply


def validation_detail(errors: list[dict]) -> str:
    """pydantic errors -> 'guess: Input should be a valid integer' (the same text on every launcher)."""
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errors)


def _valid_kwargs(fn: Any, kwargs: dict) -> dict:
    """What the server does: keep only kwargs the method accepts (all of them with **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def contract_broken(method: str, returned: str) -> str:
    """The one line for an env whose reset/step returns something else than an Observation (dipg_safety_env's
    step returned the client-side StepResult): every episode would fail the same way."""
    return (f"the env broke OpenEnv's Environment contract: {method} returned {returned}, not an openenv "
            f"Observation; make it return its Observation (reward and done are fields of it)")


# what OpenEnv's server answers when an env's reset/step returned a non-Observation it cannot serialise
_UNSERIALISABLE = re.compile(r"'(\w+)' object has no attribute 'model_dump'")


class DaemonWorker(concurrent.futures.Executor):
    """One daemon thread running the submitted calls in order. A call stuck in an env's code is abandoned with
    its thread: ThreadPoolExecutor's threads are joined at interpreter exit, so a reset that never returned
    kept a finished run's process alive for ever; a daemon thread ends with the process."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)  # the thread ends after the call it is in, if that ever returns; never joined


class InProcessTransport:
    """The env object in this process. Its calls run on a private event loop thread (MCP envs inside
    one open `mcp_session`, sync env methods on one worker thread, as the server does), so a hanging
    step can be abandoned after its timeout; both threads are daemons, so an abandoned call never holds
    the process at exit (`DaemonWorker`)."""

    def __init__(self, spec: EnvSpec) -> None:
        from openenv.core.env_server.interfaces import Environment

        self.spec = spec
        self._environment_base = Environment
        self._loop = asyncio.new_event_loop()
        self._worker = DaemonWorker("quaero-env")
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="quaero-env-loop")
        self._thread.start()
        self._requests: asyncio.Queue = asyncio.Queue()  # binds to the loop on first use (3.10+)
        self._session = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._closed = False

    async def _serve(self) -> None:
        """One session, like the server's WebSocket handler: the MCP session stays open throughout.
        The loop thread ends with the session (for an abandoned session: once its stuck call returns)."""
        from contextlib import AsyncExitStack

        try:
            env = await self._loop.run_in_executor(self._worker, self.spec.factory)
            try:
                async with AsyncExitStack() as stack:
                    if self.spec.is_mcp:
                        await stack.enter_async_context(env.mcp_session())
                    while (request := await self._requests.get()) is not None:
                        kind, data, future = request
                        try:
                            future.set_result(await self._handle(env, kind, data))
                        except Exception as e:  # noqa: BLE001 - delivered to the caller
                            future.set_exception(e)
            finally:
                await self._loop.run_in_executor(self._worker, env.close)
        finally:
            self._worker.shutdown(wait=False)
            self._loop.call_soon(self._loop.stop)

    async def _handle(self, env: Any, kind: str, data: dict) -> dict:
        from openenv.core.env_server._utils import overrides_method
        from openenv.core.env_server.serialization import deserialize_action, serialize_observation
        from openenv.core.env_server.types import Observation
        from pydantic import ValidationError

        base = self._environment_base
        if kind == "reset":
            if overrides_method(env.reset_async, base.reset_async):
                obs = await env.reset_async(**_valid_kwargs(env.reset_async, data))
            else:
                kwargs = _valid_kwargs(env.reset, data)
                obs = await self._loop.run_in_executor(self._worker, lambda: env.reset(**kwargs))
        else:
            try:
                action = deserialize_action(data, self.spec.action_cls)
            except ValidationError as e:
                raise ActionRejected(validation_detail(e.errors())) from None
            if overrides_method(env.step_async, base.step_async):
                obs = await env.step_async(action)
            else:
                obs = await self._loop.run_in_executor(self._worker, env.step, action)
        if not isinstance(obs, Observation):
            raise InvalidReply(f"observation={_shown(obs)}: "
                               + contract_broken(f"{type(env).__name__}.{kind}", type(obs).__name__))
        # quaero's server's exact serialization, JSON round trip included
        return json.loads(observation_reply_model()(data=serialize_observation(obs)).model_dump_json())[
            "data"
        ]

    def _call(self, kind: str, data: dict, timeout_s: float) -> dict:
        if self._session.done() and not self._closed:
            error = self._session.exception()  # the factory (or the MCP session) failed
            raise EnvFault("server_error", f"in-process env session ended: {type(error).__name__}: {error}")
        if self._closed:
            raise EnvFault("connection", "in-process session is closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(self._requests.put_nowait, (kind, data, future))
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self._closed = True
            self._session.cancel()  # the env is stuck mid-call: abandon it; the next session gets a fresh env
            raise EnvFault("timeout", f"{kind} took longer than {timeout_s}s") from None
        except (ActionRejected, InvalidReply):
            raise
        except Exception as e:  # noqa: BLE001 - the env raised: the server would answer EXECUTION_ERROR
            detail = str(e).strip() or type(e).__name__
            raise EnvRaised(detail, f"{kind} raised {type(e).__name__}: {e}") from None

    def reset(self, kwargs: dict, timeout_s: float) -> dict:
        return check_reply(self._call("reset", kwargs, timeout_s))

    def step(self, action: dict, timeout_s: float) -> dict:
        return check_reply(self._call("step", action, timeout_s))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._requests.put_nowait, None)
        try:
            self._session.result(timeout=5.0)
        # env.close failed or is slow: the daemon loop thread finishes it
        except Exception:  # noqa: BLE001, S110
            pass


class WebSocketTransport:
    """One OpenEnv WebSocket session (`/ws`) on a real server; a message timeout drops the socket, as
    OpenEnv's own client does, because a late reply would desynchronise the stream."""

    def __init__(self, ws_url: str, open_timeout_s: float) -> None:
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        self._ws_errors = (WebSocketException, OSError, EOFError)
        self._held = contextlib.ExitStack()
        try:
            # no client keepalive: a slow LLM turn must not kill the session (the server still pings)
            # entered as the context manager it is (websockets' documented use); close() leaves it
            self._ws = self._held.enter_context(connect(ws_url, open_timeout=open_timeout_s,
                                                        ping_interval=None,
                                                        max_size=100 * 2**20, close_timeout=1.0))
        except TimeoutError:
            raise EnvFault("timeout", f"connecting to {ws_url} took longer than {open_timeout_s}s") from None
        except self._ws_errors as e:
            raise EnvFault("connection", f"cannot connect to {ws_url}: {e}") from None
        self.url = ws_url
        self._probe(open_timeout_s)

    def _probe(self, timeout_s: float) -> None:
        """The server creates the session after accepting the socket and reports failure (capacity,
        factory error) in a frame, so ask for the state once: a refused session fails here, at connect."""
        try:
            self._exchange({"type": "state"}, timeout_s)
        except EnvFault as e:
            if e.kind != "server_error" or "EXECUTION_ERROR" not in str(e):
                raise  # an env whose `state` fails before reset still has a live session

    def _exchange(self, message: dict, timeout_s: float) -> dict:
        try:
            try:
                self._ws.send(json.dumps(message))
            except self._ws_errors:
                raw = self._ws.recv(timeout=0)  # what the server said before closing (e.g. CAPACITY_REACHED)
            else:
                raw = self._ws.recv(timeout=timeout_s)
        except TimeoutError:
            self.close()
            raise EnvFault("timeout", f"{message['type']} took longer than {timeout_s}s") from None
        except self._ws_errors as e:
            self.close()
            raise EnvFault("connection",
                           f"{message['type']} on {self.url}: {type(e).__name__}: {e}") from None
        try:
            reply = json.loads(raw)  # NaN/Infinity parse as floats, for check_reply to refuse
        except json.JSONDecodeError:
            raise InvalidReply(f"frame={_shown(raw)} is not JSON") from None
        except RecursionError:  # nested deeper than Python's parser goes: the same answer every time
            raise InvalidReply(f"frame={_shown(raw)} is nested too deeply to parse") from None
        if not isinstance(reply, dict):
            raise InvalidReply(f"frame={_shown(reply)} is not a JSON object")
        if reply.get("type") in ("observation", "state"):
            return reply.get("data")
        data = reply.get("data") if isinstance(reply.get("data"), dict) else {}
        code, text = data.get("code", "?"), data.get("message", raw[:300])
        if code == "VALIDATION_ERROR" and message["type"] == "step":
            raise ActionRejected(validation_detail(data.get("errors", [])) or text)
        if code == "EXECUTION_ERROR" and (m := _UNSERIALISABLE.search(str(text))):
            raise InvalidReply(contract_broken(f"the server's env {message['type']}", m.group(1)))
        if code == "CAPACITY_REACHED":
            self.close()
            raise EnvFault("capacity", f"{text} (server max_sessions={data.get('max_sessions')})")
        if code == "EXECUTION_ERROR":  # OpenEnv's server caught what the env raised: the session lives on
            raise EnvRaised(str(text).strip() or code, f"{code}: {text}")
        raise EnvFault("server_error", f"{code}: {text}")

    def reset(self, kwargs: dict, timeout_s: float) -> dict:
        return check_reply(self._exchange({"type": "reset", "data": kwargs}, timeout_s))

    def step(self, action: dict, timeout_s: float) -> dict:
        return check_reply(self._exchange({"type": "step", "data": action}, timeout_s))

    def close(self) -> None:
        try:
            self._held.close()  # the connection's __exit__: closes the socket
        except Exception:  # noqa: BLE001, S110 - closing a dead socket
            pass
