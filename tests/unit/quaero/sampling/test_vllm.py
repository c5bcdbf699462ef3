"""The vLLM sampler's parts that run without the engine (quaero/sampling/vllm.py): what a weight push sends
and saves, the CPU build's prefill settings, and where the engine runs. The engine itself:
tests/engines/test_sampling.py (marked vllm)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from quaero.sampling.vllm import (
    MULTIPROCESSING,
    cpu_whole_prefill,
    engine_in_process,
    prefix_cache_counts,
    pushed_tensors,
    saved_weights,
)


def _tied_state() -> dict[str, torch.Tensor]:
    embed = torch.randn(5, 3, requires_grad=True)
    return {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(3), "lm_head.weight": embed}


def test_a_push_leaves_a_tied_head_out_and_keeps_an_untied_one():
    state = _tied_state()
    pushed = pushed_tensors(state)
    assert list(pushed) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert not pushed["model.embed_tokens.weight"].requires_grad
    untied = {**state, "lm_head.weight": state["lm_head.weight"].detach().clone()}
    assert "lm_head.weight" in pushed_tensors(untied)


def test_saved_weights_are_a_safetensors_folder_removed_on_exit(tmp_path):
    state = _tied_state()
    with saved_weights(state, parent=str(tmp_path)) as folder:
        saved = load_file(os.path.join(folder, "model.safetensors"))
        assert set(saved) == {"model.embed_tokens.weight", "model.norm.weight"}
        assert torch.equal(saved["model.embed_tokens.weight"], state["model.embed_tokens.weight"].detach())
    assert not os.path.exists(folder) and list(tmp_path.iterdir()) == []


def test_the_cpu_build_prefills_each_prompt_in_one_step():
    assert cpu_whole_prefill(512) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}
    assert cpu_whole_prefill(8192)["max_num_batched_tokens"] == 8192


def test_the_users_multiprocessing_setting_decides_where_the_engine_runs(monkeypatch):
    monkeypatch.setenv(MULTIPROCESSING, "0")
    assert engine_in_process()
    monkeypatch.setenv(MULTIPROCESSING, "1")
    assert not engine_in_process()
    monkeypatch.delenv(MULTIPROCESSING)
    assert engine_in_process()  # one process, no torchrun, no other engine here


def test_prefix_cache_counts_read_each_requests_cached_tokens():
    from quaero.telemetry import names

    outs = [SimpleNamespace(prompt_token_ids=[1] * 40, num_cached_tokens=32),  # vLLM's RequestOutput fields
            SimpleNamespace(prompt_token_ids=[2] * 10, num_cached_tokens=0),
            SimpleNamespace(prompt_token_ids=[3] * 7, num_cached_tokens=None),  # not reported: not counted
            SimpleNamespace(prompt_token_ids=[4] * 5)]
    assert prefix_cache_counts(outs) == {names.SAMPLER_REUSED_TOKENS: 32, names.SAMPLER_PREFILL_TOKENS: 18,
                                         names.SAMPLER_PREFIX_HITS: 1}
