"""The openenv / openenv-core co-install, simulated in a temp site dir: an `openenv` dist-info whose RECORD
owns a file, and an `openenv-core` dist-info next to it (the real install is tests/integration's slow
test)."""
import base64
import hashlib

import pytest

from quaero.config import ConfigError
from quaero.openenv_client import loading

ORIGINAL = b"def create_app(env, action_cls, observation_cls, state_cls=None): ...\n"


def _dist(site, name, version, files):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}" for path, data in files.items()]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "openenv" / "core").mkdir(parents=True)
    (site / "openenv" / "core" / "http_server.py").write_bytes(ORIGINAL)
    _dist(site, "openenv", "0.10.0", {"openenv/core/http_server.py": ORIGINAL})
    monkeypatch.syspath_prepend(str(site))
    loading.overwritten_openenv.cache_clear()
    yield site
    loading.overwritten_openenv.cache_clear()


def test_openenv_alone_and_openenv_core_installed_first_are_fine(site):
    assert loading.overwritten_openenv() is None
    loading.overwritten_openenv.cache_clear()
    _dist(site, "openenv-core", "0.3.0", {"openenv/core/http_server.py": b"old\n"})  # then openenv over it
    assert loading.overwritten_openenv() is None


def test_openenv_core_written_over_openenv_is_refused_with_the_line_to_run(site):
    (site / "openenv" / "core" / "http_server.py").write_bytes(b"def create_app(env, action_cls): ...\n")
    _dist(site, "openenv-core", "0.3.0", {"openenv/core/http_server.py": b"def create_app(env, action_cls): "
                                                                         b"...\n"})
    with pytest.raises(ConfigError) as e:
        loading.require_openenv()
    message = str(e.value)
    assert "openenv/core/http_server.py" in message and "openenv-core 0.3.0" in message
    assert message.endswith("pip install --force-reinstall --no-deps openenv==0.10.0") and "\n" not in message
