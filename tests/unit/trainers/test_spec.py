"""trainers/spec.py: every option names its config key once, and `spec_from` reads each back at that key."""
import pytest

from trainers.spec import SelectivePolicy, TrainerSpec, options, spec_from


def test_options_list_every_keyed_field_with_its_key_and_bounds():
    found = {o.key: o for o in options()}
    assert found["model.name"].path == ("model",) and found["model.name"].default == "tiny-qwen3"
    lr = found["backend.lr"]
    assert lr.section == "backend" and lr.name == "lr" and lr.bounds and lr.about
    nested = [o for o in options() if o.path[0] == "selective"]
    assert nested and all(o.key.startswith("backend.") for o in nested)
    assert len(found) == len(options())  # no key is used twice


def test_spec_from_reads_every_option_at_its_key():
    defaults = {o.key: o.default for o in options()}
    assert spec_from(defaults.__getitem__) == TrainerSpec()
    chunk = next(o for o in options() if o.path == ("selective", "chunk_size"))
    read = {**defaults, "backend.lr": 0.5, chunk.key: 64}.__getitem__
    spec = spec_from(read, loss_constant=7)
    assert spec.lr == 0.5 and spec.selective == SelectivePolicy(chunk_size=64) and spec.loss_constant == 7


def test_a_key_the_reader_lacks_fails_naming_it():
    with pytest.raises(KeyError, match="backend.lr"):
        spec_from({o.key: o.default for o in options() if o.key != "backend.lr"}.__getitem__)
