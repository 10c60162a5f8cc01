"""The package's layers, checked on its source (no import of memtoc needed):

1. ``memtoc/`` holds the layer folders only (plus ``__init__.py`` / ``__main__.py``): a new module
   goes into the layer it belongs to, never beside them.
2. A folder imports only the folders below it (:data:`LAYERS`, bottom first), in every import of
   every module, at the top or inside a function; imports under ``if TYPE_CHECKING:`` (annotations
   only, never executed) are exempt.
3. Every stage package (``memtoc/stages/<name>/``) exposes ``run(cfg)``; the stages still driven from
   their notebooks are listed in :data:`NOTEBOOK_DRIVEN` (the list may only shrink: a listed stage
   that gains ``run`` fails until it is removed from the list).
4. Notebooks import only memtoc's public names: modules that exist, no ``_private`` module or name.

``python tests/unit/test_house_layers.py`` prints every violation.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memtoc"
#: bottom first: a folder may import itself and the folders before it
LAYERS = ("core", "generation", "config", "data", "stages", "run", "cli")
TOP_FILES = {"__init__.py", "__main__.py"}
#: stage packages whose notebook still holds the stage's steps (no ``run(cfg)`` yet)
NOTEBOOK_DRIVEN = {"construction", "elicitation", "evaluation", "report"}


def module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if parts[0] == "memtoc" and len(parts) > 1 and parts[1] in LAYERS else None


def _type_checking_ids(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            out |= {id(d) for c in n.body for d in ast.walk(c)}
    return out


def imported_modules(rel: str, src: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every memtoc import of the module at ``rel`` (relative imports
    resolved), except those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(src)
    skip = _type_checking_ids(tree)
    here = module_name(rel).split(".")
    package = here if rel.endswith("__init__.py") else here[:-1]
    out = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = package[:len(package) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            out += [(n.lineno, mod)] if mod.startswith("memtoc") else []
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names if a.name.startswith("memtoc")]
    return out


def upward_imports(rel: str, src: str) -> list[str]:
    """``rel:line imports MODULE (layer above)`` for each import of a higher layer."""
    own = layer_of(module_name(rel))
    if own is None:
        return []
    return [f"{rel}:{line} [{LAYERS[own]}] imports {mod} [{LAYERS[layer_of(mod)]}]"
            for line, mod in imported_modules(rel, src) if (layer_of(mod) or 0) > own]


def stray_entries(package: Path) -> list[str]:
    return sorted(p.name for p in package.iterdir()
                  if p.name not in TOP_FILES and p.name not in LAYERS and p.name != "__pycache__"
                  and not p.name.startswith((".", "_resources")) and not p.name.endswith(".egg-info"))


def defines_run(src: str) -> bool:
    """Whether a stage package's ``__init__`` defines or imports a ``run`` whose first parameter is
    ``cfg`` (an imported ``run`` is checked where it is defined, by :func:`stage_without_run`)."""
    tree = ast.parse(src)
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name == "run":
            return bool(n.args.args) and n.args.args[0].arg == "cfg"
        if isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == "run" for a in n.names):
            return True
    return False


def stage_without_run(package: Path) -> list[str]:
    out = []
    for d in sorted(p for p in (package / "stages").iterdir() if (p / "__init__.py").is_file()):
        init = (d / "__init__.py").read_text(encoding="utf-8")
        if not defines_run(init):
            out.append(d.name)
            continue
        for f in d.rglob("*.py"):               # where an imported run is defined: run(cfg, ...)
            for n in ast.parse(f.read_text(encoding="utf-8")).body:
                if isinstance(n, ast.FunctionDef) and n.name == "run" and f != d / "__init__.py":
                    if not n.args.args or n.args.args[0].arg != "cfg":
                        out.append(f"{d.name} ({f.relative_to(package.parent)}: run's first parameter is not cfg)")
    return out


def notebook_private_imports(name: str, cells: list[str], package: Path) -> list[str]:
    """Imports of a notebook's code cells that reach a private or missing part of memtoc."""
    out = []
    for i, src in enumerate(cells):
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("memtoc"):
                mods, names = [n.module], [a.name for a in n.names]
            elif isinstance(n, ast.Import):
                mods, names = [a.name for a in n.names if a.name.startswith("memtoc")], []
            else:
                continue
            for mod in mods:
                parts = mod.split(".")
                path = package.parent.joinpath(*parts)
                if any(p.startswith("_") for p in parts) or any(x.startswith("_") for x in names):
                    out.append(f"{name} cell {i}: {ast.unparse(n)} (private)")
                elif not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
                    out.append(f"{name} cell {i}: {ast.unparse(n)} (no such module)")
    return out


def _notebook_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def violations() -> dict[str, list[str]]:
    up = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        up += upward_imports(rel, f.read_text(encoding="utf-8"))
    nbs = []
    for f in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nbs += notebook_private_imports(f.name, _notebook_cells(f), PACKAGE)
    missing = stage_without_run(PACKAGE)
    return {"stray entries in memtoc/": stray_entries(PACKAGE), "upward imports": up,
            "stage packages without run(cfg)": [m for m in missing if m not in NOTEBOOK_DRIVEN],
            "listed as notebook-driven but have run(cfg)": sorted(NOTEBOOK_DRIVEN - set(missing)),
            "notebook imports": nbs}


# -- the rules, on the tree ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def found():
    return violations()


@pytest.mark.parametrize("rule", ["stray entries in memtoc/", "upward imports", "stage packages without run(cfg)",
                                  "listed as notebook-driven but have run(cfg)", "notebook imports"])
def test_the_layers_hold(found, rule):
    assert not found[rule], f"{rule}: {found[rule]}"


def test_every_stage_has_its_package():
    stages = {p.name for p in (PACKAGE / "stages").iterdir() if (p / "__init__.py").is_file()}
    assert {"construction", "elicitation", "evaluation", "finetune", "probes", "transfer", "agent",
            "report"} <= stages


# -- the rules fail where they should (synthetic sources) ----------------------------------------

@pytest.mark.parametrize("rel, src, flagged", [
    ("memtoc/core/x.py", "from memtoc.stages import evaluation\n", True),
    ("memtoc/core/x.py", "def f():\n    from memtoc.run.pipeline import run\n", True),       # inside a function
    ("memtoc/generation/backends/x.py", "from ...config.params import load_params\n", True),  # relative
    ("memtoc/data/x.py", "from memtoc.config.runconfig import RunConfig\n", False),
    ("memtoc/data/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from memtoc.stages.agent import core\n", False),
    ("memtoc/stages/x/__init__.py", "from .. import finetune\nfrom memtoc.run import registry\n", True),
    ("memtoc/cli/x.py", "from memtoc.run import pipeline\n", False),
])
def test_an_upward_import_is_flagged(rel, src, flagged):
    assert bool(upward_imports(rel, src)) is flagged


def test_a_stage_without_run_and_a_stray_module_are_flagged(tmp_path):
    pkg = tmp_path / "memtoc"
    for name, src in {"good": "def run(cfg, progress=True):\n    pass\n",
                      "imported": "from .stage import run\n", "bare": "X = 1\n", "wrong": "def run(params):\n    pass\n"}.items():
        (pkg / "stages" / name).mkdir(parents=True)
        (pkg / "stages" / name / "__init__.py").write_text(src)
    (pkg / "stages" / "imported" / "stage.py").write_text("def run(config):\n    pass\n")
    (pkg / "core").mkdir()
    (pkg / "helpers.py").write_text("")
    missing = stage_without_run(pkg)
    assert "bare" in missing and "wrong" in missing and "good" not in missing
    assert any(m.startswith("imported (") for m in missing)
    assert stray_entries(pkg) == ["helpers.py"]


def test_a_private_notebook_import_is_flagged():
    cells = ["from memtoc.stages import finetune\nimport memtoc.run.notebook",
             "from memtoc.generation.backends import _private",
             "from memtoc.stages.finetune import _helper",
             "from memtoc.nb import setup",
             "%matplotlib inline"]
    out = notebook_private_imports("x.ipynb", cells, PACKAGE)
    assert [o.split(":")[0] for o in out] == ["x.ipynb cell 1", "x.ipynb cell 2", "x.ipynb cell 3"]
    assert "(no such module)" in out[2] and "(private)" in out[0]


if __name__ == "__main__":
    for rule, items in violations().items():
        print(f"{rule}: {len(items)}")
        for item in items:
            print(f"  {item}")


def test_no_test_folder_shadows_an_importable_package():
    """pytest puts tests/ on sys.path (pyproject's pythonpath): a folder there named like a package
    (tests/vllm/) would be imported as that package, and every ``importorskip`` of it would run."""
    from importlib.metadata import packages_distributions
    taken = set(packages_distributions()) | set(sys.stdlib_module_names) | {"vllm", "llama_cpp", "sae_lens"}
    tests = ROOT / "tests"
    shadows = sorted(d.name for d in tests.iterdir() if d.is_dir() and d.name in taken)
    assert shadows == [], f"tests/{shadows[0] if shadows else ''}: rename it (it shadows the package)"


def test_importing_memtoc_changes_no_process_setting():
    """A library import leaves the environment alone; the entry points (memtoc.run, the CLI) set passive
    OpenMP waits before torch starts."""
    import subprocess
    code = ("import os, sys; import memtoc, memtoc.core.scoring, memtoc.generation.models; "
            "a = os.environ.get('OMP_WAIT_POLICY'); import memtoc.run; b = os.environ.get('OMP_WAIT_POLICY'); "
            "print(a, b, 'torch' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split()[:2] == ["None", "PASSIVE"], out
    # the entry points reach the setting without importing torch first (OpenMP reads it when torch starts)
    code = "import sys, memtoc.run, memtoc.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.split() == ["False"]
