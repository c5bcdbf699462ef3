"""The statistics `quaero eval` reports: a success rate's interval and a paired comparison's.

- `wilson_interval`: the Wilson score interval of k successes in n trials. Unlike the normal
  approximation it stays inside [0, 1] and keeps its coverage at 0/n and n/n, which small evals hit.
- `mcnemar_exact`: two policies on the same episodes; only the discordant pairs carry information
  about which succeeds more often, and under "no difference" each is a fair coin (exact binomial).
- `paired_bootstrap`: the mean of per-episode reward differences A - B with a percentile interval,
  resampling episode pairs (not the two sides separately) so the pairing's variance reduction is kept.
- held-out success's standard error and pass@k: quaero/telemetry/heldout.py (training's evals log them).
- `fixed_and_regressed`: which tasks one evaluation solves that the other does not, by name.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """(low, high) of the Wilson score interval; (0, 1) when n = 0 (nothing is known)."""
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes={successes} must lie in 0..n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    low = 0.0 if successes == 0 else center - half  # exact at the edges, where rounding would miss 0 or 1
    high = 1.0 if successes == n else center + half
    return low, high


def fixed_and_regressed(after: dict, before: dict) -> tuple[list, list]:
    """(fixed, regressed): the keys both outcomes ({key: (success, reward)}) share that `after` solves and
    `before` does not, and the reverse, in `after`'s order. The per-task lists behind McNemar's counts."""
    shared = [k for k in after if k in before]
    return ([k for k in shared if after[k][0] and not before[k][0]],
            [k for k in shared if before[k][0] and not after[k][0]])


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs: `a_only` episodes that A solved and B
    did not, `b_only` the reverse. 1.0 when there are none."""
    n = a_only + b_only
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(a_only, b_only) + 1))
    return min(1.0, 2 * tail / 2**n)  # exact integer arithmetic until this one division


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """(mean of a - b, low, high): the percentile bootstrap interval of the mean paired difference.

    a[i] and b[i] are the same episode (task, seed) under two policies. Seeded, so a report reproduces."""
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap: {len(a)} values for A but {len(b)} for B; pairs must line up")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if diff.size == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 1_000_000 // diff.size)  # bounded memory: chunk x n indices at a time
    for start in range(0, resamples, chunk):
        stop = min(start + chunk, resamples)
        means[start:stop] = diff[rng.integers(0, diff.size, size=(stop - start, diff.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(diff.mean()), float(low), float(high)


def paired_outcomes(a: dict, b: dict, *, seed: int = 0) -> dict:
    """A vs B on the keys both have, each value (success, reward): the success rates, the discordant pairs
    (`a_only`: A succeeded and B did not), McNemar's exact p on them and the paired bootstrap of the reward
    difference A - B. `quaero eval --compare`, `quaero review`'s RL check and `quaero bench ablation` pair
    through here. With no shared key the rates are 0 and the bootstrap figures NaN."""
    shared = [k for k in a if k in b]
    a_only = sum(1 for k in shared if a[k][0] and not b[k][0])
    b_only = sum(1 for k in shared if b[k][0] and not a[k][0])
    diff, low, high = paired_bootstrap([a[k][1] for k in shared], [b[k][1] for k in shared], seed=seed)
    n = len(shared)
    return {"pairs": n, "a_success": sum(bool(a[k][0]) for k in shared) / n if n else 0.0,
            "b_success": sum(bool(b[k][0]) for k in shared) / n if n else 0.0, "a_only": a_only,
            "b_only": b_only,
            "mcnemar_p": mcnemar_exact(a_only, b_only), "reward_diff": diff, "reward_diff_ci95": [low, high]}


def format_and_task(a: dict | None, b: dict | None, a_formats: dict | None,
                    b_formats: dict | None) -> dict | None:
    """A success comparison of A and B (outcomes {key: (success, reward)}) split in two, on the keys all four
    share, with each episode's format ({key: malformed actions}): **format**, the share of episodes with no
    malformed action (McNemar exact on the pairs where one side is well formed and the other not), and
    **task**, the success rate among each side's well-formed episodes. A gain that is only the action format
    raises the first and leaves the second. None where no key has all four (or one side has none: an eval
    whose per-task lists were unreadable)."""
    if not (a and b and a_formats and b_formats):
        return None
    shared = [k for k in a if k in b and k in a_formats and k in b_formats]
    if not shared:
        return None
    well_a = {k for k in shared if a_formats[k] == 0}
    well_b = {k for k in shared if b_formats[k] == 0}
    only_a, only_b = len(well_a - well_b), len(well_b - well_a)

    def task(outcomes: dict, well: set) -> float | None:
        return sum(bool(outcomes[k][0]) for k in well) / len(well) if well else None

    return {"pairs": len(shared), "a_well_formed": len(well_a) / len(shared),
            "b_well_formed": len(well_b) / len(shared), "format_a_only": only_a, "format_b_only": only_b,
            "format_mcnemar_p": mcnemar_exact(only_a, only_b), "a_task_success": task(a, well_a),
            "b_task_success": task(b, well_b)}

