"""Render adapter over `renderers==0.1.7`: sampling prompts, parsing, and the exact bridge.

- The sampling prompt of every turn is the normal full chat render with the generation prompt.
- The environment response is appended to the exact `prompt_ids + action_ids` by the renderer's
  `bridge_to_next_turn`, which never re-tokenizes the prefix. Its result carries no per-token roles
  (0.1.7 returns empty `message_indices`), so content tokens are found counterfactually: re-bridge
  with one message's content swapped for a sentinel; the tokens that change are that message's
  content (boundary tokens that BPE merged with content included). Everything else the bridge
  added is template scaffolding.
- The next turn's generation prompt is stripped from the response: it is not the environment's.
"""
from __future__ import annotations

from dataclasses import dataclass

from quaero.config import ModelConfig

# Two sentinels: when real content starts/ends with the same token as one, the other still differs.
_SENTINELS = ("A", "Z")


class BridgeFailure(Exception):
    """The renderer could not append the env response exactly; `.reason` is a short metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Bridged:
    """Tokens the bridge appended after prompt + action, up to (not including) the next generation prompt."""

    response_ids: list[int]
    response_kinds: list[str]  # per token: "scaffold" | "env" | "corrective"


def create_renderer(tokenizer, model_cfg: ModelConfig):
    """The renderer named in the config; Qwen3's thinking switch is not forwarded by create_renderer."""
    import renderers

    name = model_cfg.renderer
    if name == "auto":
        raise ValueError("[model] renderer='auto' is not allowed: name the renderer explicitly, e.g. 'qwen3'")
    if name == "qwen3":
        return renderers.Qwen3Renderer(tokenizer, enable_thinking=model_cfg.enable_thinking)
    return renderers.create_renderer(tokenizer, renderer=name)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _changed_range(full: list[int], other: list[int]) -> tuple[int, int]:
    """[start, stop) of `full` that differs from `other` (common prefix and suffix removed)."""
    start = _common_prefix(full, other)
    limit = min(len(full), len(other)) - start
    suffix = 0
    while suffix < limit and full[-1 - suffix] == other[-1 - suffix]:
        suffix += 1
    return start, len(full) - suffix


class RenderAdapter:
    def __init__(self, tokenizer, model_cfg: ModelConfig):
        self.tokenizer = tokenizer
        self.renderer = create_renderer(tokenizer, model_cfg)
        self.stop_token_ids: list[int] = list(self.renderer.get_stop_token_ids())
        probe = [{"role": "user", "content": "x"}]
        bare = self.renderer.render_ids(probe)
        with_gen = self.renderer.render_ids(probe, add_generation_prompt=True)
        assert with_gen[:len(bare)] == bare, "renderer's generation prompt is not an append"
        self.generation_prompt: list[int] = with_gen[len(bare):]

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The sampling prompt: the full chat render with the generation prompt."""
        return list(self.renderer.render_ids(messages, tools=tools or None, add_generation_prompt=True))

    def parse(self, completion_ids: list[int]) -> dict:
        """Sampled ids -> the assistant message that goes into the history and to the environment."""
        parsed = self.renderer.parse_response(list(completion_ids))
        calls = [{"type": "function", "function": tc.get("function", tc)} for tc in parsed.tool_calls or []]
        return {"role": "assistant", "content": parsed.content or "",
                "reasoning_content": parsed.reasoning_content or None, "tool_calls": calls or None}

    def encode_assistant(self, messages: list[dict], tools: list[dict] | None, assistant: dict) -> list[int]:
        """Token ids a model would have sampled to produce `assistant` after `messages` (scripted policies):
        the rendered assistant turn after the generation prompt, through its close token."""
        prompt = self.prompt_ids(messages, tools)
        full = list(self.renderer.render_ids([*messages, assistant], tools=tools or None))
        if full[:len(prompt)] != prompt:
            raise ValueError("encode_assistant: the assistant turn does not extend the generation prompt "
                             "(e.g. reasoning with enable_thinking=false)")
        ids = full[len(prompt):]
        closes = [i for i, t in enumerate(ids) if t in self.stop_token_ids]
        if not closes:
            raise ValueError("encode_assistant: rendered assistant turn has no close token")
        return ids[:closes[-1] + 1]

    def _bridge_ids(self, prompt_ids: list[int], action_ids: list[int], messages: list[dict],
                    tools: list[dict] | None) -> list[int]:
        try:
            out = self.renderer.bridge_to_next_turn(list(prompt_ids), list(action_ids), messages, tools=tools or None)
        except Exception as e:  # a renderer bug must not kill a run: counted as a fallback
            raise BridgeFailure("exception", f"{type(e).__name__}: {e}") from e
        if out is None:
            raise BridgeFailure("unsupported", "renderer returned None (no bridge for these messages)")
        ids = list(out.token_ids)
        prefix = len(prompt_ids) + len(action_ids)
        if ids[:prefix] != list(prompt_ids) + list(action_ids):
            raise BridgeFailure("prefix_mismatch", "bridge changed or dropped prompt/action tokens")
        return ids

    def bridge(self, prompt_ids: list[int], action_ids: list[int], messages: list[dict],
               tools: list[dict] | None, *, content_kind: str = "env") -> Bridged:
        """Append `messages` (the env response to this action) to the exact prompt + action ids.

        `content_kind` labels the messages' content tokens: "env" (ECHO target) or "corrective"."""
        full = self._bridge_ids(prompt_ids, action_ids, messages, tools)
        start = len(prompt_ids) + len(action_ids)
        kinds = ["scaffold"] * (len(full) - start)
        for i, msg in enumerate(messages):
            if not isinstance(msg.get("content"), str) or not msg["content"]:
                continue
            lo, hi = len(full), start
            for sentinel in _SENTINELS:
                swapped = [*messages[:i], {**msg, "content": sentinel}, *messages[i + 1:]]
                a, b = _changed_range(full, self._bridge_ids(prompt_ids, action_ids, swapped, tools))
                lo, hi = min(lo, a), max(hi, b)
            if lo < start:
                raise BridgeFailure("attribution", "content change reached into the prefix")
            kinds[lo - start:hi - start] = [content_kind] * (hi - lo)
        end = len(full)
        gen = self.generation_prompt
        if gen and full[-len(gen):] == gen and all(k == "scaffold" for k in kinds[len(kinds) - len(gen):]):
            end -= len(gen)
        return Bridged(full[start:end], kinds[:end - start])
