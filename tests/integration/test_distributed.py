"""The data-parallel step equals the one-process step: DDP and FSDP2 under torchrun (2 ranks, gloo, fp32).

Same rows, same random Qwen3 (an untied LM head, so FSDP2 shards a head of its own), two AdamW steps,
an active gradient clip. Five rows of different lengths split 3/2 (one rank pads a microbatch); one
row leaves a rank with nothing to train.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.dist_step import VOCAB, case_dir, run_scenarios

from quaero.models.qwen3 import random_qwen3
from quaero.telemetry.proofs import BRANCH_COUNTERS

ROOT = Path(__file__).resolve().parents[2]
EQUAL_COUNTS = (*BRANCH_COUNTERS, "action_tokens", "echo_tokens", "rows", "row_tokens", "forward_passes",
                "lm_head_skipped_microbatches", "forward_passes_per_microbatch", "optimizer_stepped",
                "grad_clipped")
LOSSES = ("loss", "rl_loss", "echo_loss", "grad_norm", "importance_ratio_mean", "sampler_logprob_gap_mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist-qwen3")
    random_qwen3(VOCAB, 32, intermediate_size=64, tie_word_embeddings=False).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def one_process(model_dir):
    """The one-process reference per chunk size (computed once each), on one thread like the ranks: the
    thread count changes the order of CPU reductions, hence the last bits."""
    cache = {}

    def reference(chunk_size):
        if chunk_size not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[chunk_size] = run_scenarios(model_dir, "none", chunk_size)
            finally:
                torch.set_num_threads(threads)
        return cache[chunk_size]
    return reference


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CASES = [("ddp", None), ("fsdp2", None),
         ("fsdp2", 5)]  # the chunked head recomputes its logits in backward: the head must be whole there too


def _written(out: Path, strategy: str, chunk: int | None) -> bool:
    """Whether a case's files are all there: each rank's metrics, and rank 0's weights after its last step."""
    folder = case_dir(out, strategy, chunk)
    return all((folder / f).exists() for f in ("rank0.json", "rank1.json", "one_row.step2.safetensors"))


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory) -> Path:
    """Every case's two-rank steps in one torchrun launch (the cases one after the other in the same ranks):
    each case's folder of metrics and weights (tests/fixtures/dist_step.py)."""
    out = tmp_path_factory.mktemp("two-ranks")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1"}
    todo = list(CASES)
    for attempt in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "tests/fixtures/dist_step.py"),
               model_dir, str(out), *(f"{strategy}:{str(chunk).lower()}" for strategy, chunk in todo)]
        proc = subprocess.run(cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        # Seen in fresh-clone CI runs with the machine fully loaded (2026-12-03 before any step; 2026-12-06 at
        # an FSDP2 case, after the DDP case had written its files; 39 launches here passed, 30 beside a
        # busy core): a rank aborted in torch's C++ runtime right after building its trainer ("terminate
        # called without an active exception", SIGABRT). That crash, and only it, is launched once more for
        # the cases it left unwritten. A wrong figure, a Python error or a second abort still fails.
        aborted = "terminate called without an active exception" in proc.stderr and "SIGABRT" in proc.stderr
        if proc.returncode == 0 or not aborted or attempt == 2:
            break
        todo = [case for case in todo if not _written(out, *case)]
        print(f"torchrun: a rank aborted; launching {todo} again\n{proc.stderr[-1500:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy,chunk_size", CASES)
def test_two_rank_step_equals_the_one_process_step(model_dir, one_process, two_ranks, strategy, chunk_size):
    from safetensors.torch import load_file

    out = case_dir(two_ranks, strategy, chunk_size)
    want_metrics, want_weights = one_process(chunk_size)
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1  # every rank returns the same metrics, so rank 0 can log them alone
    for name, want_steps in want_metrics.items():
        for want, got in zip(want_steps, rank0[name], strict=True):
            for key in EQUAL_COUNTS:
                assert got[key] == want[key], (name, key)
            for key in LOSSES:
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (name, key)
            assert got["ranks"] == 2 and sum(got["rank_rows"]) == want["rows"]
            assert sum(got["rank_forward_passes"]) == want["forward_passes"]
    for key, want_state in want_weights.items():
        state = load_file(str(out / f"{key}.safetensors"))
        assert sorted(state) == sorted(want_state)
        # After one AdamW step: 1e-6. A second step divides by sqrt(v) + eps, so where a gradient is
        # near eps (1e-8) a last-bit difference in the summed gradient or the clip's global norm
        # moves the update by up to lr * |dg| / eps: 1e-5 bounds that second step.
        atol = 1e-6 if key.endswith(".step1") else 1e-5
        for name, w in state.items():
            torch.testing.assert_close(w, want_state[name], rtol=0, atol=atol, msg=f"{key} {name}")
    uneven, one_row = rank0["uneven"][0], rank0["one_row"][0]
    assert uneven["rank_rows"] == [3, 2] and uneven["rank_padding_microbatches"] == [0, 1]
    assert one_row["rank_rows"] == [1, 0] and one_row["rank_forward_passes"] == [1, 0]
    assert uneven["grad_clipped"]  # the clip read the global norm
