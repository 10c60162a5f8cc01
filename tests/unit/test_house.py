"""The house rules of the package, checked on its source (unit-only: no model, no data).

1. No ``*_DEFAULTS`` dict outside the config layer (:data:`CONFIG_LAYER`): defaults live in the
   typed blocks (``memtoc.config.blocks``) and ``memtoc.config.params.DEFAULTS``.
2. No function takes the raw params dict outside the config layer (which reads, validates and
   types it: ``RunConfig.of``; the command line, ``memtoc.run.notebook.setup``, ``memtoc merge`` and
   ``gpuquick.quick_config`` call it once).
   Detected as a parameter named ``P`` or ``params`` that is unannotated or annotated with ``dict``
   / ``Mapping``, or any parameter annotated ``RunConfig | dict`` (or ``Mapping``): the stages, the
   pipeline, the preflight, the dry run and the GPU and server checks take the typed ``RunConfig``
   (or its block) only.
3. No path under a run directory joined outside ``RunPaths``: tests/unit/test_runpaths.py's scan (run
   there; :func:`house_violations` lists it beside the others).
4. No module of memtoc/ over :data:`MAX_MODULE_LINES` lines.
5. No function over :data:`MAX_FUNCTION_LINES` lines (``end_lineno - lineno + 1`` of its ``def``).

The config layer imports at the top only and has no import cycle: each of its modules imports in a
fresh interpreter, whichever comes first. ``python tests/unit/test_house.py`` prints every violation.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memtoc"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

CONFIG_LAYER = ("memtoc/config/params.py", "memtoc/config/runconfig.py", "memtoc/config/judge.py", "memtoc/core/vocab.py",
                "memtoc/config/blocks/")
RAW_NAMES = {"P", "params"}
_DICTLIKE = re.compile(r"\b(dict|Dict|Mapping|MutableMapping)\b")


def _modules() -> list[tuple[str, ast.Module, int]]:
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        src = f.read_text(encoding="utf-8")
        out.append((f.relative_to(ROOT).as_posix(), ast.parse(src), len(src.splitlines())))
    return out


def _under(rel: str, prefixes: tuple[str, ...]) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes)


def _functions(tree: ast.Module):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def defaults_dicts(rel: str, tree: ast.Module) -> list[str]:
    """``file:NAME`` of every assignment to a name ending in ``_DEFAULTS``."""
    out = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        out += [f"{rel}:{t.id}" for t in targets if isinstance(t, ast.Name) and t.id.endswith("_DEFAULTS")]
    return out


def takes_raw_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Rule 2: a parameter named ``P``/``params`` unannotated or dict-annotated, or ``RunConfig | dict``."""
    a = fn.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs:
        ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        if arg.arg in RAW_NAMES and (not ann or _DICTLIKE.search(ann)):
            return True
        if "RunConfig" in ann and _DICTLIKE.search(ann):
            return True
    return False


def raw_params_functions(rel: str, tree: ast.Module) -> list[str]:
    if _under(rel, CONFIG_LAYER):
        return []
    return [f"{rel}:{fn.name}" for fn in _functions(tree) if takes_raw_params(fn)]


def long_functions(rel: str, tree: ast.Module) -> list[str]:
    return [f"{rel}:{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)" for fn in _functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]


def house_violations() -> dict[str, list[str]]:
    """Every violation of the five rules in the current tree (rule 3 from tests/unit/test_runpaths.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_runpaths import scan  # the one run-directory scan (not repeated here)
    out: dict[str, list[str]] = {"defaults": [], "raw_params": [], "run_dir_joins": [], "long_modules": [],
                                 "long_functions": []}
    for rel, tree, n_lines in _modules():
        if not _under(rel, CONFIG_LAYER):
            out["defaults"] += defaults_dicts(rel, tree)
        out["raw_params"] += raw_params_functions(rel, tree)
        out["long_functions"] += long_functions(rel, tree)
        if n_lines > MAX_MODULE_LINES:
            out["long_modules"].append(f"{rel} ({n_lines} lines)")
    out["run_dir_joins"] = [f"{f} ({n})" for f, n in sorted(scan(ROOT).items())]
    return out


# -- the rules ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def modules():
    return _modules()


def test_no_defaults_dict_outside_the_config_layer(modules):
    found = [d for rel, tree, _ in modules if not _under(rel, CONFIG_LAYER) for d in defaults_dicts(rel, tree)]
    assert not found, f"defaults belong in the typed blocks (memtoc/config/blocks/): {found}"


def test_no_function_takes_the_raw_params_dict(modules):
    found = [f for rel, tree, _ in modules for f in raw_params_functions(rel, tree)]
    assert not found, f"take the typed RunConfig (memtoc.config.runconfig) or its block, not the params dict: {found}"


def test_stage_entry_points_refuse_a_params_dict():
    from memtoc.data import selection
    from memtoc.run import pipeline
    from memtoc.stages.finetune import stage as ft_stage
    for fn in (pipeline.plan, ft_stage.run, lambda p: selection.run_selection(p, None)):
        with pytest.raises(TypeError, match="takes a RunConfig"):
            fn({"models": ["x"]})


def test_no_module_over_the_size_limit(modules):
    over = [f"{rel} ({n})" for rel, _, n in modules if n > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_over_the_size_limit(modules):
    over = [f for rel, tree, _ in modules for f in long_functions(rel, tree)]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


@pytest.mark.parametrize("src, flagged", [
    ("def run(P): pass", True),
    ("def run(params: dict[str, Any]): pass", True),
    ("def run(cfg: RunConfig | Mapping[str, Any]): pass", True),
    ("def run(cfg: RunConfig): pass", False),
    ("def __init__(self, P: int): pass", False),          # a P that is no params dict
    ("def table(summary: dict[str, Any]): pass", False),  # a dict that is no params dict
])
def test_the_raw_params_rule_tells_a_params_dict_from_other_arguments(src, flagged):
    assert takes_raw_params(ast.parse(src).body[0]) is flagged


def test_the_config_layer_imports_at_the_top(modules):
    """The blocks and ``config`` read their vocabularies from ``memtoc.core.vocab`` (no import inside a
    function to break a cycle)."""
    late = [f"{rel}:{fn.name}" for rel, tree, _ in modules if _under(rel, CONFIG_LAYER)
            for fn in _functions(tree) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not late, f"imports inside functions: {late}"


@pytest.mark.parametrize("first", ["memtoc.config.judge", "memtoc.config.params", "memtoc.config.blocks.transfer"])
def test_each_config_module_imports_first_in_a_fresh_interpreter(first):
    r = subprocess.run([sys.executable, "-c", f"import {first}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr.strip().splitlines()[-1:]


def test_the_agent_runtimes_vocabulary_is_the_runtime_registry():
    """``vocab.AGENT_RUNTIMES`` (what ``agent.runtime`` accepts) names the classes of
    ``memtoc.stages.agent.runtime.RUNTIMES``, read from its source (importing it loads torch)."""
    from memtoc.core.vocab import AGENT_RUNTIMES
    tree = ast.parse((PACKAGE / "stages" / "agent" / "runtime" / "__init__.py").read_text(encoding="utf-8"))
    registry = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "RUNTIMES" for t in n.targets)]
    assert len(registry) == 1 and isinstance(registry[0], ast.Dict)
    assert tuple(k.value for k in registry[0].keys) == AGENT_RUNTIMES


if __name__ == "__main__":
    for rule, items in house_violations().items():
        print(f"{rule}: {len(items)}")
        for item in items:
            print(f"  {item}")
