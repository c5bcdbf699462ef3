"""A toolbench world: a tiny shop (products, customers, orders) generated from a seed.

Each episode gets its own world, so sessions never share state. Train and eval worlds draw product
adjectives, customer first names and order numbers from disjoint pools, so no eval question can
appear in the train split (every question names a product, a customer or an order). The train pools
are several times larger than the eval ones, so a model cannot get by on memorized names: it has to
copy the name in the question into its tool call, which is what eval (unseen names) tests.
"""
from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass

SPLITS = ("train", "eval")
_ADJECTIVES = {
    "train": ["red", "blue", "green", "black", "white", "silver", "golden", "tiny", "large", "smart",
              "pink", "yellow", "gray", "brown", "navy", "beige", "mini", "big", "compact", "classic",
              "modern", "vintage", "wooden", "steel", "glass", "plastic", "metal", "retro", "deluxe", "quiet",
              "portable", "bright", "dark", "soft", "slim", "heavy", "electric", "royal", "rustic", "sturdy"],
    "eval": ["purple", "orange", "amber", "ivory", "bronze", "copper", "teal", "crimson"],
}
_FIRST_NAMES = {
    "train": ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade",
              "Liam", "Emma", "Noah", "Olivia", "Lucas", "Mia", "Ethan", "Zoe", "Leo", "Ella",
              "Max", "Ivy", "Sam", "Lily", "Finn", "Ada", "Theo", "Iris", "Hugo", "Maya",
              "Oscar", "Ruby", "Felix", "Carmen", "Jonas", "Vera", "Tomas", "Elsa", "Marco", "Lara",
              "Yuki", "Aisha", "Ravi", "Sofia", "Pablo", "Nina", "Arjun", "Mei", "Tariq", "Ingrid"],
    "eval": ["Kai", "Lena", "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa"],
}
_ORDER_NUMBERS = {"train": range(100, 500), "eval": range(500, 1000)}
_NOUNS = {"kettle": "kitchen", "mug": "kitchen", "blender": "kitchen", "toaster": "kitchen",
          "lamp": "office", "chair": "office", "desk": "office", "clock": "office",
          "fan": "home", "heater": "home", "speaker": "home", "backpack": "travel"}
_LAST_NAMES = ["Diaz", "Okoro", "Smith", "Kim", "Novak", "Silva", "Ito", "Berg"]
_CITIES = ["Lyon", "Oslo", "Porto", "Kyoto", "Lima", "Cairo", "Perth", "Quito"]
TIER_DISCOUNT = {"basic": 0, "silver": 5, "gold": 10}  # percent off
_YEAR_START = dt.date(2024, 1, 1)


@dataclass(frozen=True)
class Product:
    id: str
    name: str
    price: float  # USD, 2 decimals
    stock: int
    weight_kg: float  # 1 decimal
    category: str


@dataclass(frozen=True)
class Customer:
    id: str
    name: str
    city: str
    tier: str


@dataclass(frozen=True)
class Order:
    id: str
    customer_id: str
    product_id: str
    qty: int
    date: str  # YYYY-MM-DD


@dataclass(frozen=True)
class World:
    products: tuple[Product, ...]
    customers: tuple[Customer, ...]
    orders: tuple[Order, ...]

    def product(self, product_id: str) -> Product | None:
        return next((p for p in self.products if p.id == product_id), None)

    def customer(self, customer_id: str) -> Customer | None:
        return next((c for c in self.customers if c.id == customer_id), None)

    def order(self, order_id: str) -> Order | None:
        return next((o for o in self.orders if o.id == order_id), None)

    def orders_of(self, customer_id: str) -> list[Order]:
        return sorted((o for o in self.orders if o.customer_id == customer_id), key=lambda o: (o.date, o.id))


def make_world(rng: random.Random, split: str) -> World:
    """6 products, 4 customers with 1-3 orders each; names unique within the world."""
    if split not in SPLITS:
        raise ValueError(f"toolbench split={split!r}: unknown split; use one of {SPLITS}")
    names = rng.sample([f"{a} {n}" for a in _ADJECTIVES[split] for n in _NOUNS], 6)
    products = tuple(
        Product(id=f"P{i + 1}", name=name, price=round(rng.uniform(3, 200), 2), stock=rng.randint(0, 50),
                weight_kg=round(rng.uniform(0.2, 9.0), 1), category=_NOUNS[name.split()[1]])
        for i, name in enumerate(names))
    people = rng.sample([f"{f} {last}" for f in _FIRST_NAMES[split] for last in _LAST_NAMES], 4)
    customers = tuple(Customer(id=f"C{i + 1}", name=name, city=rng.choice(_CITIES),
                               tier=rng.choice(list(TIER_DISCOUNT)))
                      for i, name in enumerate(people))
    counts = [rng.randint(1, 3) for _ in customers]
    numbers = rng.sample(_ORDER_NUMBERS[split], sum(counts))
    orders, k = [], 0
    for c, count in zip(customers, counts):
        days = sorted(rng.sample(range(360), count))  # distinct dates per customer
        for day in days:
            date = (_YEAR_START + dt.timedelta(days=day)).isoformat()
            orders.append(Order(id=f"O{numbers[k]}", customer_id=c.id, product_id=rng.choice(products).id,
                                qty=rng.randint(1, 5), date=date))
            k += 1
    return World(products=products, customers=customers, orders=tuple(orders))
