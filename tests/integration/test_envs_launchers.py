"""quaero.openenv_client over real launchers: in-process, a launched uvicorn server, and a remote URL served
by `quaero env serve` on 127.0.0.1 (no mocks). Also the plug-in path for a user env that lives only in
tests/fixtures, by dotted name and by URL."""
import json
import threading

import pytest

from envs.toolbench import oracle_policy
from quaero.config import ConfigError, EnvConfig, load_config
from quaero.openenv_client import open_envs

TOOLBENCH = "envs.toolbench:ToolBenchEnv"


def _call(name, **arguments):
    return {"role": "assistant", "content": "", "reasoning_content": None,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def _transcript(env, seed, split, index, wrong_answer=False):
    """A fixed script: a tool error, a malformed call, then the oracle (optionally a wrong answer)."""
    start = env.reset(seed=seed, split=split, index=index)
    steps = [env.step(_call("get_product", product_id="P99")), env.step(_call("no_such_tool"))]
    policy, chat = oracle_policy(start.info), list(start.messages)
    while not steps[-1].done:
        action = policy(chat)
        if wrong_answer and action["tool_calls"][0]["function"]["name"] == "submit_answer":
            action = _call("submit_answer", answer="-1")
        steps.append(env.step(action))
        chat += [action, *steps[-1].messages]
    return {"reset": (start.messages, start.info), "steps": [(s.messages, s.reward, s.done, s.malformed,
                                                              s.info)
                                                             for s in steps]}


def test_toolbench_is_identical_over_every_launcher(toolbench_url):
    cases = [(3, "eval", 0, False), (4, "eval", 17, True), (5, "train", 123, False)]
    results = {}
    for launcher, source in [("inprocess", {"entry": TOOLBENCH}), ("local-server", {"entry": TOOLBENCH}),
                             ("remote", {"url": toolbench_url})]:
        with open_envs(EnvConfig(launcher=launcher, max_turns=12, **source), 1) as pool:
            env = pool.sessions[0]
            results[launcher] = {"tools": env.tools, "episodes": [_transcript(env, *c) for c in cases]}
            assert pool.counts.snapshot_and_reset()["env_tool_errors"] == 3
    assert results["inprocess"] == results["local-server"] == results["remote"]
    episodes = results["inprocess"]["episodes"]
    assert [e["steps"][-1][1] for e in episodes] == [1.0, 0.0, 1.0]  # oracle right, wrong answer 0
    first = episodes[0]["steps"]
    assert first[0][0] == [{"role": "tool", "content": "Error: unknown product_id 'P99'"}] and not first[0][3]
    assert first[1][3] and first[1][0][0]["role"] == "user"  # malformed -> one corrective user message


def test_sessions_run_concurrently_on_one_server(toolbench_url):
    with open_envs(EnvConfig(url=toolbench_url), 4) as pool:
        rewards = {}

        def run(i, env):
            start = env.reset(seed=i, split="eval", index=40 + i)
            policy, chat, step = oracle_policy(start.info), list(start.messages), None
            while step is None or not step.done:
                action = policy(chat)
                step = env.step(action)
                chat += [action, *step.messages]
            rewards[i] = step.reward

        threads = [threading.Thread(target=run, args=(i, env)) for i, env in enumerate(pool.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert rewards == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}


def _play_guess(env, seed):
    """Binary search with the env's hints; returns (reward, turns)."""
    start = env.reset(seed=seed)
    assert start.messages[1]["content"] in ("Guess my number between 1 and 20.",)
    assert '"guess"' in start.messages[0]["content"]  # the action schema is in the system prompt
    lo, hi, turns = 1, 20, 0
    while True:
        guess = (lo + hi) // 2
        step = env.step({"role": "assistant", "content": json.dumps({"guess": guess}), "tool_calls": None})
        turns += 1
        if step.done:
            return step.reward, turns
        hint = step.messages[0]["content"]
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)


@pytest.mark.parametrize("launcher,entry", [("inprocess", "fixtures.guess:GuessEnv"),
                                            ("inprocess", "fixtures.guess:make_guess_env"),
                                            ("local-server", "fixtures.guess:GuessEnv")])
def test_custom_env_plugs_in_by_dotted_name(launcher, entry):
    cfg = EnvConfig(entry=entry, launcher=launcher, max_turns=10)
    with open_envs(cfg, 2) as pool:
        assert pool.sessions[0].tools is None  # a plain env: no tool specs, the schema is in the prompt
        for seed in range(3):
            reward, turns = _play_guess(pool.sessions[seed % 2], seed)
            assert reward == 1.0 and turns <= 5


def test_custom_env_plugs_in_by_url_with_a_custom_formatter(guess_url):
    cfg = EnvConfig(url=guess_url, formatter="fixtures.guess:hint_formatter")
    assert cfg.launcher == "remote"
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        step = env.step({"role": "assistant", "content": '{"guess": 1}'})
        assert step.messages[0]["content"] in ("higher", "correct")  # the user's formatter, not JSON


def test_a_server_without_room_for_n_sessions_is_a_clear_error():
    from fixtures import served

    with served("fixtures.guess:GuessEnv", max_concurrent_envs=2) as (url, _):
        with pytest.raises(ConfigError, match="hold fewer than the 3 sessions") as e:
            open_envs(EnvConfig(url=url), 3)
        # the two fixes (one server per session, or a server with room for them), never group_size = 1
        assert "add servers to [env] urls" in str(e.value) and "--max-concurrent-envs 3" in str(e.value)
        assert "group_size = 1" not in str(e.value)
        with open_envs(EnvConfig(url=url), 2) as pool:  # the failed attempt released its sessions
            assert _play_guess(pool.sessions[1], 2)[0] == 1.0


@pytest.mark.parametrize("entry,needle", [
    ("envs.toolbench.ToolBenchEnv", "expected 'package.module:Name'"),
    ("envs.toolbench:Nope", "environments there: ToolBenchEnv"),
    ("no_such_package_xyz:Env", "cannot import module 'no_such_package_xyz'"),
    ("envs.toolbench:make_task", "not an openenv Environment"),
])
def test_bad_entries_name_the_key_value_and_fix(entry, needle):
    with pytest.raises(ConfigError, match="entry=") as e:
        open_envs(EnvConfig(entry=entry), 1)
    assert needle in str(e.value)


def test_unreachable_url_is_a_clear_error():
    from fixtures import free_port

    with pytest.raises(ConfigError, match="no OpenEnv server answers there"):
        open_envs(EnvConfig(url=f"ws://127.0.0.1:{free_port()}", reset_timeout_s=2), 1)


@pytest.mark.parametrize("launcher", ["inprocess", "local-server"])
def test_the_main_job_config_opens_toolbench_with_its_kwargs(launcher):
    """[env] kwargs = {difficulty = 1} reaches the env's constructor, in this process and in the server."""
    cfg = load_config("envs/toolbench.toml", [f"env.launcher='{launcher}'"])
    assert cfg.env.kwargs == {"difficulty": 1}
    with open_envs(cfg.env, 1) as pool:
        env = pool.sessions[0]
        assert [t["function"]["name"] for t in env.tools] == ["search_products", "find_customer",
                                                              "submit_answer"]
        start = env.reset(seed=0, split=cfg.env.eval_split, index=0)
        assert start.info["split"] == "eval" and start.info["difficulty"] == 1
        assert [m["role"] for m in start.messages] == ["system", "user"]


@pytest.mark.parametrize("kwargs,needle", [
    ({"difficulty": 1, "colour": "red"}, "unexpected keyword argument 'colour'"),
    ({"dificulty": 1}, "unexpected keyword argument 'dificulty'"),
])
def test_bad_env_kwargs_fail_before_any_session_naming_the_parameters(kwargs, needle):
    with pytest.raises(ConfigError, match=r"\[env\] kwargs=") as e:
        open_envs(EnvConfig(entry=TOOLBENCH, kwargs=kwargs), 1)
    assert needle in str(e.value) and "its parameters: difficulty, max_steps" in str(e.value)


@pytest.mark.slow
def test_launched_servers_stop_with_their_run_even_when_it_is_killed():
    """pool.close() stops the server by pid; a run killed with SIGKILL (no atexit) leaves no server behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from fixtures import REPO_DIR, TESTS_DIR

    with open_envs(EnvConfig(entry="fixtures.guess:GuessEnv", launcher="local-server"), 1) as pool:
        proc = pool.servers[0].proc
    assert proc.poll() is not None  # stopped at close

    script = ("from quaero.config import EnvConfig; from quaero.openenv_client import open_envs; import "
              "time\npool = open_envs(EnvConfig(entry='fixtures.guess:GuessEnv', launcher='local-server'), "
              "1)\nprint(pool.servers[0].proc.pid, flush=True); time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO_DIR)])}
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                        env=env)
    server_pid = int(run.stdout.readline())
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return  # the orphaned server noticed its parent was gone and exited
        time.sleep(0.1)
    os.kill(server_pid, signal.SIGKILL)
    raise AssertionError("the env server outlived the run that launched it")
