"""What issue #33's eleven real environments showed, each on a test-only env of the same shape
(tests/fixtures/findings.py) over real launchers: a reset that answers done=True, an action the env raises on,
an observation far over the bound, a chat-shaped observation, the env's own instructions, an MCP env whose
reset has no text."""
import pytest
import structlog
from fixtures.findings import SANDBOX_MISSING

from quaero.config import EnvConfig
from quaero.openenv_client import EpisodeDropped, EpisodeEndedAtReset, open_envs

F = "fixtures.findings"


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _tiny_run(tmp_path, name: str, entry: str, *, steps: int, env_extra: str = "", save_rows: str = "sample"):
    """A config of a tiny run (tiny-qwen3, in process, 2 tasks x 2, no eval) on one of this file's envs."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
name = "{name}"
output_dir = "{tmp_path / 'runs'}"
[model]
name = "tiny-qwen3"
[env]
entry = "{F}:{entry}"
launcher = "inprocess"
max_turns = 2
{env_extra}
[sampler]
max_tokens = 16
[training]
steps = {steps}
eval_tasks = 0
eval_every = 0

[rollout]
tasks_per_step = 2
group_size = 2
[logging]
console = "none"
progress = false
save_rows = "{save_rows}"
""")
    return path


@pytest.mark.parametrize("launcher", ["inprocess", pytest.param("local-server", marks=pytest.mark.slow)])
def test_a_reset_that_answers_done_is_no_episode_and_says_the_env_s_reason(launcher):
    # coding_tools_env without its sandbox key: quaero showed an empty user turn, sampled, stepped the ended
    # episode and trained ECHO on "Error: environment not reset"
    with open_envs(EnvConfig(entry=f"{F}:EndsAtResetEnv", launcher=launcher), 1) as pool:
        env = pool.sessions[0]
        with pytest.raises(EpisodeEndedAtReset) as e:
            env.reset(seed=0)
        assert e.value.reason == SANDBOX_MISSING
        with pytest.raises(RuntimeError, match="after the episode ended"):
            env.step(_reply('{"code": "print(1)"}'))  # never stepped
        assert pool.counts.snapshot_and_reset()["env_steps"] == 0


@pytest.mark.parametrize("launcher", ["inprocess", pytest.param("local-server", marks=pytest.mark.slow)])
def test_an_action_the_env_raises_on_is_an_invalid_action_with_the_env_s_words(launcher):
    # atari_env: `Invalid action_id: 7` was retried three times as a server fault, then the episode dropped
    cfg = EnvConfig(entry=f"{F}:small_arcade", launcher=launcher, malformed_reward=-0.5, retry_backoff_s=0)
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        assert env.step(_reply('{"action_id": 1}')).reward == 0.0  # an accepted action the replay repeats
        illegal = env.step(_reply('{"action_id": 7}'))
        assert illegal.malformed and illegal.reward == -0.5 and not illegal.done
        (message,) = illegal.messages
        assert message["content"] == ("The environment rejected your last action: Invalid action_id: 7. "
                                      "Valid range: [0, 2]")
        won = env.step(_reply('{"action_id": 2}'))  # the episode goes on, on the session that answered
        assert won.reward == 1.0 and won.done
        counts = pool.counts.snapshot_and_reset()
        assert counts["env_rejected_actions"] == 1 and counts["env_retries"] == 1
        assert counts["env_replayed_steps"] == 0  # asked again on the same session: no replay


def test_an_action_rejected_by_an_env_whose_resets_do_not_reproduce_keeps_its_episode():
    # dm_control_env (issue #33's survey, D4): a wrong-length `values` after an accepted step was asked again
    # on a fresh session replayed from a reset that starts elsewhere: "replay diverged", the episode dropped
    cfg = EnvConfig(entry=f"{F}:UnseededArcadeEnv", launcher="inprocess", malformed_reward=-0.5,
                    retry_backoff_s=0)
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        assert env.step(_reply('{"action_id": 1}')).reward == 0.0
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):  # the same rejection twice: its words logged once
                illegal = env.step(_reply('{"action_id": 7}'))
                assert illegal.malformed and illegal.reward == -0.5
        assert env.step(_reply('{"action_id": 2}')).reward == 1.0
        counts = pool.counts.snapshot_and_reset()
    assert counts["env_rejected_actions"] == 2 and counts["env_replayed_steps"] == 0
    (said,) = [e for e in logs if e["event"] == "env_action_rejected"]
    assert said["message"] == "Invalid action_id: 7. Valid range: [0, 2]"


@pytest.mark.parametrize("entry, diverges", [("UnseededArcadeEnv", True), ("small_arcade", False)])
def test_a_replay_whose_reset_answers_otherwise_drops_the_episode(entry, diverges, monkeypatch):
    # the same survey: after a lost session on an episode's first step, the replay's reset was not compared,
    # so the episode went on from another start than the one the model had been shown
    cfg = EnvConfig(entry=f"{F}:{entry}", launcher="inprocess", retry_backoff_s=0)
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        transport, lost = env._transport, []

        def lose_the_session_once(action, timeout_s):  # the fault injected: a dropped socket
            if not lost:
                lost.append(action)
                raise ConnectionError("socket closed")
            return type(transport).step(transport, action, timeout_s)

        monkeypatch.setattr(transport, "step", lose_the_session_once)
        if diverges:
            with pytest.raises(EpisodeDropped, match="replay diverged at the reset") as e:
                env.step(_reply('{"action_id": 2}'))
            assert e.value.kind == "replay_diverged"
        else:
            assert env.step(_reply('{"action_id": 2}')).reward == 1.0
        assert pool.counts.snapshot_and_reset()["env_retries"] == 1


def test_an_env_error_that_does_not_repeat_stays_a_retried_fault():
    cfg = EnvConfig(entry=f"{F}:FlakyArcadeEnv", launcher="inprocess", kwargs={"screen_chars": 30},
                    retry_backoff_s=0)
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        result = env.step(_reply('{"action_id": 2}'))
        assert not result.malformed and result.reward == 1.0
        counts = pool.counts.snapshot_and_reset()
        assert counts["env_rejected_actions"] == 0 and counts["env_retries"] == 1


@pytest.mark.slow
def test_an_env_error_on_a_session_that_cannot_be_replayed_is_asked_again_on_the_same_session():
    cfg = EnvConfig(entry=f"{F}:small_arcade", launcher="local-server", on_session_loss="drop",
                    retry_backoff_s=0)
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        assert env.step(_reply('{"action_id": 9}')).malformed  # was: dropped at the first "fault"
        assert env.step(_reply('{"action_id": 2}')).reward == 1.0
        counts = pool.counts.snapshot_and_reset()
        assert counts["env_rejected_actions"] == 1 and counts["env_replayed_steps"] == 0


def test_an_env_error_that_changes_every_time_still_drops_the_episode():
    cfg = EnvConfig(entry=f"{F}:CountingFaultEnv", launcher="inprocess", max_retries=1, retry_backoff_s=0)
    with open_envs(cfg, 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        with pytest.raises(EpisodeDropped) as e:
            env.step(_reply('{"action_id": 2}'))
        assert e.value.kind == "server_error" and "fault number" in e.value.reason
        assert pool.counts.snapshot_and_reset()["env_rejected_actions"] == 0


@pytest.mark.slow
def test_a_run_whose_every_reset_answers_done_stops_in_one_line_without_sampling(tmp_path, capsys):
    from fixtures.runs import events_of

    from quaero import cli

    path = _tiny_run(tmp_path, "ended", "EndsAtResetEnv", steps=3)
    assert cli.main(["train", str(path)]) == 1  # was: `finished` with reward 1.0, ECHO trained on its error
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "step 1: every reset (4) answered done=True" in err[0]
    assert f"the env said: {SANDBOX_MISSING[:-1]}; fix what the env needs" in err[0]  # was "start.; fix"
    run = tmp_path / "runs" / "ended"
    (step,) = events_of(run, "train_step")
    assert step["episodes_ended_at_reset"] == 4 and step["episodes"] == 0 and step["turns"] == 0
    assert step["env_steps"] == 0 and step["rows"] == 0
    (said,) = events_of(run, "env_reset_ended")
    assert said["reason"] == SANDBOX_MISSING
    assert events_of(run, "run_end")[0]["status"] == "failed"
    # rows were being saved (save_rows = "sample"): none exist because no episode did (was: "train with
    # [logging] save_rows = ...", which the run had set)
    assert cli.main(["inspect", "rows", str(run), "--verify"]) != 0
    err = capsys.readouterr().err
    assert "no saved rows, although the run saved them (save_rows = 'sample')" in err
    assert "train with [logging] save_rows" not in err


def test_check_never_calls_a_factory_even_one_whose_return_annotation_names_its_class(tmp_path, capsys):
    # openenv-dipg-safety: `quaero check` called the factory (it tried the Hub three times)
    from fixtures import findings

    from quaero import cli

    path = tmp_path / "q.toml"
    path.write_text(f'[env]\nentry = "{F}:hub_dataset_env"\n[run]\noutput_dir = "{tmp_path}"\n')
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert findings.HUB_CALLS == []
    assert (f"tasks       read from InstructedEnv's Task API when sessions open: {F}:hub_dataset_env is a "
            "factory function, not called at check") in out
    assert "env action  GuessAction {guess: integer}" in out  # read from its annotation, without building


def _scripted(text: str):
    return lambda info: (lambda messages: _reply(text))


def test_an_observation_over_the_bound_is_cut_per_field_so_later_fields_survive(qwen3_render):
    # atari_env's default screen (~460k characters) was cut to the bound whole, and `legal_actions` and
    # `lives` after it were lost without a word
    from fixtures.rollout import make_cfg

    from quaero.config import settings_of
    from quaero.rollout.driver import DriverSettings, EpisodeDriver

    cfg = make_cfg(env__entry=f"{F}:ArcadeEnv", env__launcher="inprocess", env__max_observation_tokens=512)
    with open_envs(cfg.env, 1) as pool, structlog.testing.capture_logs() as logs:
        driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
        ((ep,),) = driver.run(pool.sessions, [{"seed": 0, "split": "train", "index": 0}], group_size=1,
                              policy=_scripted('{"action_id": 2}'))
        counts = pool.counts.snapshot_and_reset()
    start, answer = ep.messages[1]["content"], ep.messages[3]["content"]
    for text in (start, answer):
        screen, legal, lives = text.split("\n")
        assert screen.startswith("screen: [7, 7, 7") and screen.endswith("more characters]")
        assert (legal, lives) == ("legal_actions: [0, 1, 2]", "lives: 3")  # the small fields whole
        assert len(qwen3_render.tokenizer.encode(text, add_special_tokens=False)) <= 512
    assert ep.reward == 1.0 and counts["observations_truncated"] == 2
    (said,) = [e for e in logs if e["event"] == "observation_truncated"]  # the first truncation, once
    assert said["log_level"] == "warning" and said["cut"].startswith("screen: 460,0")
    assert "the other of its 3 fields kept whole" in said["note"]


def test_check_names_the_observation_fields_that_can_exceed_the_bound(tmp_path, capsys):
    from quaero import cli

    path = tmp_path / "q.toml"
    path.write_text(f'[env]\nentry = "{F}:ArcadeEnv"\nmax_observation_tokens = 512\n'
                    f'[run]\noutput_dir = "{tmp_path}"\n')
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("obs fields  screen (array), legal_actions (array) of ArcadeObservation have no size bound: an "
            "observation over [env] max_observation_tokens=512 is cut field by field") in out  # not lives


def test_the_env_s_own_instructions_are_the_system_prompt_and_not_repeated(tmp_path, capsys):
    from fixtures.findings import GUESS_RULES

    from quaero import cli

    with open_envs(EnvConfig(entry=f"{F}:InstructedEnv"), 1) as pool:
        env = pool.sessions[0]
        system, user = env.reset(seed=0).messages
        assert system["content"].startswith(GUESS_RULES + "\n\n")  # was: "You are an agent acting in ..."
        assert '"guess":{"type":"integer"}' in system["content"]  # the Action schema still follows
        assert user == {"role": "user", "content": "feedback: No guess yet."}  # the rules once: system turn
        wrong = env.step(_reply('{"guess": 3}'))
        assert wrong.messages == [{"role": "user", "content": "feedback: wrong"}] and not wrong.done
    path = tmp_path / "q.toml"
    path.write_text(f'[env]\nentry = "{F}:InstructedEnv"\n[run]\noutput_dir = "{tmp_path}"\n')
    assert cli.main(["check", str(path)]) == 0
    assert ("system      the reset's own `instructions` field (the reset metadata's system_prompt first, "
            "when it gives one); then the Action schema") in capsys.readouterr().out


def test_a_corrective_turn_says_what_was_wrong_in_one_line_and_points_back_to_the_schema():
    # carla: the whole Action schema (over 1,000 characters) was repeated after every invalid reply
    with open_envs(EnvConfig(entry=f"{F}:InstructedEnv"), 1) as pool:
        env = pool.sessions[0]
        env.reset(seed=0)
        (message,) = env.step(_reply("seven, I think")).messages
        assert message["content"] == (
            "Your last message was not a valid action: it is not JSON. Reply with exactly one JSON object "
            "matching the action schema in the system prompt.")


def test_a_chat_shaped_env_is_shown_as_chat_turns_and_answered_in_plain_text(qwen3_render):
    # korrel's export: its messages were a JSON list inside one user turn, the reply wrapped {"content": ...}
    from fixtures.findings import KORREL_SYSTEM
    from fixtures.rollout import make_cfg

    from quaero.config import settings_of
    from quaero.rollout.driver import DriverSettings, EpisodeDriver

    with open_envs(EnvConfig(entry=f"{F}:ChatShapedEnv"), 1) as pool:
        start = pool.sessions[0].reset(seed=0)
        assert start.messages == [{"role": "system", "content": KORREL_SYSTEM},
                                  {"role": "user", "content": "Is 17 a prime number?"}]
        assert pool.sessions[0].step(_reply("YES")).reward == 1.0
        pool.sessions[0].reset(seed=0)
        answer = pool.sessions[0].step(_reply('{"content": "YES"}'))  # plain text, even looking like JSON
        assert not answer.malformed and answer.reward == 0.0 and answer.messages[0]["content"] == "Wrong."
        cfg = make_cfg(env__entry=f"{F}:ChatShapedEnv")
        driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
        ((ep,),) = driver.run(pool.sessions, [{"seed": 0, "split": "train", "index": 0}], group_size=1,
                              policy=_scripted("YES"))
        counts = pool.counts.snapshot_and_reset()
    assert ep.reward == 1.0 and ep.messages[-1] == {"role": "user", "content": "Correct."}
    assert counts["prefix_mismatches"] == 0 and counts["bridge_fallbacks"] == 0
    assert counts["env_responses_captured"] == 1


def test_a_chat_env_that_ends_without_a_word_adds_no_response_to_the_row(qwen3_render):
    # was: an empty user turn after the last action, counted as an env response (ECHO's scaffold targets)
    from fixtures.rollout import make_cfg

    from quaero.config import settings_of
    from quaero.rollout.driver import DriverSettings, EpisodeDriver

    with open_envs(EnvConfig(entry=f"{F}:SilentEndChatEnv"), 1) as pool:
        pool.sessions[0].reset(seed=0)
        end = pool.sessions[0].step(_reply("NO"))
        assert end.messages == [] and end.done and end.reward == 0.0
        cfg = make_cfg(env__entry=f"{F}:SilentEndChatEnv")
        driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
        ((ep,),) = driver.run(pool.sessions, [{"seed": 0, "split": "train", "index": 0}], group_size=1,
                              policy=_scripted("YES"))
        counts = pool.counts.snapshot_and_reset()
    assert ep.reward == 1.0 and ep.messages[-1]["role"] == "assistant"
    (row,) = ep.rows
    assert [s.kind for s in row.spans] == ["prompt", "action"] and not any(row.echo_weights)
    assert counts.get("env_responses", 0) == 0 and counts["prefix_mismatches"] == 0


def test_a_chat_env_whose_action_has_optional_content_and_tool_calls_is_answered_in_plain_text(tmp_path,
                                                                                              capsys):
    # korrel 0.1.3's real export (issue #33's survey, D1): its Action has two optional fields, so replies had
    # to be JSON, and its system message was shown twice, as the system prompt and again as a user turn
    from fixtures.findings import KORREL_SYSTEM

    from quaero import cli

    with open_envs(EnvConfig(entry=f"{F}:KorrelShapedEnv"), 1) as pool:
        start = pool.sessions[0].reset(seed=0)
        assert start.messages == [{"role": "system", "content": KORREL_SYSTEM},
                                  {"role": "user", "content": "Is 17 a prime number?"}]
        answer = pool.sessions[0].step(_reply("YES"))
        assert not answer.malformed and answer.reward == 1.0
    path = tmp_path / "k.toml"
    path.write_text(f'[model]\nname = "tiny-qwen3"\n[env]\nentry = "{F}:KorrelShapedEnv"\n'
                    'launcher = "inprocess"\n')
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no Action schema: a chat is answered in plain text, which becomes its `content` field" in out


def test_an_env_that_rejects_every_action_with_one_message_is_said_to_need_its_setup(tmp_path, capsys):
    # korrel with two turns and no ANTHROPIC_API_KEY (issue #33's survey, D2): every valid action was answered
    # "rejected" and the run's notes blamed the model ("warm-start ... or use a model that writes valid
    # actions"); review showed no env_rejected_actions
    from fixtures.findings import KEY_MISSING
    from fixtures.runs import events_of

    from quaero import cli

    path = _tiny_run(tmp_path, "key", "KeyOnStepEnv", steps=1)
    assert cli.main(["train", str(path)]) == 0
    run = tmp_path / "runs" / "key"
    (step,) = events_of(run, "train_step")
    assert step["env_rejected_actions"] == step["turns"] > 0
    assert [e["message"] for e in events_of(run, "env_action_rejected")][:1] == [KEY_MISSING]
    note = events_of(run, "rl_signal")[0]["note"]
    assert f"0 of {step['turns']} actions were valid ({step['turns']} rejected by the env)" in note
    assert "fix the env's setup" in note and "warm-start" not in note
    capsys.readouterr()
    assert cli.main(["review", str(run)]) == 0
    out = capsys.readouterr().out
    assert "env_rejected_actions" in out and "fix the env's setup" in out


def test_an_mcp_env_whose_reset_has_no_text_shows_no_empty_user_turn(qwen3_render):
    from fixtures.rollout import make_cfg

    from quaero.config import settings_of
    from quaero.rollout.driver import DriverSettings, EpisodeDriver

    with open_envs(EnvConfig(entry=f"{F}:QuietMcpEnv"), 1) as pool:
        (system,) = pool.sessions[0].reset(seed=0).messages  # was: [system, {"role": "user", "content": ""}]
        assert system["role"] == "system"
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "ping", "arguments": {"word": "hello"}}}]}
        cfg = make_cfg(env__entry=f"{F}:QuietMcpEnv")
        driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
        ((ep,),) = driver.run(pool.sessions, [{"seed": 0, "split": "train", "index": 0}], group_size=1,
                              policy=lambda info: (lambda messages: call))
        counts = pool.counts.snapshot_and_reset()
    turns = cfg.env.max_turns  # ping never ends the episode
    assert ep.messages[-1] == {"role": "tool", "content": "hello"} and len(ep.transitions) == turns
    assert counts["prefix_mismatches"] == 0 and counts["bridge_fallbacks"] == 0
    assert counts["env_responses_captured"] == turns


@pytest.mark.slow
@pytest.mark.parametrize("entry, extra", [("ChatShapedEnv", ""),
                                          ("ArcadeEnv", "max_observation_tokens = 256")])
def test_chat_turns_and_per_field_cuts_keep_rows_exact_in_a_run(entry, extra, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from fixtures.runs import ROOT, events_of

    from quaero import cli

    path = _tiny_run(tmp_path, "exact", entry, steps=1, env_extra=extra, save_rows="all")
    assert cli.main(["train", str(path)]) == 0
    run = tmp_path / "runs" / "exact"
    (step,) = events_of(run, "train_step")
    assert step["prefix_mismatches"] == 0 and step["bridge_fallbacks"] == 0 and step["episodes"] == 4
    if entry == "ArcadeEnv":
        assert step["observations_truncated"] >= 4  # every reset's screen, cut per field
    rows = [json.loads(x) for x in (run / "rows" / "step-000001.jsonl").read_text().splitlines()]
    assert rows
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", "inspect", "rows", str(run), "--verify"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"verified {len(rows)} rows of 1 step(s)")
