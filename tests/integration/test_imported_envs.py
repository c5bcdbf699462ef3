"""Environments that reach OpenEnv through its importers (issue #25 item 4), in CI without their packages:
- OpenEnv's own `openenv import` (its Verifiers importer, run here) on a Verifiers source tree
  (tests/fixtures/verifiers_source: a legacy-API env with a stand-in `verifiers`): the package it writes is a
  plain Environment whose app takes CallToolAction, one `submit` tool, the Task API and the task's chat prompt
  in the reset metadata. quaero speaks tool calls to it on every launcher, shows the prompt's system and user
  messages, renders its score dict without repeating the task, and trains it from a config alone.
- the shape of OpenEnv's `reasoning_gym_env` (tests/fixtures/reasoning_gym_shape.py): reproducible only when
  `[env] reset_kwargs` names a dataset (what examples/imported/openenv_reasoning_gym.toml does).
The real packages ran through the same configs: examples/imported/README.md."""
import json
import os
import sys
from pathlib import Path

import pytest
import structlog
from fixtures.runs import ROOT, events_of

from quaero import cli
from quaero.config import ConfigError, EnvConfig, load_config
from quaero.openenv_client import open_envs
from quaero.openenv_client.loading import describe_env

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers_source"
NAME = "vf_sum"
ENTRY = f"{NAME}.server.{NAME}_environment:VfSumEnvironment"
SYSTEM_PROMPT = "Add the two numbers. Reply with the sum inside <answer></answer> tags."
RG = "fixtures.reasoning_gym_shape:ReasoningGymLikeEnv"


@pytest.fixture
def imported(tmp_path, monkeypatch):
    """`openenv import tests/fixtures/verifiers_source --name vf_sum -o OUT`, through OpenEnv's own importer,
    importable here; the stand-in `verifiers` and the package leave sys.modules afterwards."""
    from openenv.cli.importers.verifiers import VerifiersImporter

    importer = VerifiersImporter()
    (detected,) = importer.detect(SOURCE)
    assert detected.qualified_name == "sum_env:load_environment"
    out = tmp_path / "imported"
    importer.generate(source=SOURCE, destination=out / NAME, env_name=NAME, detected=detected)
    monkeypatch.syspath_prepend(str(out))
    before = set(sys.modules)
    yield out
    for name in set(sys.modules) - before:
        if name.split(".")[0] in (NAME, "verifiers", "sum_env"):
            del sys.modules[name]


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": name, "arguments": arguments}}]}


@pytest.mark.parametrize("launcher", ["inprocess", "local-server"])
def test_the_importers_verifiers_wrapper_speaks_tool_calls_and_shows_its_tasks_prompt(imported, launcher,
                                                                                      monkeypatch):
    app = (imported / NAME / "server" / "app.py").read_text()
    assert "CallToolAction" in app and "max_concurrent_envs=1" in app  # the shape quaero meets
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(imported), os.environ.get("PYTHONPATH", "")]))
    cfg = EnvConfig(entry=ENTRY, launcher=launcher)
    line = describe_env(cfg)[0]
    assert "MCP tool calls" in line and "Action is CallToolAction (from the env's own server app" in line
    with open_envs(cfg, 1) as pool:
        assert pool.tasks.splits == {"train": 20, "eval": 4}
        env = pool.sessions[0]
        assert [t["function"]["name"] for t in env.tools] == ["submit"]
        reset = env.reset(seed=0, split="eval", index=1)
        system, user = reset.messages
        # the task prompt's system message, not quaero's generic one
        assert system["content"] == SYSTEM_PROMPT
        assert user["content"].startswith("What is ") and user["content"].endswith("?")
        answer = reset.info["task_spec"]["answer"]
        step = env.step(_call("submit", completion=f"<answer>{answer}</answer>"))
        assert step.done and step.reward == 1.0 and not step.malformed
        (tool,) = step.messages
        shown = json.loads(tool["content"])
        assert shown["reward"] == 1.0 and shown["metrics"] == {"sum_reward": 1.0}
        assert "state" not in shown and "What is" not in tool["content"]  # the score dict, not the task again
        env.reset(seed=0, split="train", index=0)
        assert env.step({"role": "assistant", "content": "42"}).malformed  # no tool call: told the tools


def test_an_env_that_raises_inside_quaeros_server_is_one_line_naming_its_log(imported, monkeypatch):
    """The real legacy Verifiers env installs signal handlers when built, which Python refuses on the server's
    worker thread (examples/imported/verifiers_shim.py is the user's fix): the error says so, not just HTTP
    500."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(imported), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("VERIFIERS_STANDIN_SIGNALS", "1")
    with pytest.raises(ConfigError) as e:
        open_envs(EnvConfig(entry=ENTRY, launcher="local-server"), 1)
    message = str(e.value)
    assert "\n" not in message and "its Task API answered HTTP 500" in message
    assert "ends in: ValueError: signal only works in main thread" in message and "server-" in message


def _config(tmp_path, name, env: str, training: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
name = "{name}"
output_dir = "{tmp_path / 'runs'}"
[model]
name = "tiny-qwen3"
[env]
{env}
[sampler]
max_tokens = 8
[training]
eval_tasks = 2
eval_every = 0
{training}

[rollout]
tasks_per_step = 2
group_size = 2
[logging]
console = "none"
progress = false
""")
    return path


@pytest.mark.slow
def test_the_imported_verifiers_env_trains_from_a_config_alone_and_passes_review(imported, tmp_path, capsys):
    path = _config(tmp_path, "vf", f'entry = "{ENTRY}"\nlauncher = "inprocess"\nmax_turns = 2',
                   'oracle = "fixtures.verifiers_source.oracle:oracle_policy"\nwarmup_sft_steps = 1\nsteps = '
                   '1')
    assert cli.main(["check", str(path)]) == 0
    assert "splits 'train' (20 tasks), 'eval' (4 tasks)" in capsys.readouterr().out
    assert cli.main(["train", str(path)]) == 0
    run = tmp_path / "runs" / "vf"
    warm, rl = events_of(run, "train_step")
    assert warm["phase"] == "sft" and warm["reward_mean"] == 1.0 and warm["action_tokens"] > 0
    assert warm["echo_tokens"] > 0  # the tool result (the score) is the env's output
    assert rl["phase"] == "rl"
    assert cli.main(["review", str(run), "--require-proof"]) == 0


def test_a_reasoning_gym_shaped_env_is_reproducible_only_when_reset_kwargs_name_a_dataset():
    from quaero.telemetry.runlog import configure

    # a `quaero train` before this one left structlog filtering below warning
    configure("info", console="none")
    for reset_kwargs, verdict in (({}, "env_resets_not_reproducible"),
                                  ({"dataset_name": "leg_counting", "size": 1}, "env_resets_reproducible")):
        with structlog.testing.capture_logs() as logs, \
                open_envs(EnvConfig(entry=RG, reset_kwargs=reset_kwargs), 1) as pool:
            for _ in range(2):
                reset = pool.sessions[0].reset(seed=5, split="eval", index=0)
            said = [e["event"] for e in logs if e["event"].startswith("env_resets_")]
            assert said == [verdict], reset_kwargs
            (ignored,) = [e for e in logs if e["event"] == "env_reset_params_ignored"]
            assert ignored["ignored"] == ["split", "index"]
            assert "plain text" in reset.messages[0]["content"]  # the one `answer` field takes the raw reply
            answer = reset.messages[1]["content"]  # the question: "How many legs do C cats and B birds have?"
            cats, birds = int(answer.split()[4]), int(answer.split()[7])
            step = pool.sessions[0].step({"role": "assistant", "content": str(4 * cats + 2 * birds)})
            assert step.reward == 1.0 and step.done and "correct_answer" in step.messages[0]["content"]


@pytest.mark.slow
def test_a_reasoning_gym_shaped_env_trains_from_the_examples_config_shape(tmp_path):
    path = _config(tmp_path, "rg", f'entry = "{RG}"\nlauncher = "local-server"\nmax_turns = 1\n'
                   'reset_kwargs = { dataset_name = "leg_counting", size = 1 }',
                   'oracle = "fixtures.reasoning_gym_shape:oracle_policy"\nwarmup_sft_steps = 1\nsteps = 1')
    # eval before the first step and after the last resets its tasks twice, at different points of their
    # sessions: what shows the seed gives the task (a group's sessions agreeing on a first reset does not)
    assert cli.main(["train", str(path), "--set", "training.eval_every=2"]) == 0
    run = tmp_path / "runs" / "rg"
    warm, rl = events_of(run, "train_step")
    assert warm["reward_mean"] == 1.0 and rl["phase"] == "rl"
    assert events_of(run, "env_resets_reproducible") and not events_of(run, "env_resets_not_reproducible")
    assert cli.main(["review", str(run), "--require-proof"]) == 0


def test_the_examples_configs_load_and_name_files_that_exist():
    folder = ROOT / "examples" / "imported"
    for toml in ("verifiers_reasoning_gym.toml", "openenv_reasoning_gym.toml"):
        cfg = load_config(folder / toml)
        assert cfg.training.oracle and (folder / f"{cfg.training.oracle.split(':')[0]}.py").is_file()
    assert load_config(folder / "verifiers_reasoning_gym.toml").env.entry.startswith("verifiers_shim:")
    assert (folder / "verifiers_shim.py").is_file()
