"""The row contract (quaero/rows.py): an EchoRow refuses a broken contract, and round trips."""
from __future__ import annotations

import pytest

from quaero.rows import EchoRow, RowError, Span


def row(n=6, spans=None, adv=None, echo=None):
    spans = spans or [Span("prompt", 0, 2), Span("action", 2, 4), Span("env", 4, 6)]
    return EchoRow(list(range(n)), spans, adv or [0.0] * n, echo or [0.0] * n, [0.0] * n)


@pytest.mark.parametrize("bad, match", [
    ({"adv": [0, 0, 0, 0, 1.0, 0]}, "advantage 1.0 on a env token"),
    ({"echo": [0, 0, 1.0, 0, 0, 0]}, "ECHO weight 1.0 on a action token"),
    ({"echo": [0, 0, 0, 0, float("nan"), 0]}, "non-finite"),
    ({"spans": [Span("prompt", 0, 3), Span("action", 2, 6)]}, "overlaps"),
    ({"spans": [Span("prompt", 0, 7)]}, "outside"),
])
def test_row_rejects_broken_contracts(bad, match):
    with pytest.raises(RowError, match=match):
        row(**bad)


def test_row_round_trips_with_turns_and_sets_advantages_on_actions_only():
    r = row(spans=[Span("prompt", 0, 2, 0), Span("action", 2, 4, 0), Span("env", 4, 6, 0)], echo=[0, 0, 0, 0,
                                                                                                  1, 1])
    assert EchoRow.from_dict(r.to_dict()) == r
    assert EchoRow.from_dict({**r.to_dict(), "spans": [["prompt", 0, 2], ["action", 2, 6]],
                              "echo_weights": [0.0] * 6}).spans[0].turn == -1  # 3-field spans still load
    assert r.with_advantage(0.5).advantages == [0, 0, 0.5, 0.5, 0, 0]
