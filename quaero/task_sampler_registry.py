"""Task samplers (the `[env.tasks] sampler` values): the class that draws an env's train tasks, and whether
its draws learn from outcomes; importable without openenv.

quaero/config/ takes the sampler names from here (any other value names a class of the user's,
"package.module:Class"); `make_task_sampler` (quaero/rollout/task_samplers.py) builds the class an entry
names. Adding a sampler is its class and one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSamplerKind:
    cls: str  # "package.module:Class", built with the env's SplitView (quaero/rollout/task_samplers.py)
    learns: bool  # its draws depend on the outcomes it is told (`quaero check` then prints its settings)


TASK_SAMPLERS: dict[str, TaskSamplerKind] = {
    "sequential": TaskSamplerKind("quaero.rollout.task_samplers:SequentialSampler", False),
    "uniform": TaskSamplerKind("quaero.rollout.task_samplers:UniformSampler", False),
    "curriculum": TaskSamplerKind("quaero.rollout.task_samplers:CurriculumSampler", True),
    "difficulty_pools": TaskSamplerKind("quaero.rollout.task_samplers:DifficultyPoolSampler", True),
}
DEFAULT = "sequential"
