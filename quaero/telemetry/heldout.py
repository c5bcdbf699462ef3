"""Held-out figures an evaluation reports, shared by training's `eval` events (quaero/recipe/evaluation.py),
`quaero eval` and `quaero review`: a success rate's standard error, format failures apart from wrong answers,
and pass@k with its unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1). The paired statistics (Wilson, McNemar, bootstrap) are quaero/tools/significance.py's."""
from __future__ import annotations

import math
from collections.abc import Sequence


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of `values` (one per task): sqrt(mean squared deviation / n), so a
    success rate p over n tasks gets the binomial sqrt(p (1 - p) / n); None for no value."""
    n = len(values)
    if not n:
        return None
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n / n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k (the chance that at least one of k samples succeeds) from n >= k
    samples of which c succeeded: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, eq. 1), in exact integer
    arithmetic until the one division."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c={c} <= n={n} and 1 <= k={k} <= n")
    if n - c < k:
        return 1.0  # every draw of k holds a success
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def held_out_figures(successes: Sequence[int], malformed: Sequence[int]) -> dict:
    """An evaluation's figures from its finished episodes' success (0/1) and malformed-action counts, in one
    order: the success rate's standard error, and its failures split into format failures (an episode with a
    malformed action) and wrong answers (every action well formed), each as a share of the episodes."""
    n = len(successes)
    fails = [bool(m) for s, m in zip(successes, malformed) if not s]
    return {"success_se": standard_error([float(bool(s)) for s in successes]),
            "format_failures": sum(fails) / n if n else None,
            "wrong_answers": (len(fails) - sum(fails)) / n if n else None}


def pass_figures(samples: Sequence[tuple[int, int]], k: int) -> dict:
    """pass@1 and pass@k over tasks, each task's (successes c, finished samples n): the means over the tasks
    with n >= k of the unbiased per-task estimates, pass@k's standard error over those tasks, and how many
    tasks counted (a task that lost samples to drops below k is left out, not guessed)."""
    kept = [(c, n) for c, n in samples if n >= k]
    at_k = [pass_at_k(n, c, k) for c, n in kept]
    return {"k": k, "tasks": len(kept), "pass_at_1": (math.fsum(c / n for c, n in kept) / len(kept)) if kept
            else None, "pass_at_k": math.fsum(at_k) / len(at_k) if at_k else None,
            "pass_at_k_se": standard_error(at_k)}
