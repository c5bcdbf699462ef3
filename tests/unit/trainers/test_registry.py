"""trainers/registry.py: each backend name leads to its class, lazily, and an unknown name is refused."""
import subprocess
import sys

import pytest

from trainers.local import LocalTrainer
from trainers.registry import TRAINERS, trainer_class


def test_a_backend_name_resolves_to_its_trainer_class():
    assert trainer_class("local") is LocalTrainer
    assert TRAINERS["unsloth"].module == "trainers.unsloth_trainer:UnslothTrainer"
    assert TRAINERS["unsloth"].extra == "unsloth" and TRAINERS["local"].extra is None
    assert set(TRAINERS["local"].strategies) == {"none", "ddp", "fsdp2"}


def test_an_unknown_backend_name_is_refused_by_name():
    with pytest.raises(KeyError, match="nosuch"):
        trainer_class("nosuch")


def test_the_registry_loads_no_trainer_and_no_torch():
    code = ("import sys, trainers.registry; "
            "print(sorted(m for m in ('torch', 'trainers.local') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
