"""The recipe across torchrun ranks: who rolls out which tasks, who writes, what is summed.

Under `torchrun` (`quaero train --nproc N`, `[distributed] strategy = "ddp" | "fsdp2"`) every rank runs
the same recipe (quaero/recipe/train.py), with the same number of steps and collectives:
- a step's tasks are split in contiguous blocks (`task_share`), so their union, in rank order, is the
  one-process step's task list; each rank samples with a seed of its own (`rank_seed`), rank 0 with
  the one-process seed;
- every rank's rows are gathered in rank order (`gather_rows`), so each rank passes the step's whole
  row list to the trainer, which splits it by tokens and sums the loss denominators over ranks
  (trainers/distributed.py): the N-rank trainer step is the one-process step on those rows;
- rollout counters are summed over ranks before any mean is taken (`rollout_snapshot`), so the one
  `train_step` event holds the run's totals and `quaero review --require-proof` judges them;
- rank 0 alone takes the run lock, writes events.jsonl, the sinks, saved rows, checkpoints and
  `final/` (`is_main`, `quaero.process_group.from_rank0`).

With one process every function here is the identity: the run is today's, bit for bit.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from quaero import process_group

# (the recipe's names for them)
from quaero.process_group import from_rank0, gather, rank, world_size  # noqa: F401


def is_main() -> bool:
    """The rank that writes the run folder (rank 0; the only one outside torchrun)."""
    return process_group.rank() == 0


def task_share(n_tasks: int) -> range:
    """This rank's block of a step's `n_tasks` task offsets: the first `n_tasks % ranks` ranks take one
    more."""
    ranks, r = process_group.world_size(), process_group.rank()
    base, extra = divmod(n_tasks, ranks)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


def rank_seed(seed: int) -> int:
    """This rank's sampler seed for a call whose one-process seed is `seed` (rank 0 keeps it)."""
    return seed + 104_729 * process_group.rank()


def gather_rows(items: list[Any]) -> list[Any]:
    """Every rank's list, concatenated in rank order (this rank's own list outside torchrun)."""
    if process_group.world_size() == 1:
        return items
    return [item for part in process_group.gather(items) for item in part]


def _sum_over_ranks(counts: Counter, reward_sum: float) -> tuple[Counter, float]:
    total: Counter = Counter()
    reward = 0.0
    for part, r in process_group.gather((dict(counts), reward_sum)):
        total.update(part)
        reward += r
    return total, reward


def rollout_snapshot(counts) -> dict[str, Any]:
    """`counts.snapshot_and_reset()` with every rank's counts summed (quaero/telemetry/counts.py)."""
    return counts.snapshot_and_reset(_sum_over_ranks if process_group.world_size() > 1 else None)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on one (a Ctrl-C seen by one rank stops them all)."""
    return bool(process_group.all_max(int(flag)))


def total(n: int) -> int:
    """The sum of every rank's `n`."""
    return process_group.all_sum([n])[0]


def largest(value: float) -> float:
    """The largest of every rank's `value` (a step waits for its slowest rank)."""
    if process_group.world_size() == 1:
        return value
    return max(process_group.gather(value))
