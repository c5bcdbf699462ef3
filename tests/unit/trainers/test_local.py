"""trainers/local.py: the transformers trainer in its dtypes, on the small model and the embedded default."""
import math

import torch
from fixtures.small_model import make_spec, rows

from trainers.local import LocalTrainer


def test_bfloat16_step_runs(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir, dtype="bfloat16"), "cpu")
    assert next(b.model.parameters()).dtype == torch.bfloat16
    m = b.train_step(rows(2))
    assert math.isfinite(m["loss"]) and m["local_train_selective_hidden_logprob_batches"] > 0


def test_tiny_qwen3_smoke_local(local_smoke_metrics):
    """The embedded default (vocab 151,936) on CPU: the sparse ECHO proof on real-vocab rows."""
    m = local_smoke_metrics
    assert m["local_train_selective_sparse_suffix_skips"] > 0
    assert m["local_train_selective_hidden_logprob_batches"] > 0
    assert m["local_train_selective_fallback_logprob_batches"] == 0
    assert m["forward_passes"] == m["microbatches"] and m["forward_passes_per_microbatch"] == 1
