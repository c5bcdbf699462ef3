"""A scripted oracle that solves every toolbench task: the task's own plan, then submit_answer.

It regenerates the task from (split, index, difficulty) in the reset info, so it needs no parsing of
tool outputs; its messages have the shape of a renderer-parsed assistant turn (usable as SFT data).
"""
from __future__ import annotations

from collections.abc import Callable

from .tasks import MAX_DIFFICULTY, make_task


def oracle_policy(info: dict) -> Callable[[list[dict]], dict]:
    """`info` is ChatReset.info (split, index, difficulty); the policy maps the chat so far to the next
    assistant message. The k-th assistant turn of the chat gets the k-th call of the plan."""
    task = make_task(info.get("split", "train"), int(info["index"]),
                     int(info.get("difficulty") or MAX_DIFFICULTY))
    plan = [*task.calls, ("submit_answer", {"answer": task.answer})]

    def policy(messages: list[dict]) -> dict:
        turn = min(sum(1 for m in messages if m.get("role") == "assistant"), len(plan) - 1)
        name, arguments = plan[turn]
        # One line of reasoning per turn: Qwen3 keeps a non-empty think block in later history, so the
        # next prompt extends this row (packing), and SFT teaches the model the same stream shape.
        thought = f"I submit {task.answer}." if name == "submit_answer" else f"I call {name}."
        return {"role": "assistant", "content": "", "reasoning_content": thought,
                "tool_calls": [{"type": "function", "function": {"name": name,
                                                                 "arguments": dict(arguments)}}]}

    return policy
