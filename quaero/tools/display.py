"""How the tools show what a run logged, bounded: a table cell, a line, strict JSON. A run's events are
written by code and read back from disk, so any field may be huge (a 100 MB string), mistyped (a list where a
number was), absurd (a 400-digit integer) or non-finite; what review and the benchmarks print of it stays a
few lines of text, and `--json` stays JSON every reader parses.
"""
from __future__ import annotations

import json
import math
from typing import Any

# no metric a run logs reaches this (tokens, bytes in MB, losses): a number beyond it is not a value (a
# 400-digit integer would overflow every float it meets), and any sum of such values stays a finite float
MAX_MAGNITUDE = 2.0**63
MAX_CELL = 60  # the widest table cell (a 100 MB field must not pad every row of the table to its width)
MAX_LINE = 2000  # the longest line review prints of what a run logged (a check's detail, an env's line)
MAX_JSON_TEXT = 10_000  # the longest string `--json` carries


def finite_number(v: Any) -> int | float | None:
    """A finite number of a sane size, or None for anything else (a mistyped, non-finite or absurdly large
    field is not a value: the table shows it as text)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v) or abs(v) >= MAX_MAGNITUDE:
        return None
    return v


def clip(text: str, limit: int) -> str:
    """`text` on one terminal line: control characters escaped (a logged escape sequence must not drive the
    terminal), cut at `limit` characters with the count of the rest."""
    if len(text) > limit:
        text = f"{text[:limit]}... (+{len(text) - limit:,} chars)"
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        text = json.dumps(text, ensure_ascii=False)[1:-1]
    return text


def cell(v: Any, limit: int = MAX_CELL) -> str:
    """A value as a table cell: a float in 4 significant digits, anything else (a huge or mistyped field)
    as its text, clipped."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= MAX_MAGNITUDE:
        return f"<an integer of {len(str(v)):,} digits>"
    if isinstance(v, (dict, list)):
        v = json.dumps(strict_json(v), ensure_ascii=False)
    return clip(str(v), limit)


def strict_json(v: Any) -> Any:
    """`v` as strict JSON takes it (RFC 8259: no NaN or Infinity): a non-finite float becomes null (the
    table shows it as nan/inf), an integer beyond MAX_MAGNITUDE its text (a string: no reader's number holds
    it), a string longer than MAX_JSON_TEXT is clipped with the count of the rest, tuples are lists and keys
    are strings."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= MAX_MAGNITUDE:
        return strict_json(str(v))
    if isinstance(v, str):
        return v if len(v) <= MAX_JSON_TEXT else f"{v[:MAX_JSON_TEXT]}... (+{len(v) - MAX_JSON_TEXT:,} chars)"
    if isinstance(v, dict):
        return {strict_json(str(k)): strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return v


def dump_json(v: Any) -> str:
    return json.dumps(strict_json(v), indent=2, allow_nan=False, default=str)
