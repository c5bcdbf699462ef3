"""`quaero bench tree`'s rows: the main job's RL shape (groups sharing a prompt, actions, env responses)."""
from benchmarks.tree import rl_rows


def test_rl_rows_share_their_groups_prompt_and_carry_both_terms():
    rows = rl_rows(2, 8, 370, 450, vocab=1000)
    assert len(rows) == 16 and all(442 <= len(r) <= 458 for r in rows)
    first, second = rows[:8], rows[8:]
    assert all(r.input_ids[:370] == first[0].input_ids[:370] for r in first)
    assert all(r.input_ids[:370] == second[0].input_ids[:370] for r in second)
    assert first[0].input_ids[:370] != second[0].input_ids[:370]
    for r in rows:
        assert not any(r.advantages[:370]) and not any(r.echo_weights[:370])  # the prompt trains nothing
        assert any(r.advantages[370:]) and any(r.echo_weights[370:])
    assert {r.advantages[370] for r in first} == {1.0, -1.0}  # a group's advantages of both signs
