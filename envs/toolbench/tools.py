"""The toolbench tools: typed functions over the episode's world, registered on a FastMCP server.

Outputs are deliberately short (a few dozen tokens) because a tiny model is trained on them.
A tool raises BadToolInput on bad input; FastMCP turns that into a tool error the model sees.
"""
from __future__ import annotations

import ast
import datetime as dt
import logging
import math
import operator
from collections.abc import Callable, Collection
from typing import TypeVar

from fastmcp.exceptions import ToolError

from .world import TIER_DISCOUNT, World

T = TypeVar("T")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"round": round, "abs": abs, "min": min, "max": max}
# factor to the unit's base (kg for mass, m for length)
_UNITS = {"kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass",
                                                                                        0.028349523125),
          "m": ("length", 1.0), "km": ("length", 1000.0), "mi": ("length", 1609.344), "ft": ("length",
                                                                                             0.3048)}


class BadToolInput(ToolError, ValueError):
    """A bad call is an observation for the model, not a server fault: logged at debug, no traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(message, log_level=logging.DEBUG)


def fmt_number(x: float) -> str:
    """Integers without a decimal point, other numbers to at most 4 decimals: 25, 11.25, 0.3333."""
    if not math.isfinite(x):
        raise BadToolInput(f"result is not a finite number: {x}")
    text = f"{round(x, 4):.4f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def safe_eval(expression: str) -> float:
    """Arithmetic on numbers only: + - * / // % **, parentheses, round/abs/min/max. Never eval()."""
    if len(expression) > 200:
        raise BadToolInput("expression too long (max 200 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise BadToolInput(f"cannot parse {expression!r}; use numbers and + - * / ( )") from None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 10 or abs(left) > 1e6):
                raise BadToolInput("exponent too large")
            try:
                return _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise BadToolInput("division by zero") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords and 1 <= len(node.args) <= 4):
            return _FUNCS[node.func.id](*(ev(a) for a in node.args))
        raise BadToolInput(f"unsupported syntax in {expression!r}; use numbers and + - * / ( )")

    result = ev(tree)
    if isinstance(result, complex):
        raise BadToolInput("result is not a real number")
    return float(result)


def parse_date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text.strip())
    except ValueError:
        raise BadToolInput(f"bad date {text!r}; use YYYY-MM-DD") from None


def convert(value: float, from_unit: str, to_unit: str) -> float:
    src, dst = _UNITS.get(from_unit.strip().lower()), _UNITS.get(to_unit.strip().lower())
    if src is None or dst is None:
        raise BadToolInput(f"unknown unit; use one of {', '.join(_UNITS)}")
    if src[0] != dst[0]:
        raise BadToolInput(f"cannot convert {src[0]} to {dst[0]}")
    return round(value * src[1] / dst[1], 2)


def money(x: float) -> str:
    return f"${x:.2f}"


def by_id(find: Callable[[str], T | None], kind: str, raw: str) -> T:
    """Look an id up case-insensitively (P3, O104, C2); an unknown id is a tool error the model sees."""
    found = find(raw.strip().upper())
    if found is None:
        raise BadToolInput(f"unknown {kind}_id {raw!r}")
    return found


# The tools that read no world, in the order they are listed after the world's: plain functions, each
# registered under its own name.
def calculate(expression: str) -> str:
    """Evaluate arithmetic, e.g. 12.5*3 or (40-4)/2."""
    return fmt_number(safe_eval(expression))


def days_between(start: str, end: str) -> str:
    """Number of days from start to end (dates as YYYY-MM-DD)."""
    return str((parse_date(end) - parse_date(start)).days)


def add_days(date: str, days: int) -> str:
    """The date that is `days` days after `date` (YYYY-MM-DD)."""
    return (parse_date(date) + dt.timedelta(days=days)).isoformat()


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Convert between kg, g, lb, oz or m, km, mi, ft."""
    return fmt_number(convert(value, from_unit, to_unit))


def submit_answer(answer: str) -> str:
    """Submit the final answer (just the value, e.g. 42 or Lyon). Ends the episode."""
    return "Answer submitted."


PLAIN_TOOLS = (calculate, days_between, add_days, convert_units, submit_answer)


def register_tools(mcp, world: Callable[[], World], names: Collection[str] | None = None) -> None:
    """Register the 9 tools plus submit_answer on `mcp` (only `names`, when given), the world's five first;
    `world()` returns the episode's world."""

    def tool(fn):
        if names is None or fn.__name__ in names:
            mcp.tool(fn)
        return fn

    @tool
    def search_products(query: str) -> str:
        """Find products whose name contains the query. Returns id, name, price."""
        q = query.strip().lower()
        hits = [p for p in world().products if q and q in p.name]
        return "; ".join(f"{p.id} {p.name} {money(p.price)}"
                         for p in hits[:4]) or f"No product matches {query!r}."

    @tool
    def get_product(product_id: str) -> str:
        """Details of one product by id (e.g. P3)."""
        p = by_id(world().product, "product", product_id)
        return f"{p.id} {p.name}: {money(p.price)}, stock {p.stock}, {p.weight_kg} kg, {p.category}"

    @tool
    def find_customer(name: str) -> str:
        """Find a customer by (part of) their name. Returns id, city, tier."""
        q = name.strip().lower()
        hits = [c for c in world().customers if q and q in c.name.lower()]
        if not hits:
            raise BadToolInput(f"no customer named {name!r}")
        return "; ".join(f"{c.id} {c.name}, {c.city}, {c.tier} tier ({TIER_DISCOUNT[c.tier]}% off)"
                         for c in hits)

    @tool
    def list_orders(customer_id: str) -> str:
        """A customer's orders, oldest first."""
        c = by_id(world().customer, "customer", customer_id)
        return "; ".join(f"{o.id} {o.product_id} x{o.qty} on {o.date}" for o in world().orders_of(c.id))

    @tool
    def get_order(order_id: str) -> str:
        """One order by id (e.g. O104)."""
        o = by_id(world().order, "order", order_id)
        return f"{o.id}: {o.customer_id} bought {o.qty} x {o.product_id} on {o.date}"

    for fn in PLAIN_TOOLS:
        tool(fn)
