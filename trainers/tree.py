"""Exact tree training: a microbatch's rows packed as a token trie and forwarded once.

Rows that share a prefix (a group's system prompt, tool list and task; a multi-turn group's first action and
env response) repeat those tokens. Packed as a trie, each distinct prefix token is one node: the backbone runs
over the trie's N unique tokens as one sequence `[1, N]`, each node at its depth as position id, with an
ancestor mask (a node attends to itself and its ancestors, nothing else). Nodes are numbered in DFS preorder
with entry/exit times, so the mask is TRL's rule: q sees k iff tin[k] <= tin[q] < tout[k].

Every node's hidden state is then the one its rows compute (same tokens, same positions, same visible keys;
masked keys add exactly 0 to the softmax), and `gather` puts each row's hidden states back as `[B, L, H]`.
The selective head runs on that per-row view unchanged, so a shared node's next-token target may differ per
row (the branch point) and every loss term reads the same `[B, L-1]` log-probs as without packing. The
prefix stays in the autograd graph: the gather's backward sums every row's gradient into the shared node.

The mask replaces the model's own causal mask, so a family takes it only where that mask is all its
attention does: SDPA (a boolean mask) or eager attention (an additive one), full attention or sliding
windows no row outgrows. Anything else falls back to the per-row forward with its reason counted
(`tree_support`), and a trainer's first packed forward is checked against the per-row one (`probe`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# "auto" packs a microbatch when the trie's estimated backbone FLOPs are at most this fraction of the padded
# rows' (`tree_pays`): the masked attention runs over all N unique tokens (N^2, not the rows' B x L^2), so a
# trie of unrelated rows costs more than the rows; a model config without the sizes the estimate reads falls
# back to a token ratio at most AUTO_MAX_RATIO
AUTO_MAX_COST = 0.8
AUTO_MAX_RATIO = 0.6
PROBE_TOL = 1e-4  # relative, fp32: packing reorders the attention sums only (3e-2 in lower precision)


@dataclass
class TreePack:
    """One microbatch's trie: its unique tokens in DFS preorder and where each row's tokens sit in it."""

    input_ids: Tensor  # [1, N] long, the trie's tokens
    position_ids: Tensor  # [1, N] long, each node's depth (its position in every row that holds it)
    exit: Tensor  # [N] long, tout: one past the last node of each node's subtree (tin is the node's index)
    gather: Tensor  # [B, L] long, the node of each row token (0 at padding, which no loss reads)
    row_tokens: int  # real tokens of the rows

    @property
    def unique_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def ratio(self) -> float:
        """Unique tokens / row tokens (1.0: nothing shared)."""
        return self.unique_tokens / max(self.row_tokens, 1)

    def mask(self, implementation: str, dtype: torch.dtype) -> Tensor:  # [1, 1, N, N]
        """The ancestor mask, as the attention implementation reads a custom 4D mask: SDPA a boolean one
        (True: attend), eager attention an additive one (0 or the dtype's minimum)."""
        tin = torch.arange(self.unique_tokens, device=self.exit.device)
        sees = (tin[None, :] <= tin[:, None]) & (tin[:, None] < self.exit[None, :])  # [q, k]
        if implementation == "sdpa":
            return sees[None, None]
        zero = torch.zeros((), dtype=dtype, device=sees.device)
        return torch.where(sees, zero, torch.finfo(dtype).min)[None, None]

    def unpack(self, packed: Tensor) -> Tensor:  # [1, N, ...] -> [B, L, ...]
        """Per-row view of a packed tensor (hidden states, logits); differentiable."""
        return packed[0][self.gather]


def pack_rows(input_ids: Tensor, attention_mask: Tensor) -> TreePack:
    """The trie of a right-padded microbatch ([B, L]); rows keep their tokens where `attention_mask` is 1."""
    lengths = attention_mask.sum(dim=1).tolist()
    rows = input_ids.tolist()
    children: list[dict[int, int]] = [{}]  # node 0: a virtual root above every row's first token
    token: list[int] = [-1]
    path_of: list[list[int]] = []
    for row, n in zip(rows, lengths):
        node, path = 0, []
        for tok in row[:n]:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(token)
                children[node][tok] = nxt
                children.append({})
                token.append(tok)
            node = nxt
            path.append(node)
        path_of.append(path)
    order, depth = _preorder(children)  # trie nodes (root excluded) in DFS preorder, and their depths
    tin = [0] * len(token)
    for i, node in enumerate(order):
        tin[node] = i
    exit_ = list(range(1, len(order) + 1))
    for i in range(len(order) - 1, -1, -1):  # a subtree ends where its last descendant's does
        for child in children[order[i]].values():
            exit_[i] = max(exit_[i], exit_[tin[child]])
    gather = torch.zeros_like(input_ids)
    for b, path in enumerate(path_of):
        gather[b, :len(path)] = torch.tensor([tin[node] for node in path], dtype=torch.long)
    device = input_ids.device
    return TreePack(torch.tensor([[token[n] for n in order]], device=device),
                    torch.tensor([[depth[n] for n in order]], device=device),
                    torch.tensor(exit_, device=device), gather.to(device), int(sum(lengths)))


def _preorder(children: list[dict[int, int]]) -> tuple[list[int], dict[int, int]]:
    """The nodes below the root in DFS preorder (children in insertion order) and each node's depth."""
    order: list[int] = []
    depth = {0: -1}
    stack = list(reversed(children[0].values()))
    for c in stack:
        depth[c] = 0
    while stack:
        node = stack.pop()
        order.append(node)
        for c in reversed(children[node].values()):
            depth[c] = depth[node] + 1
            stack.append(c)
    return order, depth


def tree_support(config, max_row_len: int) -> str:
    """Why a model with this config cannot take the ancestor mask ("" when it can)."""
    if config is None:
        return "no model config to read its attention from"
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no custom 4D mask here (sdpa and eager do)"
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in layer_types or (
        not layer_types and window and getattr(config, "use_sliding_window", True))
    if sliding and window and max_row_len > window:
        return (f"sliding-window layers (window {window}) and a row of {max_row_len} tokens: the 4D mask "
                "would replace the window")
    return ""


def should_pack(mode: str, pack: TreePack, config, rows_shape: tuple[int, int]) -> bool:
    """`train_tree_packing`: "on" packs every microbatch, "auto" those where it pays, "off" none."""
    return mode == "on" or (mode == "auto" and tree_pays(pack, config, rows_shape))


def tree_pays(pack: TreePack, config, rows_shape: tuple[int, int]) -> bool:
    """Whether the trie's backbone FLOPs (N tokens through the layers' matmuls, N^2 attention pairs) are at
    most AUTO_MAX_COST of the padded rows' ([B, L]: B x L tokens, B x L^2 pairs), from the config's sizes."""
    return trie_pays(pack.unique_tokens, pack.row_tokens, config, rows_shape)


def trie_pays(unique: int, row_tokens: int, config, rows_shape: tuple[int, int]) -> bool:
    """`tree_pays` from the figures alone: a trie of `unique` tokens over rows of `row_tokens` real tokens
    padded to `rows_shape` (what the microbatch planner and the memory plan know before any trie is built)."""
    sizes = [getattr(config, k, None) for k in ("hidden_size", "num_attention_heads", "intermediate_size")]
    if not all(isinstance(v, int) for v in sizes):
        return unique / max(row_tokens, 1) <= AUTO_MAX_RATIO
    hidden, heads, inter = sizes
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    per_token = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv + 3 * hidden * inter)
    per_pair = 4 * heads * head_dim  # q.k and p.v, a multiply-add each
    B, L = rows_shape
    n = unique
    return n * per_token + n * n * per_pair <= AUTO_MAX_COST * (B * L * per_token + B * L * L * per_pair)


def packed_cost(unique: int, rows_shape: tuple[int, int], config) -> float:
    """A packed microbatch's activation memory in backbone tokens (the unit `micro_batch_tokens` counts): the
    trie's `unique` tokens, plus what the packed forward holds beside them, each against one trie token's
    saved activations: the rows' `[B, L, H]` hidden states gathered back (H elements a padded row token) and
    the `[N, N]` boolean ancestor mask (a byte an entry). A trie token saves at least layers x (4 hidden + 4
    intermediate) elements of at least 2 bytes (quaero/preflight/memory_plan.py counts more), so the extras
    are never undercounted; a config without those sizes counts a row token as 1/16 of a trie token."""
    B, L = rows_shape
    sizes = [getattr(config, k, None) for k in ("hidden_size", "num_hidden_layers", "intermediate_size")]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return unique + B * L / 16 + unique * unique / 2**16
    hidden, layers, inter = sizes
    saved = layers * (4 * hidden + 4 * inter)  # elements a trie token saves, at least
    return unique + B * L * hidden / saved + unique * unique / (2 * saved)


def planner_cost(mode: str, parts, max_row_len: int, *, blocker: str = ""
                 ) -> Callable[[int, int, int, int], float] | None:
    """How trainers/batch.py's planner costs a microbatch where `train_tree_packing` = `mode` will pack it:
    `cost(unique, row_tokens, rows, longest)` in backbone tokens, the trie's (`packed_cost`) where the
    microbatch will run packed ("on", or "auto" where `trie_pays`), its padded rows' where it will not. None
    where nothing will pack (mode "off", this trainer's `blocker`, a model that cannot take the mask): the
    rows are planned on their padded tokens, as every forward will run them."""
    if mode == "off" or blocker or tree_support(parts.config, max_row_len) or probe(parts):
        return None
    config = parts.config

    def cost(unique: int, row_tokens: int, rows: int, longest: int) -> float:
        if mode == "on" or trie_pays(unique, row_tokens, config, (rows, longest)):
            return packed_cost(unique, (rows, longest), config)
        return rows * longest
    return cost


@dataclass
class TreeInfo:
    """What one microbatch's packing decision was, for the step's counters."""

    packed: bool = False
    unique_tokens: int = 0  # of the trie (0: packing off, no trie built)
    row_tokens: int = 0
    fallback_reason: str = ""  # packing was asked for and the model cannot take it


def choose_tree(mode: str, parts, input_ids: Tensor, attention_mask: Tensor, *, blocker: str = ""
                ) -> tuple[TreePack | None, TreeInfo]:
    """The trie to forward this microbatch through (None: the rows), by `train_tree_packing` = `mode`.
    `blocker`: why this trainer cannot pack at all (its kernels, its sharding), else ""."""
    if mode == "off":
        return None, TreeInfo()
    pack = pack_rows(input_ids, attention_mask)
    info = TreeInfo(unique_tokens=pack.unique_tokens, row_tokens=pack.row_tokens)
    if not should_pack(mode, pack, parts.config, tuple(input_ids.shape)):
        return None, info
    info.fallback_reason = blocker or tree_support(parts.config, input_ids.shape[1]) or probe(parts)
    info.packed = not info.fallback_reason
    return (pack if info.packed else None), info


@torch.no_grad()
def probe(parts) -> str:
    """Once per model: two rows sharing a prefix, packed vs per row, must give the same hidden states ("" when
    they do, else why not): a family whose attention ignores the 4D mask or the position ids falls back."""
    cached = getattr(parts, "tree_probe", None)
    if cached is not None:
        return cached
    was_training, counted = parts.model.training, parts.counter.count
    parts.model.eval()
    try:
        vocab = parts.lm_head.weight.shape[0] if parts.lm_head is not None else 8
        device = parts.lm_head.weight.device if parts.lm_head is not None else "cpu"
        ids = (torch.tensor([[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10, 0]], device=device) % vocab)
        attn = torch.tensor([[1] * 6, [1] * 5 + [0]], device=device)
        want = parts.hidden_states(ids, attn).float()
        got = parts.hidden_states(ids, attn, pack_rows(ids, attn)).float()
        err = ((got - want).abs() * attn[..., None]).max().item() / max(want.abs().max().item(), 1.0)
        tol = PROBE_TOL if parts.lm_head.weight.dtype == torch.float32 else 3e-2
        parts.tree_probe = "" if err <= tol else (
            f"the packed forward differs from the per-row one by {err:.2e} (relative) on a probe: this "
            "model's attention does not take the ancestor mask or the position ids")
    except (RuntimeError, ValueError, TypeError) as exc:
        parts.tree_probe = f"the packed forward failed on a probe: {type(exc).__name__}: {exc}"[:300]
    finally:
        parts.model.train(was_training)
        parts.counter.count = counted  # the probe's forwards are no step's
    return parts.tree_probe
