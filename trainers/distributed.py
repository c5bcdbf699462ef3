"""Data parallelism for the trainer: the model wrap, the row split, gradient sync.

Under `torchrun` every rank holds the same full row list and the same model. The step then equals the
one-process step on those rows, not an approximation of it:
- rows are split by tokens (`split_rows`: greedy, longest first, deterministic, so every rank computes
  the same split without talking);
- the loss denominators (RL tokens, ECHO tokens) are summed over ranks before any loss is computed, so
  each rank's terms are its share of the one-process sum;
- gradients are SUMMED over ranks (DDP and FSDP2 average by default: `wrap_model` turns that off), so
  the summed gradient is the one-process gradient; clipping then reads the global norm (replicated
  grads under DDP, DTensor grads under FSDP2);
- every rank runs the same number of forwards (`padding_microbatches`), because FSDP2 gathers
  parameters in each forward and DDP reduces in the last backward: a rank short of rows runs
  zero-loss forwards instead of skipping collectives the others wait in.

The process group itself (joining it, ranks, the sums and gathers the step needs) is quaero/process_group.py,
which the recipe shares. `world_size() == 1` (no process group) is the one-process trainer: every function
here is then the identity, so one code path serves both.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from quaero.process_group import Strategy, world_size
from trainers.batch import common_prefix


def _sum_allreduce_hook(group, bucket):  # unannotated: DDP checks the annotation objects, not their strings
    """DDP's reduction without its division by the world size: the summed gradient."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_model(module: nn.Module, strategy: Strategy, device: torch.device,
               layers: list[nn.Module]) -> nn.Module:
    """`module` wrapped for `strategy` across the process group (unchanged with one rank).

    DDP: one replica per rank, gradients summed by `_sum_allreduce_hook`. Buffers are synced once, not
    in every forward (they are constant here, and a sync per forward is one more collective to align).
    FSDP2: each decoder layer in `layers` is its own shard unit and `module` the root, which owns the
    embeddings, the final norm and the LM head. The root unshards its parameters in its own forward and
    keeps them until backward, so the selective path, which calls the head apart from the backbone
    inside `module.forward` (and may recompute it in backward), always sees the full head.
    """
    if world_size() == 1 or strategy == "none":
        return module
    if strategy == "ddp":
        ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False)
        ddp.register_comm_hook(None, _sum_allreduce_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # sum, not mean, over ranks
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return module


def set_gradient_sync(module: nn.Module, enabled: bool) -> Any:
    """A context in which backward reduces gradients across ranks (`enabled`) or only accumulates them."""
    import contextlib

    if isinstance(module, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    setter = getattr(module, "set_requires_gradient_sync", None)  # FSDP2
    if setter is not None:
        setter(enabled)
    return contextlib.nullcontext()


def split_rows(lengths: list[int], ranks: int) -> list[list[int]]:
    """Row indices per rank, balanced by tokens: longest row first, each to the rank with the fewest tokens.

    Ties break on the lower row index and the lower rank, so every rank computes the same split.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in order:
        r = min(range(ranks), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def split_trees(ids: list[list[int]], ranks: int) -> list[list[int]]:
    """Row indices per rank for tree training (trainers/tree.py): rows in prefix order (lexicographic), cut
    into `ranks` contiguous runs balanced by unique tokens, so rows that share a prefix stay on one rank and
    its trie forwards the prefix once. A row's unique tokens in that order are those past its common prefix
    with the row before it (what it adds to the trie)."""
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    cost = [len(ids[i]) - common_prefix(ids[order[k - 1]], ids[i]) if k else len(ids[i])
            for k, i in enumerate(order)]
    total, shares, done = sum(cost), [[] for _ in range(ranks)], 0
    for i, c in zip(order, cost):
        # the rank whose slice of the running total this row's midpoint falls in
        r = min(ranks - 1, int((done + c / 2) * ranks / max(total, 1)))
        shares[r].append(i)
        done += c
    return [sorted(s) for s in shares]
