"""trainers/unsloth_trainer.py: without unsloth its import names the extra to install; with it, fast
inference on CPU is refused before any model loads. Each in a fresh process (unsloth must be imported before
transformers; the full unsloth step is tests/engines/test_unsloth.py)."""
import importlib.util
import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          check=False)


def test_without_unsloth_the_import_names_the_extra_and_the_other_backend():
    out = _run("import sys\nsys.modules['unsloth'] = None  # as if not installed\n"
               "import trainers.unsloth_trainer\n")
    assert out.returncode != 0
    assert "needs unsloth: pip install 'quaero[unsloth]'" in out.stderr and "backend='local'" in out.stderr


@pytest.mark.slow
@pytest.mark.unsloth
@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None,
                    reason="unsloth is not installed (pip install 'quaero[unsloth]')")
def test_fast_inference_on_cpu_is_refused_with_the_setting_to_change():
    out = _run("from trainers.unsloth_trainer import LORA_TARGETS, UnslothTrainer\n"
               "from trainers.spec import TrainerSpec\n"
               "assert 'lm_head' not in LORA_TARGETS\n"
               "try:\n    UnslothTrainer(TrainerSpec(unsloth_fast_inference=True), 'cpu')\n"
               "except ValueError as e:\n    print(e)\n")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "unsloth_fast_inference=true needs a GPU" in out.stdout and "set it to false on CPU" in out.stdout
