"""A toolbench world: a tiny shop (products, customers, orders) generated from a seed.

Each episode gets its own world, so sessions never share state. The splits are compositional:
product names ("purple kettle") and customer names ("Quinn Berg") are combinations of words, and a
fixed fifth of the combinations (by a stable hash) is held out for eval, so no eval product or
customer, hence no eval question, ever appears in the train split, while every word of an eval name
also occurs in train names. A model has to read the name in the question and copy it into its tool
call (a memorized name is the wrong one); it is not asked to spell words it has never been trained
on, which a model trained from scratch, like the tiny CPU default, could not do at all. Order
numbers come from disjoint ranges.
"""
from __future__ import annotations

import datetime as dt
import random
import zlib
from dataclasses import dataclass

SPLITS = ("train", "eval")
_ADJECTIVES = ["red", "blue", "green", "black", "white", "silver", "golden", "tiny", "large", "smart",
               "pink", "yellow", "gray", "brown", "navy", "beige", "mini", "big", "compact", "classic",
               "modern", "vintage", "wooden", "steel", "glass", "plastic", "metal", "retro", "deluxe",
               "quiet",
               "portable", "bright", "dark", "soft", "slim", "heavy", "electric", "royal", "rustic", "sturdy",
               "purple", "orange", "amber", "ivory", "bronze", "copper", "teal", "crimson"]
_FIRST_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade",
                "Liam", "Emma", "Noah", "Olivia", "Lucas", "Mia", "Ethan", "Zoe", "Leo", "Ella",
                "Max", "Ivy", "Sam", "Lily", "Finn", "Ada", "Theo", "Iris", "Hugo", "Maya",
                "Oscar", "Ruby", "Felix", "Carmen", "Jonas", "Vera", "Tomas", "Elsa", "Marco", "Lara",
                "Yuki", "Aisha", "Ravi", "Sofia", "Pablo", "Nina", "Arjun", "Mei", "Tariq", "Ingrid",
                "Kai", "Lena", "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa"]
_ORDER_NUMBERS = {"train": range(100, 500), "eval": range(500, 1000)}
_NOUNS = {"kettle": "kitchen", "mug": "kitchen", "blender": "kitchen", "toaster": "kitchen",
          "lamp": "office", "chair": "office", "desk": "office", "clock": "office",
          "fan": "home", "heater": "home", "speaker": "home", "backpack": "travel"}
_LAST_NAMES = ["Diaz", "Okoro", "Smith", "Kim", "Novak", "Silva", "Ito", "Berg"]


def key_of(name: str) -> str:
    """A record's one-word key: a product's noun, a customer's last name (unique within a world)."""
    return name.split()[-1]


def split_of(name: str) -> str:
    """The split a product or customer name belongs to: a stable fifth of all names is eval's."""
    return "eval" if zlib.crc32(name.encode()) % 5 == 0 else "train"


PRODUCT_NAMES = {split: [name for a in _ADJECTIVES for n in _NOUNS if split_of(name := f"{a} {n}") == split]
                 for split in SPLITS}
CUSTOMER_NAMES = {split: [name for f in _FIRST_NAMES for last in _LAST_NAMES
                          if split_of(name := f"{f} {last}") == split] for split in SPLITS}
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

    @property
    def key(self) -> str:
        """The noun ("kettle"): no two products of a world share it, so it alone finds the product."""
        return key_of(self.name)


@dataclass(frozen=True)
class Customer:
    id: str
    name: str
    city: str
    tier: str

    @property
    def key(self) -> str:
        """The last name: no two customers of a world share it, so it alone finds the customer."""
        return key_of(self.name)


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


def _distinct_keys(rng: random.Random, pool: list[str], k: int) -> list[str]:
    """k names from `pool` with k different last words (each record has its own one-word key)."""
    by_key: dict[str, list[str]] = {}
    for name in pool:
        by_key.setdefault(key_of(name), []).append(name)
    return [rng.choice(by_key[key]) for key in rng.sample(sorted(by_key), k)]


def make_world(rng: random.Random, split: str) -> World:
    """6 products with different nouns, 4 customers with different last names and 1-3 orders each."""
    if split not in SPLITS:
        raise ValueError(f"toolbench split={split!r}: unknown split; use one of {SPLITS}")
    names = _distinct_keys(rng, PRODUCT_NAMES[split], 6)
    products = tuple(
        Product(id=f"P{i + 1}", name=name, price=round(rng.uniform(3, 200), 2), stock=rng.randint(0, 50),
                weight_kg=round(rng.uniform(0.2, 9.0), 1), category=_NOUNS[key_of(name)])
        for i, name in enumerate(names))
    people = _distinct_keys(rng, CUSTOMER_NAMES[split], 4)
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
