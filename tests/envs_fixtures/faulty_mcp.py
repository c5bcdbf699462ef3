"""A test-only MCP env whose tools misbehave on purpose: one raises, one blocks."""
from __future__ import annotations

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Observation, State


class FaultyMCPEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("faulty")

        @mcp.tool
        def echo(text: str) -> str:
            """Echo the text."""
            return text

        @mcp.tool
        def explode() -> str:
            """Always raises."""
            raise RuntimeError("kaboom")

        @mcp.tool
        async def stall(seconds: float) -> str:
            """Waits, then answers."""
            import asyncio

            await asyncio.sleep(seconds)
            return "done waiting"

        @mcp.tool
        def submit_answer(answer: str) -> str:
            """Ends the episode."""
            return "ok"

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self._state = State(episode_id=episode_id)
        return Observation(metadata={"question": "Say hi with echo, then submit."})

    def _finish(self, action, obs):
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            obs.reward = 1.0 if action.tool_name == "submit_answer" else 0.0
            obs.done = action.tool_name == "submit_answer"
        return obs

    def step(self, action, timeout_s=None, **kwargs):
        return self._finish(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action, timeout_s=None, **kwargs):
        return self._finish(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(metadata={"error": "unsupported"})

    @property
    def state(self) -> State:
        return self._state
