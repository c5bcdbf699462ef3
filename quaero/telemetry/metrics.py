"""How a metric is declared (a `Table` of one owner's metrics; quaero/telemetry/names.py declares them all)
and how it totals over a run.

How a metric totals over a run (`Cumulative`, quaero/telemetry/runlog.py: the `cumulative` field of each
`train_step` event, kept in checkpoints):
- SUM: counts, summed over steps;
- MAX: peaks and levels (`peak_mem_mb`, `policy_staleness`), the run's largest;
- LATEST: settings and labels (strings, booleans), the latest value;
- STEP: per-step figures (losses, means, seconds, per-rank lists), not totalled.
A name declared nowhere (a test's, a benchmark's own) totals by its type: booleans and strings LATEST,
integers SUM, anything else STEP.
"""
from __future__ import annotations

from dataclasses import dataclass

SUM, MAX, LATEST, STEP = "sum", "max", "latest", "step"


@dataclass(frozen=True)
class Metric:
    name: str  # for a family, the pattern: `drop_reason_<kind>`
    total: str  # SUM | MAX | LATEST | STEP
    meaning: str  # docs/reference.md's
    table: str  # the title of its reference table


METRICS: dict[str, Metric] = {}
FAMILIES: dict[str, Metric] = {}  # prefix -> the family's declaration (`drop_reason_` -> drop_reason_<kind>)


class Table:
    """The metrics one owner emits: one table of docs/reference.md."""

    def __init__(self, title: str, owner: str) -> None:
        self.title, self.owner, self.names = title, owner, []

    def _declare(self, total: str, name: str, meaning: str) -> str:
        if name in METRICS:
            raise ValueError(f"metric {name!r} is declared twice (quaero/telemetry/names.py)")
        METRICS[name] = Metric(name, total, meaning, self.title)
        self.names.append(name)
        return name

    def count(self, name: str, meaning: str) -> str:
        return self._declare(SUM, name, meaning)

    def largest(self, name: str, meaning: str) -> str:
        return self._declare(MAX, name, meaning)

    def latest(self, name: str, meaning: str) -> str:
        return self._declare(LATEST, name, meaning)

    def per_step(self, name: str, meaning: str) -> str:
        return self._declare(STEP, name, meaning)

    def count_family(self, prefix: str, placeholder: str, meaning: str) -> str:
        """Counters named `prefix + <placeholder>` (one per reason); returns the prefix."""
        FAMILIES[prefix] = Metric(f"{prefix}<{placeholder}>", SUM, meaning, self.title)
        self._declare(SUM, FAMILIES[prefix].name, meaning)
        return prefix


def total_of(name: str, value: object = None) -> str:
    """How metric `name` totals over a run (see the module docstring; `value` decides for an undeclared
    name)."""
    declared = METRICS.get(name) or next((m for p, m in FAMILIES.items() if name.startswith(p)), None)
    if declared is not None:
        return declared.total
    if isinstance(value, (bool, str)):
        return LATEST
    return SUM if isinstance(value, int) else STEP
