"""How an episode's transitions become rows (`EchoRow`, the contract in quaero/rows.py): packed, one row per
episode where the renderer bridges each response exactly, or one row per transition."""
from __future__ import annotations

from dataclasses import dataclass

from quaero.rows import EchoRow, RowError, Span


@dataclass
class Transition:
    """One executed turn, exactly as sampled and bridged.

    prompt_ids: the full-render sampling prompt the sampler was given.
    action_ids / action_logprobs: exactly what the sampler returned (never re-encoded).
    response_ids / response_kinds: the env response the renderer bridged onto prompt + action
    (scaffold, env content or corrective content per token); empty when the bridge fell back.
    guided: the action is a guide's (the env's oracle, `[guidance] mode`): its row marks those tokens.
    """

    turn: int
    prompt_ids: list[int]
    action_ids: list[int]
    action_logprobs: list[float]
    response_ids: list[int]
    response_kinds: list[str]
    finish_reason: str = "stop"
    guided: bool = False  # a guide chose the action (`[guidance] mode`), not the sampler

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.action_ids + self.response_ids


class _RowBuilder:
    def __init__(self, include_scaffold: bool):
        self.include_scaffold = include_scaffold
        self.ids: list[int] = []
        self.spans: list[Span] = []
        self.logprobs: list[float] = []
        self.weights: list[float] = []
        self.turns: list[int] = []
        self.guided: list[bool] = []

    def _add(self, kind: str, ids: list[int], turn: int, logprobs: list[float] | None = None,
             guided: bool = False) -> None:
        if not ids:
            return
        start = len(self.ids)
        self.ids += ids
        self.guided += [guided] * len(ids)
        self.spans.append(Span(kind, start, len(self.ids), turn))
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        w = 1.0 if kind == "env" or (kind == "scaffold" and self.include_scaffold) else 0.0
        self.weights += [w] * len(ids)

    def add(self, t: Transition) -> None:
        self._add("prompt", t.prompt_ids[len(self.ids):], t.turn)  # the whole prompt, or the new suffix
        self._add("action", t.action_ids, t.turn, list(t.action_logprobs), t.guided)
        i = 0
        while i < len(t.response_ids):  # one span per run of equal kinds
            j = i
            while j < len(t.response_ids) and t.response_kinds[j] == t.response_kinds[i]:
                j += 1
            self._add(t.response_kinds[i], t.response_ids[i:j], t.turn)
            i = j
        self.turns.append(t.turn)

    def row(self, split: str | None = None) -> EchoRow:
        """The row; `split`: why it starts where the episode's previous row ends (`split_reason`)."""
        weights = list(self.weights)
        if weights:
            weights[0] = 0.0  # token 0 has no left context
        layout = "packed" if len(self.turns) > 1 else "transition"
        meta = {"turns": list(self.turns), "layout": layout, **({"split": split} if split else {})}
        return EchoRow(self.ids, self.spans, [0.0] * len(self.ids), weights, self.logprobs, meta=meta,
                       guided=list(self.guided) if any(self.guided) else [])


def build_rows(transitions: list[Transition], *, packing: bool = True, include_scaffold: bool = False,
               max_seq_len: int | None = None) -> list[EchoRow]:
    """Lay an episode's transitions out as rows.

    Per-transition (retrain's layout): one row per turn, [prompt | action | env response].
    Packed: when a turn's sampling prompt is an exact token extension of the current row, the turn is
    appended to it (only the prompt's new suffix is added), so a T-turn episode costs O(T) tokens instead
    of O(T^2). Every target keeps exactly the same tokens to its left, so its log-prob is unchanged;
    otherwise a new row starts, exact as well (its meta's `split` says why: `split_reason`). Advantages are 0
    here; `EchoRow.with_advantage` sets them.

    Lengths: a packed row is exactly as long as its last transition (that turn's prompt holds the whole
    row before it), so when every transition fits `max_seq_len` every row does; the episode driver cuts
    transitions to fit, and a longer one is a RowError here.
    """
    rows: list[EchoRow] = []
    cur: _RowBuilder | None = None
    split: str | None = None
    for before, t in zip([None, *transitions], transitions):
        if max_seq_len is not None and len(t.ids) > max_seq_len:
            raise RowError(f"turn {t.turn} holds {len(t.ids)} tokens, more than max_seq_len={max_seq_len}")
        extends = cur is not None and packing and t.prompt_ids[:len(cur.ids)] == cur.ids
        if not extends:
            if cur is not None:
                rows.append(cur.row(split))
                split = split_reason(cur.ids, before, t) if packing else "packing_off"
            cur = _RowBuilder(include_scaffold)
        cur.add(t)
    if cur is not None:
        rows.append(cur.row(split))
    return rows


def split_reason(row: list[int], before: Transition, t: Transition) -> str:
    """Why turn `t` starts a new row after the row `row` that ends with transition `before`: where its prompt
    first differs from the row. `history_rerendered`: inside `before`'s own prompt (the template renders an
    earlier turn otherwise once more messages follow); `reply_rerendered`: inside the sampled reply (the
    template renders it otherwise than sampled: Qwen3 drops a reply's reasoning once a new user query
    follows, and an empty `<think></think>` on any turn but the last); `response_rerendered`: inside the
    bridged env response (or past the row's end: the next prompt is shorter)."""
    at = next((i for i, (a, b) in enumerate(zip(row, t.prompt_ids)) if a != b),
              min(len(row), len(t.prompt_ids)))
    if at < len(before.prompt_ids):
        return "history_rerendered"
    replied = len(before.prompt_ids) + len(before.action_ids)
    return "reply_rerendered" if at < replied else "response_rerendered"


def per_transition_tokens(transitions: list[Transition]) -> int:
    """Tokens the per-transition layout would train for these transitions (the O(T^2) baseline)."""
    return sum(len(t.ids) for t in transitions)


def token_identity_errors(rows: list[EchoRow], transitions: list[Transition]) -> list[str]:
    """Where a row's prompt + action tokens differ from what the sampler was given and returned."""
    by_turn = {s.turn: (row, s) for row in rows for s in row.spans if s.kind == "action"}
    errors = []
    for t in transitions:
        if not t.action_ids:
            continue
        row, span = by_turn.get(t.turn, (None, None))
        if row is None:
            errors.append(f"turn {t.turn}: no row holds its action")
        elif row.input_ids[:span.start] != t.prompt_ids or row.input_ids[span.start:span.end] != t.action_ids:
            errors.append(f"turn {t.turn}: row prompt/action ids differ from the sampled ones")
        elif row.sampler_logprobs[span.start:span.end] != list(t.action_logprobs):
            errors.append(f"turn {t.turn}: row sampler log-probs differ from the sampler's")
    return errors
