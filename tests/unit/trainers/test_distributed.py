"""The pieces of data parallelism that run in one process: the row split, the torchrun guard, the identity."""
import pytest
import torch

from quaero import process_group
from trainers import distributed


def test_split_is_balanced_by_tokens_deterministic_and_covers_every_row():
    lengths = [72, 80, 88, 96, 104]
    shares = distributed.split_rows(lengths, 2)
    assert shares == [[0, 1, 4], [2, 3]]  # 104+80+72 = 256 and 96+88 = 184
    assert sorted(i for s in shares for i in s) == list(range(5))
    assert distributed.split_rows(lengths, 2) == shares
    assert distributed.split_rows([10] * 4, 3) == [[0, 3], [1], [2]]  # ties: lower index to lower rank
    assert distributed.split_rows([50], 2) == [[0], []]  # a rank may get nothing and still takes part


def test_split_keeps_the_heaviest_rank_near_the_mean():
    lengths = [17, 300, 41, 95, 95, 260, 8, 120, 33]
    shares = distributed.split_rows(lengths, 3)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first bound


def test_torchrun_with_strategy_none_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"2 ranks but \[distributed\] strategy='none'.*'ddp' or 'fsdp2'"):
        process_group.setup("none", torch.device("cpu"))


def test_one_process_is_the_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = torch.nn.Linear(2, 2)
    assert process_group.setup("fsdp2", torch.device("cpu")) == torch.device("cpu")
    assert distributed.wrap_model(module, "fsdp2", torch.device("cpu"), []) is module
    assert (
        process_group.all_sum([3, 4]) == [3, 4]
        and process_group.all_max(5) == 5
        and process_group.gather("x") == ["x"]
    )


def test_ranks_totals_add_up_and_keep_their_maxima():
    from quaero.telemetry.names import HIDDEN_BATCHES
    from trainers.batch import CropStats
    from trainers.loss import LogprobGap, PolicyStats
    from trainers.reference import KLStats
    from trainers.step import StepTotals
    from trainers.terms import NoStats, PolicyTermStats

    tokens = {"policy": 10, "echo": 20, "kl": 12}
    a = StepTotals.empty(tokens, rows=3, microbatches=2, row_tokens=256, padded_tokens=300, crop=CropStats(1,
                                                                                                           4),
                         forward_passes=2)
    a.terms["policy"].add(0.5, PolicyTermStats(PolicyStats(6, 6.5, 1), LogprobGap(6, 0.6, 0.3)))
    a.terms["echo"].add(0.25, NoStats())
    a.terms["kl"].add(0.01, KLStats(7, 0.14, 0.05))
    b = StepTotals.empty(tokens, rows=2, microbatches=1, row_tokens=184, padded_tokens=192, padding=1,
                         forward_passes=1, fallback_reason="no CUDA")
    b.terms["policy"].add(-0.125, PolicyTermStats(PolicyStats(4, 3.5, 0), LogprobGap(4, 0.2, 0.5)))
    b.terms["echo"].add(0.5, NoStats())
    b.terms["kl"].add(0.02, KLStats(5, 0.1, 0.08))
    a.branches[HIDDEN_BATCHES], b.branches[HIDDEN_BATCHES] = 2, 1
    t = StepTotals.of_ranks([a, b])
    policy, echo = t.terms["policy"], t.terms["echo"]
    assert (policy.tokens, echo.tokens) == (10, 20)  # the denominators are global already: never summed
    assert (t.rows, t.microbatches, t.row_tokens, t.padded_tokens, t.padding) == (5, 3, 440, 492, 1)
    assert (policy.loss, echo.loss, t.forward_passes) == (0.375, 0.75, 3)
    assert (t.crop.rows_cropped, t.crop.tokens_removed) == (1, 4) and t.fallback_reason == "no CUDA"
    assert t.branches[HIDDEN_BATCHES] == 3
    pg, gap = policy.stats.policy, policy.stats.gap
    assert (pg.tokens, pg.ratio_sum, pg.clipped) == (10, 10.0, 1)
    assert (gap.tokens, gap.max) == (10, 0.5) and gap.mean == pytest.approx(0.08)
    kl = t.terms["kl"]
    assert kl.tokens == 12 and kl.loss == pytest.approx(0.03)
    assert (kl.stats.tokens, kl.stats.max) == (12, 0.08) and kl.stats.total == pytest.approx(0.24)


def test_shards_written_by_one_trainer_load_whole_into_another(tiny_model_dir, monkeypatch, tmp_path):
    """torch.distributed.checkpoint's files read back into a one-process trainer (what `quaero export` and a
    resume on another number of ranks do): weights, optimizer moments and scheduler equal the writer's."""
    from benchmarks.smoke import sparse_row
    from trainers.local import LocalTrainer
    from trainers.spec import TrainerSpec

    rows = [sparse_row(i, 1.0 if i % 2 else -1.0, vocab=256, context=6 + 4 * i) for i in range(3)]
    writer = LocalTrainer(TrainerSpec(lr=1e-3), "cpu")
    writer.train_step(rows)
    writer.save_shards(tmp_path / "shards")
    state = {k: v for k, v in writer.state_dict().items() if k not in ("model",
                                                                       "optimizer")} | {"shards": "dcp"}
    reader = LocalTrainer(TrainerSpec(lr=1e-3), "cpu")
    with pytest.raises(ValueError, match="shards/ folder"):
        reader.load_state_dict(state)
    reader.load_state_dict(state, shards=tmp_path / "shards")
    for name, w in writer.model.state_dict().items():
        torch.testing.assert_close(reader.model.state_dict()[name], w, rtol=0, atol=0, msg=name)
    want, got = writer.optimizer.state_dict(), reader.optimizer.state_dict()
    for pid, moments in want["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(got["state"][pid][key], value, rtol=0, atol=0)
    assert reader.steps_done == writer.steps_done == 1
    writer.train_step(rows)  # the next step is the same step
    reader.train_step(rows)
    for name, w in writer.model.state_dict().items():
        torch.testing.assert_close(reader.model.state_dict()[name], w, rtol=0, atol=0, msg=name)


def test_a_sharded_trainer_keeps_model_and_optimizer_out_of_its_state(tiny_model_dir, monkeypatch):
    from dataclasses import replace

    from trainers.local import LocalTrainer
    from trainers.spec import TrainerSpec

    trainer = LocalTrainer(TrainerSpec(), "cpu")
    assert "model" in trainer.state_dict() and not trainer.sharded  # one process: checkpoints as before
    trainer.spec = replace(trainer.spec, distributed="fsdp2")
    monkeypatch.setattr(process_group, "world_size", lambda: 2)
    assert trainer.sharded
    state = trainer.state_dict()
    assert state["shards"] == "dcp" and "model" not in state and "optimizer" not in state


def test_tree_training_splits_rows_by_prefix_so_a_group_stays_on_one_rank():
    rng = __import__("random").Random(0)
    groups = [[g * 1000 + t for t in range(300)] for g in range(4)]  # four prompts, nothing shared between
    ids = [groups[g] + [rng.randrange(999) for _ in range(20 + m)] for m in range(6) for g in range(4)]
    shares = distributed.split_trees(ids, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(ids)))
    for s in shares:  # whole groups per rank (rows m * 4 + g belong to group g), two each: balanced
        assert len({i % 4 for i in s}) == 2 and len(s) == 12
    assert distributed.split_trees(ids, 1) == [list(range(len(ids)))]
    assert sorted(map(len, distributed.split_trees([[1, 2]], 3))) == [0, 0, 1]  # one row, one rank
