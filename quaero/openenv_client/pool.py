"""open_envs: N ChatEnv sessions over the configured launcher, counting into one RolloutCounts, and the
lifetime of any server quaero launched (stopped by pid on close, at exit, and when the parent dies).

Each session gets an env of its own:
- inprocess: one env instance per session (InProcessTransport builds it). Instances of an env that does
  not declare SUPPORTS_CONCURRENT_SESSIONS may still share module-level state, which quaero cannot see:
  with several sessions that is warned about, and `local-server` is the safe choice.
- local-server: one server for a concurrent env; for a non-concurrent one, a pool of one-session
  servers, one per session (process isolation holds whatever the env shares).
- remote (`url` or `urls`): sessions spread evenly over the servers, a session refused by a full server
  (CAPACITY_REACHED) moving on to the next; OpenEnv servers do not publish their capacity (/health,
  /metadata and /schema do not carry it), so a server's room is learnt only from its refusals.
"""
from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quaero.config import ConfigError
from quaero.launcher_registry import LAUNCHERS, opener
from quaero.telemetry import names
from quaero.telemetry.counts import RolloutCounts
from quaero.telemetry.runlog import get_logger

from .loading import EnvSpec, action_fields, ignored_reset_params, load_entry, load_formatter, require_openenv
from .mapping import model_action_schema, tool_specs
from .server import LocalServer, start_env_servers
from .session import ChatEnv, EpisodeDropped, ResetWitness
from .tasks import TaskCatalog, TaskSpecs, catalog_of_spec, catalog_over_http
from .transport import EnvFault, InProcessTransport, WebSocketTransport, endpoints

if TYPE_CHECKING:
    from pathlib import Path

    from typing_extensions import Self

    from quaero.config import EnvConfig

    from .session import Connector

log = get_logger(__name__)


class InProcessConnector:
    """Sessions on env instances built in this process."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec

    def connect(self) -> InProcessTransport:
        return InProcessTransport(self.spec)

    def recover(self) -> None:
        pass  # a stuck or failed in-process env was already abandoned; the next connect builds a new one


# how long a lost session waits to see its local server gone before it calls it alive (ensure_alive)
RECOVER_GRACE_S = 1.0


class ServerConnector:
    """Sessions on an OpenEnv server: quaero's own LocalServer (restarted when it dies) or a remote URL."""

    def __init__(self, ws_url: str, open_timeout_s: float, counts: RolloutCounts,
                 server: LocalServer | None = None) -> None:
        self.ws_url, self.open_timeout_s, self.counts, self.server = ws_url, open_timeout_s, counts, server

    def connect(self) -> WebSocketTransport:
        return WebSocketTransport(self.ws_url, self.open_timeout_s)

    def recover(self) -> None:
        """After a lost session: restart quaero's own server if it died (a second to be seen gone)."""
        if self.server is not None and self.server.ensure_alive(grace_s=RECOVER_GRACE_S):
            self.counts.add(names.ENV_RESTARTS)


class SpreadConnector:
    """Sessions over several servers ([env] urls): the session's own server first, then the others, so a
    full or lost host moves the session (and the replay of its episode) to one that answers."""

    def __init__(self, hosts: list[ServerConnector], first: int) -> None:
        self.hosts = hosts[first:] + hosts[:first]
        self.ws_url = self.hosts[0].ws_url  # where the last session opened

    def connect(self) -> WebSocketTransport:
        faults = []
        for host in self.hosts:
            try:
                transport = host.connect()
            except EnvFault as e:
                faults.append(e)
                continue
            self.ws_url = host.ws_url
            return transport
        # all full is a capacity problem, whatever else failed
        raise next((f for f in faults if f.kind == "capacity"), faults[-1])

    def recover(self) -> None:
        pass  # remote servers are not quaero's to restart


def _fetch_schema(http_url: str, timeout_s: float) -> dict:
    try:
        with urllib.request.urlopen(f"{http_url}/schema", timeout=timeout_s) as r:
            return json.loads(r.read())["action"]
    except OSError as e:
        raise ConfigError(f"[env] url={http_url!r}: no OpenEnv server answers there ({e}); start one with "
                          "`quaero env serve module:Class --port PORT`") from None


MCP_ACTION_FIELDS = frozenset({"type", "tool_name", "arguments", "metadata"})  # CallToolAction's


def mcp_schema(schema: dict) -> bool:
    """Whether an Action schema is MCP's CallToolAction: tool_name and arguments and nothing else a model must
    fill. A plain Action that merely has such fields (calendar_env's {action_type, tool_name, arguments}) is
    not: its server rejects a CallToolAction."""
    props, required = set(schema.get("properties", {})), set(schema.get("required", []))
    return {"tool_name", "arguments"} <= props <= MCP_ACTION_FIELDS and required <= {"tool_name", "arguments"}


def _serves_tools(schema: dict, http_url: str, connector: ServerConnector, timeout_s: float) -> bool:
    """Whether the server is an MCP env: its /schema is CallToolAction's, or it publishes the base Action (an
    app built with it still takes MCP actions) and answers list_tools. A plain env's server that publishes
    the base Action rejects every action the model could write: a ConfigError."""
    if mcp_schema(schema):
        return True
    if action_fields(schema):
        return False
    try:
        if _list_tools(connector, timeout_s):
            return True
    except Exception:  # noqa: BLE001, S110 - a plain env cannot list tools: the error below says what to do
        pass
    raise ConfigError(f"[env] url={http_url!r}: the server's /schema publishes an Action without fields (its "
                      "app was built with the base Action), so it rejects every action; build its app with "
                      "the env's Action class, create_app(Env, MyAction, MyObservation), or let quaero start "
                      "the env ([env] entry = \"module:Class\" and, if needed, action = "
                      "\"module:ActionClass\")")


def _replayable(cfg: EnvConfig, spec: EnvSpec | None) -> bool:
    """Say once which task parameters the env's reset drops, and what that means; False when a reset cannot
    be repeated (no seed, no index), so a lost session drops the episode instead of replaying it."""
    if spec is None:
        log.info(names.ENV_RESET_PARAMS_UNKNOWN_EVENT,
                 url=cfg.url, note="a remote server's reset signature cannot be "
                 "inspected: if it ignores seed/split/index, eval tasks come from the train distribution and "
                 "replay after a lost session diverges (counted as dropped episodes)")
        return True
    ignored = ignored_reset_params(spec)
    replayable = not {"seed", "index"} <= set(ignored)
    if ignored:
        log.warning(names.ENV_RESET_PARAMS_IGNORED_EVENT, entry=spec.entry, ignored=ignored, note=(
            f"{spec.env_cls.__name__}.reset takes no {'/'.join(ignored)}: "
            + ("the eval split is the train distribution; " if "split" in ignored else "")
            + ("quaero cannot choose its tasks, so a lost session drops the episode instead of replaying it; "
               "whether its resets repeat is unverified until two resets of one task are compared"
               if not replayable else "it takes seed or index, but whether the same seed gives the same task "
               "is unverified until two resets of one task are compared")
            + " (env_resets_reproducible or env_resets_not_reproducible; reasoning_gym ignores its seed "
            "without a dataset_name)"))
    return replayable


class EnvPool:
    def __init__(self, sessions: list[ChatEnv], counts: RolloutCounts, servers: list[LocalServer],
                 tasks: TaskCatalog | None = None, specs: TaskSpecs | None = None) -> None:
        self.sessions, self.counts, self.servers = sessions, counts, servers
        self.tasks = tasks  # the env's Task API (splits and sizes), None when it has none
        self.specs = specs or TaskSpecs()  # its tasks' specs (get_task), read when asked

    def task_spec(self, split: str, index: int) -> dict:
        """Task `index` of `split` as the env's Task API describes it ({} when it does not)."""
        return self.specs(split, index)

    def close(self) -> None:
        self.specs.close()
        _close(self.sessions, self.servers)
        self.servers = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _list_tools(connector: Connector, timeout_s: float) -> list[dict]:
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


@dataclass
class Launched:
    """What a launcher (quaero/launcher_registry.py) opens for a pool: a connector per session, the servers
    quaero started (stopped when the pool closes) and the http bases of the servers the sessions reach (none
    in process: the env's schema, tools and tasks are then read from its class)."""

    connectors: list[Connector]
    servers: list[LocalServer] = field(default_factory=list)
    http_urls: list[str] = field(default_factory=list)


def open_inprocess(cfg: EnvConfig, spec: EnvSpec, n: int, counts: RolloutCounts,
                   log_dir: Path | None) -> Launched:
    """An env instance per session, built in this process."""
    if n > 1 and not spec.supports_concurrency:
        log.warning(names.ENV_INPROCESS_NOT_CONCURRENT_EVENT, entry=spec.entry, sessions=n,
                    risk=f"{spec.env_cls.__name__} does not declare SUPPORTS_CONCURRENT_SESSIONS: each "
                         "session has its own instance, but instances that share module-level state corrupt "
                         "each other",
                    fix='[env] launcher = "local-server" runs one server process per session')
    return Launched([InProcessConnector(spec)] * n)


def open_local_servers(cfg: EnvConfig, spec: EnvSpec, n: int, counts: RolloutCounts,
                       log_dir: Path | None) -> Launched:
    """One server for a concurrent env; one one-session server per session otherwise."""
    def server(max_concurrent_envs: int) -> LocalServer:
        return LocalServer(cfg.entry, cfg.host, max_concurrent_envs=max_concurrent_envs,
                           start_timeout_s=cfg.server_start_timeout_s, kwargs=cfg.kwargs, action=cfg.action,
                           log_dir=log_dir)

    if spec.supports_concurrency:
        # headroom: a session abandoned after a timeout holds its slot until its step returns
        servers = start_env_servers([server(2 * n + 1)])
        return Launched([ServerConnector(servers[0].ws_url, cfg.reset_timeout_s, counts, servers[0])] * n,
                                                                                                    servers,
                        [servers[0].http_url])
    servers = start_env_servers([server(1) for _ in range(n)])
    return Launched([ServerConnector(s.ws_url, cfg.reset_timeout_s, counts, s) for s in servers], servers,
                    [servers[0].http_url])


def open_remote(cfg: EnvConfig, spec: None, n: int, counts: RolloutCounts, log_dir: Path | None) -> Launched:
    """Connectors over [env] url/urls and the servers' http bases; every server must serve the same env."""
    bases = [endpoints(u) for u in cfg.server_urls]
    hosts = [ServerConnector(ws, cfg.reset_timeout_s, counts) for _, ws in bases]
    if len(hosts) == 1:
        return Launched(hosts * n, http_urls=[bases[0][0]])
    return Launched([SpreadConnector(hosts, i % len(hosts)) for i in range(n)], http_urls=[http for http,
                                                                                           _ in bases])


def _action_schema(http_urls: list[str], timeout_s: float) -> dict:
    schemas = [_fetch_schema(u, timeout_s) for u in http_urls]
    for url, schema in zip(http_urls[1:], schemas[1:]):
        if schema != schemas[0]:
            raise ConfigError(f"[env] urls: {url} serves another env than {http_urls[0]} (their action "
                              "schemas differ); list only servers of one env")
    return schemas[0]


def _capacity_error(cfg: EnvConfig, n: int, fault: EnvFault) -> ConfigError:
    """The fixes that apply to the launcher in use (never group_size = 1: it zeroes every group advantage)."""
    lower = ("or lower [rollout] tasks_per_step (keep group_size >= 2: a group of one has no "
             "group-relative advantage)")
    if not cfg.starts_env:
        return ConfigError(f"[env] {_where(cfg)}: the servers hold fewer than the {n} sessions this run "
                           f"needs ([rollout] tasks_per_step x group_size) ({fault}); add servers to [env] "
                           "urls (an env's own `uvicorn server.app:app` holds 1 session: start one per "
                           "session), or, for an env that supports concurrent sessions, serve it with "
                           f"`quaero env serve module:Class --max-concurrent-envs {n}`, {lower}")
    return ConfigError(f"[env] {_where(cfg)}: quaero's local server refused a session ({fault}); sessions of "
                       f"an earlier pool may still be closing: raise [env] max_retries, {lower}")


def _where(cfg: EnvConfig) -> str:
    if cfg.starts_env:
        return f"entry={cfg.entry!r}"
    return f"url={cfg.url!r}" if cfg.url else f"urls={cfg.urls!r}"


def open_envs(cfg: EnvConfig, n: int, counts: RolloutCounts | None = None,
              log_dir: Path | None = None) -> EnvPool:
    """N sessions of the configured env, counting into `counts` (a new one by default; `pool.counts`).
    Config problems raise ConfigError here, before any episode. log_dir: where local servers' logs go
    (a run's `env-servers/`; temp files when None)."""
    require_openenv()
    counts = RolloutCounts() if counts is None else counts
    servers, sessions = [], []
    spec = load_entry(cfg.entry, cfg.kwargs, cfg.action) if LAUNCHERS[cfg.launcher].starts_env else None
    try:
        launched = opener(cfg.launcher)(cfg, spec, n, counts, log_dir)
        connectors, servers, http_urls = launched.connectors, launched.servers, launched.http_urls
        if not http_urls:  # in process: the env's class says what it takes
            is_mcp, schema = spec.speaks_tools, spec.action_schema()
            tasks = catalog_of_spec(spec, cfg.reset_timeout_s)
        else:
            schema = _action_schema(http_urls, cfg.reset_timeout_s)
            try:
                tasks = catalog_over_http(http_urls[0], cfg.reset_timeout_s)
            except ConfigError as e:  # the env raised in the server: its log holds the reason
                raise ConfigError(f"{e}{servers[0].log_hint() if servers else ''}") from None
            # an env quaero starts is MCP when its class is (as in process); a remote one when its schema says
            # so
            is_mcp = spec.speaks_tools if spec is not None else _serves_tools(schema, http_urls[0],
                                                                              connectors[0],
                                                                         cfg.reset_timeout_s)
        tools = _list_tools(connectors[0], cfg.reset_timeout_s) if is_mcp else None
        replayable = _replayable(cfg, spec)
        witness = ResetWitness()
        sessions = [ChatEnv(cfg, c, counts, tools=tools,
                            action_schema=None if is_mcp else model_action_schema(schema),
                            formatter=load_formatter(cfg.formatter), replayable=replayable, witness=witness)
                    for c in connectors]
        specs = TaskSpecs(spec, None if spec is not None else http_urls[0] if http_urls else None,
                          cfg.reset_timeout_s) if tasks is not None else None
        pool = EnvPool(sessions, counts, servers, tasks, specs)
        for s in sessions:  # open all sessions now: servers that cannot hold n of them fail here, clearly
            _open_session(s, cfg)
    except EnvFault as e:
        _close(sessions, servers)
        if e.kind == "capacity":
            raise _capacity_error(cfg, n, e) from None
        raise ConfigError(f"[env] {_where(cfg)}: cannot open sessions: {e}"
                          f"{servers[0].log_hint() if servers else ''}") from None
    except BaseException:
        _close(sessions, servers)
        raise
    spread = Counter(getattr(c, "ws_url", "inprocess") for c in connectors)
    log.info(names.ENV_POOL_OPENED_EVENT,
             launcher=cfg.launcher, source=cfg.entry or ", ".join(cfg.server_urls),
             sessions=n,
             servers=len(servers) or len(cfg.server_urls), spread=dict(spread) if len(spread) > 1 else None,
             mcp=is_mcp, tools=[t["function"]["name"] for t in tools or []],
             action=spec.action_source if spec is not None else f"{cfg.server_urls[0]}/schema",
             task_splits=tasks.splits if tasks is not None else None)
    return pool


def _close(sessions: list[ChatEnv], servers: list[LocalServer]) -> None:
    for s in sessions:
        s.close()
    for server in servers:
        server.stop()


__all__ = ["EnvPool", "EpisodeDropped", "open_envs"]
