"""trainers/memory.py's peak readings: a window's own peak, and the process's across windows."""
import sys

import pytest
import torch

from trainers.memory import peak_mem_mb, peak_window, process_peak_mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the RSS peak resets on Linux only")
def test_a_window_reads_its_own_peak_and_the_process_keeps_the_largest():
    """512 MiB touched in one window and freed: that window's peak holds them, the next window's does not,
    and the process's peak still does (what the recipe logs as rollout_/weight_sync_/eval_peak_mem_mb, a
    checkpoint's peak_mem_mb, and process_peak_mem_mb)."""
    out: dict = {}
    with peak_window("cpu", out, "big"):
        big = torch.ones(2**27)  # 512 MiB, every page written
        del big
    with peak_window("cpu", out, "small"):
        small = torch.ones(2**20)
        del small
    assert peak_mem_mb("cpu")[1] == "rss_since_reset"
    assert out["big"] - out["small"] > 400
    assert process_peak_mb("cpu") >= out["big"]
