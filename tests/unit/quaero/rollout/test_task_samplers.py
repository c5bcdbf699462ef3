"""Task samplers (quaero/rollout/task_samplers.py): the RFC 013 weight with numbers, each sampler's draws,
state round trips, and the one-line errors (the mixture's allocation: test_mixture.py)."""
from __future__ import annotations

import json
import math

import pytest

from quaero.config import TaskSamplerConfig
from quaero.openenv_client.tasks import TaskCatalog, task_index
from quaero.rollout.task_samplers import (
    CurriculumSampler,
    SplitView,
    TaskSamplerError,
    curriculum_weight,
    make_task_sampler,
    pool_of,
)
from quaero.task_sampler_registry import TASK_SAMPLERS


def view(sampler="sequential", size=10, seed=0, group=4, spec=None, **settings):
    catalog = TaskCatalog({"train": size}, "test") if size else None
    settings = TaskSamplerConfig(sampler=sampler, **settings)
    return SplitView("a", "train", size, seed, group, settings, catalog, spec)


# ── the samplers ──────────────────────────────────────────────────────────────────────────────────────────

def test_sequential_plays_the_run_seeds_order_of_the_split_as_quaero_always_did():
    for seed in (0, 1, 7):
        s = make_task_sampler(view(seed=seed, size=10))
        picks = s.sample(4) + s.sample(4) + s.sample(4)
        assert picks == [task_index(TaskCatalog({"train": 10}, "t"), "train", i, seed) for i in range(12)]
    s = make_task_sampler(view(size=None))  # no Task API: quaero's numbering
    assert s.sample(3) == [0, 1, 2]


def test_the_rfc013_weight_with_numbers():
    # p = 0.5, G = 4: 1 - 1/16 - 1/16 = 0.875; + ε 0.05 = 0.925; per 10 tokens: 0.0925
    assert curriculum_weight(0.5, 4, 10.0, 0.05) == pytest.approx(0.0925)
    # a solved (p = 1) or hopeless (p = 0) task keeps only ε
    assert curriculum_weight(1.0, 8, 1.0, 0.05) == pytest.approx(0.05)
    assert curriculum_weight(0.0, 8, 1.0, 0.05) == pytest.approx(0.05)
    # p = 0.25, G = 2: 1 - 0.0625 - 0.5625 = 0.375
    assert curriculum_weight(0.25, 2, 1.0, 0.0) == pytest.approx(0.375)


def test_the_curriculum_learns_a_discounted_success_estimate_and_draws_where_the_signal_is():
    s = make_task_sampler(view("curriculum", size=3, group=4, cost="episodes"))
    c: CurriculumSampler = s.sampler
    c.update(0, [1.0, 1.0, 1.0, 1.0], [5.0] * 4)  # solved
    c.update(1, [0.0, 0.0, 0.0, 0.0], [5.0] * 4)  # hopeless
    c.update(2, [1.0, 0.0, 1.0, 0.0], [5.0] * 4)  # half: the most signal
    c.update(2, [1.0, 1.0, 1.0, 0.0], [5.0] * 4)
    m = c.memory["2"]
    # discounted: successes 0.9 * 2 + 3 = 4.8 over 0.9 * 4 + 4 = 7.6 episodes
    assert m.p == pytest.approx(4.8 / 7.6)
    assert c.weight(2) == pytest.approx(curriculum_weight(4.8 / 7.6, 4, 1.0, 0.05))
    assert c.weight(0) == pytest.approx(0.05) and c.weight(1) == pytest.approx(0.05)
    picks = s.sample(200)
    assert picks.count(2) > 150  # weight ~0.72 vs 0.05 + 0.05
    assert [pool_of(c.memory[k]) for k in "012"] == ["saturated", "hopeless", "learnable"]
    assert s.occupancy() == {"unseen": 0, "learnable": 1, "saturated": 1, "hopeless": 1}


def test_the_curriculum_counts_cost_in_tokens_and_pools_by_the_tasks_group():
    groups = {0: "price", 1: "price", 2: "city", 3: "city"}
    s = make_task_sampler(view("curriculum", size=4, group=2, key="group",
                               spec=lambda i: {"group": groups[i]}))
    c = s.sampler
    c.update(0, [1.0, 0.0], [10.0, 10.0])  # price: p 0.5, 10 tokens an episode
    c.update(2, [1.0, 0.0], [40.0, 40.0])  # city: p 0.5, 40 tokens an episode
    assert set(c.memory) == {"group=price", "group=city"}
    assert c.weight(1) == pytest.approx(curriculum_weight(0.5, 2, 10.0, 0.05))  # task 1 shares price's memory
    assert c.weight(1) / c.weight(3) == pytest.approx(4.0)  # the same signal at a quarter of the tokens


def test_the_curriculum_draws_a_template_its_guides_teach_while_guidance_gives_its_groups_a_signal():
    """SmolLM2's curve at seed 1: the warm start solved `city` greedily but never when sampled (p = 0), so RFC
    013's weight left it ε and the curriculum drew it in 4 of 45 groups while `[guidance]` would have given
    each of those all-fail groups a signal. The weight now counts that signal (s, measured per key), and drops
    it again once guides stop giving one (guidance annealed off)."""
    assert curriculum_weight(0.0, 8, 1.0, 0.05, guided=1.0) == pytest.approx(1.05)  # all taught
    assert curriculum_weight(0.0, 8, 1.0, 0.05, guided=0.5) == pytest.approx(0.55)
    assert curriculum_weight(0.5, 4, 10.0, 0.05, guided=0.0) == pytest.approx(0.0925)  # RFC 013's, as before
    groups = {0: "price", 1: "city"}
    s = make_task_sampler(view("curriculum", size=2, group=8, key="group", cost="episodes",
                               spec=lambda i: {"group": groups[i]}))
    c = s.sampler
    c.update(0, [1.0, 0.0] * 4, [5.0] * 8)  # price: p 0.5
    for _ in range(3):  # city: all-fail, two guides gave it rewards that differ
        c.update(1, [0.0] * 8, [5.0] * 8)
        s.guided(1, True)
    city = c.memory["group=city"]
    assert city.p == 0.0 and city.guided_share == pytest.approx(1.0)
    assert c.weight(1) == pytest.approx(1.05) and c.weight(1) > c.weight(0)
    assert s.sample(100).count(1) > 40  # before: ε / (ε + 0.99), ~5 in 100
    for _ in range(20):  # guidance annealed off: all-fail groups without a guide, no signal
        c.update(1, [0.0] * 8, [5.0] * 8)
    assert c.memory["group=city"].guided_share < 0.15 and c.weight(1) < 0.2
    s.guided(0, True)  # a group that had a success never counts (guides go only to all-fail groups)
    assert c.memory["group=price"].guided_share == 0.0 and c.memory["group=price"].guided_signal == 0.0
    # a checkpoint holds it (and one from before it, five numbers a key, loads with s = 0)
    saved = json.loads(json.dumps(c.state_dict()))
    again = make_task_sampler(view("curriculum", size=2, group=8, key="group", cost="episodes",
                                   spec=lambda i: {"group": groups[i]})).sampler
    again.load_state_dict(saved)
    assert again.memory["group=city"] == c.memory["group=city"]
    again.load_state_dict({**saved, "memory": {k: v[:5] for k, v in saved["memory"].items()}})
    assert again.memory["group=city"].guided_share == 0.0
    with pytest.raises(TaskSamplerError, match=r"is not a list of 5 or 7 numbers.*or pass --restart"):
        again.load_state_dict({**saved, "memory": {"group=city": [0.0, 1.0]}})


def test_difficulty_pools_weigh_by_the_latest_group_success_rate():
    s = make_task_sampler(view("difficulty_pools", size=4, group=4))
    p = s.sampler
    p.update(0, [0.0, 0.0, 0.0, 1.0], [1.0] * 4)  # 0.25: hard
    p.update(1, [1.0, 1.0, 0.0, 0.0], [1.0] * 4)  # 0.5: normal
    p.update(2, [1.0, 1.0, 1.0, 1.0], [1.0] * 4)  # 1.0: easy
    assert [p.weight(i) for i in range(4)] == [0.2, 1.0, 0.2, 1.0]  # task 3 unseen: 1


def test_uniform_draws_every_task_of_the_split_from_its_own_generator():
    s = make_task_sampler(view("uniform", size=5))
    picks = s.sample(500)
    assert set(picks) == set(range(5)) and all(abs(picks.count(i) - 100) < 40 for i in range(5))
    import random

    random.seed(123)
    before = random.random()
    random.seed(123)
    make_task_sampler(view("uniform", size=5)).sample(3)
    assert random.random() == before  # the global generator is never read


@pytest.mark.parametrize("kind", ["sequential", "uniform", "curriculum", "difficulty_pools"])
def test_a_sampler_resumed_from_its_json_state_draws_what_the_uninterrupted_one_draws(kind):
    def run(sampler, steps):
        out = []
        for _ in range(steps):
            picks = sampler.sample(3)
            for t in picks:
                sampler.update(t, [float(t % 2), float(t % 3 == 0)], [7.0, 9.0])
            out.append(picks)
        return out

    whole = make_task_sampler(view(kind, size=50, seed=3))
    first = make_task_sampler(view(kind, size=50, seed=3))
    ref = run(whole, 6)
    head = run(first, 3)
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds: JSON, no pickle
    second = make_task_sampler(view(kind, size=50, seed=3))
    second.load_state_dict(saved)
    assert head + run(second, 3) == ref


# ── a user's sampler, and bad input ───────────────────────────────────────────────────────────────────────

class EveryOther:
    """A user's sampler through the protocol: even tasks only."""

    def __init__(self, view):
        self.view, self.n = view, 0

    def sample(self, n):
        out = [(2 * (self.n + i)) % self.view.size for i in range(n)]
        self.n += n
        return out

    def update(self, task, rewards, costs):
        pass

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class OutOfRange(EveryOther):
    def sample(self, n):
        return [self.view.size] * n


class Raises(EveryOther):
    def sample(self, n):
        raise KeyError("boom")


def test_every_registered_sampler_is_built_by_its_name_and_says_whether_it_learns():
    for name, kind in TASK_SAMPLERS.items():
        s = make_task_sampler(view(name, size=10))
        assert f"{type(s.sampler).__module__}:{type(s.sampler).__name__}" == kind.cls
        assert len(s.sample(3)) == 3 and TaskSamplerConfig(sampler=name).learns is kind.learns
    assert TaskSamplerConfig(sampler=f"{__name__}:EveryOther").learns  # a user's: assumed to learn


def test_a_users_sampler_by_import_path():
    s = make_task_sampler(view(f"{__name__}:EveryOther", size=10))
    assert s.sample(3) == [0, 2, 4] and s.sample(3) == [6, 8, 0]


@pytest.mark.hostile
def test_bad_samplers_and_states_fail_in_one_line_naming_the_sampler_and_the_fix():
    with pytest.raises(TaskSamplerError, match=r"OutOfRange'.*returned task 10; it must return 2 indices in "
                                               r"0..9"):
        make_task_sampler(view(f"{__name__}:OutOfRange", size=10)).sample(2)
    with pytest.raises(TaskSamplerError, match=r"Raises'.*sample\(2\) raised KeyError: 'boom'; fix the "
                                               r"sampler"):
        make_task_sampler(view(f"{__name__}:Raises", size=10)).sample(2)
    with pytest.raises(TaskSamplerError, match="sampler='no_such_module:Sampler': cannot import module"):
        make_task_sampler(view("no_such_module:Sampler", size=10))
    with pytest.raises(TaskSamplerError, match=r"lacks sample, update"):
        make_task_sampler(view("json:JSONDecoder", size=10))
    with pytest.raises(TaskSamplerError, match="has no Task API.*use sampler = \"sequential\""):
        make_task_sampler(view("curriculum", size=None))
    saved = make_task_sampler(view("uniform", size=10)).state_dict()
    with pytest.raises(TaskSamplerError, match=r"'uniform' on split 'train' \(10 tasks\), this config's "
                                               r"'curriculum'.*or pass --restart"):
        make_task_sampler(view("curriculum", size=10)).load_state_dict(saved)
    with pytest.raises(ValueError, match="sampler='bogus' is not one of sequential"):
        TaskSamplerConfig(sampler="bogus")
    assert math.isfinite(curriculum_weight(0.5, 4, 0.0, 0.05))  # a zero cost never divides by zero


# ── a user's sampler that hangs or misbehaves (quaero/bounded.py bounds every call) ───────────────────────

@pytest.fixture
def released():
    from fixtures import hostile_samplers

    hostile_samplers.RELEASE.clear()
    yield
    hostile_samplers.RELEASE.set()


@pytest.mark.hostile
@pytest.mark.parametrize("cls, call", [("HangingSampler", "sample(2)"),
                                       ("HangingUpdateSampler", "update(3, ...)")])
def test_a_user_sampler_that_never_returns_fails_the_run_at_its_bound_naming_it(released, cls, call):
    import time

    s = make_task_sampler(view(f"fixtures.hostile_samplers:{cls}", timeout_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(TaskSamplerError) as e:
        s.sample(2) if call.startswith("sample") else s.update(3, [1.0], [1.0])
    assert time.monotonic() - t0 < 3
    assert str(e.value).startswith(f"[env.tasks] sampler='fixtures.hostile_samplers:{cls}' (env 'a'): {call} "
                                   "did not return within 0.3s ([env.tasks] timeout_s)")


@pytest.mark.hostile
@pytest.mark.parametrize("cls", ["NotJsonStateSampler", "NanStateSampler"])
def test_a_user_samplers_state_that_is_not_json_is_named(cls):
    s = make_task_sampler(view(f"fixtures.hostile_samplers:{cls}"))
    with pytest.raises(TaskSamplerError, match=rf"sampler='fixtures.hostile_samplers:{cls}' \(env 'a'\): "
                       r"state_dict\(\) gave no JSON state"):
        s.state_dict()


@pytest.mark.hostile
def test_a_long_first_draw_reading_every_spec_logs_progress_with_the_specs_read(monkeypatch):
    """A learning sampler keyed by the spec's group weighs `candidates` tasks: its first draw reads each one's
    spec (a huge split with big candidates: minutes); the wait says how far it got."""
    import time

    import structlog

    from quaero import bounded

    monkeypatch.setattr(bounded, "PROGRESS_S", 0.1)

    def spec(index):
        time.sleep(0.002)
        return {"group": index % 3}

    s = make_task_sampler(view("curriculum", size=200, spec=spec, key="group", candidates=200))
    with structlog.testing.capture_logs() as logs:
        assert len(s.sample(4)) == 4
    lines = [e for e in logs if e["event"] == "user_call_waiting"]
    assert lines and lines[0]["call"].endswith("sample(4)") and 0 < lines[-1]["task_specs_read"] <= 200


@pytest.mark.hostile
def test_a_user_samplers_generator_is_consumed_under_the_bound_and_a_stop_request(released):
    """sample() returning an endless generator: the bound covered the call that returned it, and `list()`
    consumed it unbounded (memory without end; SIGTERM only logged stop_requested)."""
    import threading
    import time

    from quaero.bounded import STOP_REQUESTED, StoppedInCall

    name = "fixtures.hostile_samplers"
    with pytest.raises(TaskSamplerError, match=r"EndlessSampler' \(env 'a'\): sample\(2\) returned more "
                                               r"than 2 tasks; it must return 2 indices"):
        make_task_sampler(view(f"{name}:EndlessSampler")).sample(2)
    t0 = time.monotonic()
    with pytest.raises(TaskSamplerError, match=r"sample\(2\) did not return within 0.3s \(\[env.tasks\] "
                                               r"timeout_s\)"):
        make_task_sampler(view(f"{name}:StallingGeneratorSampler", timeout_s=0.3)).sample(2)
    assert time.monotonic() - t0 < 3
    stalled = make_task_sampler(view(f"{name}:StallingGeneratorSampler", timeout_s=60), grace_s=0.2)
    threading.Timer(0.2, STOP_REQUESTED.set).start()  # SIGTERM's handler sets it
    try:
        t0 = time.monotonic()
        with pytest.raises(StoppedInCall):
            stalled.sample(2)
        assert time.monotonic() - t0 < 5
    finally:
        STOP_REQUESTED.clear()


@pytest.mark.hostile
def test_numpy_integer_indices_are_indices_and_other_numbers_are_named_with_their_type():
    """Round 4: a sampler returning numpy's integers (`rng.choice`'s) was refused as 'returned task
    np.int64(0); it must return 2 indices', naming a value that reads as an index."""
    name = "fixtures.hostile_samplers"
    picks = make_task_sampler(view(f"{name}:NumpySampler")).sample(2)
    assert picks == [0, 1] and all(type(i) is int for i in picks)  # plain ints: checkpoints hold them as JSON
    with pytest.raises(TaskSamplerError, match=r"sample\(2\) returned task np.float64\(0.0\) \(a "
                                               r"numpy.float64, not an integer\); it must return 2 indices"):
        make_task_sampler(view(f"{name}:NumpyFloatSampler")).sample(2)
