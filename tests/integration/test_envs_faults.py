"""Faults never end a run: a server killed mid-episode, a step that hangs past its timeout, an env that
raises (error frames), a dropped connection, malformed actions, a tool that raises, a reply that is not a
usable observation (bad reward, non-object observation, no `done`). Each is counted, only EpisodeDropped
(with the kind its drop is counted under) ever leaves ChatEnv, and the next episode runs. The faults are
injected by real means (SIGKILL, a sleeping step, a raising tool) except the dropped socket, closed under
the session."""
import json
import os
import signal
import time

import pytest
import structlog
from fixtures.badreply import HANG_SEED, INJECT_SEED, INJECTION, RAW_REPLIES, raw_server

from envs.toolbench import oracle_policy
from quaero.config import EnvConfig
from quaero.openenv_client import EpisodeDropped, open_envs
from quaero.openenv_client.transport import contract_broken

pytestmark = pytest.mark.hostile
FAST = {"max_retries": 1, "retry_backoff_s": 0.01}


def _call(name, **arguments):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                "function": {"name": name,
                                                                             "arguments": arguments}}]}


def _finish_with_oracle(env, start, chat, step=None):
    policy = oracle_policy(start.info)
    while step is None or not step.done:
        action = policy(chat)
        step = env.step(action)
        chat += [action, *step.messages]
    return step


@pytest.mark.slow
def test_server_killed_mid_episode_is_restarted_and_the_episode_replayed():
    cfg = EnvConfig(entry="envs.toolbench:ToolBenchEnv", launcher="local-server",
                    reset_kwargs={"difficulty": 4},
                    **FAST)
    with open_envs(cfg, 1) as pool:
        env, server = pool.sessions[0], pool.servers[0]
        start = env.reset(seed=0, split="eval", index=2)
        policy, chat = oracle_policy(start.info), list(start.messages)
        first = policy(chat)
        chat += [first, *env.step(first).messages]
        old_pid = server.proc.pid
        os.kill(old_pid, signal.SIGKILL)
        server.proc.wait(timeout=5)
        final = _finish_with_oracle(env, start, chat)
        assert final.reward == 1.0  # the episode survived: new server, same episode replayed
        assert server.alive() and server.proc.pid != old_pid
        counts = pool.counts.snapshot_and_reset()
        assert (
            counts["env_restarts"] == 1 and counts["env_retries"] >= 1 and counts["env_replayed_steps"] == 1
        )

        # with on_session_loss="drop" the same fault drops the episode instead; the next one runs
        env.cfg.on_session_loss = "drop"
        env.reset(seed=0, split="eval", index=3)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=5)
        with structlog.testing.capture_logs() as logs, pytest.raises(EpisodeDropped,
                                                                     match="session lost") as e:
            env.step(_call("calculate", expression="1+1"))
        assert any(ev["event"] == "env_episode_dropped" and "session lost" in ev["reason"]
                   and ev["kind"] == e.value.kind == "connection" for ev in logs)
        start = env.reset(seed=0, split="eval", index=4)
        assert _finish_with_oracle(env, start, list(start.messages)).reward == 1.0
        assert pool.counts.snapshot_and_reset()["env_restarts"] == 1


@pytest.mark.parametrize("launcher", ["inprocess", "remote"])
def test_a_step_that_hangs_past_its_timeout_is_retried_then_dropped(launcher, guess_url):
    source = {"url": guess_url} if launcher == "remote" else {"entry": "fixtures.guess:GuessEnv"}
    with open_envs(EnvConfig(launcher=launcher, step_timeout_s=0.4, **source, **FAST), 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=1)
        assert not env.step({"role": "assistant", "content": '{"guess": 30}'}).done
        began = time.monotonic()
        with structlog.testing.capture_logs() as logs, pytest.raises(EpisodeDropped, match="timeout") as e:
            env.step({"role": "assistant", "content": '{"guess": -1}'})  # sleeps 3 s in the env
        assert time.monotonic() - began < 2.5  # two timeouts of 0.4 s, not the 3 s hang (twice)
        assert e.value.kind == "timeout" and any(ev["event"] == "env_episode_dropped" for ev in logs)
        env.reset(seed=2)  # the run goes on with a fresh session
        assert env.step({"role": "assistant", "content": '{"guess": 10}'}).malformed is False
        counts = pool.counts.snapshot_and_reset()
        assert counts["env_timeouts"] == 2 and counts["env_retries"] == 1
        assert counts["env_replayed_steps"] == 1  # the retry replayed the accepted guess first


@pytest.mark.parametrize("launcher", ["inprocess", "remote"])
def test_an_env_that_raises_the_same_on_one_action_answers_it_as_invalid(launcher, guess_url):
    # the same error for the same action on a fresh, replayed session is the action's (issue #33: atari's
    # `Invalid action_id` was retried as a fault and dropped the episode); a changing error stays a fault
    # (tests/integration/test_envs_findings.py)
    source = {"url": guess_url} if launcher == "remote" else {"entry": "fixtures.guess:GuessEnv"}
    with open_envs(EnvConfig(launcher=launcher, **source, max_retries=2, retry_backoff_s=0.01), 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=1)
        refused = env.step({"role": "assistant", "content": '{"guess": -2}'})
        assert refused.malformed and not refused.done
        assert refused.messages[0]["content"] == ("The environment rejected your last action: "
                                                  "the env crashed on purpose")
        assert env.step({"role": "assistant", "content": '{"guess": 3}'}).reward in (0.0, 1.0)
        counts = pool.counts.snapshot_and_reset()
        assert counts["env_retries"] == 1 and counts["env_rejected_actions"] == 1 and counts["env_steps"] == 1


def test_a_dropped_connection_is_retried_and_the_episode_continues(toolbench_url):
    with open_envs(EnvConfig(url=toolbench_url, **FAST), 1) as pool:
        env = pool.sessions[0]
        start = env.reset(seed=0, split="eval", index=8)
        chat = list(start.messages)
        action = oracle_policy(start.info)(chat)
        chat += [action, *env.step(action).messages]
        env._transport._ws.close()  # fault injection: the socket goes away under the session
        assert _finish_with_oracle(env, start, chat).reward == 1.0
        counts = pool.counts.snapshot_and_reset()
        assert (
            counts["env_retries"] == 1 and counts["env_replayed_steps"] == 1 and counts["env_restarts"] == 0
        )


def test_a_remote_server_that_is_gone_drops_episodes_without_raising_anything_else():
    from fixtures import served

    with served("envs.toolbench:ToolBenchEnv") as (url, _proc):
        pool = open_envs(EnvConfig(url=url, reset_timeout_s=1.0, **FAST), 1)
    # the server is stopped now; nothing can restart a remote server
    env = pool.sessions[0]
    for _ in range(2):
        with pytest.raises(EpisodeDropped) as e:
            env.reset(seed=0)
        assert e.value.kind == "connection"
    assert pool.counts.snapshot_and_reset()["env_retries"] == 2
    pool.close()


def test_malformed_actions_are_counted_corrected_and_never_sent():
    with open_envs(EnvConfig(entry="envs.toolbench:ToolBenchEnv", max_turns=10), 1) as pool:
        env = pool.sessions[0]
        start = env.reset(seed=0, split="eval", index=5)
        chat = list(start.messages)
        bad = [{"role": "assistant", "content": "the answer is 4", "tool_calls": None}, _call("fly_to_moon"),
               _call("add_days", date="2024-01-01", days="three")]
        for action in bad:
            step = env.step(action)
            assert step.malformed and step.reward == 0.0 and not step.done
            assert len(step.messages) == 1 and step.messages[0]["role"] == "user"
            chat += [action, *step.messages]
        assert pool.counts.snapshot_and_reset()["env_steps"] == 0  # nothing reached the env
        # the oracle counts assistant turns, so start it on a clean chat: the episode still completes
        assert _finish_with_oracle(env, start, list(start.messages)).reward == 1.0


def test_a_tool_that_raises_is_a_counted_tool_error_not_a_fault():
    with open_envs(EnvConfig(entry="fixtures.faulty_mcp:FaultyMCPEnv"), 1) as pool:
        env = pool.sessions[0]
        start = env.reset(seed=0)
        assert start.messages[1]["content"] == "Say hi with echo, then submit."
        boom = env.step(_call("explode"))
        assert boom.messages == [{"role": "tool", "content": "Error: kaboom"}] and not boom.malformed
        assert env.step(_call("echo", text="hi")).messages[0]["content"] == "hi"
        assert env.step(_call("submit_answer", answer="hi")).reward == 1.0
        counts = pool.counts.snapshot_and_reset()
        assert counts["env_tool_errors"] == 1 and counts["env_retries"] == 0 and counts["env_steps"] == 3


def test_the_driver_turn_limit_ends_an_episode_that_never_submits(qwen3_render):
    """The driver owns the turn limit: a real session runs the episode's steps and nothing more; the cut
    episode is truncated and no success."""
    from fixtures.rollout import make_cfg

    from quaero.config import settings_of
    from quaero.rollout.driver import DriverSettings, EpisodeDriver

    def never_submits(info):
        return lambda messages: _call("calculate", expression="1+1")

    cfg = make_cfg(env__entry="envs.toolbench:ToolBenchEnv", env__launcher="inprocess", env__max_turns=3)
    with open_envs(cfg.env, 1) as pool:
        driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
        (ep,), = driver.run(pool.sessions, [{"seed": 0}], group_size=1, policy=never_submits)
        counts = pool.counts.snapshot_and_reset()
    assert ep.turns == 3 and ep.truncated and not ep.success and not ep.dropped
    assert counts["env_steps"] == 3 and counts["episodes_truncated"] == 1 and counts["success_rate"] == 0.0


def test_a_run_of_episodes_with_every_fault_keeps_going():
    """A driver-shaped loop: faults in the middle of a run drop single episodes, the rest score."""
    cfg = EnvConfig(entry="fixtures.guess:GuessEnv", step_timeout_s=0.3, **FAST)
    plan = ['{"guess": -2}', '{"guess": -1}', "not json", None, '{"guess": -2}', None]
    results = []
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        for seed, fault in enumerate(plan):
            try:
                env.reset(seed=seed)
                if fault is not None:
                    env.step({"role": "assistant", "content": fault})
                lo, hi = 1, 20
                while True:
                    guess = (lo + hi) // 2
                    step = env.step({"role": "assistant", "content": str(guess)})
                    if step.done:
                        results.append(step.reward)
                        break
                    lo, hi = (guess + 1, hi) if "higher" in step.messages[0]["content"] else (lo, guess - 1)
            except EpisodeDropped as e:
                results.append(e.kind)
        counts = pool.counts.snapshot_and_reset()
    assert results == [1.0, "timeout", 1.0, 1.0, 1.0, 1.0]  # a guess the env raises on is an invalid action
    assert counts["env_timeouts"] == 2 and counts["env_resets"] == 6


def test_a_failed_recovery_drops_the_episode_instead_of_raising():
    """Fault injection by a fake connector: every connect fails and the server cannot be restarted."""
    from quaero.openenv_client import ChatEnv
    from quaero.openenv_client.mapping import default_formatter
    from quaero.openenv_client.transport import EnvFault
    from quaero.telemetry.counts import RolloutCounts

    class DeadConnector:
        def connect(self):
            raise EnvFault("connection", "connection refused")

        def recover(self):
            raise RuntimeError("env server exited with 1 before becoming healthy")

    counts = RolloutCounts()
    env = ChatEnv(EnvConfig(entry="envs.toolbench:ToolBenchEnv", **FAST), DeadConnector(), counts, tools=None,
                  action_schema={}, formatter=default_formatter)
    with pytest.raises(EpisodeDropped, match="recovery failed: env server exited") as e:
        env.reset(seed=0)
    assert e.value.kind == "recovery_failed" and counts.snapshot_and_reset()["env_retries"] == 0


# -- replies that are not usable observations: dropped at once with the field and value, never read as 0 ----
def _reply(shape: str) -> dict:
    return {"role": "assistant", "content": json.dumps({"reply": shape})}


def _drops_with_reasons(pool, reasons: dict) -> None:
    """Each shape drops its episode with `reasons[shape]`; the episode after it finishes on the same
    session."""
    env = pool.sessions[0]
    for shape, reason in reasons.items():
        env.reset(seed=0)
        with structlog.testing.capture_logs() as logs, pytest.raises(EpisodeDropped) as e:
            env.step(_reply(shape))
        assert e.value.reason == f"step: invalid env reply: {reason}"
        assert [ev["reason"] for ev in logs if ev["event"] == "env_episode_dropped"] == [e.value.reason]
        env.reset(seed=1)
        final = env.step(_reply("ok"))
        assert final.done and final.reward == 1.0
    counts = pool.counts.snapshot_and_reset()
    assert counts["env_invalid_replies"] == len(reasons) and e.value.kind == "invalid_reply"
    # no retry; only "ok" steps count
    assert counts["env_retries"] == 0 and counts["env_steps"] == len(reasons)


DEEP_FRAME = '{"type": "observation", "data": ' + RAW_REPLIES["deep"] + "}"
BAD_REWARDS = {"string": "reward='high' is not a number", "nan": "reward=nan is not finite",
               "inf": "reward=inf is not finite", "-inf": "reward=-inf is not finite",
               "bool": "reward=True is not a number"}  # True would train as 1.0; strings were already refused


@pytest.mark.parametrize("launcher", ["inprocess", "local-server"])
def test_a_non_numeric_or_non_finite_reward_drops_the_episode_and_the_run_goes_on(launcher):
    cfg = EnvConfig(entry="fixtures.badreply:BadReplyEnv", launcher=launcher, **FAST)
    with open_envs(cfg, 1) as pool:
        _drops_with_reasons(pool, BAD_REWARDS)


def test_an_in_process_env_that_returns_no_observation_or_a_text_success_flag_drops_the_episode():
    with open_envs(EnvConfig(entry="fixtures.badreply:BadReplyEnv", **FAST), 1) as pool:
        _drops_with_reasons(pool, {
            "none": "observation=None: " + contract_broken("BadReplyEnv.step", "NoneType"),
            "dict": "observation={'reward': 1.0}: " + contract_broken("BadReplyEnv.step", "dict"),
            "success_string": "observation.metadata.success='false' is not a boolean"})


def test_a_remote_server_s_malformed_replies_drop_episodes_with_their_reason():
    with raw_server() as url, open_envs(EnvConfig(url=url, **FAST), 1) as pool:
        _drops_with_reasons(pool, {
            "nan": "reward=nan is not finite", "inf": "reward=-inf is not finite",
            "string": "reward='1.0' is not a number", "bool": "reward=True is not a number",
            "list": "observation=['not', 'an', 'object'] is not a JSON object",
            "missing_done": "done is missing", "string_done": "done='false' is not a boolean",
            "metadata": "observation.metadata=[1, 2] is not a JSON object",
            # bool("false") and bool(nan) are True: read as flags they would make a failed episode a success
            "success_string": "observation.metadata.success='false' is not a boolean",
            "success_nan": "observation.metadata.success=nan is not a boolean",
            # deeper than Python's JSON parser goes: the same answer on every retry, so no retry
            "deep": f"frame={DEEP_FRAME!r:.77}... is nested too deeply to parse"})


def test_a_remote_server_that_closes_the_socket_errs_oddly_or_never_answers_a_reset_drops_only_that_episode():
    with raw_server() as url, open_envs(EnvConfig(url=url, reset_timeout_s=0.5, **FAST), 1) as pool:
        env = pool.sessions[0]
        began = time.monotonic()
        with pytest.raises(EpisodeDropped, match="reset took longer than 0.5s") as e:
            env.reset(seed=HANG_SEED)
        assert e.value.kind == "timeout" and time.monotonic() - began < 3
        error_data = "?: {\"type\": \"error\", \"data\": \"not an object\"}"
        for shape, kind, detail in [("close", "connection", "ConnectionClosed"),
                                    ("error_data", "server_error", error_data)]:
            env.reset(seed=0)
            # retried once (a fresh socket, the episode replayed), then dropped
            with pytest.raises(EpisodeDropped) as e:
                env.step(_reply(shape))
            assert e.value.kind == kind and detail in e.value.reason
            env.reset(seed=1)
            assert env.step(_reply("ok")).reward == 1.0
        counts = pool.counts.snapshot_and_reset()
    assert counts["env_timeouts"] == 2 and counts["env_retries"] == 3 and counts["env_invalid_replies"] == 0


def test_injected_turns_in_a_remote_reset_and_step_stay_text(qwen3_render):
    """Over real WebSocket JSON: the reset's system prompt and task and a step's observation spell turn
    boundaries and a tool call; the sampling prompt and the bridged response hold the special ids a clean
    episode holds, and the ECHO span none."""
    tok = qwen3_render.tokenizer
    added = set(tok.get_added_vocab().values())

    def specials(ids):
        return [t for t in ids if t in added]

    runs = []
    with raw_server() as url, open_envs(EnvConfig(url=url, **FAST), 1) as pool:
        env = pool.sessions[0]
        for seed, reply in ((INJECT_SEED, "inject"), (0, "ok")):
            start = env.reset(seed=seed)
            prompt = qwen3_render.prompt_ids(start.messages, None)
            action = tok.encode(json.dumps({"reply": reply}),
                                add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            step = env.step(qwen3_render.parse(action))
            runs.append((start, prompt, step, qwen3_render.bridge(prompt, action, step.messages, None)))
    (start, prompt, step, bridged), (_, clean_prompt, _, clean_bridged) = runs
    assert INJECTION in start.messages[0]["content"] and INJECTION in start.messages[1]["content"]
    assert INJECTION in step.messages[0]["content"]
    assert specials(prompt) == specials(clean_prompt)  # 151644/151645/151657 only where the template put them
    assert specials(bridged.response_ids) == specials(clean_bridged.response_ids)
    echo = [t for t, k in zip(bridged.response_ids, bridged.response_kinds) if k == "env"]
    assert echo and not added & set(echo)
