"""toolbench whose server process dies once, mid-episode (fault injection for training tests).

The first tool call after `$QUAERO_TEST_CRASH_MARKER` is set (and before the marker file exists) creates the
marker and kills the whole server process with os._exit: what a segfault or OOM kill looks like from
the trainer's side.
"""
import os

from openenv.core.env_server.mcp_types import CallToolAction

from envs.toolbench import ToolBenchEnv, oracle_policy  # noqa: F401  (oracle_policy: warm start finds it here)


def _maybe_die(action) -> None:
    marker = os.environ.get("QUAERO_TEST_CRASH_MARKER")
    if isinstance(action, CallToolAction) and marker and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)


class CrashOnceToolBench(ToolBenchEnv):
    def step(self, action, timeout_s=None, **kwargs):
        _maybe_die(action)
        return super().step(action, timeout_s=timeout_s, **kwargs)

    async def step_async(self, action, timeout_s=None, **kwargs):
        _maybe_die(action)
        return await super().step_async(action, timeout_s=timeout_s, **kwargs)
