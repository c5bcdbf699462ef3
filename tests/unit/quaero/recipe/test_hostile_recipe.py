"""The recipe (quaero/recipe/train.py) and the warm start's traces (quaero/rollout/traces.py) against hostile
rewards, advantages, files and settings: each is refused or reported in one line naming what was wrong. The
recipe's arithmetic runs over a scripted driver (no model, no env), as tests/unit/quaero/test_train.py
does."""
import json
import math
import os

import pytest
import structlog
from fixtures.rollout import make_cfg, recipe_parts
from fixtures.small_model import V

from quaero.bounded import STOP_REQUESTED
from quaero.config import ConfigError, load_config
from quaero.recipe.progress import RunProgress
from quaero.recipe.stop import EmptySteps
from quaero.recipe.train import collect_rows
from quaero.rollout.driver import Episode
from quaero.rollout.traces import load_traces, warm_start_rows
from quaero.rows import EchoRow, Span
from quaero.telemetry.counts import RolloutCounts

pytestmark = pytest.mark.hostile


def _row() -> EchoRow:
    return EchoRow([1, 2, 3, 4], [Span("prompt", 0, 1, 0), Span("action", 1, 3, 0), Span("env", 3, 4, 0)],
                   [0.0] * 4, [0.0, 0.0, 0.0, 1.0], [0.0, -0.5, -0.5, 0.0])


def _recipe(rewards_of_task, on_call=None, **rollout):
    calls = []

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        calls.append([t["index"] for t in tasks])
        if on_call:
            on_call(len(calls))
        return [[Episode([_row()], r, r > 0, 1, {}, []) for r in rewards_of_task(t["index"])[:group_size]]
                for t in tasks]

    over = {"tasks_per_step": 2, "group_size": 2, **rollout}
    cfg = make_cfg(**{f"rollout__{k}": v for k, v in over.items()})
    return recipe_parts(cfg, run, RolloutCounts()), calls


def test_a_kept_rows_meta_carries_its_episodes_reward_for_export():
    """`--export` wrote "reward": null for every row: the recipe never put the episode's reward on its
    rows."""
    c, _ = _recipe(lambda i: [1.0, 0.0])
    collected = collect_rows(c, RunProgress(), 1, sft=False)
    assert [row.meta["reward"] for row, _ in collected] == [1.0, 0.0, 1.0, 0.0]


def test_each_dynamic_sampling_round_is_logged_and_a_stop_request_ends_the_rounds():
    """Every group uniform: the step samples on, round after round; each round is a line, and a stop request
    (SIGTERM's StopRequest sets STOP_REQUESTED) ends the rounds at the next one."""
    c, calls = _recipe(lambda i: [0.0, 0.0], on_call=lambda n: STOP_REQUESTED.set() if n == 2 else None,
                       dynamic_sampling=True, dynamic_sampling_max_groups=100.0)
    try:
        with structlog.testing.capture_logs() as logs:
            collect_rows(c, RunProgress(), 1, sft=False)
    finally:
        STOP_REQUESTED.clear()
    assert calls == [[0, 1], [2, 3]]  # two rounds of 200 groups' worth, then the stop request
    rounds = [e for e in logs if e["event"] == "dynamic_sampling_round"]
    assert [(e["groups"], e["groups_with_spread"], e["sampling"]) for e in rounds] == [(2, 0, 2)]
    assert [e["groups"] for e in logs if e["event"] == "dynamic_sampling_stopped"] == [4]


@pytest.mark.parametrize("value, shown", [("1e9", "1000000000.0"), ("101", "101")])
def test_dynamic_sampling_max_groups_is_bounded_in_one_line(tmp_path, value, shown):
    path = tmp_path / "run.toml"
    path.write_text(f'[env]\nentry = "tests:toy"\n[training]\ndynamic_sampling = true\n'
                    f"dynamic_sampling_max_groups = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path} [rollout] dynamic_sampling_max_groups={shown}: Input should be less "
                            "than or equal to 100")


def test_steps_that_left_out_every_group_for_a_non_finite_advantage_say_so():
    """Rewards of +-1e308: nothing is dropped, the groups are left out (groups_nonfinite_advantage); the run's
    end said "none dropped ... the env_episode_dropped events say why"."""
    why = EmptySteps().after(make_cfg(training__max_empty_steps=1), {}, 1,
                             {"rows": 0, "groups_nonfinite_advantage": 2})
    assert why == ("step 1 trained no row ([training] max_empty_steps=1); dropped episodes by reason: none "
                   "dropped; 2 group(s) left out because their rewards give no finite advantage "
                   "(groups_nonfinite_advantage: rewards too far apart for a float, e.g. ±1e308); bound "
                   "the env's "
                   "rewards")


ACTION = [0, 0, 1, 1, 0]


def _record(**fields):
    return {"input_ids": [3, 4, 5, 6, 7], "action_mask": ACTION, "obs_mask": [0, 0, 0, 0, 1],
            "logprobs": [-0.5 if a else 0.0 for a in ACTION], **fields}


def test_recorded_advantages_past_what_the_loss_holds_are_refused_naming_the_record(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(_record(advantage=a)) + "\n" for a in (1e308, -1e308, 0.5)))
    rows, refused = load_traces(path, V, loss="rl")
    assert len(rows) == 1 and rows[0].advantages == [0.5 if a else 0.0 for a in ACTION]
    assert refused == [f"{path}:{n}: its advantage {a:g} is past +-1e+30, more than the fp32 loss holds "
                       "(it would "
                       "train nothing: a NaN loss); scale the record's advantages"
                       for n, a in ((1, 1e308), (2, -1e308))]
    assert not math.isnan(rows[0].advantages[2])


def test_a_fifo_named_as_traces_is_refused_without_blocking(tmp_path, tiny_model_dir):
    fifo = tmp_path / "traces.fifo"
    os.mkfifo(fifo)
    cfg = make_cfg(model__name="tiny-qwen3", data__traces=str(fifo), training__warmup_sft_steps=1)
    with pytest.raises(ConfigError) as e:
        warm_start_rows(cfg, "run.toml")
    assert str(e.value) == (f"run.toml [data] traces={str(fifo)!r}: not a regular file (a FIFO, a device "
                            "or a "
                            "folder); name a .jsonl file of records")
