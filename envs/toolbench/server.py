"""The toolbench OpenEnv server app: `uvicorn envs.toolbench.server:app --host 127.0.0.1 --port 8000`
(or `quaero env serve envs.toolbench:ToolBenchEnv`). MAX_CONCURRENT_ENVS sets the session limit."""
import os

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

from .environment import ToolBenchEnv, ToolBenchState

app = create_app(ToolBenchEnv, CallToolAction, CallToolObservation, env_name="toolbench",
                 max_concurrent_envs=int(os.getenv("MAX_CONCURRENT_ENVS", "64")), state_cls=ToolBenchState)
