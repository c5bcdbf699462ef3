"""trainers/batch.py: rows packed into microbatches, cropped to their context, and the step's crop counts."""
import torch
from fixtures.small_model import make_spec, rows

from trainers.batch import CropStats, build_microbatches, crop_start, first_target, plan_microbatches
from trainers.local import LocalTrainer


def test_context_crop_and_save_on_cpu_options(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir, memory={"supervised_context_tokens": 8, "save_on_cpu": True}),
                     "cpu")
    m = b.train_step(rows(2))
    assert m["context_rows_cropped"] == 2 and m["context_tokens_removed"] == 2 * (32 - 8)
    assert m["local_train_save_on_cpu"] and m["save_on_cpu_offloaded_tensors"] == 0  # CPU: a no-op


def test_packing_puts_rows_longest_first_within_the_token_budget():
    assert plan_microbatches([10, 30, 20, 30], 60) == [[1, 3], [2, 0]]
    assert plan_microbatches([10, 30, 20, 30], 59) == [[1], [3], [2, 0]]
    assert plan_microbatches([5, 5, 5], 10**6) == [[0, 1, 2]]


def test_the_crop_keeps_k_tokens_before_the_first_target_of_any_term():
    assert first_target([[0.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0]]) == 1
    assert first_target([[0.0, 0.0], [0.0, 0.0]]) is None
    assert crop_start(10, 4) == 6 and crop_start(3, 4) == 0 and crop_start(None, 4) == 0
    assert crop_start(10, 0) == 0  # K = 0: no crop


def test_built_microbatches_pad_crop_and_never_target_token_0():
    rs = rows(2, context=40)
    weights = {"echo": [[1.0] * len(r) for r in rs]}
    weights["echo"][1] = [0.0] * 30 + [1.0] * (len(rs[1]) - 30)
    mbs, crop = build_microbatches(rs, micro_batch_tokens=10**6, weights=weights, context_tokens=8,
                                   scales={"echo": [0.5, 0.25]})
    assert len(mbs) == 1 and crop == CropStats(rows_cropped=1, tokens_removed=22)
    mb = mbs[0]
    by_row = dict(zip(mb.row_index, range(2)))
    b0, b1 = by_row[0], by_row[1]
    assert mb.input_ids.shape == (2, len(rs[0]))
    assert mb.input_ids[b1, :len(rs[1]) - 22].tolist() == rs[1].input_ids[22:]
    assert int(mb.attention_mask[b1].sum()) == len(rs[1]) - 22 and mb.tokens == len(rs[0]) + len(rs[1]) - 22
    assert not mb.weights["echo"][:, 0].any() and mb.weights["echo"][b1, 8] == 1.0
    assert mb.scales["echo"][b0].item() == 0.5 and mb.trains and mb.old_logprobs is None
    assert torch.equal(mb.target_mask, mb.targets("echo"))
