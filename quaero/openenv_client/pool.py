"""open_envs: N ChatEnv sessions over the configured launcher, counting into one RolloutStats, and the
lifetime of any server quaero launched (stopped by pid on close, at exit, and when the parent dies)."""
from __future__ import annotations

import json
import time
import urllib.request
from typing import TYPE_CHECKING

from quaero.config import ConfigError
from quaero.metrics import get_logger
from quaero.rollout_stats import RolloutStats

from .loading import (
    EnvSpec,
    action_fields,
    check_concurrency,
    ignored_reset_params,
    load_entry,
    require_openenv,
)
from .mapping import load_formatter, model_action_schema, tool_specs
from .server import LocalServer
from .session import ChatEnv, EpisodeDropped
from .transport import EnvFault, InProcessTransport, WebSocketTransport

if TYPE_CHECKING:
    from pathlib import Path

    from typing_extensions import Self

    from quaero.config import EnvConfig

log = get_logger(__name__)


class InProcessConnector:
    """Sessions on env instances built in this process."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec

    def connect(self) -> InProcessTransport:
        return InProcessTransport(self.spec)

    def recover(self) -> None:
        pass  # a stuck or failed in-process env was already abandoned; the next connect builds a new one


class ServerConnector:
    """Sessions on an OpenEnv server: quaero's own LocalServer (restarted when it dies) or a remote URL."""

    def __init__(self, ws_url: str, open_timeout_s: float, stats: RolloutStats,
                 server: LocalServer | None = None) -> None:
        self.ws_url, self.open_timeout_s, self.stats, self.server = ws_url, open_timeout_s, stats, server

    def connect(self) -> WebSocketTransport:
        return WebSocketTransport(self.ws_url, self.open_timeout_s)

    def recover(self) -> None:
        if self.server is not None and self.server.ensure_alive():
            self.stats.add("env_restarts")


def _urls(url: str) -> tuple[str, str]:
    """Any of ws://h:p, ws://h:p/ws, http://h:p -> (http base, ws endpoint)."""
    base = url.rstrip("/").removesuffix("/ws")
    if base.startswith("ws"):
        base = "http" + base[2:]
    if not base.startswith("http"):
        raise ConfigError(f"[env] url={url!r}: expected ws://HOST:PORT or http://HOST:PORT")
    return base, "ws" + base[4:] + "/ws"


def _fetch_schema(http_url: str, timeout_s: float) -> dict:
    try:
        with urllib.request.urlopen(f"{http_url}/schema", timeout=timeout_s) as r:
            return json.loads(r.read())["action"]
    except OSError as e:
        raise ConfigError(f"[env] url={http_url!r}: no OpenEnv server answers there ({e}); start one with "
                          "`quaero env serve module:Class --port PORT`") from None


def _serves_tools(schema: dict, http_url: str, connector: ServerConnector, timeout_s: float) -> bool:
    """Whether the server is an MCP env: its /schema is CallToolAction's, or it publishes the base Action (an
    app built with it still takes MCP actions) and answers list_tools. A plain env's server that publishes
    the base Action rejects every action the model could write: a ConfigError."""
    if {"tool_name", "arguments"} <= set(schema.get("properties", {})):
        return True
    if action_fields(schema):
        return False
    try:
        if _list_tools(connector, timeout_s):
            return True
    except Exception:  # noqa: BLE001, S110 - a plain env cannot list tools: the error below says what to do
        pass
    raise ConfigError(f"[env] url={http_url!r}: the server's /schema publishes an Action without fields (its app "
                      "was built with the base Action), so it rejects every action; build its app with the env's "
                      "Action class, create_app(Env, MyAction, MyObservation), or let quaero start the env "
                      "([env] entry = \"module:Class\" and, if needed, action = \"module:ActionClass\")")


def _replayable(cfg: EnvConfig, spec: EnvSpec | None) -> bool:
    """Say once which task parameters the env's reset drops, and what that means; False when a reset cannot
    be repeated (no seed, no index), so a lost session drops the episode instead of replaying it."""
    if spec is None:
        log.info("env_reset_params_unknown", url=cfg.url, note="a remote server's reset signature cannot be "
                 "inspected: if it ignores seed/split/index, eval tasks come from the train distribution and "
                 "replay after a lost session diverges (counted as dropped episodes)")
        return True
    ignored = ignored_reset_params(spec)
    replayable = not {"seed", "index"} <= set(ignored)
    if ignored:
        log.warning("env_reset_params_ignored", entry=spec.entry, ignored=ignored, note=(
            f"{spec.env_cls.__name__}.reset takes no {'/'.join(ignored)}: "
            + ("the eval split is the train distribution; " if "split" in ignored else "")
            + ("tasks are not reproducible and a lost session drops the episode instead of replaying it"
               if not replayable else "tasks stay reproducible")))
    return replayable


class EnvPool:
    def __init__(self, sessions: list[ChatEnv], stats: RolloutStats, server: LocalServer | None) -> None:
        self.sessions, self.stats, self.server = sessions, stats, server

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _list_tools(connector: InProcessConnector | ServerConnector, timeout_s: float) -> list[dict]:
    transport = connector.connect()
    try:
        payload = transport.step({"type": "list_tools"}, timeout_s)
    finally:
        transport.close()
    return tool_specs(payload["observation"].get("tools", []))


def _open_session(session: ChatEnv, cfg: EnvConfig) -> None:
    """Connect, waiting out a full server briefly (sessions of a previous pool may still be closing)."""
    for attempt in range(cfg.max_retries + 1):
        try:
            return session.connect()
        except EnvFault as e:
            if e.kind != "capacity" or attempt == cfg.max_retries:
                raise
            time.sleep(cfg.retry_backoff_s * 2**attempt)


def open_envs(cfg: EnvConfig, n: int, stats: RolloutStats | None = None, log_dir: Path | None = None) -> EnvPool:
    """N sessions of the configured env, counting into `stats` (a new one by default; `pool.stats`).
    Config problems raise ConfigError here, before any episode. log_dir: where a local server's log goes
    (a run's `env-servers/`; a temp file when None)."""
    require_openenv()
    stats = RolloutStats() if stats is None else stats
    server, sessions = None, []
    spec = None if cfg.launcher == "remote" else load_entry(cfg.entry, cfg.kwargs, cfg.action)
    if spec is not None:
        check_concurrency(spec, n)
    try:
        if cfg.launcher == "inprocess":
            connector = InProcessConnector(spec)
            is_mcp, schema = spec.is_mcp, spec.action_schema()
        else:
            if cfg.launcher == "local-server":
                # headroom: a session abandoned after a timeout holds its slot until its step returns
                server = LocalServer(cfg.entry, cfg.host, max_concurrent_envs=2 * n + 1 if spec.supports_concurrency
                                     else 1, start_timeout_s=cfg.server_start_timeout_s,
                                     kwargs=cfg.kwargs, action=cfg.action, log_dir=log_dir).start()
                http_url, ws_url = server.http_url, server.ws_url
            else:
                http_url, ws_url = _urls(cfg.url)
            connector = ServerConnector(ws_url, cfg.reset_timeout_s, stats, server)
            schema = _fetch_schema(http_url, cfg.reset_timeout_s)
            is_mcp = _serves_tools(schema, http_url, connector, cfg.reset_timeout_s)
        tools = _list_tools(connector, cfg.reset_timeout_s) if is_mcp else None
        replayable = _replayable(cfg, spec)
        sessions = [ChatEnv(cfg, connector, stats, tools=tools, action_schema=None if is_mcp else
                            model_action_schema(schema), formatter=load_formatter(cfg.formatter),
                            replayable=replayable) for _ in range(n)]
        pool = EnvPool(sessions, stats, server)
        for s in sessions:  # open all sessions now: a server that cannot hold n of them fails here, clearly
            _open_session(s, cfg)
    except EnvFault as e:
        for s in sessions:
            s.close()
        if server is not None:
            server.stop()
        where = cfg.url or cfg.entry
        if e.kind == "capacity":
            raise ConfigError(f"[env] {where}: the server cannot hold {n} sessions ({e}); raise its "
                              "max_concurrent_envs (quaero env serve --max-concurrent-envs) or lower "
                              "[training] tasks_per_step x group_size") from None
        raise ConfigError(f"[env] {where}: cannot open sessions: {e}") from None
    except BaseException:
        for s in sessions:
            s.close()
        if server is not None:
            server.stop()
        raise
    log.info("env_pool_opened", launcher=cfg.launcher, source=cfg.url or cfg.entry, sessions=n, mcp=is_mcp,
             tools=[t["function"]["name"] for t in tools or []],
             action=spec.action_source if spec is not None else f"{cfg.url}/schema")
    return pool


__all__ = ["EnvPool", "EpisodeDropped", "open_envs"]
