"""OpenEnv's Task API read by quaero (quaero/openenv_client/tasks.py), in process and over a real server's
routes on 127.0.0.1: the env's splits and sizes at `quaero check`, a split it lacks refused in one line,
training drawing from the train split's range and evaluation playing exactly the eval split."""
import json

import pytest
from fixtures.rollout import make_cfg
from fixtures.taskenv import SPLITS

from quaero import cli
from quaero.config import EnvConfig
from quaero.openenv_client import open_envs
from quaero.openenv_client.tasks import TaskCatalog, catalog_over_http, eval_indices, task_index
from quaero.rollout.tasks import task_reset

SUM = "fixtures.taskenv:SumEnv"


@pytest.fixture(scope="module")
def sum_url():
    from fixtures import served

    with served(SUM) as (url, _proc):
        yield url


def _config(tmp_path, env: str, **training) -> str:
    lines = ["[env]", env, "[training]", *(f"{k} = {v!r}".replace("'", '"') for k, v in training.items()),
             "[run]", f'output_dir = "{tmp_path}"']
    path = tmp_path / "q.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("launcher", ["inprocess", "local-server", "remote"])
def test_the_env_splits_are_read_in_process_and_over_its_routes(launcher, sum_url):
    source = {"url": sum_url} if launcher == "remote" else {"entry": SUM, "launcher": launcher}
    with open_envs(EnvConfig(**source, eval_split="test"), 1) as pool:
        assert pool.tasks.splits == {"train": 5, "test": 3}
        start = pool.sessions[0].reset(seed=1, split="test", index=2)
        assert start.info["played"] == "test-2"  # the env played the task quaero named


def test_an_env_without_the_task_api_keeps_quaeros_numbering(guess_url):
    with open_envs(EnvConfig(url=guess_url), 1) as pool:
        assert pool.tasks is None
    assert catalog_over_http(guess_url.replace("ws", "http", 1)) is None
    assert [task_reset(make_cfg(), "train", i)["index"] for i in (0, 7)] == [0, 7]
    assert eval_indices(None, "eval", 4) == [0, 1, 2, 3]


@pytest.mark.slow
def test_check_prints_the_splits_and_refuses_a_split_the_env_lacks(tmp_path, capsys, sum_url):
    good = _config(tmp_path, f'entry = "{SUM}"\neval_split = "test"', eval_tasks=2)
    assert cli.main(["check", good]) == 0
    out = capsys.readouterr().out
    assert (
        "splits 'train' (5 tasks), 'test' (3 tasks)" in out
        and "the first 2 (set [training] eval_tasks = 3 for all)" in out
    )

    bad = _config(tmp_path, f'entry = "{SUM}"')  # eval_split defaults to "eval": the env has none
    assert cli.main(["check", bad]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval_split='eval'" in err[0] and "'test' (3 tasks)" in err[0]

    remote = _config(tmp_path, f'url = "{sum_url}"\neval_split = "test"')
    assert cli.main(["check", remote]) == 0
    assert f"(the env's Task API, {sum_url.replace('ws', 'http', 1)})" in capsys.readouterr().out


def test_train_wraps_round_the_split_and_eval_covers_the_eval_split(tmp_path, capsys):
    catalog = TaskCatalog(dict(SPLITS), "test")
    assert [task_index(catalog, "train", i) for i in range(7)] == [0, 1, 2, 3, 4, 0, 1]
    # another run seed trains the split in another order: each task once per pass, the same order each pass
    orders = {seed: [task_index(catalog, "train", i, seed) for i in range(10)] for seed in range(1, 6)}
    assert all(sorted(o[:5]) == [0, 1, 2, 3, 4] and o[5:] == o[:5] for o in orders.values()), orders
    assert len({tuple(o[:5]) for o in orders.values()}) > 1, orders
    for n in (1, 2, 12, 1_000_000):  # a permutation whatever n's factors
        big = TaskCatalog({"train": n}, "test")
        assert len({task_index(big, "train", i, 7) for i in range(min(n, 1000))}) == min(n, 1000)
    assert eval_indices(catalog, "test", 64) == [0, 1, 2] and eval_indices(catalog, "test", 2) == [0, 1]

    # quaero eval with the env's oracle, eval_tasks far above the split: exactly the 3 test tasks, each once
    cfg = _config(tmp_path, f'entry = "{SUM}"\neval_split = "test"', eval_tasks=64, tasks_per_step=1,
                  group_size=2)
    out = tmp_path / "eval"
    assert cli.main(["eval", cfg, "--model", "fixtures.taskenv:oracle_policy", "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "transcripts.jsonl").read_text().splitlines()]
    assert [(r["split"], r["task"], r["reward"]) for r in records] == [("test", i, 1.0) for i in range(3)]


def test_toolbench_implements_the_task_api_and_check_names_its_splits(tmp_path, capsys):
    assert cli.main(["check", "envs/toolbench.toml", "--set", f"run.output_dir={str(tmp_path)!r}"]) == 0
    assert (
        "tasks       splits 'train' (1000000 tasks), 'eval' (500 tasks) (the env's Task API, in "
        "process); train draws from 'train', eval plays 'eval': the first 128 ("
    ) in capsys.readouterr().out
