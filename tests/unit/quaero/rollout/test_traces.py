"""`[data] traces_loss = "rl"` (quaero/rollout/traces.py `rl_rows`): recorded rows that carry an advantage, or
a reward and a group, and the sampler's log-probs train the RL loss off-policy. Rows keep the records' ids
(never re-tokenized), records that cannot be used are refused one line each, and the trainer's importance
ratio is taken over the recorded log-probs: the RL term is non-zero and moves with them."""
import json
import math

import pytest
from fixtures.small_model import V, make_spec, save_small_model

from quaero.rollout.traces import load_traces
from trainers.local import LocalTrainer
from trainers.policy_losses import PPOClip
from trainers.step import audit_logprobs

# 4 prompt tokens, 3 action tokens, 3 env tokens, 2 action tokens
ACTION = [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
OBS = [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0]


def record(seed, *, logprobs=True, **fields):
    ids = [(seed * 37 + 11 * i) % V for i in range(len(ACTION))]
    rec = {"input_ids": ids, "action_mask": ACTION, "obs_mask": OBS, "warning_mask": [0] * len(ACTION),
           **fields}
    if logprobs:
        rec["logprobs"] = [-0.5 - 0.01 * i if a else 0.0 for i, a in enumerate(ACTION)]
    return rec


def write(tmp_path, records):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_rows_keep_the_records_ids_and_take_group_relative_or_recorded_advantages(tmp_path):
    records = [record(1, reward=1.0, group="g"), record(2, reward=0.0, group="g"), record(3, reward=0.5,
                                                                                          group="g"),
               record(4, advantage=-0.25)]
    rows, refused = load_traces(write(tmp_path, records), V, loss="rl")
    assert refused == []
    assert [r.input_ids for r in rows] == [rec["input_ids"] for rec in records]  # exactly the ids, in order
    mean = 0.5
    for row, rec, adv in zip(rows, records, [1.0 - mean, 0.0 - mean, 0.5 - mean, -0.25]):
        assert row.advantages == [adv if a else 0.0 for a in ACTION]
        assert row.sampler_logprobs == rec["logprobs"]  # the recorded log-probs: the ratio's denominator
        assert row.echo_weights == [float(o) for o in OBS]
    assert rows[0].meta["episode"] == "g" and rows[3].meta["episode"].endswith(":4")


def test_the_same_file_trains_as_demonstrations_by_default(tmp_path):
    rows, refused = load_traces(write(tmp_path, [record(1, reward=1.0, group="g"), record(2)]), V)
    assert refused == [] and all(r.advantages == [1.0 if a else 0.0 for a in ACTION] for r in rows)


def test_records_the_rl_loss_cannot_use_are_refused_one_line_each(tmp_path):
    records = [
        record(1, logprobs=False, advantage=1.0),  # no sampler log-probs: no importance ratio
        # not log-probs
        record(2, advantage=1.0, logprobs=True) | {"logprobs": [0.3 if a else 0.0 for a in ACTION]},
        record(3, reward=1.0),  # a reward but no group
        record(4),  # nothing at all
        record(5, reward=1.0, group="alone"),  # a group of one
        record(6, advantage=0.5) | {"action_mask": ACTION[:-1]},  # inexact: the mask does not cover the ids
        # inexact: ids outside the vocabulary
        record(7, advantage=0.5) | {"input_ids": [V + 3] * len(ACTION)},
        record(8, advantage=0.5),  # the one usable record
    ]
    path = write(tmp_path, records)
    rows, refused = load_traces(path, V, loss="rl")
    assert [r.input_ids for r in rows] == [records[7]["input_ids"]]
    assert len(refused) == 7 and all("\n" not in r for r in refused)
    by_line = {int(r.split(":")[1]): r for r in refused}
    assert "no sampler log-probs" in by_line[1] and 'traces_loss = "sft"' in by_line[1]
    assert "above 0" in by_line[2]
    assert "no `advantage`, and no `reward` with a `group`" in by_line[3] and by_line[4].count("no "
                                                                                               "`advantage`")
    assert "the only record of group 'alone'" in by_line[5]
    assert "does not cover" in by_line[6] and "outside the tokenizer's vocabulary" in by_line[7]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return LocalTrainer(make_spec(save_small_model(tmp_path_factory.mktemp("small")),
                                  policy_loss=PPOClip(None, None)), "cpu")


def _step(trainer, rows):
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_step(rows, sft=False, echo_weight=0.3)
    trainer.model.load_state_dict(state)  # the next step starts from the same weights
    return m


def test_the_rl_term_is_non_zero_and_its_ratio_is_over_the_recorded_logprobs(tmp_path, trainer):
    records = [record(1, reward=1.0, group="g"), record(2, reward=0.0, group="g")]
    rows, _ = load_traces(write(tmp_path, records), V, loss="rl")
    # the trainer's own log-probs of the action tokens, before the step
    own = audit_logprobs(trainer, rows, trainer.spec.temperature)
    shift = 0.3
    for k, (row, lps) in enumerate(zip(rows, own)):  # recorded = the trainer's own, minus `shift`
        recorded = [lp - shift if a else 0.0 for lp, a in zip(lps, row.action_mask)]
        rows[k] = type(row)(row.input_ids, row.spans, row.advantages, row.echo_weights, recorded, row.meta)
    m = _step(trainer, rows)
    assert m["action_tokens"] == 2 * sum(ACTION[1:]) and m["rl_loss"] != 0.0 and m["sft_loss"] == 0.0
    assert m["importance_ratio_mean"] == pytest.approx(math.exp(shift), rel=1e-3)
    assert m["sampler_logprob_gap_mean"] == pytest.approx(shift, abs=1e-3)
    # the rows' advantages are +-0.5: token mean of -ratio * A over both rows' action tokens is 0 when the two
    # rows' ratios agree; moving one row's recorded log-probs moves the loss, so the ratio reads them
    moved = [rows[0], type(rows[1])(rows[1].input_ids, rows[1].spans, rows[1].advantages,
                                    rows[1].echo_weights,
                                    [lp - 0.5 if a else 0.0 for lp, a in zip(rows[1].sampler_logprobs,
                                                                             rows[1].action_mask)],
                                    rows[1].meta)]
    assert _step(trainer, moved)["rl_loss"] != pytest.approx(m["rl_loss"], abs=1e-4)


@pytest.mark.hostile
def test_a_recorded_advantage_or_reward_that_is_not_a_finite_number_is_named_as_such(tmp_path):
    """A NaN, infinite or string advantage was refused as "no `advantage`", which it had."""
    records = [record(1, advantage=float("nan")), record(2, advantage="1.0"),
               record(3, reward=float("inf"), group="g"), record(4, reward=1.0, group="g"),
               record(5, reward=0.0, group="g")]
    rows, refused = load_traces(write(tmp_path, records), V, loss="rl")
    assert len(rows) == 2 and len(refused) == 3
    assert refused[0].endswith(":1: its advantage nan is not a finite number")
    assert refused[1].endswith(":2: its advantage '1.0' is not a finite number")
    assert refused[2].endswith(":3: its reward inf is not a finite number")
