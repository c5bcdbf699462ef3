"""The mixture's allocation (quaero/rollout/mixture.py): each env within one group of its share at every
point, and resumed from its state."""
from __future__ import annotations

import json

import pytest

from quaero.rollout.mixture import Mixture, MixtureError


def test_the_allocation_keeps_every_env_within_one_group_of_its_share_at_every_point():
    m = Mixture({"a": 3.0, "b": 1.0, "c": 0.5})
    total = dict.fromkeys("abc", 0)
    for step in range(1, 40):
        for name, k in m.allocate(3).items():
            total[name] += k
        handed = 3 * step
        for name, share in m.shares.items():
            assert abs(total[name] - share * handed) < 1, (step, name, total)
    fresh = Mixture({"a": 1.0, "b": 1.0})
    assert [fresh.allocate(1) for _ in range(4)] == [{"a": 1, "b": 0}, {"a": 0, "b": 1}] * 2  # alternates


def test_the_allocation_resumes_from_its_state_and_refuses_another_mixture():
    a = Mixture({"x": 2.0, "y": 1.0})
    a.allocate(5)
    b = Mixture({"x": 2.0, "y": 1.0})
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.allocate(4) for _ in range(5)] == [b.allocate(4) for _ in range(5)]
    with pytest.raises(MixtureError, match=r"another mixture \(env ratios x: 2.0 -> 3.0\)"):
        Mixture({"x": 3.0, "y": 1.0}).load_state_dict(a.state_dict())
