"""Recompute a finished run's model-free summaries with the code of this checkout and diff them.

    python tools/recompute_summaries.py REF_RUN_DIR WORK_ROOT [--diff-only]

Copies the reference run's inputs (params.yaml, config.json, episodes/, scored/, and the summaries of
the stages that need a model: finetuning.json, transfer.json, probes.json, agent.json) into WORK_ROOT/<the reference's run name> (so
the run name is the same), then re-runs, with no model, what notebooks 01, 02, 03 and 08 compute from them:
``summaries/construction.json``, ``elicitation.json``, ``evaluation.json`` and ``paper/claims.json``.
Each is compared line by line (JSON re-dumped with sorted keys) with the reference file; the exit
status is 0 when every file is identical. It uses only public names that are stable across the
refactor of issue 11, so the same script runs on the old and the new tree (a proof that the
analysis path, which needs no model, gives the same numbers).
"""
from __future__ import annotations

import difflib
import json
import shutil
import sys
from pathlib import Path

COPY = ("params.yaml", "config.json", "episodes", "scored", "summaries/finetuning.json",
        "summaries/transfer.json", "summaries/probes.json", "summaries/agent.json")
COMPARED = ("summaries/construction.json", "summaries/elicitation.json", "summaries/evaluation.json",
            "paper/claims.json")


def prepare(ref: Path, work: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    for rel in COPY:
        src, dst = ref / rel, work / rel
        if not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)


def _write(work: Path, stage: str, summary: dict, old_dump) -> None:
    """A summary written as the notebooks write it (RunPaths' one writer, so the bytes, and the claims'
    sha256 of their source files, compare); an older tree without it: its notebooks' plain dump."""
    try:
        from memtoc.config.runconfig import RunPaths
        RunPaths(work).write_summary(stage, summary)
    except (ImportError, AttributeError):
        (work / "summaries" / f"{stage}.json").write_text(old_dump())


def recompute(work: Path) -> None:
    import pandas as pd

    from memtoc.config.params import load_params, resolve_release_dir
    from memtoc.data.benchmark import load_benchmark, select_questions
    from memtoc.data.episodes import run_episodes
    from memtoc.stages import construction as construct, elicitation, evaluation, report
    from memtoc.stages.evaluation import judge
    try:                                   # the split of issue 11; before it, evaluation held the analyses
        from memtoc.stages.evaluation import analyses
    except ImportError:
        analyses = evaluation

    P = load_params(work / "params.yaml", overrides={"output_root": str(work.parent), "run_name": work.name})
    P["release_dir"] = str(resolve_release_dir(P.get("release_dir")))
    P["run_dir"] = work
    summaries = work / "summaries"
    summaries.mkdir(parents=True, exist_ok=True)
    bench = load_benchmark(P["release_dir"])
    try:                                   # typed configs (issue 23): stage functions take the RunConfig
        from memtoc.config.runconfig import RunConfig
        cfg = RunConfig.of(P)
    except ImportError:
        cfg = P
    # 01: construction.json
    episodes = run_episodes(bench, cfg)
    s = construct.construction_summary(bench, episodes)
    _write(work, "construction", s, lambda: json.dumps(s, indent=1, ensure_ascii=False, default=str))
    # 02: elicitation.json (the closed-book answers are read back, not regenerated)
    questions = select_questions(bench.analysis, P["n_questions"], P["seed"])
    variants = [P["closed_book_variant"]]
    if P["elicit_permissive"]:
        variants += [v for v in ("forced", "permissive") if v not in variants]
    memory_all = pd.concat([elicitation.load_memory(work, m, v) for m in P["models"] for v in variants],
                           ignore_index=True)
    s = elicitation.summary(memory_all, alpha=P["alpha"], extra={
        "run_name": P["run_name"], "matcher": P["matcher"], "n_questions": len(questions),
        "formulations": P["formulations"], "primary_variant": P["closed_book_variant"], "variants": variants,
        "backend": P["backend"]})
    _write(work, "elicitation", s, lambda: json.dumps(s, indent=1))
    # 03: evaluation.json from the scored files
    scored = {m: evaluation.read_scored(work, m) for m in P["models"]}
    memory = {m: elicitation.load_memory(work, m, P["closed_book_variant"]) for m in P["models"]}
    s = analyses.evaluation_summary(scored, memory, cfg)
    s = judge.add_judged(s, scored, cfg)
    analyses.write_summary(s, work)
    # 08: claims.json / report.md
    report.build_report(work)


def canonical(path: Path, run_dir: Path) -> list[str]:
    """Sorted-key JSON lines; claims.json's creation time and the hashes of files this check does
    not copy (adapters, figures, generations) are left out: they are not outputs of the analysis."""
    obj = json.loads(path.read_text().replace(str(run_dir), "<RUN_DIR>"))
    if path.name == "claims.json" and isinstance(obj, dict):
        obj.pop("created", None)
        obj["registry"] = Path(obj.get("registry") or "").name   # the checkout it ran in
        obj["inputs"] = {k: v for k, v in (obj.get("inputs") or {}).items() if k.startswith("summaries/")}
    return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).splitlines()


def diff(ref: Path, work: Path) -> int:
    n_bad = 0
    for rel in COMPARED:
        a, b = ref / rel, work / rel
        if not b.exists():
            print(f"{rel}: NOT RECOMPUTED")
            n_bad += 1
            continue
        la, lb = canonical(a, ref), canonical(b, work)
        d = list(difflib.unified_diff(la, lb, f"ref/{rel}", f"new/{rel}", lineterm="", n=1))
        n_diff = sum(1 for x in d if x[:1] in "+-") - 2
        same_bytes = a.read_bytes() == b.read_bytes()
        print(f"{rel}: " + ("identical" if not d else f"{n_diff} lines differ") + f" ({len(la)} lines)"
              + ("; byte-identical" if same_bytes else ""))
        for line in d[:200]:
            print("   ", line)
        n_bad += bool(d)
    return n_bad


def main(argv: list[str]) -> int:
    ref = Path(argv[0]).resolve()
    work = Path(argv[1]).resolve() / ref.name
    if "--diff-only" not in argv:
        prepare(ref, work)
        recompute(work)
    return 1 if diff(ref, work) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
