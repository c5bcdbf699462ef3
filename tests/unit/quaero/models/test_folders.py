"""Bad model input in one line, at `quaero check` before any model loads: missing or truncated shards, a
config.json that does not match the weights, an architecture quaero cannot train, a dtype the device
cannot run."""
import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from quaero.config import ConfigError
from quaero.models import base, folders, qwen3
from quaero.models import load as loading
from quaero.preflight.plan import load_checked

ROOT = Path(__file__).resolve().parents[4]
MAIN = ROOT / "envs" / "toolbench.toml"
SMALL = qwen3.Qwen3Shape(64, 2, 4, 2, 32, 128)  # the real shapes' family at tiny dims


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, qwen3_tokenizer):
    """A reduced Qwen3 folder saved in several safetensors shards, with its index."""
    import torch

    folder = tmp_path_factory.mktemp("sharded")
    SMALL.model().to(torch.bfloat16).save_pretrained(folder, max_shard_size="50KB")
    copy.deepcopy(qwen3_tokenizer).save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 3
    return folder


@pytest.fixture
def folder(sharded, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(sharded, out)
    return out


@pytest.fixture
def no_weights_load(monkeypatch):
    """Any weight load fails the test: the check must decide from the files alone."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def check_error(folder: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, [f"model.name='{folder}'", *overrides])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{MAIN} [model] ")
    return msg


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


@pytest.mark.hostile
def test_an_intact_sharded_folder_passes_and_loads(folder):
    assert folders.folder_problem(folder) is None
    model = loading.load_causal_lm(str(folder))
    assert model.config.num_hidden_layers == 2


@pytest.mark.hostile
@pytest.mark.slow
def test_a_truncated_shard_is_named_at_check(folder, no_weights_load):
    last = shards(folder)[-1]
    last.write_bytes(last.read_bytes()[:-1000])
    msg = check_error(folder)
    assert f"weight shard {last.name} is truncated" in msg and "download the model folder again" in msg


@pytest.mark.hostile
def test_each_bad_folder_is_one_line_from_its_files_alone(folder, no_weights_load):
    """The quick tier's copy of the check-level tests: `folder_problem` reads headers, never weights."""
    first, last = shards(folder)[0], shards(folder)[-1]
    cfg = json.loads((folder / "config.json").read_text())
    first.write_bytes(first.read_bytes()[:20])  # cut inside its header
    assert folders.folder_problem(folder).startswith(f"weight shard {first.name} is truncated")
    first.unlink()
    assert folders.folder_problem(folder).startswith(f"weight shard {first.name} is missing")
    shutil.copy(last, first)  # a shard with the wrong tensors: the config's are not all there
    assert "is not in the weights" in folders.folder_problem(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["T5ForConditionalGeneration"]}))
    assert folders.folder_problem(folder).startswith("architecture 'T5ForConditionalGeneration'")
    (folder / "config.json").write_text("{not json")
    assert "config.json cannot be read as JSON" in folders.folder_problem(folder)


@pytest.mark.hostile
@pytest.mark.slow
def test_a_missing_shard_is_named_at_check(folder, no_weights_load):
    gone = shards(folder)[1]
    gone.unlink()
    msg = check_error(folder)
    assert f"weight shard {gone.name} is missing" in msg and f"1 of {len(shards(folder)) + 1} absent" in msg


@pytest.mark.hostile
@pytest.mark.slow
def test_a_config_that_does_not_match_the_weights_is_named_at_check(folder, no_weights_load):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    msg = check_error(folder)
    assert "config.json does not match the weights: model.layers.0.mlp.gate_proj.weight is [128, 64]" in msg
    assert "implies [256, 64]" in msg
    fewer = {k: v for k, v in cfg.items() if k != "layer_types"}  # transformers checks their count itself
    (folder / "config.json").write_text(json.dumps({**fewer, "num_hidden_layers": 3}))
    assert "model.layers.2.self_attn.q_proj.weight is not in the weights" in check_error(folder)


@pytest.mark.hostile
@pytest.mark.slow
def test_an_architecture_quaero_cannot_train_is_named_at_check(folder, no_weights_load):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForMaskedLM"],
                                                    "model_type": "bert"}))
    msg = check_error(folder)
    assert "architecture 'BertForMaskedLM' (model_type 'bert') is not a causal LM" in msg
    assert "e.g. Qwen3ForCausalLM" in msg


@pytest.mark.hostile
def test_load_causal_lm_refuses_a_truncated_folder_in_one_line(folder):
    last = shards(folder)[-1]
    last.write_bytes(last.read_bytes()[:-10])
    with pytest.raises(base.ModelNotFound) as e:
        loading.load_causal_lm(str(folder))
    assert "is truncated" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.hostile
@pytest.mark.slow
def test_a_dtype_the_device_cannot_run_is_named_at_check(folder, monkeypatch, no_weights_load):
    assert loading.dtype_problem("bfloat16", "cpu") is None
    assert loading.dtype_problem("float16", "cpu") is None

    def unsupported(dtype, device):  # an injected fault: a device without float16 kernels
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(loading, "_dtype_probe", unsupported)
    msg = check_error(folder, "model.dtype='float16'")
    assert "[model] dtype='float16': cpu cannot run a float16 forward and backward" in msg
    assert "not implemented for 'Half'" in msg and "use dtype = 'float32'" in msg


# ── hostile config.json: every malformed one is one line, its sizes judged before any shape is built ────────

MALFORMED = {
    "a list": ("[{}]", "holds a JSON list, not an object of model settings"),
    "nested 200,000 deep": ("[" * 200_000 + "]" * 200_000, "is nested too deep to be a model config"),
    "not JSON": ("{not json", "config.json cannot be read as JSON"),
}
SIZES = [({"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000 is outside 1..2,048"),
         ({"hidden_size": -64}, "hidden_size=-64 is outside 1..131,072"),
         ({"num_hidden_layers": -2}, "num_hidden_layers=-2 is outside 1..2,048"),
         ({"num_attention_heads": 0}, "num_attention_heads=0 is outside 1..2,048"),
         ({"hidden_size": "64"}, "hidden_size='64' is a str, not an integer"),
         ({"intermediate_size": 128.0}, "intermediate_size=128.0 is a float, not an integer"),
         ({"num_hidden_layers": True}, "num_hidden_layers=True is a bool, not an integer"),
         ({"vocab_size": 10**15}, "vocab_size=1000000000000000 is outside 1..16,777,216"),
         ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
         ({"architectures": "Qwen3ForCausalLM"}, "architectures='Qwen3ForCausalLM' is not a list of class"),
         ({"architectures": [["Qwen3ForCausalLM"]]}, "is not a list of class names"),
         ({"model_type": ["qwen3"]}, "model_type=['qwen3'] is not a name"),
         ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' is not true or false"),
         ({"vocab_size": None}, "lacks vocab_size for a qwen3 model")]


def _no_shapes(monkeypatch):
    monkeypatch.setattr(folders, "_expected_shapes",
                        lambda cfg: pytest.fail("a shape was built from bad sizes"))


@pytest.mark.hostile
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_config_json_of_the_wrong_shape_is_one_line(folder, monkeypatch, no_weights_load, case):
    text, says = MALFORMED[case]
    (folder / "config.json").write_text(text)
    _no_shapes(monkeypatch)
    problem = folders.folder_problem(folder)
    assert says in problem and "\n" not in problem and "restore the folder's config.json" in problem


@pytest.mark.hostile
@pytest.mark.parametrize("change,says", SIZES, ids=[s for _, s in SIZES])
def test_sizes_are_validated_before_any_shape_or_plan_is_built(folder, monkeypatch, no_weights_load, change,
                                                               says):
    """`num_hidden_layers = 10**12` exhausted memory building the expected shapes; negative sizes printed a
    negative memory plan and "config OK"; string sizes, 0 heads, `architectures` as a string or a nested list
    were tracebacks."""
    from quaero.models.config import ModelConfigError

    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **change}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(cfg))
    _no_shapes(monkeypatch)
    problem = folders.folder_problem(folder)
    assert says in problem and "\n" not in problem
    with pytest.raises(ModelConfigError, match=re.escape(says)):  # the memory plan's reader: the same line
        loading.config_fields(str(folder))


@pytest.mark.hostile
def test_the_named_shapes_and_real_configs_pass_the_size_check():
    from quaero.models.config import size_problem

    for name in qwen3.NAMED_SHAPES:
        assert size_problem(qwen3.NAMED_SHAPES[name].config_fields()) is None, name
    llama_405b = {"model_type": "llama", "hidden_size": 16384, "num_hidden_layers": 126,
                  "num_attention_heads": 128, "num_key_value_heads": 8, "intermediate_size": 53248,
                  "vocab_size": 128256}
    assert size_problem(llama_405b) is None


@pytest.mark.hostile
@pytest.mark.slow
def test_check_names_bad_sizes_and_a_folder_without_tokenizer_files(folder, no_weights_load):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**12}))
    assert "config.json: num_hidden_layers=1000000000000 is outside 1..2,048" in check_error(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "vocab.json"):
        (folder / f).unlink(missing_ok=True)
    msg = check_error(folder)
    assert f"{folder} holds no tokenizer files (none of tokenizer.json" in msg and "renderer" not in msg
