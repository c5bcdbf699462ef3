"""Data parallelism for the trainer: the process group, the model wrap, the row split, the step's sums.

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

`world_size() == 1` (no process group) is the one-process trainer: every function here is then the
identity, so one code path serves both.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

Strategy = Literal["none", "ddp", "fsdp2"]


def launched_ranks() -> int:
    """How many ranks the launcher (torchrun) started; 1 outside a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_ranks() -> int:
    """How many ranks the launcher started on this node; 1 outside a launcher."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_ranks() > 1 else 1


def local_rank() -> int:
    """This rank's index on its node (its CUDA device); 0 outside a launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def setup(strategy: Strategy, device: torch.device) -> torch.device:
    """Join the launcher's process group (from its environment variables) and return this rank's device.

    gloo on CPU, nccl on CUDA; a CUDA rank takes the GPU of its LOCAL_RANK.
    """
    ranks = dist.get_world_size() if dist.is_initialized() else launched_ranks()
    if ranks > 1 and strategy == "none":
        raise ValueError(f"running under a launcher with {ranks} ranks but [distributed] strategy='none': every "
                         "rank would train on all rows alone; set strategy = 'ddp' or 'fsdp2'")
    if ranks == 1 or strategy == "none":
        return device
    if device.type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def world_size() -> int:
    """The ranks the step splits rows over (`setup` refuses a process group of several with strategy "none")."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _sum_allreduce_hook(group, bucket):  # unannotated: DDP checks the annotation objects, not their strings
    """DDP's reduction without its division by the world size: the summed gradient."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_model(module: nn.Module, strategy: Strategy, device: torch.device, layers: list[nn.Module]) -> nn.Module:
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


def all_sum(values: list[int]) -> list[int]:
    """Element-wise sum over ranks of a few integers (exact: int64)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def all_max(value: int) -> int:
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def from_rank0(work: Callable[[], Any]) -> Any:
    """`work()` run on rank 0 alone, its result (or its exception) given to every rank.

    For what one process must do for all (take the run lock, pick the checkpoint to resume, write one):
    the other ranks wait here, then return the same value or raise the same error, so a failure on
    rank 0 ends every rank with its message instead of leaving them in a collective.
    """
    if world_size() == 1:
        return work()
    outcome: list[Any] = [None]
    error: Exception | None = None
    if rank() == 0:
        try:
            outcome[0] = ("ok", work())
        except Exception as e:  # noqa: BLE001 - whatever it is, every rank must raise it, not wait
            error, outcome[0] = e, ("error", _portable(e))
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if error is not None:
        raise error
    if kind == "error":
        raise value
    return value


def _portable(error: Exception) -> Exception:
    """`error` if it survives pickling (a one-message exception does), else a RuntimeError saying the same."""
    import pickle

    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any pickling failure: send the message instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def shutdown() -> None:
    """Leave the process group (a no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
