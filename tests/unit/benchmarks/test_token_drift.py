"""benchmarks.token_drift: the drift counts of `quaero bench peers-trl`, on hand-made rows."""
from benchmarks.token_drift import generation_drift, saved_row_drift


def test_exact_multi_turn_rows_do_not_drift():
    # two rows of one group share the first prompt; the second turn's prompt holds the first turn and a tool
    # reply
    calls = [([1, 2], [5, 6]), ([1, 2], [7, 8]), ([1, 2, 5, 6, 9], [10])]
    rows = [([1, 2, 5, 6, 9, 10], [False, False, True, True, False, True]),
            ([1, 2, 7, 8], [False, False, True, True])]
    d = generation_drift(calls, rows).as_dict()
    assert d["rows"] == 2 and d["rows_drifted"] == 0 and d["unmatched_calls"] == 0
    assert d["sampled_tokens"] == d["scored_action_tokens"] == 5


def test_re_tokenized_truncated_and_unsampled_tokens_are_counted():
    calls = [([1], [5, 6, 7]), ([2], [4])]
    # row 1: position 2 re-tokenized (6 -> 60), position 3 cut off; row 2: a template token scored as an
    # action
    rows = [([1, 5, 60], [False, True, True]), ([2, 4, 12], [False, True, True])]
    d = generation_drift(calls, rows).as_dict()
    assert (d["differ"], d["not_scored"], d["scored_not_sampled"], d["rows_drifted"]) == (1, 1, 1, 2)
    assert generation_drift([([9], [1])], rows).unmatched_calls == 1


def test_saved_rows_are_checked_against_the_sampled_actions():
    exact = {"input_ids": [1, 2, 3, 4], "spans": [["prompt", 0, 2, 0], ["action", 2, 4, 0]],
             "sampled_actions": [{"turn": 0, "action_ids": [3, 4]}]}
    drifted = {**exact, "input_ids": [1, 2, 3, 9], "sampled_actions": [{"turn": 0, "action_ids": [3, 4]},
                                                                       {"turn": 1, "action_ids": [8]}]}
    d = saved_row_drift([exact, drifted]).as_dict()
    assert (d["rows"], d["rows_drifted"], d["differ"], d["not_scored"]) == (2, 1, 1, 1)
