"""Each session gets an env of its own: a non-concurrent env with module-level state (fixtures.board) driven
at tasks_per_step x group_size = 2 x 2 through a local-server pool, in-process (warned) and `[env] urls` over
two servers started with `quaero env serve`; capacity errors name fixes that apply to the launcher in use."""
import os
import signal

import pytest
import structlog
from fixtures import served
from fixtures.board import oracle_policy
from fixtures.rollout import make_cfg

from quaero.config import ConfigError, EnvConfig, settings_of
from quaero.openenv_client import open_envs
from quaero.rollout.driver import DriverSettings, EpisodeDriver

BOARD = "fixtures.board:BoardEnv"
TASKS = [{"seed": 2, "split": "train", "index": 0}, {"seed": 3, "split": "train", "index": 1}]


def _drive(render, cfg, pool):
    driver = EpisodeDriver(render, None, settings_of(DriverSettings, cfg), pool.counts)
    groups = driver.run(pool.sessions, TASKS, group_size=2, policy=oracle_policy)
    return [ep for g in groups for ep in g], pool.counts.snapshot_and_reset()


def _opened(logs):
    (event,) = [e for e in logs if e["event"] == "env_pool_opened"]
    return event


def test_local_server_gives_a_non_concurrent_env_one_server_per_session(qwen3_render):
    cfg = make_cfg(env__entry=BOARD, env__launcher="local-server", env__max_turns=3)
    with structlog.testing.capture_logs() as logs, open_envs(cfg.env, 4) as pool:
        pids = {s.proc.pid for s in pool.servers}
        episodes, counts = _drive(qwen3_render, cfg, pool)
    assert len(pids) == 4 and len(_opened(logs)["spread"]) == 4  # one server process per session
    assert [ep.reward for ep in episodes] == [1.0] * 4 and all(ep.success for ep in episodes)
    assert [ep.info["prize"] for ep in episodes] == [2, 2, 3, 3]
    assert "prize is under cell 3" in episodes[2].messages[1]["content"]  # the rendered task
    assert counts["env_steps"] == 4 and counts["success_rate"] == 1.0
    assert not any(e["event"] == "env_inprocess_not_concurrent" for e in logs)


def test_a_dead_pool_server_is_restarted_and_its_episode_replayed():
    cfg = EnvConfig(entry=BOARD, launcher="local-server", retry_backoff_s=0.05)
    with open_envs(cfg, 2) as pool:
        for seed, env in enumerate(pool.sessions):
            env.reset(seed=seed)
            assert env.step({"role": "assistant", "content": '{"cell": 5}'}).reward == -0.1
        victim = pool.servers[1].proc.pid
        os.kill(victim, signal.SIGKILL)
        pool.servers[1].proc.wait(timeout=10)
        step = pool.sessions[1].step({"role": "assistant", "content": '{"cell": 1}'})
        other = pool.sessions[0].step({"role": "assistant", "content": '{"cell": 0}'})
        counts = pool.counts.snapshot_and_reset()
        assert pool.servers[1].proc.pid != victim
    assert (step.reward, step.done, other.reward) == (1.0, True, 1.0)
    assert counts["env_restarts"] == 1 and counts["env_replayed_steps"] == 1


def test_inprocess_warns_that_a_non_concurrent_env_may_share_state_and_proceeds(qwen3_render):
    cfg = make_cfg(env__entry=BOARD, env__launcher="inprocess", env__max_turns=3)
    with structlog.testing.capture_logs() as logs, open_envs(cfg.env, 4) as pool:
        episodes, counts = _drive(qwen3_render, cfg, pool)
    (warning,) = [e for e in logs if e["event"] == "env_inprocess_not_concurrent"]
    assert warning["log_level"] == "warning" and 'launcher = "local-server"' in warning["fix"]
    # what the warning is about: the four resets ran first, so only the last one's board survives
    assert sorted(ep.reward for ep in episodes) == [-1.0, -1.0, -1.0, 1.0]
    assert counts["env_steps"] == 4 and not any(ep.dropped for ep in episodes)


def test_one_inprocess_session_is_not_warned_about():
    with structlog.testing.capture_logs() as logs, open_envs(EnvConfig(entry=BOARD), 1):
        pass
    assert not any(e["event"] == "env_inprocess_not_concurrent" for e in logs)


def test_urls_spread_sessions_over_servers_started_with_quaero_env_serve(qwen3_render):
    with served(BOARD) as (url_a, _), served(BOARD) as (url_b, _):  # non-concurrent: one session each
        cfg = make_cfg(env__entry=None, env__urls=[url_a, url_b], env__max_turns=3)
        assert cfg.env.launcher == "remote"
        with structlog.testing.capture_logs() as logs, open_envs(cfg.env, 2) as pool:
            episodes, counts = _drive(qwen3_render, cfg, pool)  # 2 x 2 episodes over the 2 sessions
        assert _opened(logs)["spread"] == {f"{url_a}/ws": 1, f"{url_b}/ws": 1}
        assert [ep.reward for ep in episodes] == [1.0] * 4 and counts["env_steps"] == 4
        with pytest.raises(ConfigError) as e:
            open_envs(cfg.env, 3)
    message = str(e.value)
    assert "hold fewer than the 3 sessions" in message and "add servers to [env] urls" in message
    assert (
        "quaero env serve module:Class --max-concurrent-envs 3" in message and "group_size = 1" not in message
    )


def test_a_lost_host_replays_its_episode_on_another():
    guess_env = "fixtures.guess:GuessEnv"
    with served(guess_env, max_concurrent_envs=4) as (url_a, _), served(guess_env, max_concurrent_envs=4) as (
            url_b, proc_b), open_envs(EnvConfig(urls=[url_a, url_b], retry_backoff_s=0.05), 2) as pool:
        env = pool.sessions[1]  # on host b
        env.reset(seed=7)
        first = env.step({"role": "assistant", "content": '{"guess": 10}'})
        proc_b.kill()
        proc_b.wait(timeout=10)
        lo, hi = (11, 20) if "higher" in first.messages[0]["content"] else (1, 9)
        while True:
            guess = (lo + hi) // 2
            step = env.step({"role": "assistant", "content": str(guess)})
            if step.done:
                break
            lo, hi = (guess + 1, hi) if "higher" in step.messages[0]["content"] else (lo, guess - 1)
        counts = pool.counts.snapshot_and_reset()
    assert step.reward == 1.0 and counts["env_replayed_steps"] >= 1 and counts["episodes_dropped"] == 0
