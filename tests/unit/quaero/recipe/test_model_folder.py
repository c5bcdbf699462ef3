"""The model a run hands over (quaero/recipe/model_folder.py): a Hugging Face folder written beside and moved
into place, that loads back to the same weights; a destination that is a file, or a non-empty folder an
export would mix into, is refused in one line before anything is written."""
from __future__ import annotations

import pytest
import torch

from quaero.recipe.model_folder import ExportError, check_destination, save_model


def test_a_saved_folder_loads_back_to_the_same_weights_and_replaces_an_old_one(tmp_path, tiny_lm,
                                                                               qwen3_tokenizer,
                                                                               tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "final"
    out.mkdir()
    (out / "stale.txt").write_text("a previous run's file")
    save_model(tiny_lm, qwen3_tokenizer, out, base_name=str(tiny_model_dir), replace=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # nothing half-written left beside it
    back = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), (_, b) in zip(tiny_lm.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), name


def test_a_destination_that_is_a_file_or_a_full_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match=r"file: a file, not a folder; name a new folder"):
        check_destination(tmp_path / "file")
    with pytest.raises(ExportError, match=r"file/out: a file \(.*file\), not a folder"):
        check_destination(tmp_path / "file" / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ExportError, match="folder exists and is not empty"):
        check_destination(tmp_path / "full")
    check_destination(tmp_path / "full", replace=True)
    check_destination(tmp_path / "new")
