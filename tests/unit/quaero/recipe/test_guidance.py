"""Guided episodes (quaero/recipe/guidance.py, `[guidance] mode = "episode"`): an RL group whose kept
episodes all fail gets k members played by the env's oracle on the same reset, encoded exactly as the warm
start's, marked guided, with the mixed group's advantages; counted; the task sampler learns from the policy's
own episodes; the schedule anneals to 0; the config's bad inputs are one line each."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from fixtures.rollout import make_cfg
from fixtures.toyenv import TOOLS, ToyChatEnv, oracle
from pydantic import ValidationError

from quaero.bounded import CallTimeout
from quaero.config import ConfigError, QuaeroConfig, check_rules, settings_of
from quaero.preflight.guidance_lines import guidance_lines, schedule_warning
from quaero.recipe.groups import learn, play_groups, signal_metrics
from quaero.recipe.guidance import members_at
from quaero.recipe.parts import EnvRun, RunParts, env_tasks
from quaero.rollout.driver import DriverSettings, EpisodeDriver
from quaero.rollout.mixture import Mixture
from quaero.sampling import Completion
from quaero.telemetry import names
from quaero.telemetry.counts import RolloutCounts

GROUP, K = 4, 2


class WrongAnswers:
    """The policy: submit_answer("0") every time (the toy env's tasks cost more: always a failure)."""

    def __init__(self, render):
        reset = ToyChatEnv().reset(index=0)
        wrong = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "submit_answer", "arguments": {"answer": "0"}}}]}
        self.ids = render.encode_assistant(reset.messages, TOOLS, wrong)

    def generate(self, prompts, *, n=1, greedy=False, seed=None):
        return [[Completion(list(self.ids), [-1.0] * len(self.ids), "stop")] for _ in prompts]


def _parts(render, **over):
    cfg = make_cfg(**{"rollout__tasks_per_step": 1, "rollout__group_size": GROUP, "training__steps": 4,
                      "guidance__mode": "episode", "guidance__members": K, **over})
    counts = RolloutCounts()
    sampler = WrongAnswers(render)
    pool = SimpleNamespace(sessions=[ToyChatEnv() for _ in range(GROUP)], tasks=None,
                           task_spec=lambda split, index: {})
    env = EnvRun("env", cfg, pool, EpisodeDriver(render, sampler, settings_of(DriverSettings, cfg), counts),
                 env_tasks("env", cfg, pool), oracle=oracle)
    return RunParts(cfg, None, sampler, render, [env], counts, False, Mixture({"env": 1.0})), counts


def _members(rows) -> dict[int, list]:
    out: dict[int, list] = {}
    for row, _ in rows:
        out.setdefault(int(row.meta["episode"].rsplit("/", 1)[1]), []).append(row)
    return out


def test_an_all_fail_group_gets_k_oracle_members_encoded_as_the_warm_start_with_the_mixed_advantages(
        qwen3_render, monkeypatch):
    parts, counts = _parts(qwen3_render)
    learned = []
    monkeypatch.setattr(parts.envs[0].tasks, "update", lambda task, rewards, costs: learned.append(rewards))
    monkeypatch.setattr(parts.envs[0].tasks, "guided", lambda task, sig: learned.append(("guided", sig)))
    rows, (outcome,) = play_groups(parts, 1, [["env", 2]], 0, seed=5, sft=False)
    members = _members(rows)
    assert sorted(members) == list(range(GROUP))
    # rewards 0, 0 (the policy's) and 1, 1 (the oracle's): advantages -0.5 and +0.5 on every action token
    for g, want, guided in [(0, -0.5, False), (1, -0.5, False), (2, 0.5, True), (3, 0.5, True)]:
        for row in members[g]:
            assert [a for a, m in zip(row.advantages, row.action_mask) if m] == [want] * row.num_action_tokens
            assert row.guided_mask == (row.action_mask if guided else [False] * len(row))
            assert row.meta["reward"] == (1.0 if guided else 0.0)
    # the oracle's tokens are exactly the warm start's on the same task (log-prob 0: never sampled)
    warm, _ = play_groups(parts, 1, [["env", 2]], 0, seed=5, sft=True)
    for g in (2, 3):
        assert [r.input_ids for r in members[g]] == [r.input_ids for r, _ in warm]
        assert [r.spans for r in members[g]] == [r.spans for r, _ in warm]
        assert all(lp == 0.0 for r in members[g] for lp in r.sampler_logprobs)
    # the outcome and the task sampler see the policy's four failures; the trained group has spread
    assert outcome.rewards == [0.0] * GROUP and outcome.guided == K and outcome.spread and outcome.kept
    learn(parts, 1, [outcome])  # and that the guides gave it a signal (the curriculum's s)
    assert learned == [[0.0] * GROUP, ("guided", True)]
    snap = counts.snapshot_and_reset()
    assert snap[names.GROUPS_GUIDED] == 1 and snap[names.GUIDED_MEMBERS] == K
    assert snap[names.GUIDED_MEMBERS_SUCCEEDED] == K and snap[names.GUIDED_MEMBERS_DROPPED] == 0
    assert snap[names.EPISODES] == GROUP + 1  # and the warm start's one; the guides count apart
    assert snap[names.GROUPS_ZERO_ADVANTAGE] == 0
    m = signal_metrics(parts, [outcome], step=1)
    guided_tokens = sum(r.num_action_tokens for g in (2, 3) for r in members[g])
    assert m[names.GUIDED_TOKENS] == guided_tokens and m[names.GUIDANCE_MEMBERS] == K
    assert m[names.GENERATED_TOKENS] == sum(outcome.costs)
    assert m[names.SIGNAL_GROUPS] == 1 and m[names.SIGNAL_GROUPS_GUIDED] == 1
    assert m[names.SIGNAL_GROUPS_PER_1K_TOKENS] == round(1000 / (sum(outcome.costs) + guided_tokens), 6)


def test_no_guide_once_the_schedule_reaches_none_or_where_the_policy_succeeded(qwen3_render):
    parts, counts = _parts(qwen3_render, guidance__until_step=2)
    rows, (outcome,) = play_groups(parts, 2, [["env", 0]], 0, seed=5, sft=False)  # RL step 2: 0 members
    assert outcome.guided == 0 and not outcome.spread
    assert not any(any(r.guided_mask) or any(r.advantages) for r, _ in rows)
    assert counts.snapshot_and_reset()[names.GROUPS_GUIDED] == 0
    parts, counts = _parts(qwen3_render, guidance__mode="none")
    _, (outcome,) = play_groups(parts, 1, [["env", 0]], 0, seed=5, sft=False)
    assert outcome.guided == 0
    parts, counts = _parts(qwen3_render)
    parts.envs[0].driver.run = lambda *a, **kw: [[SimpleNamespace(dropped=False, success=s, reward=float(s),
                                                                  rows=[], transitions=[])
                                                  for s in (True, False, False, False)]]
    _, (outcome,) = play_groups(parts, 1, [["env", 0]], 0, seed=5, sft=False)
    assert outcome.guided == 0  # one success: the group has its signal already


def test_the_schedule_anneals_linearly_from_k_to_none_and_a_schedule_that_never_ends_is_a_warning():
    t = make_cfg(guidance__mode="episode", guidance__members=3, guidance__until_step=6,
                 training__steps=8).guidance
    ks = [members_at(t, s) for s in range(10)]
    assert ks == [3, 3, 2, 2, 1, 1, 0, 0, 0, 0]  # ceil(3 (6 - s) / 6): 3 at step 0, 0 from step 6 on
    assert members_at(t.model_copy(update={"mode": "none"}), 1) == 0
    assert members_at(t.model_copy(update={"until_step": None}), 10**6) == 3
    cfg = make_cfg(guidance__mode="episode", training__steps=8, guidance__until_step=6)
    assert schedule_warning(cfg) is None and len(guidance_lines(cfg)) == 1
    for until, says in ((None, "never anneals"), (9, "never reaches none")):
        cfg = make_cfg(guidance__mode="episode", training__steps=8, guidance__until_step=until)
        assert says in schedule_warning(cfg) and guidance_lines(cfg)[-1] == schedule_warning(cfg)
    assert guidance_lines(make_cfg()) == []


def test_bad_guidance_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"\[guidance\] members=5 > \[rollout\] group_size=4"):
        check_rules(make_cfg(guidance__mode="episode", guidance__members=5, rollout__group_size=4))
    check_rules(make_cfg(guidance__members=5, rollout__group_size=4))  # no guidance: k is not read
    mixture = QuaeroConfig.model_validate({
        "envs": [{"name": "a", "entry": "tests:toy"}, {"name": "b", "entry": "tests:toy", "group_size": 2,
                                                       "guidance": "episode"}],
        "rollout": {"group_size": 4}, "guidance": {"members": 3}})
    assert mixture.views()["a"].guidance.mode == "none"
    with pytest.raises(ConfigError, match="name='b'.*members=3 > \\[rollout\\] group_size=2"):
        check_rules(mixture)
    remote = QuaeroConfig.model_validate({"env": {"url": "ws://localhost:1", "launcher": "remote"},
                                          "guidance": {"mode": "episode"}})
    with pytest.raises(ConfigError, match="mode='episode' with a remote env and no oracle"):
        check_rules(remote)


def test_an_oracle_that_raises_drops_its_members_counted_and_the_group_trains_as_played(qwen3_render):
    parts, counts = _parts(qwen3_render)

    def broken(info):
        def act(messages):
            raise KeyError("items")
        return act

    parts = replace(parts, envs=[replace(parts.envs[0], oracle=broken)])
    rows, (outcome,) = play_groups(parts, 1, [["env", 0]], 0, seed=5, sft=False)
    assert outcome.guided == 0 and outcome.kept and len(_members(rows)) == GROUP
    assert not any(any(r.guided_mask) or any(r.advantages) for r, _ in rows)
    snap = counts.snapshot_and_reset()
    assert snap[names.GUIDED_MEMBERS_DROPPED] == K and snap[names.GROUPS_GUIDED] == 0


class AnswersOnceHelped:
    """The policy: submit_answer("0") on a task's first prompt (a failure on every task), the right total of
    task 2 (15) from any later prompt: it succeeds only after a guide's prefix."""

    def __init__(self, render):
        reset = ToyChatEnv().reset(index=2)
        self.first = len(render.prompt_ids(reset.messages, TOOLS))

        def submit(answer):
            call = {"type": "function", "function": {"name": "submit_answer",
                                                     "arguments": {"answer": answer}}}
            return {"role": "assistant", "content": "", "reasoning_content": f"The total is {answer}.",
                    "tool_calls": [call]}

        self.ids = {a: render.encode_assistant(reset.messages, TOOLS, submit(a)) for a in ("0", "15")}

    def generate(self, prompts, *, n=1, greedy=False, seed=None):
        return [[Completion(list(ids), [-1.0] * len(ids), "stop")]
                for ids in (self.ids["0" if len(p) == self.first else "15"] for p in prompts)]


def _prefix_parts(render, **over):
    parts, counts = _parts(render, guidance__mode="prefix", guidance__prefix_turns=2, **over)
    sampler = AnswersOnceHelped(render)
    e = parts.envs[0]
    driver = EpisodeDriver(render, sampler, e.driver.settings, counts)
    return replace(parts, sampler=sampler, envs=[replace(e, driver=driver)]), counts


def test_a_prefix_member_is_the_oracles_first_turns_then_the_policys_rendered_exactly_with_a_token_mask(
        qwen3_render):
    from quaero.recipe.guidance import play_guides

    parts, _ = _prefix_parts(qwen3_render)
    e = parts.envs[0]
    (ep, _), = play_guides(e, [{"seed": 0, "split": "train", "index": 2}], 2, seed=5, turns=2)
    # task 2 (pear, plum, apple): the oracle looks up pear and plum, the policy then submits the total
    assert ep.success and ep.turns == 3 and [t.guided for t in ep.transitions] == [True, True, False]
    (row,) = ep.rows
    assert row.meta["layout"] == "packed"
    # the row is the template's render of the whole conversation, prefix and continuation
    whole = list(qwen3_render.renderer.render_ids(qwen3_render._text(ep.messages), tools=TOOLS,
                                                  add_generation_prompt=False))
    assert row.input_ids == whole[:len(row)] and whole[len(row):] in ([], [198])  # the template's last "\n"
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                "assistant", "tool"]
    # the guided mask covers exactly the oracle's action tokens: turns 0 and 1, not the policy's turn 2
    want = [False] * len(row)
    for s in row.spans:
        if s.kind == "action" and s.turn < 2:
            want[s.start:s.end] = [True] * (s.end - s.start)
    assert row.guided == want and any(want)
    policy = [s for s in row.spans if s.kind == "action" and s.turn == 2]
    assert len(policy) == 1 and row.input_ids[policy[0].start:policy[0].end] == AnswersOnceHelped(
        qwen3_render).ids["15"]
    # the guide's tokens log-prob 0 (never sampled), the policy's its sampler's
    assert {row.sampler_logprobs[i] for i in range(len(row)) if want[i]} == {0.0}
    assert set(row.sampler_logprobs[policy[0].start:policy[0].end]) == {-1.0}


def test_a_prefix_guided_group_trains_the_guides_tokens_shaped_and_the_continuation_on_policy(qwen3_render):
    parts, counts = _prefix_parts(qwen3_render)
    rows, (outcome,) = play_groups(parts, 1, [["env", 2]], 0, seed=5, sft=False)
    members = _members(rows)
    for g, want in [(0, -0.5), (1, -0.5), (2, 0.5), (3, 0.5)]:
        (row,) = members[g]
        assert [a for a, m in zip(row.advantages, row.action_mask) if m] == [want] * row.num_action_tokens
        turns = {s.turn for s in row.spans if s.kind == "action"}
        guided_turns = {s.turn for s in row.spans
                        if s.kind == "action" and all(row.guided_mask[s.start:s.end])}
        assert guided_turns == ({0, 1} if g >= 2 else set()) and turns == ({0, 1, 2} if g >= 2 else {0})
    assert outcome.rewards == [0.0] * GROUP and outcome.guided == K and outcome.spread
    assert outcome.guided_costs == sum(r.num_action_tokens for g in (2, 3) for r in members[g])
    snap = counts.snapshot_and_reset()
    assert snap[names.GUIDED_MEMBERS] == K and snap[names.GUIDED_MEMBERS_SUCCEEDED] == K


def test_the_prefix_anneals_with_the_schedule():
    from quaero.recipe.guidance import prefix_turns_at

    t = make_cfg(guidance__mode="prefix", guidance__prefix_turns=4,
                 guidance__until_step=4, training__steps=8).guidance
    assert [prefix_turns_at(t, s) for s in range(6)] == [4, 3, 2, 1, 0, 0]
    assert [members_at(t, s) for s in range(6)] == [1, 1, 1, 1, 0, 0]
    assert prefix_turns_at(t.model_copy(update={"mode": "episode"}), 1) is None
    line = guidance_lines(make_cfg(guidance__mode="prefix", guidance__prefix_turns=4,
                                   training__steps=8, guidance__until_step=4))[0]
    assert "(prefix: their first 4 turn(s)) played by the env's oracle, the rest by the policy" in line


def test_a_prefix_that_covers_every_turn_the_env_allows_is_a_warning_at_check():
    """[guidance] prefix_turns >= max_turns: the guide would play whole episodes under the name `prefix`."""
    from quaero.preflight.guidance_lines import prefix_warnings

    def cfg(turns, most):
        return make_cfg(guidance__mode="prefix", guidance__prefix_turns=turns,
                        env__max_turns=most, training__steps=8, guidance__until_step=4)

    (line,) = prefix_warnings(cfg(4, 4))
    assert "[guidance] prefix_turns=4 >= [env] max_turns=4" in line and "set prefix_turns < 4" in line
    assert guidance_lines(cfg(5, 4))[-1] == prefix_warnings(cfg(5, 4))[0]
    assert prefix_warnings(cfg(3, 4)) == [] and len(guidance_lines(cfg(3, 4))) == 1
    assert prefix_warnings(make_cfg(guidance__mode="episode", guidance__prefix_turns=4,
                                    env__max_turns=2)) == []


def test_a_guide_past_its_bound_or_raising_mid_episode_drops_its_member_counted_never_the_run(qwen3_render):
    import time

    def slow(info):
        def act(messages):
            time.sleep(3.0)
        return act

    def raises_on_turn_two(info):
        inner = oracle(info)

        def act(messages):
            if any(m["role"] == "tool" for m in messages):
                raise RuntimeError("the guide lost its place")
            return inner(messages)
        return act

    def exits(info):  # an oracle that ends the process (or raises Ctrl-C's exception) while guiding
        def act(messages):
            raise SystemExit(0) if len(messages) % 2 else KeyboardInterrupt
        return act

    for guide, counter in ((slow, names.GUIDES_TIMED_OUT), (raises_on_turn_two, names.GUIDES_FAILED),
                           (exits, names.GUIDES_FAILED)):
        parts, counts = _parts(qwen3_render, guidance__timeout_s=0.2)
        parts = replace(parts, envs=[replace(parts.envs[0], oracle=guide)])
        started = time.monotonic()
        rows, (outcome,) = play_groups(parts, 1, [["env", 2]], 0, seed=5, sft=False)
        assert time.monotonic() - started < 2.5  # the bound, not the guide, ended the wait
        assert outcome.guided == 0 and outcome.kept and len(_members(rows)) == GROUP
        assert not any(any(r.guided_mask) for r, _ in rows)
        snap = counts.snapshot_and_reset()
        assert snap[counter] == K and snap[names.GUIDED_MEMBERS_DROPPED] == K
        assert snap[names.GROUPS_GUIDED] == 0


@pytest.mark.hostile
def test_a_warm_start_oracle_that_never_returns_stops_the_run_at_the_step_timeout_named(qwen3_render):
    """The scripted policy (the oracle, user code) was called unbounded: one that never answered held the run
    forever. As the warm start's demonstrator, [env] step_timeout_s bounds each call and the run stops naming
    it (a guide's own bound, `guide_timeout_s`, drops its members instead: the tests above)."""
    import threading
    import time


    parts, _ = _parts(qwen3_render)
    release = threading.Event()

    def stuck(info):
        def act(messages):
            release.wait(30)
            return {"role": "assistant", "content": "late"}
        return act

    e = parts.envs[0]
    settings = replace(e.driver.settings, policy_timeout_s=0.3)
    driver = EpisodeDriver(e.driver.render, e.driver.sampler, settings, e.driver.counts)
    parts = replace(parts, envs=[replace(e, oracle=stuck, driver=driver)])
    t0 = time.monotonic()
    try:
        with pytest.raises(CallTimeout) as err:
            play_groups(parts, 1, [["env", 0]], 0, seed=5, sft=True)
    finally:
        release.set()
    assert time.monotonic() - t0 < 10
    said = "act(messages) (the env's oracle) did not return within 0.3s ([env] step_timeout_s)"
    assert said in str(err.value)


# ── recorded episodes as the guide ([guidance] traces) ──────────────────────────────────────


def _never(info):
    raise AssertionError("a recorded guide never calls the oracle")


def _recorded_parts(render, indices, **training):
    """`_parts` whose guide is the oracle's warm-start episodes on tasks `indices`, recorded (their rows
    indexed by prompt, quaero/rollout/traces.py), with the oracle itself out of reach."""
    from quaero.rollout.traces import RecordedActions

    parts, counts = _parts(render, **training)
    recorded = {i: [row for row, _ in play_groups(parts, 1, [["env", i]], 0, seed=5, sft=True)[0]]
                for i in indices}
    counts.snapshot_and_reset()
    guide = RecordedActions([row for rows in recorded.values() for row in rows])
    return replace(parts, envs=[replace(parts.envs[0], oracle=_never, recorded=guide)]), counts, recorded


def test_a_recorded_guide_replays_the_recorded_ids_verbatim_where_the_live_prompt_is_a_recordings(
        qwen3_render):
    parts, counts, recorded = _recorded_parts(qwen3_render, [1, 2])
    rows, (outcome,) = play_groups(parts, 1, [["env", 2]], 0, seed=5, sft=False)
    members = _members(rows)
    for g, adv, guided in [(0, -0.5, False), (1, -0.5, False), (2, 0.5, True), (3, 0.5, True)]:
        (row,) = members[g]
        assert [a for a, m in zip(row.advantages, row.action_mask) if m] == [adv] * row.num_action_tokens
        assert row.guided_mask == (row.action_mask if guided else [False] * len(row))
    for g in (2, 3):  # the recorded task 2 episode, token for token: ids, spans, log-prob 0
        assert [(r.input_ids, r.spans) for r in members[g]] == [(r.input_ids, r.spans) for r in recorded[2]]
        assert all(lp == 0.0 for r in members[g] for lp in r.sampler_logprobs)
    assert outcome.guided == K and outcome.spread and outcome.rewards == [0.0] * GROUP
    snap = counts.snapshot_and_reset()
    assert snap[names.GUIDED_MEMBERS] == K and snap[names.GUIDED_MEMBERS_SUCCEEDED] == K
    assert snap[names.GUIDES_UNMATCHED] == 0 and snap[names.GUIDED_MEMBERS_DROPPED] == 0


def test_a_task_never_recorded_or_an_env_that_answers_otherwise_drops_the_member_counted(qwen3_render):
    parts, counts, _ = _recorded_parts(qwen3_render, [1, 2])
    rows, (outcome,) = play_groups(parts, 1, [["env", 3]], 0, seed=5, sft=False)  # task 3: not recorded
    assert outcome.guided == 0 and outcome.kept and len(_members(rows)) == GROUP
    assert not any(any(r.guided_mask) for r, _ in rows)
    snap = counts.snapshot_and_reset()
    assert snap[names.GUIDES_UNMATCHED] == K and snap[names.GUIDED_MEMBERS_DROPPED] == K
    assert snap[names.GROUPS_GUIDED] == 0 and snap[names.GUIDES_FAILED] == 0
    # the same recorded task on an env that answers otherwise after the first lookup (a follow-up question):
    # the first turn replays, the second prompt was never recorded, the member is dropped there
    from quaero.recipe.guidance import play_guides

    e = parts.envs[0]
    e = replace(e, pool=SimpleNamespace(sessions=[ToyChatEnv("followup") for _ in range(GROUP)]))
    (a, b), = play_guides(e, [{"seed": 0, "split": "train", "index": 2}], 2, seed=5)
    assert a.dropped and b.dropped and a.drop_kind == "guide_unmatched"
    assert a.drop_reason.startswith("step 1: no recorded action follows this prompt")
    assert len(a.transitions) == 1 and a.transitions[0].guided


def test_a_recorded_prefix_is_the_oracles_prefix_token_for_token_then_the_policy_continues(qwen3_render):
    from quaero.recipe.guidance import play_guides

    parts, _ = _prefix_parts(qwen3_render)
    e = parts.envs[0]
    task = [{"seed": 0, "split": "train", "index": 2}]
    (by_oracle, _), = play_guides(e, task, 2, seed=5, turns=2)
    recorded, _, _ = _recorded_parts(qwen3_render, [2])
    e = replace(e, oracle=_never, recorded=recorded.envs[0].recorded)
    (by_recording, _), = play_guides(e, task, 2, seed=5, turns=2)
    assert by_recording.success and [t.guided for t in by_recording.transitions] == [True, True, False]
    assert [(r.input_ids, r.spans, r.guided, r.sampler_logprobs) for r in by_recording.rows] == \
           [(r.input_ids, r.spans, r.guided, r.sampler_logprobs) for r in by_oracle.rows]


def test_recorded_guides_settings_are_checked_in_one_line(tmp_path):
    from quaero.preflight.plan import check_trace_path

    with pytest.raises(ValidationError, match="traces='r.jsonl' with mode='none'"):
        make_cfg(guidance__traces="r.jsonl")
    remote = QuaeroConfig.model_validate({"env": {"url": "ws://localhost:1", "launcher": "remote"},
                                          "guidance": {"mode": "episode", "traces": "r.jsonl"}})
    check_rules(remote)  # recordings need no oracle
    for path, says in ((tmp_path / "missing.jsonl", "no such file"), (tmp_path, "a folder")):
        with pytest.raises(ConfigError, match=f"traces='{path}': {says}"):
            check_trace_path(str(path), "config [guidance] traces")
    cfg = make_cfg(guidance__mode="episode", guidance__traces="r.jsonl",
                   guidance__until_step=2, training__steps=4)
    assert "replayed from the recorded episodes in r.jsonl" in guidance_lines(cfg)[0]
