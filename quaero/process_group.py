"""The torchrun process group as every part of quaero sees it: how many ranks torchrun started, this process's
rank, joining and leaving the group, and the collectives of plain values that the recipe
(quaero/recipe/ranks.py), the samplers and the trainer step (trainers/) share: sums, maxima, gathers, and rank
0's result for all.

Imported by quaero/ and trainers/ alike; the trainer's own data parallelism (the model wrap, the row split,
gradient sync) is trainers/distributed.py. `world_size() == 1` (no process group) is one process: every
function here is then the identity, so one code path serves both.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

Strategy = Literal["none", "ddp", "fsdp2"]


def launched_ranks() -> int:
    """How many ranks torchrun started; 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_ranks() -> int:
    """How many ranks torchrun started on this node; 1 outside torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_ranks() > 1 else 1


def local_rank() -> int:
    """This rank's index on its node (its CUDA device); 0 outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def setup(strategy: Strategy, device: torch.device) -> torch.device:
    """Join torchrun's process group (from its environment variables) and return this rank's device.

    gloo on CPU, nccl on CUDA; a CUDA rank takes the GPU of its LOCAL_RANK.
    """
    ranks = dist.get_world_size() if dist.is_initialized() else launched_ranks()
    if ranks > 1 and strategy == "none":
        raise ValueError(f"running under torchrun with {ranks} ranks but [distributed] strategy='none': "
                         "every rank would train on all rows alone; set strategy = 'ddp' or 'fsdp2'")
    if ranks == 1 or strategy == "none":
        return device
    if device.type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def world_size() -> int:
    """The ranks the step splits rows over (`setup` refuses a process group of several with strategy
    "none")."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
    return torch.device("cuda",
                        torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
