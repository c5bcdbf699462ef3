"""ToolBenchEnv: the toolbench world behind OpenEnv's MCP tool interface.

Reward logic sits in `_finish`, called from both `step` (in-process sync path) and `step_async`
(what the WebSocket server calls): overriding only one silently drops rewards on the other path.
"""
from __future__ import annotations

import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation, ToolError, ToolErrorType
from openenv.core.env_server.types import Observation, State

from .tasks import MAX_DIFFICULTY, NUM_TASKS, TEMPLATES, Task, check_answer, make_task, tools_for
from .tools import BadToolInput, register_tools
from .world import SPLITS, World

SYSTEM_PROMPT = ("You are a shop assistant with tools. Call tools to look facts up, "
                 "then call submit_answer with only the final value.")


class ToolBenchState(State):
    task_id: str = ""
    split: str = "train"
    index: int = 0
    difficulty: int = MAX_DIFFICULTY
    max_steps: int = 10
    done: bool = False
    reward: float = 0.0


class ToolBenchEnv(MCPEnvironment):
    """Seeded shop worlds, typed tools and submit_answer; reward 1.0 for a correct answer, else 0.0.

    `difficulty` d (1-4) is the most tool calls a task needs; the env lists only the tools such tasks
    use (`tasks.tools_for(d)`): 3 at d=1, all 10 from d=3. A reset may ask for an easier task, not a
    harder one (its tools would be missing).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # every instance owns its world; nothing is shared

    def __init__(self, difficulty: int = MAX_DIFFICULTY, max_steps: int = 10) -> None:
        difficulty = int(difficulty)
        if not 1 <= difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"toolbench difficulty={difficulty}: use 1..{MAX_DIFFICULTY} (max tool calls "
                             "per task)")
        mcp = FastMCP("toolbench")
        register_tools(mcp, self._world_or_raise, tools_for(difficulty))
        super().__init__(mcp)
        self.default_difficulty = difficulty
        self.default_max_steps = max_steps
        self._task: Task | None = None
        self._state = ToolBenchState()

    def _world_or_raise(self) -> World:
        if self._task is None or self._task.world is None:
            raise BadToolInput("no episode: call reset first")
        return self._task.world

    # -- OpenEnv API -------------------------------------------------------------------------------
    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train",
              index: int | None = None, difficulty: int | None = None, max_steps: int | None = None,
              **kwargs: Any) -> Observation:
        """Task (split, index); without an index, index = seed mod the split's size."""
        if split not in SPLITS:
            raise ValueError(f"toolbench reset split={split!r}: use one of {SPLITS}")
        if index is None:
            index = (seed or 0) % NUM_TASKS[split]
        difficulty = int(difficulty or self.default_difficulty)
        if difficulty > self.default_difficulty:
            raise ValueError(f"toolbench reset difficulty={difficulty}: this env was built for difficulty "
                             f"{self.default_difficulty} and lists only its tools; build it with "
                             f"difficulty={difficulty} ([env] kwargs = {{difficulty = {difficulty}}})")
        task = make_task(split, int(index), difficulty)
        self._task = task
        self._state = ToolBenchState(
            episode_id=episode_id or str(uuid.uuid4()), step_count=0, task_id=task.task_id, split=split,
            index=task.index, difficulty=task.difficulty, max_steps=int(max_steps or self.default_max_steps))
        return Observation(metadata={
            "question": task.question, "task_id": task.task_id, "task_source": "toolbench", "split": split,
            "index": task.index, "difficulty": task.difficulty, "template": task.template, "seed": seed,
            "system_prompt": SYSTEM_PROMPT})

    def step(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if (over := self._over(action)) is not None:
            return over
        return self._finish(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if (over := self._over(action)) is not None:
            return over
        return self._finish(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"toolbench takes call_tool/list_tools actions, not "
                                              f"{type(action).__name__}"})

    @property
    def state(self) -> ToolBenchState:
        return self._state

    # -- OpenEnv's optional TaskProvider protocol (GET /{env}/splits, POST /{env}/task, ...) ------------
    def list_splits(self) -> list[str]:
        return list(SPLITS)

    def num_tasks(self, split: str) -> int:
        return NUM_TASKS[split]

    def get_task(self, split: str, index: int) -> dict:
        """A task's public description (never its answer)."""
        if not 0 <= index < NUM_TASKS.get(split, 0):
            raise IndexError(index)
        t = make_task(split, index, self.default_difficulty)
        # `group` and `difficulty` are OpenEnv RFC 013's reserved keys: a task sampler pools outcomes by them
        # (a template's tasks share a plan; `difficulty` is the tool calls its plan needs before
        # submit_answer)
        return {"task_id": t.task_id, "split": split, "index": index, "difficulty": TEMPLATES[t.template][0],
                "group": t.template, "template": t.template, "question": t.question}

    def get_task_range(self, split: str, start: int, stop: int) -> list[dict]:
        return [self.get_task(split, i) for i in range(start, min(stop, start + 1000, NUM_TASKS[split]))]

    # -- reward and termination --------------------------------------------------------------------
    def _over(self, action) -> Observation | None:
        """After the episode ended, tool calls are refused (as a tool error, not an exception)."""
        if isinstance(action, CallToolAction) and self._state.done:
            return CallToolObservation(tool_name=action.tool_name, done=True, reward=0.0, error=ToolError(
                error_type=ToolErrorType.EXECUTION_ERROR, message="the episode is over; call reset"))
        return None

    def _finish(self, action, obs: Observation) -> Observation:
        if not isinstance(action, CallToolAction):
            return obs  # list_tools: no step, no reward
        st = self._state
        st.step_count += 1
        obs.reward = 0.0
        if action.tool_name == "submit_answer" and self._task is not None and obs.error is None:
            correct = check_answer(self._task, action.arguments.get("answer", ""))
            obs.reward, obs.done = float(correct), True
            obs.metadata = {"correct": correct, "expected": self._task.answer, "task_id": self._task.task_id}
        elif st.step_count >= st.max_steps:
            obs.done = True
            obs.metadata = {"truncated": True, "max_steps": st.max_steps}
        st.done, st.reward = bool(obs.done), float(obs.reward)
        return obs
