"""Which task an episode plays (quaero/rollout/tasks.py): the reset seed derives from the run seed and the
task's index alone, and with the env's Task API the run seed orders the split and the index wraps round it."""
from __future__ import annotations

from fixtures.rollout import make_cfg

from quaero.openenv_client.tasks import TaskCatalog
from quaero.rollout.tasks import reset_args, task_reset


def test_the_reset_seed_is_the_run_seed_and_the_index_alone():
    assert reset_args(3, "train", 5) == {"seed": 3 * 1_000_003 + 5, "split": "train", "index": 5}
    assert reset_args(3, "eval", 5)["seed"] == reset_args(3, "train", 5)["seed"]
    assert len({reset_args(seed, "train", i)["seed"] for seed in range(4) for i in range(50)}) == 200


def test_without_a_task_api_the_index_is_the_draw_and_the_seed_the_configs():
    cfg = make_cfg(run__seed=7)
    assert task_reset(cfg, "train", 12) == reset_args(7, "train", 12)


def test_with_a_task_api_the_run_seed_orders_the_split_and_the_index_wraps():
    catalog = TaskCatalog({"train": 5}, "test")
    plain = [task_reset(make_cfg(run__seed=0), "train", i, catalog)["index"] for i in range(7)]
    assert plain == [0, 1, 2, 3, 4, 0, 1]
    seeded = [task_reset(make_cfg(run__seed=3), "train", i, catalog)["index"] for i in range(10)]
    assert sorted(seeded[:5]) == [0, 1, 2, 3, 4] and seeded[5:] == seeded[:5]
