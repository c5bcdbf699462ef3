"""Third-party env shapes trained as they are.

Sessions (fast): a plain env whose step takes the base Action (its Action resolved by its own server app, by
`[env] action`, or by the /schema of its own app under uvicorn), with a penalty (-1 illegal move), a
multi-field reset observation (the cards sit in `context`), and a reset without seed/split/index; each
launcher: the rendered prompt and the rewards.
Whole runs (`slow`): one env with all four shapes (not concurrent, base-Action step, a -1 penalty, a
multi-field reset observation) trained at tasks_per_step x group_size = 2 x 2 through `inprocess`,
`local-server` and `urls` of its own app under uvicorn: the events, the review's proofs and the trained
prompt.
"""
import json

import pytest
import structlog

from quaero.config import ConfigError, EnvConfig, load_config
from quaero.openenv_client import EpisodeDropped, open_envs

PICK = {"entry": "fixtures.basegame:PickEnv"}
BARE = {"entry": "fixtures.untyped:BarePickEnv", "action": "fixtures.basegame.models:PickAction"}


@pytest.fixture(scope="module")
def pick_app_url():
    """PickEnv's own server app (fixtures/basegame/server.py) under uvicorn, as its authors serve it."""
    from fixtures import served_app

    with served_app("fixtures.basegame.server:app") as (url, _proc):
        yield url


def _env_config(launcher: str, url: str, **extra) -> EnvConfig:
    if launcher == "remote":
        return EnvConfig(url=url, **extra)
    return EnvConfig(**(PICK if launcher == "inprocess" else BARE), launcher=launcher, **extra)


def _say(content: str) -> dict:
    return {"role": "assistant", "content": content}


@pytest.mark.parametrize("launcher", ["inprocess", "local-server", "remote"])
def test_base_action_env_plays_with_its_penalties_and_context_on_every_launcher(launcher, pick_app_url,
                                                                                  qwen3_render):
    cfg = _env_config(launcher, pick_app_url, malformed_reward=-0.5)
    with open_envs(cfg, 2) as pool:
        env = pool.sessions[0]
        start = env.reset(seed=3)
        prompt = qwen3_render.tokenizer.decode(qwen3_render.prompt_ids(start.messages, None))
        cards = [int(c)
                 for c in start.messages[1]["content"].split("context: cards: ")[1].split("\n")[0].split()]
        # the trial data reached it
        assert "Which position holds the largest card?\ncontext: cards: " in prompt
        # and the schema
        assert "legal_moves: [0, 1, 2, 3]" in prompt and '"move":{"type":"integer"}' in prompt
        malformed = env.step(_say("the biggest one"))
        # [env] malformed_reward
        assert malformed.malformed and malformed.reward == -0.5 and not malformed.done
        illegal = env.step(_say('{"move": 7}'))
        assert not illegal.malformed and illegal.reward == -1.0 and illegal.done  # the env's own penalty
        assert illegal.messages[0]["content"] == "result: illegal move 7"
        env.reset(seed=3)
        right = env.step(_say(json.dumps({"move": cards.index(max(cards))})))
        assert right.reward == 1.0 and right.done and right.messages[0]["content"] == "result: right"


def test_a_base_action_env_quaero_cannot_resolve_fails_when_sessions_open():
    with pytest.raises(ConfigError, match=r"BarePickEnv.step takes the base Action.*\[env\] action = "):
        open_envs(EnvConfig(entry="fixtures.untyped:BarePickEnv"), 1)


def test_a_server_publishing_the_base_action_is_a_config_error():
    from fixtures import served, served_app

    empty = r"/schema publishes an Action without fields .* create_app\(Env, MyAction, MyObservation\)"
    with served_app("fixtures.basegame.server:base_action_app") as (url, _proc), pytest.raises(ConfigError,
                                                                                               match=empty):
        open_envs(EnvConfig(url=url), 1)
    # `quaero env serve` of an env that names no Action does not start: its Action is resolved first
    unnamed = "no server app of its package publishes another"
    with pytest.raises(RuntimeError, match=unnamed), served("fixtures.untyped:BarePickEnv", timeout_s=30):
        pass


def test_an_mcp_server_publishing_the_base_action_still_trains_as_mcp():
    from fixtures import served_app

    with served_app("fixtures.faulty_mcp:base_action_app", factory=True) as (url, _proc), \
            open_envs(EnvConfig(url=url), 1) as pool:
        env = pool.sessions[0]
        assert [t["function"]["name"] for t in env.tools][:2] == ["echo", "explode"]
        env.reset(seed=0)
        call = {"type": "function", "function": {"name": "echo", "arguments": {"text": "hi"}}}
        assert env.step({"role": "assistant", "content": "",
                         "tool_calls": [call]}).messages[0]["content"] == "hi"


def test_a_reset_without_seed_split_or_index_is_named_once_and_never_replayed():
    cfg = EnvConfig(entry="fixtures.basegame.env:SeedlessPickEnv", on_session_loss="replay", max_retries=1,
                    retry_backoff_s=0.0)
    with structlog.testing.capture_logs() as logs:
        pool = open_envs(cfg, 2)
    with pool:
        # once per pool, not per session
        (warning,) = [e for e in logs if e["event"] == "env_reset_params_ignored"]
        assert warning["ignored"] == ["seed", "split", "index"] and warning["log_level"] == "warning"
        assert (
            "eval split is the train distribution" in warning["note"]
            and "drops the episode" in warning["note"]
        )
        env = pool.sessions[0]
        env.reset(seed=0)
        env._transport.close()  # fault injection: the session is lost mid-episode
        with pytest.raises(EpisodeDropped,
                           match="not replayable: the env's reset takes no seed or index") as e:
            env.step(_say('{"move": 0}'))
        assert e.value.kind == "not_replayable"
        assert pool.counts.snapshot_and_reset()["env_replayed_steps"] == 0


def test_a_remote_env_s_reset_parameters_are_said_to_be_unknown_once(pick_app_url):
    with structlog.testing.capture_logs() as logs, open_envs(EnvConfig(url=pick_app_url), 2):
        pass
    assert [e["event"] for e in logs].count("env_reset_params_unknown") == 1


# -- whole runs: all four shapes in one env, tiny-qwen3, 1 step at tasks_per_step x group_size = 2 x 2
# --------------- CardEnv (fixtures/cardgame) is not concurrent, its step takes the base Action, an answer
# that is no suit costs -1, and its reset observation carries the question, the cards and the choices.
CARDS = {  # the [env] lines and where the Action comes from
    "inprocess": ('entry = "fixtures.cardgame:CardEnv"', ("the env's own server app "
                                                         "fixtures.cardgame.server:app")),
    "local-server": ('entry = "fixtures.untyped:BareCardEnv"\naction = '
                     '"fixtures.cardgame.models:SuitAction"\n'
                     + 'launcher = "local-server"', "[env] action"),
}
RUN = """
[run]
name = "{name}"
output_dir = "{out}"

[model]
name = "tiny-qwen3"

[env]
{env}
max_turns = 2
malformed_reward = -1.0

[sampler]
backend = "hf"
max_tokens = 6

[training]
steps = 1
eval_every = 1
eval_tasks = 1

[rollout]
tasks_per_step = 2
group_size = 2

[logging]
console = "none"
progress = false
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["inprocess", "local-server", "remote"])
def test_a_non_concurrent_base_action_env_with_penalties_and_context_trains_2x2_on_every_launcher(
        launcher, tmp_path, request, qwen3_tokenizer):
    from types import SimpleNamespace

    from quaero.recipe.train import train
    from quaero.telemetry.runlog import read_events
    from quaero.tools import review_command

    if launcher == "remote":  # the env's own app under uvicorn, one session each: one server per session
        urls = [url for url, _ in request.getfixturevalue("card_app_servers")]
        source, action = f"urls = {json.dumps(urls)}", f"{urls[0]}/schema"
    else:
        source, action = CARDS[launcher]
    path = tmp_path / "cards.toml"
    path.write_text(RUN.format(name=launcher, out=tmp_path / "runs", env=source))
    run_dir = train(load_config(path))
    events = read_events(run_dir / "events.jsonl")[0]

    (opened,) = [e for e in events if e["event"] == "env_pool_opened"]
    servers = 0 if launcher == "inprocess" else 4  # quaero's pool of four, or the four running apps
    assert (opened["sessions"], opened["servers"], len(opened["spread"] or {})) == (4, servers, servers)
    assert opened["action"] == action
    warned = [e for e in events if e["event"] == "env_inprocess_not_concurrent"]
    assert len(warned) == (launcher == "inprocess")  # four instances in one process: said, then trained
    (step,) = [e for e in events if e["event"] == "train_step"]
    assert step["phase"] == "rl" and step["episodes"] == 4 and step["episodes_dropped"] == 0
    # No reply names a suit: each turn is malformed ([env] malformed_reward) or an illegal answer (the env's
    # -1, which ends the episode), so the rewards sum to -(malformed + env steps), within [-2, -1] per
    # episode.
    assert step["env_steps"] > 0 and step["reward_mean"] * 4 == -(step["malformed_actions"]
                                                                  + step["env_steps"])
    # the env's responses are trained (ECHO), in one shared forward per microbatch with targets
    assert step["rows"] > 0 and step["echo_tokens"] > 0 and step["forward_passes"] > 0
    assert step["prefix_mismatches"] == 0 and step["bridge_fallbacks"] == 0
    args = SimpleNamespace(run_dir=str(run_dir), require_proof=True, require=["trained at least one step"],
                           plots=None, json=False, compare=None)
    assert review_command.main(args) == 0

    rows = [json.loads(x) for x in (run_dir / "rows" / "step-000001.jsonl").read_text().splitlines()]
    prompt = next(qwen3_tokenizer.decode(rows[0]["input_ids"][a:b]) for kind, a, b, _ in rows[0]["spans"]
                  if kind == "prompt")
    assert "Which suit holds the highest card?\ncontext: cards: " in prompt  # the trial data reached it
    assert 'choices: ["clubs", "diamonds", "hearts", "spades"]' in prompt
    # the Action the base annotation hid
    assert "your whole reply becomes its `suit` field (string)" in prompt
    assert any("result: illegal answer" in qwen3_tokenizer.decode(r["input_ids"][a:b])
               # the penalty's response, trained
               for r in rows for kind, a, b, _ in r["spans"] if kind == "env")
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 1]
    assert evals[0]["sample_transcript"][0].startswith("user: Which suit holds the highest card?\ncontext: "
                                                       "cards:")
    progress = [e for e in events if e["event"] == "eval_progress"]
    assert [(p["done"], p["tasks"]) for p in progress] == [(0, 1), (1, 1)] * 2  # from its first second


@pytest.fixture
def card_app_servers():
    """CardEnv's own server app (fixtures/cardgame/server.py) under uvicorn, as its authors serve it: the env
    is not concurrent, so its app holds one session, and a 2 x 2 run spreads its four sessions over four."""
    from fixtures import served_apps

    with served_apps("fixtures.cardgame.server:app", 4, timeout_s=120) as servers:
        yield servers
