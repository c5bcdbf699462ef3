"""trainers/memory.py's peak readings: a window's own peak, and the process's across windows; malloc's memory
in use, read at a bounded cost."""
import json
import platform
import subprocess
import sys

import pytest
import torch


def _fresh_process(code: str, *args: str) -> list[str]:
    """The words `code` prints, run by a Python process of its own (a clean allocator and peak RSS)."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return done.stdout.split()


# in a process of its own: an xdist worker's malloc already holds what earlier tests freed, and there a 512
# MiB tensor was twice served from resident memory (RSS 4314.3 and 3118.4 MB before and after, in fresh-clone
# CI)
_WINDOWS = """
import json, torch
from trainers.memory import peak_mem_mb, peak_window, process_peak_mb

out = {}
with peak_window("cpu", out, "big"):
    big = torch.ones(2**27)  # 512 MiB, every page written
    del big
with peak_window("cpu", out, "small"):
    small = torch.ones(2**20)
    del small
print(json.dumps({**out, "source": peak_mem_mb("cpu")[1], "process": process_peak_mb("cpu")},
                 separators=(",", ":")))  # one word: _fresh_process splits on whitespace
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the RSS peak resets on Linux only")
def test_a_window_reads_its_own_peak_and_the_process_keeps_the_largest():
    """512 MiB touched in one window and freed: that window's peak holds them, the next window's does not,
    and the process's peak still does (what the recipe logs as rollout_/weight_sync_/eval_peak_mem_mb, a
    checkpoint's peak_mem_mb, and process_peak_mem_mb)."""
    out = json.loads(_fresh_process(_WINDOWS)[-1])
    assert out["source"] == "rss_since_reset"
    assert out["big"] - out["small"] > 400
    assert out["process"] >= out["big"] - 0.1  # peak_window rounds to 0.1 MB


# a process that frees what a step's microbatch held: with glibc's dynamic mmap threshold raised by one freed
# 24 MiB block, 8 MiB tensors (an activation of a 2k-token row) come from malloc's heap and stay with the
# process once freed; with the trainer's fixed threshold each is unmapped when freed
_RETAINED = """
import sys, torch
from trainers.local import LocalTrainer
from trainers.spec import MemoryPolicy, TrainerSpec

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))

spec = TrainerSpec(memory=MemoryPolicy(cpu_mmap_threshold=int(sys.argv[1])))
LocalTrainer(spec, "cpu")
big = torch.ones(24 * 2**18)
del big
base = rss_mib()
blocks = [torch.ones(2 * 2**20) for _ in range(32)]  # 32 x 8 MiB, every page written
last = blocks.pop()  # kept: the heap above the freed blocks cannot shrink from its top
del blocks
print(round(rss_mib() - base))
"""


def _retained_mib(threshold: int) -> int:
    return int(_fresh_process(_RETAINED, str(threshold))[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and mallopt only")
def test_the_trainer_gives_freed_tensors_back_to_the_system():
    """Issue #41: an RL step of SmolLM2-135M was killed at 9.7-14 GB RSS against a 3 GiB plan; torch's own
    count was 2.8 GiB: glibc kept what each microbatch freed. A CPU trainer can fix malloc's mmap threshold
    (`train_cpu_mmap_threshold = 131072`, as envs/toolbench_smollm2.toml does), so 248 MiB of freed 8 MiB
    tensors leave the process; with 0 (glibc's dynamic threshold, the default) they stay."""
    assert _retained_mib(131072) < 40
    assert _retained_mib(0) > 200


def test_the_mmap_threshold_is_left_alone_off_cpu_and_at_zero():
    from trainers import memory

    before = memory._mmap_threshold
    assert memory.fix_cpu_mmap_threshold("cuda", 131072) == before
    assert memory.fix_cpu_mmap_threshold("cpu", 0) == before


# a 64 MiB tensor allocated, written and freed 8 times after a first: the page faults of the 8
_FAULTS = """
import resource, sys, torch
from trainers import memory

print(memory.keep_cpu_malloc_cache("cpu", sys.argv[1] == "1"))
x = torch.ones(2**24)
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    x = torch.ones(2**24)
    del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> tuple[str, int]:
    out = _fresh_process(_FAULTS, "1" if keep else "0")
    return out[-2], int(out[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and mallopt only")
def test_the_malloc_cache_reuses_freed_tensors_without_faulting_their_pages_in_again():
    """`train_cpu_malloc_cache`: a 64 MiB tensor freed and allocated again comes back from malloc's heap with
    its pages mapped, as CUDA's caching allocator hands a freed block back; without it each is mmapped afresh
    and every 4 KiB page faults in zeroed (16,384 a tensor), which cost the tiny main job's warm-start step
    ~30% (trainers/memory.py)."""
    on, cached = _faults(True)
    off, mapped = _faults(False)
    assert (on, off) == ("True", "False")
    assert mapped >= 8 * 2**24 * 4 // 4096 * 0.9
    assert cached * 4 < mapped


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc and mallopt only")
def test_a_released_malloc_cache_gives_the_kept_memory_back_and_rss_grows_again():
    """A process that ran a trainer with the cache (a test session, a notebook) gets glibc's behaviour back:
    the 256 MiB its heap kept leaves the process, and a new 256 MiB tensor raises RSS again, as the peak
    readings above need (tests/conftest.py releases it after every test)."""
    from trainers import memory

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))

    assert memory.keep_cpu_malloc_cache("cpu", True)
    x = torch.ones(2**26)  # 256 MiB, every page written
    del x
    kept = rss_mib()
    memory.release_cpu_malloc_cache()
    assert memory._malloc_cache is False
    assert rss_mib() < kept - 200
    before = rss_mib()
    x = torch.ones(2**26)
    assert rss_mib() > before + 200
    del x


def test_the_malloc_cache_is_refused_beside_a_fixed_mmap_threshold(tmp_path):
    from quaero.config import ConfigError, load_config

    toml = tmp_path / "run.toml"
    toml.write_text('[env]\nentry = "envs.toolbench:ToolBenchEnv"\n[backend.options]\n'
                    "train_cpu_malloc_cache = true\ntrain_cpu_mmap_threshold = 131072\n")
    with pytest.raises(ConfigError, match="train_cpu_malloc_cache=true with train_cpu_mmap_threshold=131072"):
        load_config(toml)


def test_malloc_in_use_is_read_unless_its_last_reading_cost_more_than_its_share_of_the_step(monkeypatch):
    from trainers import memory

    if not memory.MALLINFO_READABLE:
        pytest.skip("glibc's mallinfo2 only")
    big = torch.ones(2**22)  # 16 MiB from malloc, held while it is read
    assert memory.malloc_in_use_mb() >= 16
    monkeypatch.setattr(memory, "_mallinfo_cost_s", 0.05)  # a heap of ~50,000 free blocks
    assert memory.malloc_in_use_mb(step_s=1.0) is None  # 0.05 s > 1% of a 1 s step: skipped
    assert memory._mallinfo_cost_s == 0.025  # halved, so the next steps try again
    assert memory.malloc_in_use_mb(step_s=1.0) is None and memory.malloc_in_use_mb(step_s=1.0) is None
    assert memory.malloc_in_use_mb(step_s=1.0) >= 16  # 0.00625 s <= 0.01 s: read, its cost measured afresh
    assert 0 < memory._mallinfo_cost_s != 0.00625
    assert memory.malloc_in_use_mb(step_s=100.0) >= 16
    del big
