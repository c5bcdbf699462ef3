"""A mixture's share of each step's groups across its envs (`[[envs]]` ratios).

Smooth weighted round robin: each group of a step goes, one at a time, to the env furthest behind its share
(share x groups handed out so far, minus its groups), ties to the first env in the config. So after any
number of groups every env's count is within one group of its exact share: the proportions hold over a
step or two, not only in expectation, and a run's allocation is a function of the config and how many
groups were handed out (the cursor, kept in checkpoints) alone.
"""
from __future__ import annotations

from typing import Any

from quaero.config import shares_of
from quaero.rollout.task_samplers import saved_number


class MixtureError(ValueError):
    """A checkpoint's mixture is not this config's."""


class Mixture:
    def __init__(self, ratios: dict[str, float]) -> None:
        self.shares = shares_of(ratios)
        self.ratios = dict(ratios)
        self.counts = dict.fromkeys(ratios, 0)

    @property
    def handed_out(self) -> int:
        return sum(self.counts.values())

    def allocate(self, n: int) -> dict[str, int]:
        """How many of the next `n` groups each env plays (every env listed, in config order)."""
        out = dict.fromkeys(self.shares, 0)
        for _ in range(n):
            total = self.handed_out + 1
            name = max(self.shares, key=lambda e: self.shares[e] * total - self.counts[e])
            self.counts[name] += 1
            out[name] += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"ratios": self.ratios, "counts": self.counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theirs = {str(k): float(v) for k, v in dict(state["ratios"]).items()}
        if theirs != self.ratios:
            names = sorted(theirs.keys() | self.ratios.keys())
            diff = ", ".join(f"{k}: {theirs.get(k, 'absent')} -> {self.ratios.get(k, 'absent')}"
                             for k in names if theirs.get(k) != self.ratios.get(k))
            raise MixtureError(f"the checkpoint was written by another mixture (env ratios {diff}); resume "
                               "with the config it was saved with, or pass --restart to start over")
        self.counts = {k: saved_number(state["counts"][k], f"mixture counts[{k!r}]") for k in self.ratios}
