"""OpenEnv's Task API, read by quaero: an env's splits and their task counts, and the tasks a run plays.

An env may implement task discovery (`list_splits()`, `num_tasks(split)`, `get_task(split, index)`; OpenEnv
0.10's `TaskProvider` protocol, served by its HTTP server as `GET /{env}/splits` and `POST /{env}/num_tasks`)
and select a task with `reset(split=..., index=...)`. When it does, quaero uses the env's own splits: `[env]
train_split`/`eval_split` must name one of them (`quaero check` says which exist), training draws indices from
the train split's range in an order the run seed fixes (seed 0: 0, 1, 2, ...; another seed: a permutation of
the split, so seeds train on different tasks; wrapping round it), and evaluation plays the eval split's tasks
(all of them, or the first `[training] eval_tasks` of them, by index). An env without it keeps quaero's own
numbering: task i of a split is index i, seed derived from the run seed.

Discovery is side-effect free and works on a fresh instance (the protocol says so), so in process quaero
builds one instance for it and closes it.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import random
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quaero.bounded import CallTimeout, CallWorker, bounded_call
from quaero.config import TASK_SAMPLERS, ConfigError
from quaero.telemetry.runlog import error_line


@dataclass(frozen=True)
class TaskCatalog:
    """An env's splits (in the env's order) and how many tasks each holds; `source` says where they were
    read."""

    splits: dict[str, int]
    source: str

    def size(self, split: str) -> int | None:
        return self.splits.get(split)

    def describe(self) -> str:
        listed = ", ".join(f"{name!r} ({n} tasks)" for name, n in self.splits.items())
        return f"{listed} (the env's Task API, {self.source})"


def _awaited(value: Any) -> Any:
    """The protocol lets each method be sync or async."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def split_name(split: Any) -> str:
    """A split descriptor (a string, a dict or a pydantic model with `name`) -> its name, as OpenEnv's server
    normalises it."""
    if isinstance(split, str):
        return split
    if hasattr(split, "model_dump"):
        split = split.model_dump()
    if isinstance(split, dict) and "name" in split:
        return str(split["name"])
    return str(split)


class TaskCountError(ValueError):
    """`num_tasks` answered something other than a non-negative int."""


def task_count(value: Any, split: str) -> int:
    """`num_tasks(split)`'s answer, strictly a non-negative int (2.7, "3", NaN or true are not counts)."""
    if type(value) is not int or value < 0:
        raise TaskCountError(f"num_tasks({split!r}) returned {value!r} ({type(value).__name__}), not a "
                             "non-negative int; return the split's task count as an int")
    return value


class DiscoveryTimeout(ConfigError):
    """An env's list_splits/num_tasks did not answer within the bound."""


def _bounded(call: Callable[[], Any], what: str, timeout_s: float | None) -> Any:
    """`call()` (an env's discovery method), waited for at most `timeout_s` seconds: it runs on a daemon
    thread, abandoned (never joined) when it does not answer, so a blocking env cannot hold `quaero check` or
    a run."""
    if timeout_s is None:
        return call()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="quaero-task-discovery")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise DiscoveryTimeout(f"{what} (OpenEnv's Task API) did not answer within {timeout_s:g}s ([env] "
                               "reset_timeout_s bounds task discovery); fix the env's discovery (it must not "
                               "block) or raise the bound")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def catalog_of(env: Any, source: str = "in process", timeout_s: float | None = None) -> TaskCatalog | None:
    """The Task API of an env instance, or None when it has none (no methods, or they raise
    NotImplementedError, as OpenEnv's server answers 501); each method waited for at most `timeout_s`."""
    list_splits, num_tasks = getattr(env, "list_splits", None), getattr(env, "num_tasks", None)
    if not (callable(list_splits) and callable(num_tasks)):
        return None
    cls = type(env).__name__
    try:
        listed = _bounded(lambda: _awaited(list_splits()), f"{cls}.list_splits()", timeout_s)
        names = [split_name(s) for s in listed]
        return TaskCatalog({name: task_count(_bounded(lambda name=name: _awaited(num_tasks(name)),
                                                      f"{cls}.num_tasks({name!r})", timeout_s), name)
                            for name in names}, source)
    except NotImplementedError:
        return None
    except DiscoveryTimeout as e:
        raise DiscoveryTimeout(f"[env] {e}") from None
    except TaskCountError as e:
        raise ConfigError(f"[env] {cls}: {e}") from None
    # an env whose discovery fails is named in one line, not a traceback
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{cls}.list_splits/num_tasks (OpenEnv's Task API) failed: "
                          f"{error_line(e)}; fix the env's task discovery or remove those methods") from None


def _http_json(url: str, timeout_s: float, body: dict | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.loads(r.read())


def catalog_over_http(http_url: str, timeout_s: float = 10.0) -> TaskCatalog | None:
    """The Task API of a running OpenEnv server (`GET /list_environments`, `GET /{env}/splits`, `POST
    /{env}/num_tasks`), or None when it serves none (no such routes, or 501 from an env without the
    methods)."""
    try:
        env_name = _http_json(f"{http_url}/list_environments", timeout_s)[0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None  # not OpenEnv's HTTP server (an older one, a WebSocket-only server): no Task API to read
    try:
        splits = [split_name(s) for s in _http_json(f"{http_url}/{env_name}/splits", timeout_s)]
        counts = {s: task_count(_http_json(f"{http_url}/{env_name}/num_tasks", timeout_s, {"split": s})
                                ["num_tasks"], s) for s in splits}
    except TaskCountError as e:
        raise ConfigError(f"[env] {http_url}: its Task API's {e}") from None
    except urllib.error.HTTPError as e:
        if e.code in (404, 405, 501):
            return None
        raise ConfigError(f"[env] {http_url}: its Task API answered HTTP {e.code} ({e.reason}): the env "
                          "raised in the server, building an instance for the session or in "
                          "list_splits/num_tasks; the server's log has the traceback") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ConfigError(f"[env] {http_url}: cannot read its Task API ({error_line(e)}); is an OpenEnv "
                          "server running there?") from None
    return TaskCatalog(counts, http_url)


DRAWING_SAMPLERS = tuple(s for s in TASK_SAMPLERS if s != "sequential")  # those that need the split's size


def check_splits(catalog: TaskCatalog | None, env_cfg: Any, *, train: bool, evaluate: bool,
                 source: str = "config") -> None:
    """`[env] train_split`/`eval_split` against the env's own splits (nothing to check without a Task API);
    train/evaluate: whether the run reads that split at all."""
    if catalog is None:
        sampler = getattr(getattr(env_cfg, "tasks", None), "sampler", "sequential")
        if train and sampler in DRAWING_SAMPLERS:
            raise ConfigError(f"{source} [env.tasks] sampler={sampler!r}: draws from the split's tasks, and "
                              "the env has no Task API (list_splits/num_tasks) to count them; use sampler = "
                              "\"sequential\", or give the env a Task API")
        return
    for key, split, used in (("train_split", env_cfg.train_split, train), ("eval_split", env_cfg.eval_split,
                                                                           evaluate)):
        if not used:
            continue
        n = catalog.size(split)
        if n is None:
            raise ConfigError(f"{source} [env] {key}={split!r}: the env has no such split; its splits: "
                              f"{catalog.describe()}; set {key} to one of them")
        if n <= 0:
            raise ConfigError(f"{source} [env] {key}={split!r}: the split holds no task; its splits: "
                              f"{catalog.describe()}")


def task_index(catalog: TaskCatalog | None, split: str, i: int, seed: int = 0) -> int:
    """The env index of the i-th task quaero draws from `split`: i itself without a Task API (the reset seed
    tells tasks apart there), else the i-th of the split's indices in the seed's order, wrapped round the
    split (a run longer than the split plays it again, in the same order). Seed 0's order is 0, 1, 2, ...;
    another seed's is the affine permutation i -> (a i + b) mod n, a coprime with n, both drawn from the
    seed."""
    n = catalog.size(split) if catalog is not None else None
    if not n:
        return i
    if seed == 0:
        return i % n
    draw = random.Random(f"task-order:{seed}:{n}")
    a, b = draw.randrange(1, n) if n > 1 else 1, draw.randrange(n)
    while math.gcd(a, n) != 1:
        a = a % (n - 1) + 1
    return (a * (i % n) + b) % n


def eval_indices(catalog: TaskCatalog | None, split: str, eval_tasks: int) -> list[int]:
    """The indices evaluation plays: the first eval_tasks (the same on every run, and what quaero played
    before it read the Task API), never past the end of the env's split: every task of it when eval_tasks
    covers it, each once."""
    n = catalog.size(split) if catalog is not None else None
    return list(range(min(eval_tasks, n) if n else eval_tasks))


def plan_line(catalog: TaskCatalog | None, env_cfg: Any, eval_tasks: int) -> str:
    """`quaero check`'s tasks line."""
    if catalog is None:
        return ("tasks       the env has no Task API (list_splits/num_tasks): task i of a split is reset "
                "with index i and a seed derived from [run] seed")
    n_eval = catalog.size(env_cfg.eval_split) or 0
    played = len(eval_indices(catalog, env_cfg.eval_split, eval_tasks))
    cover = ("all of them" if played >= n_eval else
             f"the first {played} (set [training] eval_tasks = {n_eval} for all)")
    return (f"tasks       splits {catalog.describe()}; train draws from {env_cfg.train_split!r}, eval plays "
            f"{env_cfg.eval_split!r}: {cover}")


def check_lines(cfg: Any, source: str = "config") -> list[str]:
    """`quaero check`'s tasks line, the configured splits judged against the env's (a ConfigError when one is
    missing): read from a fresh instance of an [env] entry that is an Environment class (a factory function is
    never called here), or from the first [env] url's routes when it is up."""
    env_cfg, t = cfg.env, cfg.training
    if not env_cfg.starts_env:
        from .transport import endpoints

        http_url = endpoints(env_cfg.server_urls[0])[0]
        try:
            urllib.request.urlopen(f"{http_url}/health", timeout=2).close()
        except OSError:
            return [(f"tasks       read from {http_url}'s Task API routes when sessions open (not reachable "
                    "now)")]
        catalog = catalog_over_http(http_url)
    else:
        from .loading import FactoryNotCalled, load_entry

        # an Environment class is built once (what every session does); a factory function is never called
        try:
            spec = load_entry(env_cfg.entry, env_cfg.kwargs, env_cfg.action, call_factory=False)
        except FactoryNotCalled:
            return [("tasks       read from the env's Task API when sessions open (a factory function is not "
                     "called at check)")]
        if not builds_class(spec):  # a factory whose return annotation named its class: still never called
            cls = spec.env_cls.__name__
            return [(f"tasks       read from {cls}'s Task API when sessions open: {spec.entry} is a factory "
                     "function, not called at check (its splits and task counts cannot be read without it)")]
        catalog = catalog_of_spec(spec, env_cfg.reset_timeout_s)
    check_splits(catalog, env_cfg, train=bool(t.steps or t.warmup_sft_steps), evaluate=bool(t.eval_tasks),
                 source=source)
    return [plan_line(catalog, env_cfg, t.eval_tasks)]


def builds_class(spec: Any) -> bool:
    """Whether an EnvSpec's factory is its env class itself ([env] kwargs bound or not), not a function of the
    config's: `quaero check` builds a class, as every session does, and never calls a factory function."""
    factory = spec.factory.func if isinstance(spec.factory, functools.partial) else spec.factory
    return factory is spec.env_cls


def catalog_of_spec(spec: Any, timeout_s: float | None = None) -> TaskCatalog | None:
    """The Task API of a fresh instance of an EnvSpec's env, closed afterwards (abandoned, unclosed, when its
    discovery did not answer within `timeout_s`: its thread is still inside it)."""
    try:
        env = spec.factory()
    except Exception as e:  # noqa: BLE001 - an env that cannot be built is named in one line, not a traceback
        raise ConfigError(f"[env] entry={spec.entry!r}: building the env raised {error_line(e)}; fix its "
                          "setup (a dataset, file or [env] kwargs it needs?)") from None
    try:
        catalog = catalog_of(env, timeout_s=timeout_s)
    except DiscoveryTimeout:
        raise  # the instance is left to its stuck thread: closing it could block as well
    except BaseException:
        env.close()
        raise
    env.close()
    return catalog


class TaskSpecs:
    """Task specs of one env (its Task API's `get_task(split, index)`, whose RFC 013 keys `group` and
    `difficulty` pool a task sampler's outcomes), read when first asked and remembered: from one instance of
    an env quaero builds (discovery is side-effect free), or from a server's `POST /{env}/task`. An env that
    has no `get_task`, or fails it, gives {} (the task is then its own key). An in-process `get_task` runs on
    a worker thread, each call bounded by `timeout_s` ([env] reset_timeout_s): one past it leaves that
    instance to its stuck thread, and every later spec is {} (logged once, `task_specs_abandoned`)."""

    def __init__(self, spec: Any = None, http_url: str | None = None, timeout_s: float = 10.0) -> None:
        self.spec, self.http_url, self.timeout_s = spec, http_url, timeout_s
        self._worker = CallWorker("quaero-task-specs")
        self._env: Any = None
        self._env_name: str | None = None
        self._known: dict[tuple[str, int], dict] = {}

    def __call__(self, split: str, index: int) -> dict:
        key = (split, index)
        if key not in self._known:
            self._known[key] = self._read(split, index)
        return self._known[key]

    def _read(self, split: str, index: int) -> dict:
        try:
            if self.spec is not None:
                if self._worker.stuck:
                    return {}
                task = bounded_call(lambda: self._in_process(split, index),
                                    f"{self.spec.entry} get_task({split!r}, {index})",
                                    timeout_s=self.timeout_s, bound="[env] reset_timeout_s",
                                    worker=self._worker)
            elif self.http_url:
                if self._env_name is None:
                    self._env_name = _http_json(f"{self.http_url}/list_environments", self.timeout_s)[0]
                task = _http_json(f"{self.http_url}/{self._env_name}/task", self.timeout_s,
                                  {"split": split, "index": index})["task"]
            else:
                return {}
        except CallTimeout as e:
            from quaero.telemetry import names
            from quaero.telemetry.runlog import get_logger

            get_logger(__name__).warning(names.TASK_SPECS_ABANDONED_EVENT, error=str(e),
                                         note="every later task is its own key ([env.tasks] key)")
            return {}
        except Exception:  # noqa: BLE001 - no spec: the task is its own key
            return {}
        if hasattr(task, "model_dump"):
            task = task.model_dump()
        return dict(task) if isinstance(task, dict) else {}

    def _in_process(self, split: str, index: int) -> Any:
        if self._env is None:
            self._env = self.spec.factory()
        return _awaited(self._env.get_task(split, index))

    def close(self) -> None:
        if self._worker.stuck:
            return  # its instance is left to the thread still inside get_task: closing it could block too
        if self._env is not None:
            self._env.close()
            self._env = None
