"""What moves every step of a run, apart from the parts it is wired from (quaero/recipe/parts.py): the run's
totals, the steps trained and checkpointed, the tasks drawn for steps not yet trained, the latest RL step's
groups, the empty steps counted towards `max_empty_steps`, and whether the sampler holds the trainer's latest
weights. A checkpoint keeps what a resumed run needs of it (quaero/recipe/run_state.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quaero.recipe.stop import EmptySteps
from quaero.telemetry.outcomes import SignalWatch
from quaero.telemetry.runlog import Cumulative

if TYPE_CHECKING:
    from quaero.recipe.groups import GroupOutcome


@dataclass
class RunProgress:
    cumulative: Cumulative = field(default_factory=Cumulative)  # the run's totals (checkpointed)
    pending: dict[int, list[list]] = field(default_factory=dict)  # tasks drawn for steps not yet trained
    step_groups: list[GroupOutcome] = field(default_factory=list)  # the latest RL step's groups
    empty: EmptySteps = field(default_factory=EmptySteps)  # consecutive steps that trained no row
    signal: SignalWatch = field(default_factory=SignalWatch)  # whether RL steps carried a learning signal
    sampler_behind: bool = False  # the trainer changed since the sampler last got its weights
    completed_step: int = 0  # the last step trained and logged (a resume's step)
    saved_step: int = 0  # the last step checkpointed (a resume's step)
    updating_step: int = 0  # the step whose update of the trainer began last
