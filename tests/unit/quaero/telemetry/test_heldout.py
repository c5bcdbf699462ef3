"""The held-out figures' arithmetic against hand-computed values: a success rate's standard error, format
failures apart from wrong answers, the unbiased pass@k estimator (checked also against its definition, the
share of the C(n, k) draws of k samples that hold a success) and pass@k over tasks."""
import itertools
import math

import pytest

from quaero.telemetry.heldout import held_out_figures, pass_at_k, pass_figures, standard_error
from quaero.tools.significance import fixed_and_regressed


def test_standard_error_is_the_binomial_one_for_a_success_rate():
    assert standard_error([1, 1, 0, 0]) == pytest.approx(math.sqrt(0.5 * 0.5 / 4))  # 0.25
    assert standard_error([1, 0, 0, 0, 0]) == pytest.approx(math.sqrt(0.2 * 0.8 / 5))  # 0.178885
    assert standard_error([1, 1, 1]) == 0.0 and standard_error([]) is None


@pytest.mark.parametrize("n,c,k,want", [
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (10, 3, 1, 0.3),  # pass@1 is c/n
    (4, 0, 2, 0.0),
    (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a success
    (8, 1, 4, 1 - 35 / 70),  # 1 - C(7,4)/C(8,4)
    (200, 13, 10, 1 - math.comb(187, 10) / math.comb(200, 10)),
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (6, 1, 3), (6, 4, 3), (7, 0, 2), (7, 3, 7)])
def test_pass_at_k_equals_the_share_of_k_draws_with_a_success(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    share = sum(any(outcomes[i] for i in d) for d in draws) / len(draws)
    assert pass_at_k(n, c, k) == pytest.approx(share, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_figures_average_over_tasks_and_leave_out_tasks_short_of_k_samples():
    # per task (c, n) at k = 2: 0.7, 0.0, 1.0; the last lost samples to drops (1 < k) and is left out
    p = pass_figures([(2, 5), (0, 4), (4, 4), (1, 1)], 2)
    assert p["k"] == 2 and p["tasks"] == 3
    assert p["pass_at_1"] == pytest.approx((2 / 5 + 0 + 1) / 3)
    assert p["pass_at_k"] == pytest.approx(1.7 / 3)
    mean = 1.7 / 3
    se = math.sqrt(((0.7 - mean) ** 2 + mean ** 2 + (1 - mean) ** 2) / 3 / 3)
    assert p["pass_at_k_se"] == pytest.approx(se) and round(se, 5) == 0.24191
    assert pass_figures([(1, 1)], 2) == {"k": 2, "tasks": 0, "pass_at_1": None, "pass_at_k": None,
                                         "pass_at_k_se": None}


def test_failures_split_into_format_failures_and_wrong_answers():
    # 5 episodes: 2 solved (one of them despite a malformed action), 1 failed malformed, 2 failed well formed
    f = held_out_figures([1, 0, 0, 1, 0], [0, 2, 0, 1, 0])
    assert (f["format_failures"], f["wrong_answers"]) == (1 / 5, 2 / 5)
    assert f["success_se"] == pytest.approx(math.sqrt(0.4 * 0.6 / 5))
    assert held_out_figures([], []) == {"success_se": None, "format_failures": None, "wrong_answers": None}


def test_fixed_and_regressed_name_the_tasks_behind_the_discordant_counts():
    after = {0: (1, 1.0), 1: (1, 1.0), 2: (0, 0.0), 3: (0, 0.0), 5: (1, 1.0)}
    before = {0: (1, 1.0), 1: (0, 0.0), 2: (1, 1.0), 3: (0, 0.0), 4: (1, 1.0)}
    assert fixed_and_regressed(after, before) == ([1], [2])  # 4 and 5 are in one eval only: not paired
