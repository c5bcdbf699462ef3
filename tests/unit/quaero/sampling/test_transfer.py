"""The weight-transfer source (quaero/sampling/transfer.py) sends what the file push writes."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.vllm
def test_the_weight_source_is_what_the_file_push_writes(tiny_lm):
    """The NCCL/IPC engines send the names, dtypes and shapes the file push saves, for the real tiny model
    (its tied LM head left out of both), in the order vLLM's NCCL engine checks iteration against."""
    from safetensors import safe_open
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from quaero.sampling.transfer import StateDictSource
    from quaero.sampling.vllm import saved_weights

    state = tiny_lm.state_dict()
    assert "lm_head.weight" in state  # tied: the same storage as the embedding
    with saved_weights(state) as folder, safe_open(f"{folder}/model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    source = StateDictSource(state)
    meta = source.metadata()
    assert {m.name: (m.dtype, m.shape) for m in meta} == {k: (v.dtype, tuple(v.shape)) for k,
                                                          v in saved.items()}
    assert len(meta) == len(saved) == len(state) - 1 and "lm_head.weight" not in saved
    pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))  # vLLM's own agreement check
    assert [n for n, _ in pairs] == [m.name for m in meta] == [k for k in state if k != "lm_head.weight"]
    assert all(torch.equal(t, saved[n]) and t.data_ptr() == state[n].data_ptr() for n, t in pairs)  # no copy
    assert [n for names, _ in source.iter_groups() for n in names] == [m.name for m in meta]
    source.set({k: v * 2 for k, v in state.items()})  # the next push: fresh tensors, same names
    assert torch.equal(dict(source)["model.norm.weight"], 2 * state["model.norm.weight"])
