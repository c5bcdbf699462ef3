"""The issue's proof on the real toolbench env (in-process OpenEnv MCP env) with the real Qwen3 renderer and
the offline Qwen tokenizer: 60 episodes, scripted oracle and tiny-model driven, exact rows, every env response
captured (terminal included), prefix mismatches 0, packed rows reproducing per-transition log-probs to
1e-6."""
from __future__ import annotations

import pytest
import torch
from fixtures.rollout import IM_END, assert_exact, make_cfg, target_logprobs

from quaero.config import settings_of
from quaero.rollout.driver import DriverSettings, EpisodeDriver
from quaero.rollout.rows import build_rows

pytest.importorskip("envs.toolbench")


def reasoned(policy, thought=lambda name: f"Next I call {name}."):
    """The oracle with its reasoning replaced. Qwen3 keeps non-empty reasoning inside a tool cycle, so such
    episodes pack; without reasoning (thought -> None) the empty <think> block is dropped and they cannot."""
    def make(info):
        act = policy(info)

        def step(messages):
            msg = act(messages)
            name = msg["tool_calls"][0]["function"]["name"]
            return {**msg, "reasoning_content": thought(name)}
        return step
    return make


@pytest.fixture(scope="module")
def toolbench():
    from quaero.openenv_client import open_envs

    cfg = make_cfg(env__entry="envs.toolbench:ToolBenchEnv", env__launcher="inprocess", env__max_turns=8,
                   rollout__strict=True)  # any exactness mismatch raises
    with open_envs(cfg.env, 4) as pool:
        yield cfg, pool


def run(toolbench, qwen3_render, tasks, group, max_turns=8, **kw):
    cfg, pool = toolbench
    cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"max_turns": max_turns})})
    settings = settings_of(DriverSettings, cfg)
    driver = EpisodeDriver(qwen3_render, kw.pop("sampler", None), settings, pool.counts)
    groups = driver.run(pool.sessions, tasks, group_size=group, **kw)
    return [ep for g in groups for ep in g], pool.counts.snapshot_and_reset()


@pytest.mark.slow
def test_sixty_toolbench_episodes_are_exact(toolbench, qwen3_render, tiny_hf_sampler, tiny_lm):
    from envs.toolbench import oracle_policy

    tasks = [{"seed": i, "split": "train", "index": i} for i in range(20)]
    packed, a1 = run(toolbench, qwen3_render, tasks, 2, policy=reasoned(oracle_policy))
    verbatim, a2 = run(toolbench, qwen3_render, tasks[:12], 1, policy=reasoned(oracle_policy,
                                                                               lambda name: None))
    sampled, a3 = run(toolbench, qwen3_render, tasks[:4], 2, max_turns=2, sampler=tiny_hf_sampler)
    episodes = packed + verbatim + sampled
    assert len(episodes) == 60 and not any(ep.dropped for ep in episodes)
    for ep in episodes:
        assert_exact(qwen3_render, ep)
    for ep in packed + verbatim:
        assert ep.success and ep.reward == 1.0
        assert ep.messages[-1]["role"] == "tool"  # the terminal response is in the transcript...
        (row, s), = [(r, s) for r in ep.rows for s in r.spans if s.kind == "env" and s.turn == ep.turns - 1]
        # ...and trained (".\n" is one Qwen token: a boundary token merged with content counts as content)
        assert (
            qwen3_render.tokenizer.decode(row.input_ids[s.start : s.end]).strip()
            == ep.messages[-1]["content"]
        )
    for counts, eps in ((a1, packed), (a2, verbatim), (a3, sampled)):
        assert counts["prefix_mismatches"] == 0 and counts["bridge_fallbacks"] == 0
        assert (
            counts["env_responses"]
            == counts["env_responses_captured"]
            == counts["turns"]
            == sum(e.turns for e in eps)
        )
    assert a1["terminal_responses"] == 40 and a2["terminal_responses"] == 12
    assert a1["rows_packed"] == 40 and a1["rows_transition"] == 0  # one row per episode
    # empty <think> is not kept by Qwen3
    assert a2["rows_packed"] == 0 and a2["rows_transition"] == a2["turns"]
    assert a3["truncated_completions"] == a3["turns"] and all(IM_END not in t.action_ids
                                                           for ep in sampled for t in ep.transitions)
    # packing changes no target's log-prob (same tokens, same left context)
    worst = 0.0
    for ep in packed[::10] + sampled[:1]:
        a = target_logprobs(tiny_lm, build_rows(ep.transitions, packing=True))
        b = target_logprobs(tiny_lm, build_rows(ep.transitions, packing=False))
        assert a.keys() == b.keys()
        worst = max(worst, max(abs(a[k] - b[k]) for k in a))
    assert worst < 1e-6
    responses = a1["env_responses"] + a2["env_responses"] + a3["env_responses"]
    print(f"\n60 toolbench episodes: prefix mismatches 0, {responses} env responses all captured, "
          f"packed-vs-per-transition max |dlogp| {worst:.2e}, trained tokens/episode "
          f"packed {a1['rollout_row_tokens_per_episode']:.0f} vs per-transition "
          f"{a1['rollout_row_tokens_per_transition_layout'] / a1['episodes']:.0f}")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_driven_toolbench_episodes_are_exact(toolbench, qwen3_render, tiny_lm, tiny_model_dir,
                                                  vllm_engine):
    from quaero.sampling.vllm import VLLMSampler

    cfg, _ = toolbench
    sampler = VLLMSampler(str(tiny_model_dir), cfg.sampler, stop_token_ids=qwen3_render.stop_token_ids,
                          llm=vllm_engine)
    tasks = [{"seed": i, "split": "train", "index": i} for i in range(4)]
    episodes, counts = run(toolbench, qwen3_render, tasks, 2, max_turns=2, sampler=sampler)
    assert len(episodes) == 8 and counts["prefix_mismatches"] == 0
    assert counts["env_responses"] == counts["env_responses_captured"] == counts["turns"] == 16
    for ep in episodes:
        assert_exact(qwen3_render, ep)
    rows = [r for ep in episodes for r in ep.rows]
    trainer = []
    for row in rows:  # the trainer's no-grad log-probs of each row (shifted: entry j scores token j + 1)
        with torch.no_grad():
            lp = tiny_lm(torch.tensor([row.input_ids])).logits[0, :-1].log_softmax(-1)
        trainer.append(lp.gather(-1, torch.tensor(row.input_ids[1:])[:, None]).squeeze(-1).tolist())
    # sampler-vs-reference log-prob gap on every sampled token (entry j - 1 of the shifted list scores token
    # j)
    gaps = [abs(lps[j - 1] - row.sampler_logprobs[j]) for row, lps in zip(rows, trainer)
            for j, m in enumerate(row.action_mask) if m]
    assert gaps and max(gaps) < 1e-4
