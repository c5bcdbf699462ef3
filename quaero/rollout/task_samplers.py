"""Task samplers: which train tasks an env's groups play, per env (`[env.tasks]`, `[envs.tasks]`).

The protocol is OpenEnv RFC 013's: `sample(n) -> list[int]` (task indices of the train split), `update(task,
rewards, costs)` after a task's group finished (its episodes' rewards and costs: generated tokens), and
`state_dict()` / `load_state_dict(state)`, a JSON-able dict a checkpoint holds, so a resumed run draws what an
uninterrupted one draws. Every draw's randomness comes from a generator keyed by (run seed, env, draw number),
the draw number being part of the state: no global random state is read or moved.

- `sequential`: the run seed's order of the split (quaero/openenv_client/tasks.py `task_index`), what quaero
  always played: its state is the cursor.
- `uniform`: tasks drawn uniformly, with replacement.
- `curriculum` (RFC 013): a task's weight is its chance of a group with a learning signal, per unit of cost,
  w = (1 - p^G - (1 - p)^G (1 - s) + ε) / c, p the discounted success estimate of its key (γ), G the group
  size, c its discounted mean cost (generated tokens or episodes), and s the discounted share of the key's
  all-fail groups that still carried a signal because `[guidance]` put oracle members in them (0 without
  guidance: RFC 013's weight, where an all-fail group has none). Without s, a template the warm start solves
  greedily but not when sampled (p = 0) kept only ε and was starved while guidance could have taught it
  (benchmarks/README.md, the SmolLM2 curve at seed 1). An unseen key takes p = 0.5, s = 0 and the mean cost of
  the keys seen.
- `difficulty_pools` (prime-rl): a key's latest group success rate puts it in a pool, hard (<= hard_max),
  normal, easy (>= easy_min), or unseen, each with its weight.
A learning sampler weighs `candidates` tasks per draw (drawn uniformly; the whole split when smaller) and
draws n of them by weight, with replacement. Outcomes are remembered by the sampler's `key`: the task itself,
or the RFC 013 key of its spec (`group`, `difficulty`), which pools tasks that rarely repeat (toolbench's
train split holds a million; its tasks declare their template as `group`).

A success is an episode whose reward is > 0 (the driver's rule when the env says nothing else).
"""
from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quaero.bounded import STOP_GRACE_S, CallTimeout, bounded_call
from quaero.openenv_client.tasks import task_index
from quaero.task_sampler_registry import TASK_SAMPLERS


def _as_index(value: Any) -> Any:
    """A sampler's pick as a plain int where it is an integer of another type (numpy's, as `rng.choice`
    gives them: a checkpoint holds the picks as JSON), else as it is (judged by the caller); bools stay."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


class TaskSamplerError(RuntimeError):
    """A task sampler failed, returned a task outside its split, or its saved state does not fit."""


class SavedStateError(TaskSamplerError):
    """A checkpoint's task state holds a value no run writes (an edited or corrupt checkpoint)."""


MAX_SAVED = 2**53  # above any count a run reaches: a float still holds it exactly


def saved_number(value: Any, field: str, *, whole: bool = True, below: float = MAX_SAVED) -> Any:
    """`value`, the checkpoint's `field`, if it is a finite number in 0..`below` (an integer when `whole`);
    else SavedStateError naming the field and the value."""
    ok = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
    if not ok or not 0 <= value < below:  # NaN fails the comparison
        kind = "an integer" if whole else "a number"
        raise SavedStateError(f"{field} = {value!r} is not {kind} in 0..{below:g}; the checkpoint was edited "
                              "or is corrupt: move it aside to resume from the one before, or pass --restart")
    return value


@dataclass
class SplitView:
    """What a sampler is built with: its env's train split, the run seed, the group size and settings."""

    env: str  # the env's name ("env" in a one-env run)
    split: str
    size: int | None  # tasks in the split (None: the env has no Task API)
    seed: int
    group_size: int
    settings: Any  # quaero.config.TaskSamplerConfig
    catalog: Any = None  # its TaskCatalog (sequential's order)
    spec: Callable[[int], dict] | None = None  # the task's spec (Task API get_task), for pooled keys
    specs_read: int = 0  # how many specs `key` has read (a long first draw's progress line says it)

    def key(self, index: int) -> str:
        """The outcome memory's key of task `index`: the index, or its spec's `group` / `difficulty`."""
        which = self.settings.key
        if which == "task" or self.spec is None:
            return str(index)
        self.specs_read += 1
        value = (self.spec(index) or {}).get(which)
        return f"{which}={value}" if value is not None else str(index)


class SequentialSampler:
    """The run seed's order of the split (wrapping round it); without a Task API, quaero's own numbering."""

    def __init__(self, view: SplitView) -> None:
        self.view, self.cursor = view, 0
        self.last_weights: list[float] = []

    def sample(self, n: int) -> list[int]:
        v = self.view
        picks = [task_index(v.catalog, v.split, self.cursor + i, v.seed) for i in range(n)]
        self.cursor += n
        self.last_weights = [1.0] * n
        return picks

    def update(self, task: int, rewards: list[float], costs: list[float]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "sequential", "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = saved_number(state["cursor"], "cursor")


@dataclass
class Outcome:
    """A key's discounted memory: success and cost sums over a discounted episode count."""

    successes: float = 0.0
    cost: float = 0.0
    episodes: float = 0.0
    groups: int = 0
    last_rate: float = 0.0  # the latest group's success rate
    all_fail: float = 0.0  # discounted count of its groups with no success
    guided_signal: float = 0.0  # of those, the ones guided members gave a signal (discounted alike)

    @property
    def p(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.5

    @property
    def guided_share(self) -> float:
        """s: the share of its all-fail groups that carried a signal through guided members."""
        return min(1.0, self.guided_signal / self.all_fail) if self.all_fail else 0.0

    def to_list(self) -> list:
        return [self.successes, self.cost, self.episodes, self.groups, self.last_rate, self.all_fail,
                self.guided_signal]


class _Drawing:
    """The shared part of the samplers that draw: their keyed generator and outcome memory."""

    kind = ""

    def __init__(self, view: SplitView) -> None:
        if not view.size:
            raise TaskSamplerError(f"[env.tasks] sampler={view.settings.sampler!r} (env {view.env!r}) draws "
                                   "from the split's tasks, and the env has no Task API (list_splits/"
                                   "num_tasks) to count them; use sampler = \"sequential\"")
        self.view = view
        self.draws = 0
        self.memory: dict[str, Outcome] = {}
        self.played: set[int] = set()
        self.last_weights: list[float] = []
        self._keys: dict[int, str] = {}

    def _rng(self) -> random.Random:
        rng = random.Random(f"task-sampler:{self.kind}:{self.view.seed}:{self.view.env}:{self.draws}")
        self.draws += 1
        return rng

    def key(self, index: int) -> str:
        if index not in self._keys:
            self._keys[index] = self.view.key(index)
        return self._keys[index]

    def _candidates(self, rng: random.Random) -> list[int]:
        size, k = self.view.size, self.view.settings.candidates
        return list(range(size)) if size <= k else [rng.randrange(size) for _ in range(k)]

    def weight(self, index: int) -> float:
        raise NotImplementedError

    def sample(self, n: int) -> list[int]:
        rng = self._rng()
        candidates = self._candidates(rng)
        weights = [self.weight(i) for i in candidates]
        if not any(w > 0 for w in weights):
            weights = [1.0] * len(candidates)
        picks = rng.choices(range(len(candidates)), weights=weights, k=n)
        total = sum(weights)
        self.last_weights = [round(weights[j] / total, 6) for j in picks]
        return [candidates[j] for j in picks]

    def update(self, task: int, rewards: list[float], costs: list[float]) -> None:
        if not rewards:
            return
        gamma = self.view.settings.gamma
        m = self.memory.setdefault(self.key(task), Outcome())
        wins = sum(1 for r in rewards if r > 0)
        m.successes = gamma * m.successes + wins
        m.cost = gamma * m.cost + sum(costs)
        m.episodes = gamma * m.episodes + len(rewards)
        m.groups += 1
        m.last_rate = wins / len(rewards)
        m.all_fail = gamma * m.all_fail + (wins == 0)
        m.guided_signal = gamma * m.guided_signal
        self.played.add(task)

    def guided(self, task: int, signal: bool) -> None:
        """After `update`: the group of `task` had guided members, and `signal` says whether they gave it
        rewards that differ; counted only where that group was all-fail (quaero's own samplers; RFC 013's
        protocol has no such call)."""
        m = self.memory.get(self.key(task))
        if m is not None and signal and m.last_rate == 0:
            m.guided_signal += 1

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "draws": self.draws, "played": sorted(self.played),
                "memory": {k: m.to_list() for k, m in sorted(self.memory.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = saved_number(state["draws"], "draws")
        self.played = {saved_number(i, "played", below=self.view.size) for i in state["played"]}
        self.memory = {str(k): _outcome(f"memory[{k!r}]", v) for k, v in state["memory"].items()}


def _outcome(field: str, saved: list) -> Outcome:
    """A saved outcome memory ([successes, cost, episodes, groups, last rate, all-fail groups, guided
    signal]; a checkpoint from before the last two holds five), each value checked."""
    if not isinstance(saved, list) or len(saved) not in (5, 7):
        raise SavedStateError(f"{field} = {saved!r} is not a list of 5 or 7 numbers; the checkpoint was "
                              "edited or is corrupt: move it aside to resume from the one before, or pass "
                              "--restart")
    successes, cost, episodes, groups, rate, all_fail, guided = [*saved, 0.0, 0.0][:7]
    return Outcome(saved_number(successes, f"{field} successes", whole=False),
                   saved_number(cost, f"{field} cost", whole=False),
                   saved_number(episodes, f"{field} episodes", whole=False),
                   saved_number(groups, f"{field} groups"),
                   saved_number(rate, f"{field} last rate", whole=False, below=1 + 1e-9),
                   saved_number(all_fail, f"{field} all-fail groups", whole=False),
                   saved_number(guided, f"{field} guided signal", whole=False))


class UniformSampler(_Drawing):
    kind = "uniform"

    def weight(self, index: int) -> float:
        return 1.0

    def sample(self, n: int) -> list[int]:
        rng = self._rng()
        self.last_weights = [round(1 / self.view.size, 9)] * n
        return [rng.randrange(self.view.size) for _ in range(n)]


def curriculum_weight(p: float, group_size: int, cost: float, epsilon: float, guided: float = 0.0) -> float:
    """(1 - p^G - (1 - p)^G (1 - s) + ε) / c: the chance that a group of G carries a learning signal (plus ε),
    per unit of cost. RFC 013's, where only a group with both a success and a failure does, when `guided` (s,
    the share of the key's all-fail groups that guided members gave a signal) is 0."""
    return (1 - p ** group_size - (1 - p) ** group_size * (1 - guided) + epsilon) / max(cost, 1e-9)


class CurriculumSampler(_Drawing):
    kind = "curriculum"

    def _mean_cost(self) -> float:
        seen = [m.cost / m.episodes for m in self.memory.values() if m.episodes]
        return sum(seen) / len(seen) if seen else 1.0

    def sample(self, n: int) -> list[int]:
        self._cost = self._mean_cost()
        return super().sample(n)

    def weight(self, index: int) -> float:
        s = self.view.settings
        m = self.memory.get(self.key(index))
        cost = 1.0 if s.cost == "episodes" else (m.cost / m.episodes if m and m.episodes else self._cost)
        return curriculum_weight(m.p if m else 0.5, self.view.group_size, cost, s.epsilon,
                                 m.guided_share if m else 0.0)


class DifficultyPoolSampler(_Drawing):
    kind = "difficulty_pools"

    def weight(self, index: int) -> float:
        s = self.view.settings
        m = self.memory.get(self.key(index))
        if m is None or not m.groups:
            return s.unseen_weight
        if m.last_rate <= s.hard_max:
            return s.hard_weight
        return s.easy_weight if m.last_rate >= s.easy_min else s.normal_weight


POOLS = ("unseen", "learnable", "saturated", "hopeless")


def pool_of(m: Outcome | None) -> str:
    """A key's pool for the occupancy counters: unseen, hopeless (p <= 0.05), saturated (p >= 0.95), or
    learnable."""
    if m is None or not m.groups:
        return "unseen"
    return "hopeless" if m.p <= 0.05 else "saturated" if m.p >= 0.95 else "learnable"


@dataclass
class EnvTasks:
    """An env's sampler, checked: every draw is validated, every failure named in one line, every call bounded
    by `[env.tasks] timeout_s` with a progress line while it runs and ended by a stop request `grace_s` later
    (quaero/bounded.py)."""

    view: SplitView
    sampler: Any
    last: list[dict] = field(default_factory=list)  # the latest draw: [{"task", "weight"}]
    grace_s: float = STOP_GRACE_S  # [sampler] stop_grace_s

    @property
    def name(self) -> str:
        return f"[env.tasks] sampler={self.view.settings.sampler!r} (env {self.view.env!r})"

    def _call(self, call: Callable[[], Any], what: str) -> Any:
        """`call()`, one of the sampler's methods (`what`), bounded; TaskSamplerError when it runs past the
        bound."""
        try:
            return bounded_call(call, f"{self.name}: {what}", timeout_s=self.view.settings.timeout_s,
                                bound="[env.tasks] timeout_s", grace_s=self.grace_s,
                                progress=lambda: {"task_specs_read": self.view.specs_read})
        except CallTimeout as e:
            raise TaskSamplerError(str(e)) from None

    def sample(self, n: int) -> list[int]:
        try:
            # consumed inside the bound, and at most n + 1 items: a generator the sampler returns runs
            # the user's code too (an endless one would grow the list until memory ran out)
            picks = self._call(lambda: list(itertools.islice(self.sampler.sample(n), n + 1)), f"sample({n})")
        except TaskSamplerError:
            raise
        except Exception as e:  # noqa: BLE001 - a user's sampler's failure is named in one line
            raise TaskSamplerError(f"{self.name}: sample({n}) raised {type(e).__name__}: {e}; fix the sampler"
                                   ) from None
        size = self.view.size
        picks = [_as_index(i) for i in picks]
        bad = [i for i in picks if not isinstance(i, int) or isinstance(i, bool) or i < 0
               or (size is not None and i >= size)]
        if len(picks) != n or bad:
            kind = type(bad[0]) if bad else int
            what = (f"more than {n} tasks" if len(picks) > n else f"{len(picks)} tasks for {n}"
                    if len(picks) != n else f"task {bad[0]!r}" + (
                        "" if kind is int else f" (a {kind.__module__}.{kind.__qualname__}, not an integer)"))
            raise TaskSamplerError(f"{self.name}: sample({n}) returned {what}; it must return {n} indices in "
                                   f"0..{size - 1 if size else 'N'} of split {self.view.split!r}")
        weights = list(itertools.islice(getattr(self.sampler, "last_weights", []) or [], n))
        self.last = [{"task": i, "weight": weights[j] if j < len(weights) else None}
                     for j, i in enumerate(picks)]
        return picks

    def guided(self, task: int, signal: bool) -> None:
        """A guided all-fail group's signal, to the samplers that read it (`_Drawing.guided`)."""
        if isinstance(self.sampler, _Drawing):
            self.sampler.guided(task, signal)

    def update(self, task: int, rewards: list[float], costs: list[float]) -> None:
        try:
            self._call(lambda: self.sampler.update(task, rewards, costs), f"update({task}, ...)")
        except TaskSamplerError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TaskSamplerError(f"{self.name}: update({task}, ...) raised {type(e).__name__}: {e}; fix "
                                   "the sampler") from None

    def state_dict(self) -> dict[str, Any]:
        import json

        try:
            state = self._call(self.sampler.state_dict, "state_dict()")
            json.dumps(state, allow_nan=False)  # a checkpoint holds it as JSON
        except TaskSamplerError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TaskSamplerError(f"{self.name}: state_dict() gave no JSON state ({type(e).__name__}: "
                                   f"{str(e)[:200]}); return a dict of numbers, strings and lists") from None
        return {"sampler": self.view.settings.sampler, "split": self.view.split, "size": self.view.size,
                "state": state}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        mine = (self.view.settings.sampler, self.view.split, self.view.size)
        theirs = (saved.get("sampler"), saved.get("split"), saved.get("size"))
        if mine != theirs:
            raise TaskSamplerError(f"the checkpoint's task sampler of env {self.view.env!r} is {theirs[0]!r} "
                                   f"on split {theirs[1]!r} ({theirs[2]} tasks), this config's {mine[0]!r} "
                                   f"on {mine[1]!r} ({mine[2]} tasks); resume with the config it was saved "
                                   "with, or pass --restart")
        try:
            self._call(lambda: self.sampler.load_state_dict(saved["state"]), "load_state_dict()")
        except TaskSamplerError as e:
            if isinstance(e, SavedStateError):
                raise SavedStateError(f"the task sampler state of env {self.view.env!r}: {e}") from None
            raise
        except SavedStateError as e:
            raise SavedStateError(f"the task sampler state of env {self.view.env!r}: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise TaskSamplerError(f"{self.name}: load_state_dict raised {type(e).__name__}: {e}") from None

    def occupancy(self) -> dict[str, int]:
        """How many remembered keys sit in each pool, and the split's coverage (tasks played)."""
        memory = getattr(self.sampler, "memory", None)
        out = dict.fromkeys(POOLS, 0)
        if isinstance(memory, dict):
            for m in memory.values():
                out[pool_of(m)] += 1
        return out

    def played(self) -> int | None:
        played = getattr(self.sampler, "played", None)
        return len(played) if isinstance(played, set) else None


def make_task_sampler(view: SplitView, grace_s: float = STOP_GRACE_S) -> EnvTasks:
    """The env's configured sampler: a registry entry's class (quaero/task_sampler_registry.py), or a user's
    "package.module:Class", built with the SplitView (bounded like its calls; `grace_s`: [sampler]
    stop_grace_s)."""
    import inspect

    from quaero.resolve import resolve_name

    kind = view.settings.sampler
    where = TASK_SAMPLERS[kind].cls if kind in TASK_SAMPLERS else kind
    cls = resolve_name(where, f"env {view.env!r} [env.tasks] sampler", want=inspect.isclass, wanted="a class",
                       error=TaskSamplerError, example="mypkg.samplers:MySampler")
    missing = [m for m in ("sample", "update", "state_dict", "load_state_dict")
               if not callable(getattr(cls, m, None))]
    if missing:
        raise TaskSamplerError(f"[env.tasks] sampler={kind!r} (env {view.env!r}) lacks {', '.join(missing)}"
                               ": a task sampler has sample(n), update(task, rewards, costs), state_dict(), "
                               "load_state_dict()")
    tasks = EnvTasks(view, None, grace_s=grace_s)
    try:
        tasks.sampler = tasks._call(lambda: cls(view), "building it")
        return tasks
    except TaskSamplerError:
        raise
    except Exception as e:  # noqa: BLE001
        raise TaskSamplerError(f"[env.tasks] sampler={kind!r} (env {view.env!r}): building it raised "
                               f"{type(e).__name__}: {e}") from None
