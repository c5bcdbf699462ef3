"""`quaero eval`'s summary arithmetic (quaero/tools/evaluate.py) on whatever rewards an env sends."""
import pytest

from quaero.tools.evaluate import _mean


@pytest.mark.hostile
def test_the_summary_mean_of_huge_finite_rewards_does_not_raise():
    # statistics.fmean raised OverflowError: the eval died at its summary
    assert _mean([1e308, 1e308]) == 1e308
    assert _mean([1.0, 0.0]) == 0.5 and _mean([]) is None
