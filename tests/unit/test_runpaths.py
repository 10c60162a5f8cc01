"""RunPaths owns the ``outputs/<run>/`` layout, and a run's question selection is computed once.

* Every path under a run directory comes from :class:`memtoc.config.runconfig.RunPaths`: a scan of memtoc/
  and the notebooks' code cells finds no path joined onto a run directory (``run_dir / ...``,
  ``cfg.run_dir / ...``, ``Path(run_dir) / ...``, ``os.path.join(run_dir, ...)``) and no
  layout folder name (``/ "summaries"``, ``/ "scored"``, ...) joined by hand outside runconfig.py.
* Every stage's questions and formulations equal ``selection.run_selection``'s.
"""
from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from memtoc.config.params import load_params
from memtoc.config.runconfig import RunConfig, RunPaths
from memtoc.core.project import REPO_ROOT
from memtoc.data.benchmark import load_benchmark, select_questions
from memtoc.data.episodes import run_episodes
from memtoc.data.selection import Selection, run_selection
from memtoc.generation import models
from memtoc.stages import elicitation, finetune
from memtoc.stages.agent import core as agent_core
from memtoc.stages.transfer import core as transfer_core

# -- the layout scan -------------------------------------------------------------------------------

#: names a run directory goes by in the code (a variable or an attribute)
RUN_DIR_NAMES = {"run_dir", "run_dir_", "rd"}
#: the run layout's folders (docs/architecture.md, "Output layout") that no other tree of the
#: repository has; ``paper``, ``notebooks`` and ``config.json`` also name repository / model files
LAYOUT_FOLDERS = {"summaries", "figures", "scored", "scored_judged", "generations", "adapters", "probes",
                  "transfer", "episodes", "agent"}
#: roots that are not run directories
OTHER_ROOTS = {"REPO_ROOT", "PACKAGE_DIR"}
#: ``Path.<method>()`` roots that are not run directories either (a user cache, the working directory)
OTHER_ROOT_CALLS = {"home", "cwd"}
#: the one module that may join paths under a run directory
OWNER = "memtoc/config/runconfig.py"


def _is_run_dir(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RUN_DIR_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in RUN_DIR_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Path", "PurePath"):
        return len(node.args) == 1 and _is_run_dir(node.args[0])
    return False


def _chain(node: ast.BinOp) -> list[ast.AST]:
    """The operands of ``a / b / c`` (left to right)."""
    out: list[ast.AST] = []
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        out.insert(0, node.right)
        node = node.left
    return [node] + out


def _layout_literal(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.split("/")[0] in LAYOUT_FOLDERS)


def _root_name(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Call)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in OTHER_ROOT_CALLS and _root_name(node.func.value) == "Path"):
            return f"Path.{node.func.attr}"
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def hand_joins(source: str) -> list[int]:
    """Line numbers of the paths under a run directory that ``source`` joins by hand."""
    tree = ast.parse(source)
    inner: set[int] = set()
    lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and id(node) not in inner:
            parts = _chain(node)
            inner.update(id(n) for n in ast.walk(node.left) if isinstance(n, ast.BinOp))
            root = _root_name(parts[0])
            if _is_run_dir(parts[0]) or (root not in OTHER_ROOTS and not root.startswith("Path.")
                                         and any(_layout_literal(p) for p in parts[1:])):
                lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
              and node.args and _is_run_dir(node.args[0])):
            lines.append(node.lineno)
    return lines


def _notebook_source(path: Path) -> str:
    cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    code = "\n".join("".join(c["source"]) for c in cells)
    return "\n".join("" if re.match(r"\s*[%!]", ln) else ln for ln in code.splitlines())


def scan(root: Path) -> Counter:
    """``{file: number of hand joins}`` over ``root``'s memtoc/ package and notebooks/."""
    found: Counter = Counter()
    files = sorted((root / "memtoc").rglob("*.py")) + sorted((root / "notebooks").glob("*.ipynb"))
    for f in files:
        rel = f.relative_to(root).as_posix()
        if rel == OWNER:
            continue
        src = _notebook_source(f) if f.suffix == ".ipynb" else f.read_text(encoding="utf-8")
        n = len(hand_joins(src))
        if n:
            found[rel] = n
    return found


def test_no_path_under_a_run_directory_is_joined_outside_runpaths():
    found = dict(scan(REPO_ROOT))
    assert not found, ("paths under a run directory joined by hand (use memtoc.config.runconfig.RunPaths; "
                       f"add a method there when the layout needs one): {found}")


@pytest.mark.parametrize("src,n", [
    ('p = run_dir / "summaries" / "x.json"', 1),
    ('p = cfg.run_dir / "agent" / model / "traces.jsonl"', 1),
    ('p = Path(run_dir) / folder / model', 1),
    ('p = self.rd / "config.json"', 1),
    ('p = os.path.join(run_dir, "figures")', 1),
    ('p = base / "scored" / label', 1),
    ('p = cfg.paths.summary("x"); q = REPO_ROOT / "paper" / "claims.yaml"; r = model_dir / "config.json"', 0),
    ('p = RunPaths(run_dir).scored_file(label, key); q = cfg.paths.figure("f")', 0),
    ('p = Path.home() / ".cache" / "memtoc" / "transfer"', 0),
    ('p = Path(base).expanduser() / "transfer" / model', 1),
])
def test_the_scan_tells_hand_joins_from_runpaths(src, n):
    assert len(hand_joins(src)) == n


def test_runpaths_layout(tmp_path):
    p = RunPaths(str(tmp_path))
    assert p.root == tmp_path
    rel = lambda x: x.relative_to(tmp_path).as_posix()   # noqa: E731
    assert rel(p.summary("probes")) == "summaries/probes.json"
    assert rel(p.closed_book("m", "forced")) == "scored/m/closed_book_forced.jsonl"
    judged = p.scored_file("m", "untreated__reference", "scored_judged")
    assert rel(judged) == "scored_judged/m/untreated__reference.jsonl"
    assert rel(p.generation_file("judge__j", "judge_ack")) == "generations/judge__j/judge_ack.jsonl"
    assert rel(p.adapter("m", "dpo", 1)) == "adapters/m/dpo/fold1"
    assert rel(p.external_adapter("m", "dpo")) == "adapters/m/dpo/external"
    assert rel(p.untreated_closed_book("m", "forced")) == "adapters/m/untreated_closed_book_forced.jsonl"
    assert rel(p.probe_sae("m", 3)) == "probes/m/sae/layer3"
    assert rel(p.probe_steer_cache("m")) == "probes/m/steer/replies.jsonl"
    assert rel(p.transfer_scored("m", "dpo_fold0")) == "transfer/m/scored_dpo_fold0.jsonl"
    assert rel(p.agent_traces("m")) == "agent/m/traces.jsonl"
    assert (rel(p.report_md), rel(p.claims_json), rel(p.config_json)) == ("paper/report.md", "paper/claims.json",
                                                                        "config.json")
    assert (rel(p.params_yaml), rel(p.lock_file)) == ("params.yaml", ".memtoc.lock")
    out = p.write_summary("stage", {"x": float("nan"), "y": (1, 2)})
    assert out == p.summary("stage") and json.loads(out.read_text()) == {"x": None, "y": [1, 2]}
    assert not list(p.summaries.glob("*.tmp"))


def test_modules_write_where_runpaths_says(tmp_path):
    assert elicitation.scored_path(tmp_path, "m", "forced") == RunPaths(tmp_path).closed_book("m", "forced")
    assert finetune.adapter_dir(tmp_path, "m", "sft", 0) == RunPaths(tmp_path).adapter("m", "sft", 0)
    path = finetune.write_summary({"models": {}}, tmp_path)
    assert path == RunPaths(tmp_path).summary("finetuning") and finetune.read_summary(tmp_path) == {"models": {}}
    assert transfer_core.write_summary({"a": 1}, tmp_path) == RunPaths(tmp_path).summary("transfer")


# -- the run's selection ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench():
    return load_benchmark()


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    P = load_params(None, {"n_questions": 12, "n_questions_extra": 5, "seed": 7, "extra_arms": ["noop"],
                           "formulations": ["reference", "paraphrase_a"], "models": ["smollm2-135m-instruct"]})
    return RunConfig.of({**P, "run_dir": tmp_path_factory.mktemp("run")})


def test_run_selection_is_the_stratified_selection(cfg, bench):
    sel = run_selection(cfg, bench)
    assert isinstance(sel, Selection)
    assert sel.headline == select_questions(bench.analysis, 12, 7)
    assert sel.extra == select_questions(bench.analysis, 5, 7)
    assert sel.first(30) == select_questions(bench.analysis, 30, 7)
    assert len(sel.order) == len(bench.analysis)
    assert run_selection(cfg.replace(seed=8), bench).headline != sel.headline
    m = "smollm2-135m-instruct"
    assert sel.formulations_for(m) == models.formulations_for(m, list(cfg.formulations), None)


def test_episodes_use_the_run_selection(cfg, bench):
    sel = run_selection(cfg, bench)
    eps = run_episodes(bench, cfg)
    assert {e.qkey for e in eps} == {q.qkey for q in sel.headline}
    assert {e.qkey for e in eps if e.arm != "untreated" or e.condition == "noop"} == {q.qkey for q in sel.extra}
    assert {e.formulation for e in eps} == set(sel.formulations)


def test_finetune_plan_evaluates_the_run_headline(cfg, bench):
    plans, _ = finetune.plan(cfg, bench)
    evaluated = {q.qkey for p in plans for q in p.eval_questions}
    assert evaluated and evaluated <= {q.qkey for q in run_selection(cfg, bench).headline}


def test_transfer_reverse_questions_come_from_the_run_headline(cfg, bench):
    qs, note = transfer_core.reverse_eval_questions(bench, cfg, "m")
    assert "no closed-book file" in note
    assert qs == run_selection(cfg, bench).headline[:cfg.transfer.reverse_eval_questions]


def test_agent_questions_are_a_prefix_of_the_run_selection(cfg, bench):
    forms = agent_core.formulations_of(cfg, "smollm2-135m-instruct")
    qs = agent_core.questions_for(cfg, "smollm2-135m-instruct", bench, forms)
    assert qs == run_selection(cfg, bench).first(cfg.agent.n_questions)
    assert forms == run_selection(cfg, bench).formulations_for("smollm2-135m-instruct", cfg.agent.formulations)


def test_notebooks_02_and_03_take_the_run_selection():
    for name in ("02_elicitation.ipynb", "03_evaluation.ipynb"):
        src = _notebook_source(REPO_ROOT / "notebooks" / name)
        assert "run_selection(cfg, bench)" in src and "selection.formulations_for(model)" in src, name
        assert "select_questions" not in src and "models.formulations_for" not in src, name
