"""Episode driver on the real Qwen3 renderer + offline Qwen tokenizer: exact rows, capture after step,
packing, Qwen3's awkward cases (thinking in earlier turns, a new user turn, truncation, malformed and parallel
calls), and what the driver judges: the turn limit, success, drops."""
from __future__ import annotations

import pytest
from fixtures.badreply import INJECTION
from fixtures.rollout import (
    IM_END,
    SameReplySampler,
    assert_exact,
    drive,
    make_cfg,
    spans_of,
    target_logprobs,
    text,
)
from fixtures.toyenv import ChatStep, HostileToyEnv, ToyChatEnv, oracle

from quaero.config import settings_of
from quaero.models.qwen3 import QWEN3_ADDED
from quaero.openenv_client import EpisodeDropped
from quaero.rollout.driver import DriverSettings, EpisodeDriver, ExactnessError
from quaero.rollout.env_text import WORD_JOINER
from quaero.rollout.rows import build_rows
from quaero.telemetry.counts import RolloutCounts


def test_thinking_tool_cycle_packs_into_one_row(qwen3_render):
    eps, audit = drive(qwen3_render, tasks=3)
    for ep in eps:
        assert ep.success and ep.reward == 1.0
        assert len(ep.rows) == 1 and ep.rows[0].meta["layout"] == "packed"
        assert_exact(qwen3_render, ep)
        row = ep.rows[0]
        # earlier turns' sampled thinking stays in the row (the full render keeps it inside a tool cycle)
        assert "<think>\nI need the price of" in text(qwen3_render, row, spans_of(ep, "action", 0)[0][1])
        (last_row, last), = spans_of(ep, "env", ep.turns - 1)
        assert text(qwen3_render, last_row, last) == "correct"  # the terminal response is an ECHO target
        assert ep.info["trained_tokens"] < ep.info["trained_tokens_per_transition_layout"]
    assert audit["prefix_mismatches"] == 0 and audit["bridge_fallbacks"] == 0 and audit["packing_breaks"] == 0
    assert audit["env_responses"] == audit["env_responses_captured"] == audit["turns"] == 9
    assert audit["terminal_responses"] == 3 and audit["rows_packed"] == 3 and audit["rows_transition"] == 0


def test_empty_thinking_is_dropped_by_qwen3_so_every_turn_starts_a_row(qwen3_render):
    """Qwen3 renders an empty <think></think> only on the last assistant turn: the next full render is not an
    extension, so packing must fall back to one row per transition (counted)."""
    eps, audit = drive(qwen3_render, tasks=2, policy=lambda info: oracle(info, reasoning=False))
    for ep in eps:
        assert len(ep.rows) == ep.turns and all(r.meta["layout"] == "transition" for r in ep.rows)
        assert_exact(qwen3_render, ep)
    assert audit["packing_breaks"] == sum(ep.turns - 1 for ep in eps) and audit["prefix_mismatches"] == 0
    assert audit["packing_break_reason_reply_rerendered"] == audit["packing_breaks"]  # its `<think></think>`


def test_new_user_turn_breaks_packing_and_is_counted(qwen3_render):
    eps, audit = drive(qwen3_render, tasks=2, envs=[ToyChatEnv("followup")])
    for ep in eps:
        assert ep.success
        assert_exact(qwen3_render, ep)
        # the follow-up question is model-visible env content of turn 0, weighted
        assert any("two of each" in text(qwen3_render, r, s) for r, s in spans_of(ep, "env", 0))
        # Qwen3 drops earlier reasoning after a new user query: turn 1's prompt is not an extension
        assert len(ep.rows) >= 2 and ep.rows[0].meta["turns"] == [0]
    assert audit["packing_breaks"] >= 2 and audit["prefix_mismatches"] == 0
    # turn 0's reply, re-rendered without its reasoning once the user's query follows
    assert audit["packing_break_reason_reply_rerendered"] == audit["packing_breaks"]


def test_consecutive_tool_messages_are_two_env_spans_in_one_block(qwen3_render):
    eps, audit = drive(qwen3_render, tasks=3, policy=lambda info: oracle(info, parallel=True))
    ep = eps[2]  # three items: three tool results after one assistant turn
    spans = spans_of(ep, "env", 0)
    assert [text(qwen3_render, r, s) for r,
            s in spans] == [m["content"] for m in ep.messages if m["role"] == "tool"][:3]
    row = spans[0][0]
    response = row.input_ids[spans_of(ep, "action", 0)[0][1].end:spans_of(ep, "prompt", 1)[0][1].start]
    assert qwen3_render.tokenizer.decode(response).count("<|im_start|>user") == 1
    assert audit["prefix_mismatches"] == 0 and all(len(e.rows) == 1 for e in eps)


@pytest.mark.hostile
def test_malformed_tool_call_gets_a_corrective_message_never_weighted(qwen3_render):
    def policy(info):
        good = oracle(info)

        def act(messages):
            if not any(m["role"] == "assistant" for m in messages):  # broken JSON inside <tool_call>
                return {"role": "assistant", "content": '<tool_call>\n{"name": "get_price", "arguments": '
                                                        '{item}}\n'
                        "</tool_call>", "tool_calls": None}
            return good(messages)
        return act

    eps, audit = drive(qwen3_render, tasks=2, policy=policy)
    for ep in eps:
        assert ep.success and ep.messages[2]["tool_calls"] is None
        (row, corr), = spans_of(ep, "corrective")
        assert "no valid tool call" in text(qwen3_render, row, corr) and corr.turn == 0
        assert set(row.echo_weights[corr.start:corr.end]) == {0.0}
        assert_exact(qwen3_render, ep)
    assert audit["malformed_actions"] == 2


def test_truncated_completion_is_kept_verbatim_and_bridged(qwen3_render, tiny_hf_sampler):
    eps, audit = drive(qwen3_render, tasks=2, group=2, policy=None, sampler=tiny_hf_sampler, env__max_turns=2)
    for ep in eps:
        assert ep.turns == 2 and not ep.success
        assert_exact(qwen3_render, ep)
        for t in ep.transitions:
            assert t.finish_reason == "length" and len(t.action_ids) == 8 and IM_END not in t.action_ids
            # the bridge closes the truncated turn with a synthetic <|im_end|>: scaffold, never an action
            # token
            assert t.response_ids[0] == IM_END and t.response_kinds[0] == "scaffold"
            assert "corrective" in t.response_kinds
    assert audit["truncated_completions"] == audit["turns"] == 8 and audit["malformed_actions"] == 8
    assert audit["prefix_mismatches"] == 0


def test_bridge_that_alters_the_prefix_is_counted_and_strict_raises(qwen3_render, monkeypatch):
    real = qwen3_render.renderer.bridge_to_next_turn

    def corrupt(prompt, completion, messages, **kw):  # a fault: a renderer that re-tokenized the action
        out = real(prompt, completion, messages, **kw)
        out.token_ids[len(prompt)] += 1
        return out

    monkeypatch.setattr(qwen3_render.renderer, "bridge_to_next_turn", corrupt)
    eps, audit = drive(qwen3_render, tasks=1)
    assert audit["prefix_mismatches"] == audit["bridge_fallbacks"] == audit["turns"] == 2
    assert audit["bridge_fallback_reason_prefix_mismatch"] == 2
    for t in eps[0].transitions:  # action-only fallback: the sampled ids still train, no env target
        assert t.response_ids == [] and t.action_ids
    with pytest.raises(ExactnessError, match="prefix_mismatch"):
        drive(qwen3_render, tasks=1, rollout__strict=True)


@pytest.mark.hostile
def test_dropped_episode_is_marked_and_has_no_rows(qwen3_render):
    envs = [ToyChatEnv(drop_at=2, dropped_exc=EpisodeDropped), ToyChatEnv()]
    eps, stats = drive(qwen3_render, envs=envs, tasks=2, group=2)
    dropped = [ep for ep in eps if ep.dropped]
    assert dropped and all(ep.rows == [] and "server died" in ep.drop_reason for ep in dropped)
    assert (
        stats["episodes_dropped"] == stats["drop_reason_connection"] == len(dropped)
        and stats["episodes"] == 4
    )
    kept = [ep for ep in eps if not ep.dropped]  # the means are over kept episodes only
    assert stats["reward_mean"] == sum(ep.reward for ep in kept) / len(kept) == 1.0
    assert stats["turns_mean"] == sum(ep.turns for ep in kept) / len(kept)


def _lookups_only(info):
    """A policy that looks a price up every turn and never submits."""
    call = {"type": "function", "function": {"name": "get_price", "arguments": {"item": info["items"][0]}}}
    return lambda messages: {"role": "assistant", "content": "", "reasoning_content": "Check the price.",
                             "tool_calls": [call]}


@pytest.mark.hostile
def test_an_episode_cut_by_the_turn_limit_is_truncated_and_never_a_success(qwen3_render):
    """Partial credit every turn (reward > 0) but never ended by the env: the driver's turn limit cuts it."""
    shaped = [ToyChatEnv("shaped"), ToyChatEnv("shaped")]
    eps, stats = drive(qwen3_render, envs=shaped, tasks=2, policy=_lookups_only, env__max_turns=3)
    for ep in eps:
        assert ep.turns == 3 and ep.reward == 1.5 and ep.truncated and not ep.success
        assert_exact(qwen3_render, ep)  # the cut turn's env response is still captured
    assert stats["episodes_truncated"] == 2 and stats["success_rate"] == 0.0 and stats["reward_mean"] == 1.5
    # the same env solved within the limit: the env's success flag decides, nothing is truncated
    eps, stats = drive(qwen3_render, envs=shaped, tasks=2, env__max_turns=6)
    assert all(ep.success and not ep.truncated for ep in eps)
    assert stats["episodes_truncated"] == 0 and stats["success_rate"] == 1.0


def test_packing_reproduces_per_transition_target_logprobs(qwen3_render, tiny_lm):
    eps, _ = drive(qwen3_render, tasks=3)
    eps += drive(qwen3_render, tasks=2, envs=[ToyChatEnv("followup")])[0]
    for ep in eps:
        packed = build_rows(ep.transitions, packing=True)
        flat = build_rows(ep.transitions, packing=False)
        assert len(packed) <= len(flat)
        a, b = target_logprobs(tiny_lm, packed), target_logprobs(tiny_lm, flat)
        assert a.keys() == b.keys() and len(a) > 50
        assert max(abs(a[k] - b[k]) for k in a) < 1e-6


@pytest.mark.hostile
def test_the_trainer_measures_the_sampler_vs_trainer_logprob_gap_of_sampled_rows(qwen3_render,
                                                                                 tiny_hf_sampler):
    """Rows sampled by the HF sampler, trained by the `local` trainer on the same weights: the trainer's
    sampler_logprob_gap_* is measured, non-zero (two different forwards) and tiny (the same model)."""
    from quaero.preflight.plan import trainer_spec
    from trainers.local import LocalTrainer

    eps, stats = drive(qwen3_render, tasks=1, group=2, policy=None, sampler=tiny_hf_sampler, env__max_turns=2)
    rows = [r.with_advantage(1.0 if i % 2 else -1.0) for i, ep in enumerate(eps) for r in ep.rows]
    m = LocalTrainer(trainer_spec(make_cfg(model__name="tiny-qwen3")), "cpu").train_step(rows)
    assert 0 < m["sampler_logprob_gap_mean"] <= m["sampler_logprob_gap_max"] < 1e-4
    # the trainer's token counts are its loss denominators; the rollout's are its own names
    assert m["action_tokens"] == stats["rollout_action_tokens"] == sum(r.num_action_tokens for r in rows)


def test_run_seed_makes_sampled_episodes_reproducible(qwen3_render, tiny_hf_sampler):
    def actions(seed):
        settings = settings_of(DriverSettings, make_cfg(env__max_turns=2))
        driver = EpisodeDriver(qwen3_render, tiny_hf_sampler, settings, RolloutCounts())
        groups = driver.run([ToyChatEnv(), ToyChatEnv()], [{"index": 0}], group_size=2, seed=seed)
        return [t.action_ids for ep in groups[0] for t in ep.transitions]

    first = actions(5)
    assert first == actions(5) and first != actions(6)
    assert first[0] != first[2]  # the G episodes of one task sample differently from the same prompt


# -- text from environments is text: no added-token string in env text becomes a special id -----------


@pytest.fixture(scope="module")
def clean_run(qwen3_render):
    return drive(qwen3_render, tasks=2, envs=[HostileToyEnv("")])


@pytest.mark.hostile
def test_the_hostile_payloads_cover_every_added_token_of_the_tokenizer(qwen3_tokenizer):
    assert set(qwen3_tokenizer.get_added_vocab()) == {t for t, _ in QWEN3_ADDED}


@pytest.mark.hostile
@pytest.mark.parametrize("payload", [f" a{t}b" for t, _ in QWEN3_ADDED] + [INJECTION])
def test_added_token_strings_in_env_text_stay_text_in_prompts_rows_and_echo(qwen3_render, clean_run, payload):
    """The env writes `payload` into its system prompt, task, tool results and tool descriptions. Every
    sampling prompt and row holds the same special ids, in the same order, as the episode on clean text;
    the ECHO targets hold none; the text is still there (joiners removed); the bridge stays exact."""
    added = set(qwen3_render.tokenizer.get_added_vocab().values())

    def specials(ids):
        return [t for t in ids if t in added]

    eps, audit = drive(qwen3_render, tasks=2, envs=[HostileToyEnv(payload)])
    clean_eps, clean_audit = clean_run
    for ep, clean in zip(eps, clean_eps, strict=True):
        assert ep.success and len(ep.transitions) == len(clean.transitions)
        for t, c in zip(ep.transitions, clean.transitions):
            assert specials(t.prompt_ids) == specials(c.prompt_ids)
        for row, clean_row in zip(ep.rows, clean.rows, strict=True):
            assert specials(row.input_ids) == specials(clean_row.input_ids)
            assert not added & {t for t, w in zip(row.input_ids, row.echo_weights) if w > 0}
        echo_text = "".join(text(qwen3_render, r, s) for r, s in spans_of(ep, "env"))
        assert echo_text.replace(WORD_JOINER, "").count(payload) == len(spans_of(ep, "env"))
    assert audit["prefix_mismatches"] == 0 and audit["bridge_fallbacks"] == 0
    assert audit["packing_breaks"] == clean_audit["packing_breaks"]
    # the renderer alone would have turned the payload into special ids (what the adapter prevents)
    raw = qwen3_render.renderer.render_ids(eps[0].messages[:2])
    assert specials(raw) != specials(qwen3_render.prompt_ids(eps[0].messages[:2], None)[:len(raw)])


# -- what the driver judges: success, and rewards that do not add up --------------------------------------
class JudgedEnv(ToyChatEnv):
    """ToyChatEnv whose terminal step gives `reward` and `info` (the env's own success/truncated flags)."""

    def __init__(self, reward: float, info: dict):
        super().__init__()
        self.final_reward, self.final_info = reward, info

    def step(self, assistant: dict) -> ChatStep:
        s = super().step(assistant)
        return ChatStep(s.messages, self.final_reward, True, False, dict(self.final_info)) if s.done else s


@pytest.mark.hostile
@pytest.mark.parametrize("reward, info, success, truncated", [
    (1.0, {"success": False}, False, False),  # the env's flag decides, whatever the reward
    (0.0, {"success": True}, True, False),
    (1.0, {}, True, False),  # no flag: the final reward > 0 (the documented threshold)
    (0.0, {}, False, False),
    (1.0, {"success": True, "truncated": True}, False, True),  # an env-truncated episode is never a success
])
def test_success_is_the_env_flag_where_given_else_a_final_reward_above_zero(qwen3_render, reward, info,
                                                                            success,
                                                                           truncated):
    (ep,), stats = drive(qwen3_render, envs=[JudgedEnv(reward, info)], tasks=1)
    assert ep.success is success and ep.truncated is truncated and not ep.dropped
    assert stats["episodes_succeeded"] == int(success) and stats["episodes_truncated"] == int(truncated)


class HugeRewardEnv(ToyChatEnv):
    """Every price lookup earns 1e308: finite each, infinite summed."""

    def step(self, assistant: dict) -> ChatStep:
        s = super().step(assistant)
        return s if s.done else ChatStep(s.messages, 1e308, s.done, s.malformed, s.info)


@pytest.mark.hostile
def test_an_episode_whose_rewards_overflow_when_summed_is_dropped_and_counted(qwen3_render):
    eps, stats = drive(qwen3_render, envs=[HugeRewardEnv()], tasks=3)  # task i looks up 1 + i prices
    assert [ep.dropped for ep in eps] == [False, True, True] and eps[0].reward == 1e308 and eps[0].success
    assert all(ep.drop_reason == "step 1: reward sum inf is not finite" and ep.rows == [] for ep in eps[1:])
    assert stats["drop_reason_nonfinite_reward"] == stats["episodes_dropped"] == 2


@pytest.mark.hostile
@pytest.mark.parametrize("body", ["5", "[1, 2]", '"get_price"', "null"])
def test_a_reply_the_parser_raises_on_is_a_malformed_action_not_the_end_of_the_run(qwen3_render, body):
    """renderers 0.1.7's Qwen3 parser raises AttributeError on a tool call whose JSON is not an object
    (`<tool_call>\\n5\\n</tool_call>`, 12 tokens): the driver answers it with the corrective message."""
    ids = qwen3_render.tokenizer.encode(f"<tool_call>\n{body}\n</tool_call><|im_end|>",
                                        add_special_tokens=False)
    with pytest.raises(Exception) as raised:  # the renderer's own behaviour, which the driver must survive
        qwen3_render.renderer.parse_response(ids)
    assert not isinstance(raised.value, SyntaxError)
    eps, audit = drive(qwen3_render, tasks=2, group=2, policy=None, sampler=SameReplySampler(ids),
                       env__max_turns=2)
    assert audit["unparsable_actions"] == audit["malformed_actions"] == audit["turns"] == 8
    for ep in eps:
        assert not ep.dropped and not ep.success and ep.turns == 2
        assert ep.messages[2]["tool_calls"] is None and body in ep.messages[2]["content"]
        assert_exact(qwen3_render, ep)
        corrective = spans_of(ep, "corrective")
        assert corrective and all(set(r.echo_weights[s.start:s.end]) == {0.0} for r, s in corrective)


class _LogprobSampler(SameReplySampler):
    """A fault: a sampler whose log-probs are `lp` (positive, or not finite)."""

    def __init__(self, ids: list[int], lp: float):
        super().__init__(ids)
        self.lp = lp

    def generate(self, prompts, n=1, greedy=False, seed=None):
        from quaero.sampling import Completion

        return [[Completion(list(self.ids), [self.lp] * len(self.ids), "stop")] for _ in prompts]


@pytest.mark.hostile
@pytest.mark.parametrize("lp", [50.0, 0.01, float("nan"), float("-inf")])
def test_an_episode_with_impossible_sampler_logprobs_is_dropped_and_counted(qwen3_render, lp):
    """log p > 0 (or not finite) cannot come from a distribution: the episode is dropped, counted under
    drop_reason_impossible_logprobs, and none of its tokens reach a row."""
    ids = qwen3_render.tokenizer.encode("hello<|im_end|>", add_special_tokens=False)
    eps, stats = drive(qwen3_render, tasks=2, group=1, policy=None, sampler=_LogprobSampler(ids, lp))
    assert all(ep.dropped and ep.rows == [] for ep in eps)
    assert eps[0].drop_reason == f"step 0: sampler log-prob {lp} is impossible (log p <= 0)"
    assert stats["drop_reason_impossible_logprobs"] == stats["episodes_dropped"] == 2
