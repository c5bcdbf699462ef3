"""The two layouts (per-transition, packed) built from transitions (the row contract itself:
tests/unit/quaero/test_rows.py)."""
from __future__ import annotations

import pytest

from quaero.rollout.rows import Transition, build_rows, per_transition_tokens
from quaero.rows import RowError


def transition(turn, prompt, action, response, kinds):
    return Transition(turn, prompt, action, [-0.5] * len(action), response, kinds)


# turn 1's prompt extends turn 0's prompt + action + response with a generation prompt [9]
T0 = transition(0, [1, 2, 3], [4, 5], [6, 7, 8], ["scaffold", "env", "scaffold"])
T1 = transition(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10], [11, 12], ["scaffold", "corrective"])
T2 = transition(2, [1, 2, 3, 99, 9], [13], [14], ["env"])  # history re-rendered differently: not an extension


def test_packed_layout_extends_only_on_exact_token_extension():
    rows = build_rows([T0, T1, T2], packing=True)
    assert [r.meta for r in rows] == [{"turns": [0, 1], "layout": "packed"},
                                      {"turns": [2], "layout": "transition", "split": "history_rerendered"}]
    a = rows[0]
    assert a.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert [(s.kind, s.start, s.end, s.turn) for s in a.spans] == [
        ("prompt", 0, 3, 0), ("action", 3, 5, 0), ("scaffold", 5, 6, 0), ("env", 6, 7, 0), ("scaffold", 7, 8,
                                                                                            0),
        ("prompt", 8, 9, 1), ("action", 9, 10, 1), ("scaffold", 10, 11, 1), ("corrective", 11, 12, 1)]
    assert a.echo_weights == [0] * 6 + [1.0] + [0] * 5  # env content only; corrective never
    assert a.sampler_logprobs == [0, 0, 0, -0.5, -0.5, 0, 0, 0, 0, -0.5, 0, 0]
    assert sum(len(r) for r in rows) < per_transition_tokens([T0, T1, T2])


def test_per_transition_layout_and_scaffold_option():
    rows = build_rows([T0, T1, T2], packing=False)
    assert [r.input_ids for r in rows] == [T0.ids, T1.ids, T2.ids]
    assert sum(len(r) for r in rows) == per_transition_tokens([T0, T1, T2])
    scaffolded = build_rows([T0], packing=False, include_scaffold=True)[0]
    assert scaffolded.echo_weights == [0, 0, 0, 0, 0, 1.0, 1.0, 1.0]


def test_first_token_never_carries_echo_weight():
    t = transition(0, [], [4], [6, 7], ["env", "env"])
    r = build_rows([Transition(0, [], [], [], [6, 7], ["env", "env"])])[0]
    assert r.echo_weights == [0.0, 1.0] and len(build_rows([t])[0]) == 3


def test_build_rows_refuses_a_transition_past_max_seq_len():
    with pytest.raises(RowError, match="turn 1 holds 12 tokens, more than max_seq_len=11"):
        build_rows([T0, T1, T2], max_seq_len=11)
    # a packed row is exactly as long as its last transition, so transitions that fit make rows that fit
    assert [len(r) for r in build_rows([T0, T1, T2], max_seq_len=12)] == [len(T1.ids), len(T2.ids)]


def test_each_new_row_says_where_the_next_prompt_left_the_row():
    """The next prompt differs inside the previous turn's prompt, its sampled reply or its bridged response;
    every row is exact all the same (the next prompt starts it whole)."""
    reply = transition(1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12], ["env"])
    cases = {"history_rerendered": [1, 2, 3, 4, 99], "reply_rerendered": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99],
             "response_rerendered": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99],
             # shorter than the row: the response ends the turn otherwise (a response dropped on re-render)
             "response_rerendered ": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]}
    for reason, prompt in cases.items():
        rows = build_rows([T0, reply, transition(2, prompt, [13], [], [])])
        assert [r.meta.get("split") for r in rows] == [None, reason.strip()], reason
        assert rows[1].input_ids == [*prompt, 13]
    split = build_rows([T0, T1, T2], packing=False)
    assert [r.meta.get("split") for r in split] == [None, "packing_off", "packing_off"]
