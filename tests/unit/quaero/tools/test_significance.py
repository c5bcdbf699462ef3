"""quaero.tools.significance against known values and the definitions they come from."""
import math
import statistics

import pytest

from quaero.tools.significance import Z_95, mcnemar_exact, paired_bootstrap, wilson_interval


def test_wilson_39_of_64_known_value_and_defining_equation():
    low, high = wilson_interval(39, 64)
    assert low == pytest.approx(0.48692, abs=1e-5) and high == pytest.approx(0.71944, abs=1e-5)
    # the Wilson bounds are the two roots p of (k/n - p)^2 = z^2 p (1 - p) / n
    for p in (low, high):
        assert (39 / 64 - p) ** 2 == pytest.approx(Z_95**2 * p * (1 - p) / 64, rel=1e-9)


def test_wilson_edges_stay_in_unit_interval():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27754, abs=1e-5)  # not the normal approximation's [0, 0]
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(1 - 0.27754, abs=1e-5)
    with pytest.raises(ValueError, match="successes=5 must lie in 0..n=4"):
        wilson_interval(5, 4)


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(10, 2) == pytest.approx(158 / 4096)  # 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12
    assert mcnemar_exact(2, 10) == mcnemar_exact(10, 2)  # two-sided: symmetric
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert 0 < mcnemar_exact(600, 400) < 1e-9  # large n stays exact (integer arithmetic), no overflow


def test_paired_bootstrap_keeps_the_pairing_and_reproduces():
    import random

    rng = random.Random(0)
    b = [rng.random() for _ in range(50)]  # noisy per-episode rewards
    a = [x + 0.1 for x in b]  # A is exactly 0.1 better on every episode
    diff, low, high = paired_bootstrap(a, b, seed=3)
    assert diff == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # unpaired noise: an interval around the mean that reproduces under the same seed
    c = [rng.random() for _ in range(50)]
    first = paired_bootstrap(c, b, seed=7)
    assert first == paired_bootstrap(c, b, seed=7) != paired_bootstrap(c, b, seed=8)
    diff, low, high = first
    assert low < diff < high and high - low > 0.1
    assert diff == pytest.approx(sum(c) / 50 - sum(b) / 50)
    assert all(math.isnan(x) for x in paired_bootstrap([], []))
    with pytest.raises(ValueError, match="3 values for A but 2 for B"):
        paired_bootstrap([1, 2, 3], [1, 2])


def test_safe_mean_is_fmean_and_survives_huge_finite_values():
    from quaero.rollout.advantages import safe_mean

    assert safe_mean([1.0] * 6) == 1.0 and safe_mean([0.1, 0.2, 0.3]) == statistics.fmean([0.1, 0.2, 0.3])
    assert safe_mean([1e308, 1e308]) == 1e308  # fmean's exact sum overflows here
    with pytest.raises(ValueError):
        safe_mean([])


def test_format_and_task_split_a_success_gain_into_the_action_format_and_the_task():
    from quaero.tools.significance import format_and_task

    # B: tasks 0-1 malformed (failed), 2-3 well formed (one solved); A: all well formed, 0 and 2 solved
    b = {0: (0, 0.0), 1: (0, 0.0), 2: (1, 1.0), 3: (0, 0.0)}
    a = {0: (1, 1.0), 1: (0, 0.0), 2: (1, 1.0), 3: (0, 0.0)}
    c = format_and_task(a, b, {k: 0 for k in a}, {0: 2, 1: 1, 2: 0, 3: 0})
    assert c == {"pairs": 4, "a_well_formed": 1.0, "b_well_formed": 0.5, "format_a_only": 2,
                 "format_b_only": 0, "format_mcnemar_p": 0.5, "a_task_success": 0.5, "b_task_success": 0.5}
    assert format_and_task(a, b, {9: 0}, {9: 0}) is None  # no key all four share
    c = format_and_task(a, b, {k: 1 for k in a}, {k: 0 for k in a})  # nothing well formed on A's side
    assert c["a_well_formed"] == 0.0 and c["a_task_success"] is None
