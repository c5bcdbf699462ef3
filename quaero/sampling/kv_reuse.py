"""What the transformers sampler keeps between calls: the KV of token sequences it already ran, and the
draw that replaces a full-vocabulary `torch.multinomial`.

Exactness: a causal model's keys and values at position p depend only on tokens 0..p, so the KV of any
prefix of a cached sequence is the KV a fresh prefill of that prefix computes (to float rounding: another
batch shape sums in another order). A cache entry is keyed by its exact token ids, dropped whenever the
model's weights change (`PrefixKV.check`), and the store is bounded in bytes (least recently used first).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each [1, kv_heads, L, head_dim]
BLOCK = 1024  # the draw's first level: one float64 mass per block of this many vocabulary entries


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[B, V] probabilities (rows need not sum to exactly 1) -> [B] sampled ids, one uniform per row.

    Inverse CDF in two levels: a block by the float64 cumulative sum of the blocks' masses, then a token by
    the float64 cumulative sum inside that block, so P(token) = p / sum(p) with float64 bookkeeping (a float32
    cumulative sum over 151,936 entries would round every tail token's share to a multiple of 6e-8).
    torch.multinomial draws one exponential per vocabulary entry: ~20x slower on one CPU thread at V=151,936
    (`quaero bench sampler-reuse` prints both)."""
    B, V = probs.shape
    full = V // BLOCK
    masses = [probs[:, :full * BLOCK].reshape(B, full, BLOCK).sum(-1, dtype=torch.float64)] if full else []
    if V > full * BLOCK:
        masses.append(probs[:, full * BLOCK:].sum(-1, keepdim=True, dtype=torch.float64))
    cum = torch.cat(masses, dim=-1).cumsum(-1)  # [B, blocks]
    total = cum[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # as torch.multinomial refuses them
        raise ValueError("probability tensor contains nan, inf or a row of no mass: the model's logits are "
                         "not finite (a diverged model); nothing sampled from them")
    u = torch.rand((B, 1), generator=gen, dtype=torch.float64, device=probs.device) * cum[:, -1:]
    block = torch.searchsorted(cum, u, right=True)  # a block of mass > 0; u rounded up to the total: the last
    block = torch.minimum(block, (cum < cum[:, -1:]).sum(-1, keepdim=True))
    below = torch.where(block > 0, cum.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(u))
    frac = (u - below) / (cum.gather(-1, block) - below)  # [B, 1]: where in the block, [0, 1)
    idx = block * BLOCK + torch.arange(BLOCK, device=probs.device)  # [B, BLOCK]
    inner = probs.gather(-1, idx.clamp(max=V - 1)).masked_fill(idx >= V, 0.0).double().cumsum(-1)
    k = torch.searchsorted(inner, frac * inner[:, -1:], right=True)
    k = torch.minimum(k, (inner < inner[:, -1:]).sum(-1, keepdim=True))  # frac rounded to 1: the last p > 0
    return (block * BLOCK + k).squeeze(-1)


def reusable(model) -> bool:
    """Whether every layer keeps a plain, sliceable KV (no sliding window, no recurrent state)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        cache = DynamicCache(config=model.config)
    except (AttributeError, KeyError, TypeError, ValueError):  # layers transformers cannot map: no reuse
        return False
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


def weights_version(model) -> tuple:
    """Changes whenever any parameter is written in place (an optimizer step, a weight copy): the sampler may
    run the trainer's own module, which no `update_weights` call announces."""
    return tuple((p._version, p.data_ptr()) for p in model.parameters())  # `.data =` swaps the storage


class PrefixKV:
    """KV of exact token sequences, looked up by longest common prefix; bounded by `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[torch.Tensor, KV]] = OrderedDict()  # id -> (ids [L], kv)
        self._bytes = 0
        self._next = 0
        self._version: tuple | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def check(self, version: tuple) -> None:
        """Drop everything when the weights changed since the last check."""
        if version != self._version:
            self.clear()
            self._version = version

    def longest(self, ids: list[int], limit: int) -> tuple[int, KV | None]:
        """(n, KV of ids[:n]) for the longest cached prefix, n <= limit; (0, None) where none is."""
        if not self._entries or limit < 1:
            return 0, None
        query = torch.tensor(ids[:limit], dtype=torch.long)
        best, best_key = 0, None
        for key, (seq, _) in self._entries.items():
            n = min(len(seq), len(query))
            same = seq[:n] == query[:n]
            common = n if bool(same.all()) else int(same.to(torch.int8).argmin())
            if common > best:
                best, best_key = common, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key][1]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in kv]

    def put(self, ids: list[int], kv: KV) -> None:
        """Keep `kv` (cloned: a view would keep a whole batch's cache alive) as the KV of `ids`."""
        if not ids:
            return
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        seq = torch.tensor(ids, dtype=torch.long)
        for key, (old, _) in list(self._entries.items()):  # an entry this one extends is redundant
            if len(old) <= len(seq) and bool((seq[:len(old)] == old).all()):
                self._drop(key)
        while self._entries and self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = (seq, [(k.clone(), v.clone()) for k, v in kv])
        self._next += 1
        self._bytes += size

    def _drop(self, key: int) -> None:
        _, kv = self._entries.pop(key)
        self._bytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
