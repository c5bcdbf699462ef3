"""Server mode's weight push through vLLM's weight-transfer engines (`[sampler] weight_transfer = "nccl" |
"ipc"`).

quaero drives vLLM's own trainer engines (`WeightTransferTrainerFactory.trainer_init`, vLLM 0.32's
`vllm/distributed/weight_transfer/`); it implements only what vLLM leaves to the trainer:
- `StateDictSource`: the `WeightSource` the engine sends from, the tensors the file push writes
  (`pushed_tensors`: the tied LM head left out, vLLM ties it again), on the trainer's device;
- `ServerWeightSync`: vLLM's `VLLMWeightSyncClient` protocol over one server's HTTP routes
  (`vllm/entrypoints/rl/online/api_router.py`), posted through the sampler's own `_post`, so a failed call
  names the server and, for a server quaero started that has exited, its log tail.

One trainer engine per server. vLLM's NCCL engine puts every worker at rank_offset 1 after the one sender,
so several servers cannot join one group: each gets a group of its own (world size 2, its own port on
127.0.0.1), and the pushes run one server after another. IPC needs no rendezvous; an engine per server
keeps both backends one code path. Every quaero rank drives its own servers, so each engine's trainer
rank is 0 (the sender). Under torchrun vLLM's IPC engine all-gathers the handles over the default process
group (every rank pushes in lockstep, `sync_sampler`) and each server, on its rank's GPU, picks its own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine, WeightSource
from vllm.distributed.weight_transfer.clients import _json_safe_update_payload
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from quaero.sampling.supervisor import free_port
from quaero.sampling.vllm import pushed_tensors

Post = Callable[[str, str, "dict | None"], dict]  # (url, path, JSON body) -> reply: VLLMServerSampler._post


class StateDictSource(WeightSource):
    """The trainer's exported weights as vLLM's `WeightSource`: name, dtype and shape of every tensor the
    file push writes, in the state dict's order. `set` before each push (exports alias live parameters)."""

    def __init__(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors = pushed_tensors(state_dict or {})

    def set(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.tensors = pushed_tensors(state_dict)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()  # full tensors: export_weights gathered any FSDP2 shard


class ServerWeightSync:
    """vLLM's `VLLMWeightSyncClient` for one server: the four calls a trainer engine makes, as the JSON bodies
    vLLM's HTTP routes take (IPC handles pickled by vLLM's own `_json_safe_update_payload`)."""

    def __init__(self, url: str, post: Post) -> None:
        self.url, self._post = url, post

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post(self.url, "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post(self.url, "/start_weight_update", None)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post(self.url, "/update_weights", {"update_info": _json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post(self.url, "/finish_weight_update", None if weight_version is None else
                   {"weight_version": weight_version})


def trainer_init_info(backend: str):
    """This trainer's side of one engine: rank 0 (the sender); NCCL adds a group of 2 on a free local port."""
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0)
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=0)
    raise ValueError(f"[sampler] weight_transfer={backend!r}: vLLM's engines here are 'nccl' and 'ipc'")


class WeightTransfer:
    """One vLLM trainer engine per server, connected at the first push (NCCL: both sides join the group
    then), each sending `source` again at every push."""

    def __init__(self, backend: str, urls: list[str], post: Post) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"[sampler] weight_transfer={backend!r}: vLLM's NCCL/IPC weight transfer "
                               "needs CUDA and none is available here (the CPU build has neither); use "
                               "weight_transfer = 'file'")
        self.backend, self.urls, self._post = backend, list(urls), post
        self.source = StateDictSource()
        self.engines: list[TrainerWeightTransferEngine] = []

    def push(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.source.set(state_dict)
        if not self.engines:
            self.engines = [WeightTransferTrainerFactory.trainer_init(
                trainer_init_info(self.backend), client=ServerWeightSync(url, self._post), source=self.source)
                for url in self.urls]
        for engine in self.engines:
            engine.send_weights()

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        self.engines = []
