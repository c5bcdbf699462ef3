"""The pieces of data parallelism that run in one process: the row split, the launcher guard, the identity."""
import pytest
import torch

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


def test_a_launcher_with_strategy_none_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"2 ranks but \[distributed\] strategy='none'.*'ddp' or 'fsdp2'"):
        distributed.setup("none", torch.device("cpu"))


def test_one_process_is_the_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = torch.nn.Linear(2, 2)
    assert distributed.setup("fsdp2", torch.device("cpu")) == torch.device("cpu")
    assert distributed.wrap_model(module, "fsdp2", torch.device("cpu"), []) is module
    assert distributed.all_sum([3, 4]) == [3, 4] and distributed.all_max(5) == 5 and distributed.gather("x") == ["x"]
