import pytest
from fixtures.small_model import save_small_model


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    """A random Qwen3 with vocab 512 (tests/fixtures/small_model.py)."""
    return save_small_model(tmp_path_factory.mktemp("small-qwen3"))
