"""Every lock resolves under the real interpreter of each Python version it admits (the resolution test
carries the marker ``registry``: it asks the package index, about three minutes per lock and interpreter;
``make test-locks``; ``make test`` leaves it out).

A lock's header names the versions in one line, ``# resolved for CPython: 3.11, 3.12, 3.13``. For each one
whose interpreter exists on the machine (``python3.X`` on PATH, or a pyenv build), a fresh venv of that
interpreter runs ``pip install --dry-run --ignore-installed --only-binary=:all: -r LOCK``: the resolver
evaluates every environment marker of the pinned packages on that interpreter, which resolving with
``--python-version`` from another interpreter does not (the cause of the locks that did not install).
"""
from __future__ import annotations

import glob
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ("cpu.lock", "gpu.lock", "gpu-cu12.lock")
_LINE = re.compile(r"^# resolved for CPython: (.+)$", re.MULTILINE)


def lock_pythons(lock: str) -> list[str]:
    m = _LINE.search((ROOT / "requirements" / lock).read_text())
    assert m, f"requirements/{lock}: its header lacks the line '# resolved for CPython: 3.X, ...'"
    return [v.strip() for v in m.group(1).split(",")]


def interpreter(version: str) -> str | None:
    """A working CPython ``version`` interpreter: this one, ``python3.X`` on PATH, or a pyenv build (a pyenv
    shim for a version that is not selected exits with an error and is passed over)."""
    if sys.version_info[:2] == tuple(int(x) for x in version.split(".")):
        return sys.executable
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv" / "versions" / f"{version}.*" / "bin" / "python")))
    for exe in filter(None, candidates):
        r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip() == version:
            return exe
    return None


def test_every_lock_names_the_pythons_it_was_resolved_for():
    for lock in LOCKS:
        assert set(lock_pythons(lock)) <= {"3.10", "3.11", "3.12", "3.13", "3.14"}


@pytest.mark.registry
@pytest.mark.parametrize("lock, version", [(lock, v) for lock in LOCKS for v in lock_pythons(lock)])
def test_the_lock_resolves_under_the_real_interpreter(lock, version, tmp_path):
    exe = interpreter(version)
    if exe is None:
        pytest.skip(f"no CPython {version} on this machine")
    venv = tmp_path / "venv"
    subprocess.run([exe, "-m", "venv", str(venv)], check=True, timeout=300)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
                        "-q", "-r", str(ROOT / "requirements" / lock)], capture_output=True, text=True, timeout=1800)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if not line.startswith("WARNING: Location")]
    assert r.returncode == 0, f"requirements/{lock} does not resolve on CPython {version}:\n" + "\n".join(errors[-25:])
