"""Sharded (DCP) checkpoint state is read without running code: DCP's own reader unpickles."""
import io
import pickle
from pathlib import Path

import pytest
import torch

from quaero.models.qwen3 import random_qwen3
from trainers.local import LocalTrainer
from trainers.shard_reader import SafeLoadPlanner, SafeShardReader
from trainers.spec import TrainerSpec

pytestmark = pytest.mark.hostile


class _Payload:
    """What an attacker puts in a file that gets unpickled: unpickling it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("shard-qwen3")
    random_qwen3(256, 32, intermediate_size=64, tie_word_embeddings=True).save_pretrained(path)
    return str(path)


def sharded_state(trainer: LocalTrainer) -> dict:
    """What a sharded trainer's state_dict says: model and optimizer live in shards/."""
    return {"backend": "local", "lora": False, "steps_done": 0, "shards": "dcp",
            "scheduler": trainer.scheduler.state_dict()}


def test_shards_round_trip_through_the_safe_reader(model_dir, tmp_path):
    a = LocalTrainer(TrainerSpec(model=model_dir, lr=1e-3), "cpu")
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(0.5)
    a.save_shards(tmp_path / "shards")
    b = LocalTrainer(TrainerSpec(model=model_dir, lr=1e-3), "cpu")
    b.load_state_dict(sharded_state(a), shards=tmp_path / "shards")
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_a_crafted_shard_metadata_is_refused_without_running(model_dir, tmp_path):
    trainer = LocalTrainer(TrainerSpec(model=model_dir, lr=1e-3), "cpu")
    trainer.save_shards(tmp_path / "shards")
    marker = tmp_path / "code-ran"
    (tmp_path / "shards" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match=r"names pathlib.Path.touch, which is not checkpoint "
                                                     r"metadata"):
        trainer.load_state_dict(sharded_state(trainer), shards=tmp_path / "shards")
    assert not marker.exists()
    pickle.loads((tmp_path / "shards" / ".metadata").read_bytes())  # the payload is live
    assert marker.exists()


def test_shard_metadata_naming_a_file_outside_its_folder_is_refused(model_dir, tmp_path):
    trainer = LocalTrainer(TrainerSpec(model=model_dir, lr=1e-3), "cpu")
    trainer.save_shards(tmp_path / "shards")
    reader = SafeShardReader(tmp_path / "shards")
    md = reader.read_metadata()
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / "shards" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(pickle.UnpicklingError, match="names a file outside its folder"):
        SafeShardReader(tmp_path / "shards").read_metadata()


def test_a_crafted_byte_item_is_refused_without_running(tmp_path):
    marker = tmp_path / "code-ran"
    item = io.BytesIO()
    torch.save(_Payload(marker), item)  # what DCP's default planner would torch.load(weights_only=False)
    item.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        SafeLoadPlanner().load_bytes(None, item)
    assert not marker.exists()
