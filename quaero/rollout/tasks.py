"""Which task an episode plays: the reset arguments of task `index` of a split.

The env's own Task API (its splits and their sizes, read in process or over its server's routes) is
quaero/openenv_client/tasks.py; this is quaero's side of it: the seed of every reset derives from the run
seed and the task's index alone, so training, evaluation and `quaero eval` reset a task alike and a resumed
run repeats its tasks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quaero.openenv_client.tasks import task_index

if TYPE_CHECKING:
    from quaero.config import QuaeroConfig
    from quaero.openenv_client.tasks import TaskCatalog


def task_reset(cfg: QuaeroConfig, split: str, index: int, catalog: TaskCatalog | None = None) -> dict:
    """The reset arguments of task `index` of `split`: its reset seed derives from the run seed alone (train,
    eval and `quaero eval` agree on it); with the env's Task API (`catalog`, which training passes and
    evaluation does not: every seed evaluates the same tasks) the run seed orders the split and the index
    wraps round it."""
    return reset_args(cfg.run.seed, split, task_index(catalog, split, index, cfg.run.seed))


def reset_args(seed: int, split: str, index: int) -> dict:
    """The reset arguments of the env's task `index` of `split` (a task sampler's pick) under run seed
    `seed`."""
    return {"seed": seed * 1_000_003 + index, "split": split, "index": index}


MAX_LABEL_CHARS = 200  # a task spec's group or difficulty as events carry it (toolbench's are a word)


def spec_label(value: Any) -> Any:
    """A task spec's `group` or `difficulty` as events and the eval's groups carry it: a scalar as it is, a
    nested RFC 013 group as its text (as the task samplers key it), text cut at MAX_LABEL_CHARS with the
    count of what was cut: a 10 MB group rode in every step's task_outcomes event."""
    if value is None or isinstance(value, (int, float, bool)):
        return value
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_LABEL_CHARS else (
        f"{text[:MAX_LABEL_CHARS]}… [{len(text) - MAX_LABEL_CHARS} more characters]")
