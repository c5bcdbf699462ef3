"""Several optimizer steps per rollout batch (trainers/mini_steps.py): episodes kept whole in mini-batches,
the trainer's log-probs recorded once before the first mini-step and read by every later one, the metrics
merged as each name totals."""
from dataclasses import replace

import torch
from fixtures.small_model import V, make_spec

from benchmarks.smoke import sparse_rows
from trainers import step
from trainers.local import LocalTrainer
from trainers.mini_steps import merge_metrics, mini_batches
from trainers.policy_losses import PPOClip


def _rows():
    rows = sparse_rows(6, vocab=V, context=40)
    # three episodes of two rows each
    return [replace(r, meta={**r.meta, "episode": f"e{i // 2}"}) for i, r in enumerate(rows)]


def test_mini_batches_keep_episodes_whole_and_in_order():
    rows = _rows()
    assert mini_batches(rows, 2) == [[0, 1], [2, 3, 4, 5]]
    assert mini_batches(rows, 3) == [[0, 1], [2, 3], [4, 5]]
    assert mini_batches(rows, 9) == [[0, 1], [2, 3], [4, 5]]  # no more than there are episodes
    assert mini_batches(rows, 1) == [[0, 1, 2, 3, 4, 5]]


def test_merged_metrics_total_as_their_names_say():
    a = {"rows": 2, "peak_mem_mb": 5.0, "rl_loss": 1.0, "policy_loss": "ppo_clip", "step_time_s": 1.0,
         "sequence_ratio_mean": None, "optimizer_stepped": True}
    b = {"rows": 3, "peak_mem_mb": 4.0, "rl_loss": 3.0, "policy_loss": "ppo_clip", "step_time_s": 2.0,
         "sequence_ratio_mean": None, "optimizer_stepped": False}
    assert merge_metrics([a, b]) == {"rows": 5, "peak_mem_mb": 5.0, "rl_loss": 2.0, "policy_loss": "ppo_clip",
                                     "step_time_s": 3.0, "sequence_ratio_mean": None,
                                     "optimizer_stepped": False}


def test_each_mini_step_compares_with_the_log_probs_recorded_before_the_first(small_model_dir):
    settings = {"lr": 2e-2, "policy_loss": PPOClip(1e-3, 1e-3), "sampler_correction": "token_truncate"}
    rows = _rows()
    multi = LocalTrainer(make_spec(small_model_dir, steps_per_generation=2, num_iterations=2, **settings),
                         "cpu")
    by_hand = LocalTrainer(make_spec(small_model_dir, **settings), "cpu")
    m = multi.train_step(rows)
    assert m["optimizer_steps"] == 4 and m["rows"] == 2 * len(rows) and multi.steps_done == 1
    # the later mini-steps' ratios moved off 1 against the recorded log-probs: the tight clip binds
    assert m["clip_fraction"] > 0.0
    old = by_hand.logprobs(rows)  # recorded once, before the first step
    for _ in range(2):
        for chunk in ([0, 1], [2, 3, 4, 5]):
            step.shared_forward_step(by_hand, [rows[i] for i in chunk], sft=False,
                                     old_logprobs=[old[i] for i in chunk])
    for (k, a), b in zip(multi.model.state_dict().items(), by_hand.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_one_step_per_batch_is_the_default_step(small_model_dir):
    rows = _rows()
    a = LocalTrainer(make_spec(small_model_dir), "cpu")
    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    m = a.train_step(rows)
    step.shared_forward_step(b, rows, sft=False)
    assert m["optimizer_steps"] == 1
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(x, y)
