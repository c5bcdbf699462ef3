"""toolbench: an offline tool-use OpenEnv MCP environment (seeded shop worlds, 9 tools + submit_answer).

Entry point for configs: `envs.toolbench:ToolBenchEnv`; server app: `envs.toolbench.server:app`.
"""
from .environment import SYSTEM_PROMPT, ToolBenchEnv, ToolBenchState
from .oracle import oracle_policy
from .tasks import MAX_DIFFICULTY, NUM_TASKS, TEMPLATES, Task, check_answer, make_task

__all__ = ["MAX_DIFFICULTY", "NUM_TASKS", "SYSTEM_PROMPT", "TEMPLATES", "Task", "ToolBenchEnv",
           "ToolBenchState", "check_answer", "make_task", "oracle_policy"]
