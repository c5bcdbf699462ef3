"""toolbench on its own: deterministic tasks, disjoint splits, the oracle, answer checking, tools."""
import asyncio

import pytest

# first: it keeps openenv's optional gradio UI out of the process (4 s)
import quaero.openenv_client  # noqa: F401

# isort: split
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

from envs.toolbench import NUM_TASKS, TEMPLATES, ToolBenchEnv, check_answer, make_task, oracle_policy
from envs.toolbench.tasks import MAX_DIFFICULTY, tools_for
from envs.toolbench.tools import safe_eval
from envs.toolbench.world import CUSTOMER_NAMES, PRODUCT_NAMES


def test_tasks_are_deterministic_and_need_1_to_4_calls():
    for d in range(1, 5):
        for i in range(40):
            a, b = make_task("train", i, d), make_task("train", i, d)
            assert a == b
            assert 1 <= len(a.calls) <= d
            assert TEMPLATES[a.template][0] <= d
    assert {make_task("train", i, 4).template for i in range(200)} == set(TEMPLATES)
    assert {len(make_task("train", i, 1).calls) for i in range(50)} == {1}


def test_train_and_eval_splits_are_disjoint():
    for names in (PRODUCT_NAMES, CUSTOMER_NAMES):
        assert not set(names["train"]) & set(names["eval"])
        assert len(names["eval"]) > 100 and len(names["train"]) > 3 * len(names["eval"])
        # compositional: every word of an eval name also occurs in train names
        words = {split: {w for name in names[split] for w in name.split()} for split in ("train", "eval")}
        assert words["eval"] <= words["train"]
    for split in ("train", "eval"):
        worlds = [make_task(split, i, 4).world for i in range(300)]
        assert {p.name for w in worlds for p in w.products} <= set(PRODUCT_NAMES[split])
        assert {c.name for w in worlds for c in w.customers} <= set(CUSTOMER_NAMES[split])
    eval_q = {make_task("eval", i, d).question for i in range(NUM_TASKS["eval"]) for d in (2, 4)}
    train_q = {make_task("train", i, d).question for i in range(1500) for d in (2, 4)}
    assert len(eval_q) > 300 and not eval_q & train_q
    with pytest.raises(ValueError, match="out of range"):
        make_task("eval", NUM_TASKS["eval"])




def test_an_env_lists_exactly_the_tools_its_difficulty_needs():
    for d in range(1, MAX_DIFFICULTY + 1):
        used = {name for i in range(400) for name, _ in make_task("train", i, d).calls}
        assert used | {"submit_answer"} == set(tools_for(d))  # every needed tool, and no other
        env = ToolBenchEnv(difficulty=d)
        listed = asyncio.run(env.mcp_server.list_tools())
        assert sorted(t.name for t in listed) == sorted(tools_for(d))
    assert len(tools_for(1)) == 3 and len(tools_for(4)) == 10
    with pytest.raises(ValueError, match="built for difficulty 1"):
        ToolBenchEnv(difficulty=1).reset(split="eval", index=0, difficulty=2)

def test_one_word_keys_find_exactly_one_record():
    """The oracle searches by a product's noun and a customer's last name; in every world that word
    matches one record only (the tools match substrings, case-insensitively)."""
    for split in ("train", "eval"):
        for i in range(300):
            w = make_task(split, i, 4).world
            for p in w.products:
                assert [q.id for q in w.products if p.key.lower() in q.name.lower()] == [p.id]
            for c in w.customers:
                assert [d.id for d in w.customers if c.key.lower() in d.name.lower()] == [c.id]

def _run_episode(env: ToolBenchEnv, info: dict, answer_override=None):
    """Drive the env through step_async, as the WebSocket server does; returns (rewards, dones, texts)."""
    policy = oracle_policy(info)

    async def run():
        chat, rewards, dones, texts = [], [], [], []
        async with env.mcp_session():
            while True:
                call = policy(chat)["tool_calls"][0]["function"]
                args = dict(call["arguments"])
                if call["name"] == "submit_answer" and answer_override is not None:
                    args["answer"] = answer_override
                obs = await env.step_async(CallToolAction(tool_name=call["name"], arguments=args))
                chat.append({"role": "assistant"})
                rewards.append(obs.reward)
                dones.append(obs.done)
                texts.append(obs.result.content[0].text if obs.result else obs.error.message)
                if obs.done:
                    return rewards, dones, texts
    return asyncio.run(run())


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_oracle_scores_1_on_every_eval_task_of_a_fixed_seed_set(difficulty):
    env = ToolBenchEnv()
    for index in range(0, NUM_TASKS["eval"], 5):  # a fixed set: 100 eval tasks per difficulty
        obs = env.reset(seed=7, split="eval", index=index, difficulty=difficulty)
        rewards, dones, texts = _run_episode(env, obs.metadata)
        assert rewards[-1] == 1.0 and dones[-1], (obs.metadata, texts)
        assert all(r == 0.0 for r in rewards[:-1]) and not any(dones[:-1])
        assert all(len(t) < 120 for t in texts), texts  # observations stay short
        assert len(obs.metadata["question"]) < 100


def test_wrong_answer_scores_0_and_ends_the_episode():
    env = ToolBenchEnv()
    obs = env.reset(split="eval", index=11)
    rewards, dones, _ = _run_episode(env, obs.metadata, answer_override="definitely wrong 123456")
    assert rewards[-1] == 0.0 and dones[-1]
    assert env.state.done and env.state.reward == 0.0


def test_reward_flows_through_the_sync_step_path_too():
    env = ToolBenchEnv()
    obs = env.reset(split="eval", index=2, difficulty=1)
    task = make_task("eval", 2, 1)
    name, args = task.calls[0]
    assert env.step(CallToolAction(tool_name=name, arguments=args)).reward == 0.0
    final = env.step(CallToolAction(tool_name="submit_answer", arguments={"answer": task.answer}))
    assert final.reward == 1.0 and final.done and final.metadata["correct"] is True
    after = env.step(CallToolAction(tool_name="calculate", arguments={"expression": "1+1"}))
    assert after.done and after.error is not None and "over" in after.error.message
    assert obs.metadata["task_id"] == task.task_id


def test_step_limit_ends_runaway_episodes():
    env = ToolBenchEnv(max_steps=3)
    env.reset(split="train", index=0)
    obs = [env.step(CallToolAction(tool_name="calculate", arguments={"expression": "2*3"})) for _ in range(3)]
    assert [o.done for o in obs] == [False, False, True]
    assert obs[-1].reward == 0.0 and obs[-1].metadata["truncated"] is True


def test_tool_errors_come_back_as_observations():
    env = ToolBenchEnv()
    env.reset(split="train", index=4)
    tools = env.step(ListToolsAction()).tools
    assert 7 <= len(tools) <= 11 and tools[-1].name == "submit_answer"
    bad = env.step(CallToolAction(tool_name="get_product", arguments={"product_id": "P99"}))
    assert bad.error is not None and "unknown product_id" in bad.error.message and not bad.done
    div = env.step(CallToolAction(tool_name="calculate", arguments={"expression": "1/0"}))
    assert "division by zero" in div.error.message


@pytest.mark.parametrize("expr,value", [("12.5*3", 37.5), ("(40-4)/2", 18.0), ("-2**2", -4.0),
                                        ("round(10/3, 2)", 3.33), ("max(1, 7, 3) % 4", 3.0)])
def test_safe_eval_computes_arithmetic(expr, value):
    assert safe_eval(expr) == pytest.approx(value)


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "x + 1", "(1).real", "2**99999",
                                  "[1, 2]", "lambda: 1", "'a' * 3", "open('f')"])
def test_safe_eval_refuses_everything_else(expr):
    with pytest.raises(ValueError):
        safe_eval(expr)


def test_check_answer_normalizes_numbers_and_text():
    num = make_task("eval", 0, 4)
    num = num if num.kind == "number" else make_task("eval", 1, 4)
    assert num.kind == "number"
    value = float(num.answer)
    assert check_answer(num, f"{value:.2f}") and check_answer(num, f"${value:,.2f}")
    assert not check_answer(num, f"{value + 1:.2f}") and not check_answer(num, f"P3 {value}")
    city = next(t for t in (make_task("train", i, 1) for i in range(50)) if t.template == "city")
    assert check_answer(city, city.answer.upper() + ".") and not check_answer(city, "Atlantis")


def test_task_listing_over_the_openenv_task_api(toolbench_url):
    """OpenEnv's TaskProvider routes on the real server list splits and tasks, never answers."""
    import json
    import urllib.request

    base = toolbench_url.replace("ws://", "http://")
    with urllib.request.urlopen(f"{base}/toolbenchenv/splits", timeout=5) as r:
        assert [s["name"] for s in json.loads(r.read())] == ["train", "eval"]
    req = urllib.request.Request(f"{base}/toolbenchenv/task", data=json.dumps({"split": "eval",
                                                                               "index": 3}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        task = json.loads(r.read())["task"]
    assert task["question"] == make_task("eval", 3, 4).question and "answer" not in task
