"""A tiny in-test ChatEnv (the quaero.envs session interface) for the rollout tests: a price lookup tool and
submit_answer. Modes exercise Qwen3's awkward cases: a follow-up user turn, parallel tool calls."""
from __future__ import annotations

from dataclasses import dataclass, field

PRICES = {"apple": 3, "pear": 5, "plum": 7, "fig": 11}
TOOLS = [
    {"type": "function", "function": {"name": "get_price", "description": "Price of one item in EUR.",
                                      "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                                                     "required": ["item"]}}},
    {"type": "function", "function": {"name": "submit_answer", "description": "Final answer; ends the episode.",
                                      "parameters": {"type": "object", "properties": {"answer": {"type": "string"}},
                                                     "required": ["answer"]}}},
]


@dataclass
class ChatReset:
    messages: list[dict]
    info: dict


@dataclass
class ChatStep:
    messages: list[dict]
    reward: float
    done: bool
    malformed: bool
    info: dict = field(default_factory=dict)


class EpisodeDroppedToy(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class ToyChatEnv:
    """Task i: the total price of items[i] (1-3 items). mode="followup": after the first tool result the
    user asks a new question (a real user turn). drop_at: raise the env layer's EpisodeDropped at that step."""

    tools = TOOLS

    def __init__(self, mode: str = "plain", drop_at: int | None = None, dropped_exc=EpisodeDroppedToy):
        self.mode, self.drop_at, self.dropped_exc = mode, drop_at, dropped_exc
        self.steps = 0

    def task(self, index: int) -> list[str]:
        names = sorted(PRICES)
        return [names[(index + k) % len(names)] for k in range(1 + index % 3)]

    def reset(self, seed=None, split=None, index=None) -> ChatReset:
        self.index, self.steps, self.asked_followup = int(index or 0), 0, False
        items = self.task(self.index)
        q = f"What do {', '.join(items)} cost together? Use get_price for each, then submit_answer."
        return ChatReset([{"role": "system", "content": "You are a shop assistant."},
                          {"role": "user", "content": q}], {"index": self.index, "items": items})

    def answer(self) -> int:
        return sum(PRICES[i] for i in self.task(self.index)) * (2 if self.asked_followup else 1)

    def step(self, assistant: dict) -> ChatStep:
        self.steps += 1
        if self.drop_at is not None and self.steps == self.drop_at:
            raise self.dropped_exc("server died")
        calls = assistant.get("tool_calls") or []
        names = [c["function"]["name"] for c in calls]
        if not calls or any(n not in ("get_price", "submit_answer") for n in names):
            return ChatStep([{"role": "user", "content": "Your reply had no valid tool call. Call a tool."}],
                            0.0, False, True)
        out = []
        for c in calls:
            args = c["function"].get("arguments") or {}
            if c["function"]["name"] == "submit_answer":
                ok = str(args.get("answer")) == str(self.answer())
                return ChatStep([{"role": "tool", "content": "correct" if ok else "wrong"}], float(ok), True, False,
                                {"success": ok})
            item = str(args.get("item"))
            out.append({"role": "tool", "content": f"{item}: {PRICES[item]} EUR" if item in PRICES
                        else f"error: unknown item {item!r}"})
        if self.mode == "followup" and not self.asked_followup:
            self.asked_followup = True
            out.append({"role": "user", "content": "Thanks. Actually I need two of each; what is the total now?"})
        return ChatStep(out, 0.0, False, False)

    def close(self) -> None:
        pass


def oracle(info: dict, *, reasoning: bool = True, parallel: bool = False):
    """Scripted policy: price lookups (one per turn, or all at once), then the answer."""
    items = list(info["items"])

    def act(messages: list[dict]) -> dict:
        done = sum(1 for m in messages if m["role"] == "tool" and "EUR" in m["content"])
        followup = any(m["role"] == "user" and "two of each" in m["content"] for m in messages)
        if done < len(items):
            todo = items[done:] if parallel else [items[done]]
            calls = [{"type": "function", "function": {"name": "get_price", "arguments": {"item": i}}} for i in todo]
            why = f"I need the price of {', '.join(todo)}."
        else:
            total = sum(PRICES[i] for i in items) * (2 if followup else 1)
            calls = [{"type": "function", "function": {"name": "submit_answer", "arguments": {"answer": str(total)}}}]
            why = f"The total is {total}."
        return {"role": "assistant", "content": "", "reasoning_content": why if reasoning else None,
                "tool_calls": calls}

    return act
