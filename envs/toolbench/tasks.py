"""Toolbench tasks: deterministic from (split, index, difficulty), with a verifiable answer and the
exact tool calls that solve them (the oracle's plan).

`difficulty` d in 1..4 draws a template needing between 1 and d tool calls (before submit_answer).
Expected answers are computed with the same functions the tools use, so the oracle's plan scores 1.0.

Questions quote product and customer names ("purple kettle") so a name in the question tokenizes
exactly as it does inside a tool call's JSON string argument (Qwen's BPE splits ` Quinn`, after a
space, and `Quinn`, after a quote, differently). The plans look records up by their one-word key (a
product's noun, a customer's last name; unique within a world), as a person would type into a search
box; the tools also accept the full name or any other unique part of it.
"""
from __future__ import annotations

import datetime as dt
import random
import re
from dataclasses import dataclass, field

from .tools import convert, fmt_number, parse_date, safe_eval
from .world import SPLITS, TIER_DISCOUNT, World, make_world

NUM_TASKS = {"train": 1_000_000, "eval": 500}
MAX_DIFFICULTY = 4
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Task:
    task_id: str
    split: str
    index: int
    difficulty: int
    template: str
    question: str
    answer: str
    kind: str  # "number" | "text"
    calls: tuple[tuple[str, dict], ...] = field(default=())  # the oracle's tool calls, in order
    world: World | None = None


def _price_task(w: World, rng: random.Random):
    p = rng.choice(w.products)
    return f'How much does the "{p.name}" cost?', [("search_products", {"query": p.key})], p.price, "number"


def _city_task(w: World, rng: random.Random):
    c = rng.choice(w.customers)
    return f'Which city does "{c.name}" live in?', [("find_customer", {"name": c.key})], c.city, "text"


def _stock_task(w: World, rng: random.Random):
    p = rng.choice(w.products)
    calls = [("search_products", {"query": p.key}), ("get_product", {"product_id": p.id})]
    return f'How many "{p.name}" units are in stock?', calls, p.stock, "number"


def _order_count_task(w: World, rng: random.Random):
    c = rng.choice(w.customers)
    calls = [("find_customer", {"name": c.key}), ("list_orders", {"customer_id": c.id})]
    return f'How many orders has "{c.name}" placed?', calls, len(w.orders_of(c.id)), "number"


def _total_price_task(w: World, rng: random.Random):
    p, q = rng.choice(w.products), rng.randint(2, 9)
    expr = f"{p.price:.2f}*{q}"
    calls = [("search_products", {"query": p.key}), ("calculate", {"expression": expr})]
    return f'What do {q} "{p.name}" units cost in total?', calls, safe_eval(expr), "number"


def _delivery_task(w: World, rng: random.Random):
    o, d = rng.choice(w.orders), rng.randint(2, 30)
    due = (parse_date(o.date) + dt.timedelta(days=d)).isoformat()
    calls = [("get_order", {"order_id": o.id}), ("add_days", {"date": o.date, "days": d})]
    return (
        f"Order {o.id} arrives {d} days after it was placed. On what date (YYYY-MM-DD)?",
        calls,
        due,
        "text",
    )


def _weight_lb_task(w: World, rng: random.Random):
    p = rng.choice(w.products)
    args = {"value": p.weight_kg, "from_unit": "kg", "to_unit": "lb"}
    calls = [("search_products", {"query": p.key}), ("get_product", {"product_id": p.id}), ("convert_units",
                                                                                            args)]
    return f'How many pounds does the "{p.name}" weigh?', calls, convert(p.weight_kg, "kg", "lb"), "number"


def _discount_task(w: World, rng: random.Random):
    c, p = rng.choice(w.customers), rng.choice(w.products)
    expr = f"{p.price:.2f}*(100-{TIER_DISCOUNT[c.tier]})/100"
    calls = [("find_customer", {"name": c.key}), ("search_products", {"query": p.key}),
             ("calculate", {"expression": expr})]
    return (
        f'What does "{c.name}" pay for the "{p.name}" after their tier discount?',
        calls,
        safe_eval(expr),
        "number",
    )


def _order_span_task(w: World, rng: random.Random):
    repeat = [c for c in w.customers if len(w.orders_of(c.id)) >= 2] or None
    if repeat is None:
        return _order_count_task(w, rng)
    c = rng.choice(repeat)
    first, last = w.orders_of(c.id)[0], w.orders_of(c.id)[-1]
    calls = [("find_customer", {"name": c.key}), ("list_orders", {"customer_id": c.id}),
             ("days_between", {"start": first.date, "end": last.date})]
    days = (parse_date(last.date) - parse_date(first.date)).days
    return f'How many days passed between the first and last order of "{c.name}"?', calls, days, "number"


def _order_cost_task(w: World, rng: random.Random):
    o = rng.choice(w.orders)
    p = w.product(o.product_id)
    expr = f"{p.price:.2f}*{o.qty}"
    calls = [("get_order", {"order_id": o.id}), ("get_product", {"product_id": p.id}),
             ("calculate", {"expression": expr})]
    return f"What was the total cost of order {o.id}?", calls, safe_eval(expr), "number"


def _order_weight_task(w: World, rng: random.Random):
    o = rng.choice(w.orders)
    p = w.product(o.product_id)
    expr = f"{p.weight_kg}*{o.qty}"
    kg = float(fmt_number(safe_eval(expr)))  # the model reads the calculate output, so convert that
    calls = [("get_order", {"order_id": o.id}), ("get_product", {"product_id": p.id}),
             ("calculate", {"expression": expr}), ("convert_units", {"value": kg, "from_unit": "kg",
                                                                     "to_unit": "lb"})]
    return f"How many pounds did order {o.id} weigh in total?", calls, convert(kg, "kg", "lb"), "number"


def _last_order_cost_task(w: World, rng: random.Random):
    c = rng.choice(w.customers)
    o = w.orders_of(c.id)[-1]
    p = w.product(o.product_id)
    expr = f"{p.price:.2f}*{o.qty}"
    calls = [("find_customer", {"name": c.key}), ("list_orders", {"customer_id": c.id}),
             ("get_product", {"product_id": p.id}), ("calculate", {"expression": expr})]
    return f'What did the most recent order of "{c.name}" cost?', calls, safe_eval(expr), "number"


# template name -> (tool calls needed, generator)
TEMPLATES = {
    "price": (1, _price_task), "city": (1, _city_task),
    "stock": (2, _stock_task), "order_count": (2, _order_count_task), "total_price": (2, _total_price_task),
    "delivery": (2, _delivery_task),
    "weight_lb": (3, _weight_lb_task), "discount": (3, _discount_task), "order_span": (3, _order_span_task),
    "order_cost": (3, _order_cost_task),
    "order_weight": (4, _order_weight_task), "last_order_cost": (4, _last_order_cost_task),
}
# template name -> the tools its plan calls (the order_span fallback, order_count, calls a subset)
TEMPLATE_TOOLS = {
    "price": ("search_products",), "city": ("find_customer",),
    "stock": ("search_products", "get_product"), "order_count": ("find_customer", "list_orders"),
    "total_price": ("search_products", "calculate"), "delivery": ("get_order", "add_days"),
    "weight_lb": ("search_products", "get_product", "convert_units"),
    "discount": ("find_customer", "search_products", "calculate"),
    "order_span": ("find_customer", "list_orders", "days_between"),
    "order_cost": ("get_order", "get_product", "calculate"),
    "order_weight": ("get_order", "get_product", "calculate", "convert_units"),
    "last_order_cost": ("find_customer", "list_orders", "get_product", "calculate"),
}


def tools_for(difficulty: int) -> list[str]:
    """The tools that tasks of up to `difficulty` calls need, plus submit_answer: what an env built for
    that difficulty lists (fewer tools, a shorter system prompt: 3 tools at difficulty 1, 10 at 3-4)."""
    names = {t for name, (calls, _) in TEMPLATES.items() if calls <= difficulty for t in TEMPLATE_TOOLS[name]}
    return sorted(names) + ["submit_answer"]


def make_task(split: str = "train", index: int = 0, difficulty: int = MAX_DIFFICULTY) -> Task:
    """The task at (split, index, difficulty); the same arguments always give the same task and world."""
    if split not in SPLITS:
        raise ValueError(f"toolbench split={split!r}: unknown split; use one of {SPLITS}")
    if not 0 <= index < NUM_TASKS[split]:
        raise ValueError(f"toolbench index={index}: out of range for split {split!r} "
                         f"(0..{NUM_TASKS[split] - 1})")
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"toolbench difficulty={difficulty}: use 1..{MAX_DIFFICULTY} (max tool calls per "
                         "task)")
    rng = random.Random(f"toolbench:{split}:{index}:{difficulty}")  # str seeds hash stably across runs
    world = make_world(rng, split)
    name = rng.choice(sorted(t for t, (calls, _) in TEMPLATES.items() if calls <= difficulty))
    question, calls, answer, kind = TEMPLATES[name][1](world, rng)
    answer_text = fmt_number(answer) if kind == "number" else str(answer)
    return Task(task_id=f"toolbench/{split}/d{difficulty}/{index}", split=split, index=index,
                difficulty=difficulty, template=name, question=question, answer=answer_text, kind=kind,
                calls=tuple(calls), world=world)


def check_answer(task: Task, answer: object) -> bool:
    """Exact match for text (case and punctuation ignored); numbers match within 0.011 (cent rounding),
    and a numeric answer must contain exactly one number ("P3 costs 12.50" is ambiguous, so wrong)."""
    text = str(answer).strip()
    if task.kind == "number":
        found = _NUMBER.findall(text.replace(",", ""))
        return len(found) == 1 and abs(float(found[0]) - float(task.answer)) <= 0.011
    norm = lambda s: re.sub(r"[^\w\-]", "", s).casefold()
    return norm(text) == norm(task.answer)
