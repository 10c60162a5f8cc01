"""Build a MemToC release in the official layout from the compact copy (for tests, or by hand).

    python tests/official_release.py DEST [--compact DIR] [--sample DIR] [--chains N]

The record shapes come from the official-layout sample (``memtoc-release-official-sample``: real
release files, the big ones cut after their first records). Every truncated file is rebuilt from the
sample's own top-level keys and metadata and its first real record of each kind as the template;
no field is added that the sample does not have. Files written:

* ``benchmark/{reference,paraphrase_a,paraphrase_b}.json``: per question the sample's five conditions
  (``tool_right``, ``tool_wrong``, ``tool_error``, ``no_tool``, ``no_conflict``), repairs applied;
  the ``tool_wrong`` episode of a repaired question is its overlay episode.
* ``benchmark/repair_overlay/<formulation>.json``: the repaired ``tool_wrong`` episodes.
* ``results/construction/distractor_mapping_575.json`` (``rows``: near values before the repairs).
* ``results/quality_control/{analysis_set_lists,repair_list_39,crossfit_folds}.json``.
* every file the sample holds complete (summaries, distractor distance, acknowledgment round,
  verification reports, the release README, CLAIM-TO-FILE.md, NOTICE), copied verbatim.

Values filled from the compact copy (``questions_575.jsonl``, ``qc_lists.json``,
``repair_overlay_39.json``, ``crossfit_folds.json``, ``formulations.json``): ids, instance/hop, qkey,
question, gold answer and kind (``tau``), family, near/far values, distractor source and method, the
validation fields, tool outputs (``{"result": value}``, the formulation's error payload), the prompts
(the formulation's ``closed_book`` / ``with_tool`` templates), the QC lists, the repairs and the
fold assignments. Episode-file summaries get the written counts and distributions; for a subset
(``n_chains``) the mapping's ``summary.final_rows`` and the fold summary are recomputed too.

Not in the compact copy, so not real: ``tool_schema`` is the question's real ToolHop schema where the
sample shows it (questions 0.0, 13.0, 15.0) and ``memtoc.core.prompts.synthesize_schema`` elsewhere;
``machine_provenance`` is the sample's where it has the row and ``{}`` elsewhere. The semantic
review and the scored episodes are not written (the compact copy has no per-question review or
model outputs).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from memtoc.core.prompts import synthesize_schema

FORMS = {"reference": 0, "paraphrase_a": 1, "paraphrase_b": 2}
SAMPLE_ENV = "MEMTOC_OFFICIAL_SAMPLE"
GENERATED = ("results/quality_control/analysis_set_lists.json", "results/quality_control/repair_list_39.json")
HUMAN_SOURCE = "dual_human_adjudication"


def default_sample_dir(compact_dir: Path) -> Path:
    """``$MEMTOC_OFFICIAL_SAMPLE``, else ``memtoc-release-official-sample`` beside the compact copy."""
    env = os.environ.get(SAMPLE_ENV)
    return Path(env) if env else Path(compact_dir).parent / "memtoc-release-official-sample"


def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _write(path: Path, obj: Any, indent: int, newline: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + ("\n" if newline else ""), encoding="utf-8")


def _ordered(template: dict, counts: Counter) -> dict:
    """Counts keyed in the template's order, new keys after."""
    return {k: counts[k] for k in template if counts[k]} | {k: v for k, v in counts.items() if k not in template}


def _fill(template: str, **values: str) -> str:
    return re.sub(r"\{(question|schema|tool_output)\}", lambda m: values[m.group(1)], template)


class _Compact:
    """The compact copy, restricted to the first ``n_chains`` chains (all when None)."""

    def __init__(self, compact_dir: Path, n_chains: Optional[int]):
        text = (compact_dir / "questions_575.jsonl").read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        chains = sorted({r["instance_id"] for r in rows})
        keep = set(chains if n_chains is None else chains[:n_chains])
        self.subset = n_chains is not None
        self.rows = [r for r in rows if r["instance_id"] in keep]
        keys = {r["qkey"] for r in self.rows}
        qc = _load(compact_dir / "qc_lists.json")
        self.exclude = [k for k in qc["exclude_qkeys"] if k in keys]
        self.repair_qkeys = [k for k in qc["repair_qkeys"] if k in keys]
        self.repairs = {r["qkey"]: r for r in _load(compact_dir / "repair_overlay_39.json") if r["qkey"] in keys}
        self.assignments = [a for a in _load(compact_dir / "crossfit_folds.json")["assignments"]
                            if a["instance_id"] in keep]
        self.formulations = _load(compact_dir / "formulations.json")

    def near(self, row: dict) -> str:
        rep = self.repairs.get(row["qkey"])
        return rep["new_near"] if rep else row["final_near"]


def _sample_schemas(sample: Path) -> dict[tuple[int, int], dict]:
    out: dict[tuple[int, int], dict] = {}
    for path in sorted((sample / "benchmark").rglob("*.json")):
        for ep in _load(path)["episodes"]:
            if isinstance(ep.get("tool_schema"), dict):
                out.setdefault((ep["instance_id"], ep["hop_idx"]), ep["tool_schema"])
    return out


def _episode(tpl: dict, row: dict, form: str, data: _Compact, schema: dict, overlay_prov: Optional[dict]) -> dict:
    """One episode in the template's shape, filled from a compact row."""
    spec, cond, pv = data.formulations[form], tpl["condition"], FORMS[form]
    near = data.near(row)
    out = tpl["tool_output"]
    if isinstance(out, dict) and "result" in out:
        out = {"result": near if cond == "tool_wrong" else row["gold_answer"]}
    elif out is not None:
        out = dict(spec["error_payload"])
    ep = dict(tpl)
    ep.update(episode_id=f"{row['instance_id']}-{row['hop_idx']}-{cond}-v{pv}", instance_id=row["instance_id"],
              hop_idx=row["hop_idx"], tau=row["gold_kind"], family=row["family"], question=row["question"],
              gold_answer=row["gold_answer"], tool_output=out, tool_schema=schema)
    schema_json = json.dumps(schema, ensure_ascii=False)
    ep["prompts"] = {
        "closed_book": _fill(spec["closed_book"], question=row["question"]),
        "with_tool": None if out is None else _fill(spec["with_tool"], question=row["question"], schema=schema_json,
                                                    tool_output=json.dumps(out, ensure_ascii=False)),
    }
    ep["provenance"] = dict(tpl["provenance"], instance_id=row["instance_id"], hop_idx=row["hop_idx"], qkey=row["qkey"],
                            distractor_source=row["source"], distractor_method=row["method"])
    if cond == "tool_wrong" and overlay_prov is not None and row["qkey"] in data.repairs:
        ep["provenance"].update(distractor_source=overlay_prov["distractor_source"],
                                distractor_method=overlay_prov["distractor_method"])
    if "distractor" in tpl:
        ep["distractor"] = near
    return ep


def _summary(tpl: dict, rows: list[dict], n_episodes: int, source: list[str], method: list[str]) -> dict:
    out = dict(tpl)
    out.update(n_episodes=n_episodes,
               tau_distribution=_ordered(tpl["tau_distribution"], Counter(r["gold_kind"] for r in rows)),
               family_distribution=_ordered(tpl["family_distribution"], Counter(r["family"] for r in rows)),
               distractor_source=_ordered(tpl["distractor_source"], Counter(source)),
               distractor_method=_ordered(tpl["distractor_method"], Counter(method)))
    return out


def _write_episode_files(sample: Path, dest: Path, data: _Compact, schemas: dict) -> None:
    rows = data.rows
    for form in FORMS:
        bench_t = _load(sample / "benchmark" / f"{form}.json")
        over_t = _load(sample / "benchmark" / "repair_overlay" / f"{form}.json")
        over_prov = over_t["episodes"][0]["provenance"]
        templates = {}
        for ep in bench_t["episodes"]:
            templates.setdefault(ep["condition"], ep)
        episodes, overlay = [], []
        for row in rows:
            schema = schemas.get((row["instance_id"], row["hop_idx"])) or synthesize_schema(SimpleNamespace(
                question=row["question"], family=row["family"], gold_kind=row["gold_kind"]))
            for cond in bench_t["summary"]["conditions"]:
                episodes.append(_episode(templates[cond], row, form, data, schema, over_prov))
                if cond == "tool_wrong" and row["qkey"] in data.repairs:
                    overlay.append(episodes[-1])
        src, meth = [r["source"] for r in rows], [r["method"] for r in rows]
        bench_s = _summary(bench_t["summary"], rows, len(episodes), src, meth)
        _write(dest / "benchmark" / f"{form}.json", {**bench_t, "summary": bench_s | {"n_questions": len(rows)},
                                                      "episodes": episodes}, indent=1)
        fixed = [(over_prov["distractor_source"], over_prov["distractor_method"]) if r["qkey"] in data.repairs
                 else (r["source"], r["method"]) for r in rows]
        over_s = _summary(over_t["summary"], rows, len(overlay), [s for s, _ in fixed], [m for _, m in fixed])
        _write(dest / "benchmark" / "repair_overlay" / f"{form}.json",
               {**over_t, "summary": over_s | {"n_questions": len(rows)}, "episodes": overlay}, indent=1)


def _write_mapping(sample: Path, dest: Path, data: _Compact) -> None:
    tpl = _load(sample / "results/construction/distractor_mapping_575.json")
    real = {r["qkey"]: r for r in tpl["rows"]}
    rows = []
    for r in data.rows:
        rec = {k: r[k] for k in tpl["rows"][0] if k in r}
        rec["machine_provenance"] = real.get(r["qkey"], {}).get("machine_provenance", {})
        rows.append({k: rec[k] for k in tpl["rows"][0]})
    summary = dict(tpl["summary"], final_rows=len(rows)) if data.subset else tpl["summary"]
    _write(dest / "results/construction/distractor_mapping_575.json", {**tpl, "summary": summary, "rows": rows},
           indent=1)


def _fold_block(rows: list[dict]) -> dict:
    src = ["human" if r["source"] == HUMAN_SOURCE else "machine" for r in rows]
    count = lambda xs: dict(sorted(Counter(xs).items()))  # noqa: E731
    return {"n_questions": len(rows), "n_instances": len({r["instance_id"] for r in rows}),
            "family": count(r["family"] for r in rows), "tau": count(r["gold_kind"] for r in rows),
            "source_bucket": count(src),
            "stratum": count(f"{r['family']}|{r['gold_kind']}|{s}" for r, s in zip(rows, src))}


def _write_quality_control(sample: Path, dest: Path, data: _Compact) -> None:
    qc_dir = dest / "results/quality_control"
    lists_t = _load(sample / "results/quality_control/analysis_set_lists.json")
    _write(qc_dir / "analysis_set_lists.json", {**lists_t, "exclude_qkeys": data.exclude,
                                                "repair_qkeys": data.repair_qkeys}, indent=1, newline=False)
    list_t = _load(sample / "results/quality_control/repair_list_39.json")
    repairs = [{k: r[k] for k in list_t["repairs"][0]} for r in data.repairs.values()]
    _write(qc_dir / "repair_list_39.json", {**list_t, "repairs": repairs}, indent=1, newline=False)
    folds_t = _load(sample / "results/quality_control/crossfit_folds.json")
    fold_of = {a["instance_id"]: a["fold"] for a in data.assignments}
    assignments = [{"instance_id": a["instance_id"], "fold": a["fold"], "n_questions": len(a["qkeys"]),
                    "qkeys": a["qkeys"]} for a in data.assignments]
    rows = [{"id": r["id"], "qkey": r["qkey"], "instance_id": r["instance_id"], "hop_idx": r["hop_idx"],
             "fold": fold_of[r["instance_id"]]} for r in data.rows]
    summary = folds_t["summary"]
    if data.subset:
        by_fold = {f: [r for r in data.rows if fold_of[r["instance_id"]] == f] for f in sorted(set(fold_of.values()))}
        summary = dict(summary, n_questions=len(rows), n_instances=len(assignments),
                       folds={f: _fold_block(rs) for f, rs in by_fold.items()})
    _write(qc_dir / "crossfit_folds.json", {**folds_t, "summary": summary, "assignments": assignments, "rows": rows},
           indent=2)


def _copy_complete(sample: Path, dest: Path) -> None:
    for entry in _load(sample / "MANIFEST.json")["files"]:
        if entry["status"] != "complete" or entry["path"] in GENERATED:
            continue
        target = dest / entry["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sample / entry.get("stored_as", entry["path"]), target)


def build_official_release(compact_dir: Path, dest: Path, n_chains: int | None = None,
                           sample_dir: Path | None = None) -> Path:
    """Write a release in the official layout under ``dest`` from the compact copy at ``compact_dir``,
    with the record shapes of the official-layout sample (``sample_dir``, default
    :func:`default_sample_dir`). ``n_chains``: only the first that many chains (by instance_id);
    None: all 575 questions. Returns ``dest``."""
    compact_dir, dest = Path(compact_dir), Path(dest)
    sample = Path(sample_dir) if sample_dir else default_sample_dir(compact_dir)
    for need, what in ((compact_dir / "questions_575.jsonl", "the compact copy"),
                       (sample / "MANIFEST.json", "the official-layout sample")):
        if not need.is_file():
            raise FileNotFoundError(f"{need} not found: {what} is needed to build an official-layout release")
    data = _Compact(compact_dir, n_chains)
    dest.mkdir(parents=True, exist_ok=True)
    _write_episode_files(sample, dest, data, _sample_schemas(sample))
    _write_mapping(sample, dest, data)
    _write_quality_control(sample, dest, data)
    _copy_complete(sample, dest)
    return dest


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python tests/official_release.py", description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path, help="directory to write the release into")
    ap.add_argument("--compact", type=Path, default=Path(os.environ.get("MEMTOC_RELEASE", "../shared/memtoc-release")),
                    help="the compact copy (default: $MEMTOC_RELEASE or ../shared/memtoc-release)")
    ap.add_argument("--sample", type=Path, default=None, help=f"the official-layout sample (default: ${SAMPLE_ENV} "
                    "or memtoc-release-official-sample beside the compact copy)")
    ap.add_argument("--chains", type=int, default=None, help="only the first N chains (default: all)")
    args = ap.parse_args(argv)
    try:
        out = build_official_release(args.compact, args.dest, args.chains, args.sample)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
