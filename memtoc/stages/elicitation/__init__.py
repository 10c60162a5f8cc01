"""Closed-book elicitation: each model's parametric answer m per question × formulation.

::

    df = elicit(generator, model_label, questions, formulations, variant, run_dir)

generates the closed-book prompt (``memtoc.core.prompts.closed_book_prompt``) of every question in every
formulation through the generation cache
``generations/<model_label>/closed_book_<variant>__<formulation>.jsonl``, extracts the answer span
and scores it against gold with ``memtoc.core.scoring.memory_status`` (span, mem_absent,
memory_correct), writes ``scored/<model_label>/closed_book_<variant>.jsonl`` and returns the frame
(one row per question × formulation). ``load_memory(run_dir, model_label, variant)`` reads it back.

The forced variant is the paper's primary memory; the no_tool episodes of the evaluation carry the
same forced prompt and are served from the same cache file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import pandas as pd

from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import DataError, check_choice, check_choices
from memtoc.core.io import write_jsonl
from memtoc.core.metrics import assign_cell
from memtoc.core.prompts import closed_book_prompt
from memtoc.core.records import Question
from memtoc.core.scoring import memory_status
from memtoc.core.vocab import CELLS, CLOSED_BOOK_VARIANTS as VARIANTS, FORMULATIONS

COLUMNS = ["model", "formulation", "variant", "question_id", "qkey", "instance_id", "response", "span",
           "mem_absent", "memory_correct"]
EXTRA_COLUMNS = ["gold", "gold_kind", "fold", "n_new_tokens", "cached"]


def cache_stem(formulation: str, variant: str) -> str:
    return f"closed_book_{variant}__{formulation}"


def scored_path(run_dir: str | os.PathLike, model_label: str, variant: str) -> Path:
    """``scored/<model>/closed_book_<variant>.jsonl`` (``RunPaths.closed_book``)."""
    return RunPaths(run_dir).closed_book(model_label, variant)


def elicit(generator, model_label: str, questions: Sequence[Question], formulations: Iterable[str],
           variant: str, run_dir: str | os.PathLike, matcher: str = "paper",
           scored_file: str | os.PathLike | None = None) -> pd.DataFrame:
    """Closed-book replies and memory status per question × formulation (see the module doc).

    ``scored_file``: where the scored rows go (default ``scored_path(run_dir, model_label, variant)``);
    notebook 04 writes an adapter's (or its own untreated) closed-book answers next to the adapter so
    that notebook 02's file is never overwritten with a subset."""
    check_choice("closed-book variant", variant, VARIANTS)
    formulations = check_choices("formulation", list(formulations), FORMULATIONS)
    questions = list(questions)
    if not questions:
        raise DataError("elicit: no questions given (check n_questions and the selection)")
    paths = RunPaths(run_dir)
    rows: list[dict[str, Any]] = []
    for form in formulations:
        prompts = [closed_book_prompt(q.question, form, variant) for q in questions]
        cache = paths.generation_file(model_label, cache_stem(form, variant))
        replies = generator.generate(prompts, cache_path=cache,
                                     desc=f"{model_label} closed-book {variant} {form}")
        for q, r in zip(questions, replies):
            span, absent, correct = memory_status(r.text, q.gold, matcher=matcher, gold_kind=q.gold_kind)
            rows.append({"model": model_label, "formulation": form, "variant": variant,
                         "question_id": q.id, "qkey": q.qkey, "instance_id": q.instance_id,
                         "response": r.text, "span": span, "mem_absent": bool(absent),
                         "memory_correct": correct, "gold": q.gold, "gold_kind": q.gold_kind,
                         "fold": q.fold, "n_new_tokens": r.n_new_tokens, "cached": r.cached})
    df = pd.DataFrame(rows, columns=COLUMNS + EXTRA_COLUMNS)
    out = Path(scored_file) if scored_file is not None else scored_path(run_dir, model_label, variant)
    write_jsonl(out, rows, convert=False)
    return df


def load_memory(run_dir: str | os.PathLike, model_label: str, variant: str = "forced") -> pd.DataFrame:
    """The frame ``elicit`` wrote for this model and variant."""
    check_choice("closed-book variant", variant, VARIANTS)
    path = scored_path(run_dir, model_label, variant)
    if not path.is_file():
        raise DataError(f"{path} does not exist: run the closed-book elicitation (notebook "
                        f"02_elicitation) for model {model_label!r}, variant {variant!r} first")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise DataError(f"{path}: line {n} is not valid JSON ({e}); rerun the elicitation "
                                    "to rewrite it (the replies come from the cache)") from None
    df = pd.DataFrame(rows)
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; the file was written by another version, "
                        "rerun the elicitation to rewrite it")
    return df


def cell_distribution(memory: pd.DataFrame) -> pd.DataFrame:
    """The source-correctness cells the with-tool episodes of each model × formulation × variant
    will fall into: every question contributes one tool_right (tool correct) and one tool_wrong
    (tool incorrect) episode; cells from ``memtoc.core.metrics.assign_cell``.

    Columns: model, formulation, variant, memory (correct | incorrect | absent), tool (correct |
    incorrect), cell, n, share (of the group's episodes).
    """
    rows = []
    for (model, form, variant), g in memory.groupby(["model", "formulation", "variant"], sort=True):
        counts: dict[tuple[str, str, str], int] = {}
        for mc, ab in zip(g["memory_correct"], g["mem_absent"]):
            mc = None if ab or pd.isna(mc) else bool(mc)
            mem = "absent" if ab else ("correct" if mc else "incorrect")
            for tc in (True, False):
                cell = assign_cell(mc, bool(ab), tc)
                k = (mem, "correct" if tc else "incorrect", cell)
                counts[k] = counts.get(k, 0) + 1
        total = 2 * len(g)
        for mem in ("correct", "incorrect", "absent"):
            for tool in ("correct", "incorrect"):
                cell = assign_cell(None if mem == "absent" else mem == "correct", mem == "absent",
                                   tool == "correct")
                n = counts.get((mem, tool, cell), 0)
                rows.append({"model": model, "formulation": form, "variant": variant, "memory": mem,
                             "tool": tool, "cell": cell, "n": n, "share": n / total if total else float("nan")})
    return pd.DataFrame(rows)


def rates(memory: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Per model × formulation × variant: n, memory-correct rate (of all questions; absent counts as
    not correct), memory-correct rate among elicited answers, mem_absent rate; Wilson intervals."""
    from statsmodels.stats.proportion import proportion_confint

    rows = []
    for (model, form, variant), g in memory.groupby(["model", "formulation", "variant"], sort=True):
        n = len(g)
        absent = int(g["mem_absent"].astype(bool).sum())
        correct = int(sum(bool(x) for x, a in zip(g["memory_correct"], g["mem_absent"])
                          if not a and not pd.isna(x)))
        present = n - absent
        row = {"model": model, "formulation": form, "variant": variant, "n": n,
               "n_correct": correct, "n_absent": absent}
        for name, k, d in (("memory_correct", correct, n), ("memory_correct_of_elicited", correct, present),
                           ("mem_absent", absent, n)):
            row[name] = k / d if d else float("nan")
            lo, hi = proportion_confint(k, d, alpha=alpha, method="wilson") if d else (float("nan"),) * 2
            row[f"{name}_lo"], row[f"{name}_hi"] = float(lo), float(hi)
        rows.append(row)
    return pd.DataFrame(rows)


def summary(memory: pd.DataFrame, alpha: float = 0.05, extra: Optional[dict] = None) -> dict[str, Any]:
    """``summaries/elicitation.json`` content::

        /models/<model>/<variant>/<formulation>/{n, memory_correct, memory_correct_of_elicited,
            mem_absent}   interval objects {"value", "ci95": [lo, hi] (Wilson), "n"}
        /models/<model>/<variant>/<formulation>/cells/<cell>   int, with-tool episodes per cell
                                                              (tool_right + tool_wrong)
        /models/<model>/<variant>/pooled/<metric>   unweighted mean over formulations
    """
    r = rates(memory, alpha)
    cells = cell_distribution(memory)
    out: dict[str, Any] = {"schema_version": 1, "alpha": alpha, "models": {}}
    for _, row in r.iterrows():
        node = out["models"].setdefault(row["model"], {}).setdefault(row["variant"], {})
        f = node[row["formulation"]] = {"n": int(row["n"])}
        for name, d in (("memory_correct", row["n"]), ("memory_correct_of_elicited", row["n"] - row["n_absent"]),
                        ("mem_absent", row["n"])):
            v = row[name]
            f[name] = {"value": None if pd.isna(v) else float(v),
                       "ci95": None if pd.isna(v) else [row[f"{name}_lo"], row[f"{name}_hi"]], "n": int(d)}
        sub = cells[(cells.model == row["model"]) & (cells.variant == row["variant"])
                    & (cells.formulation == row["formulation"])]
        f["cells"] = {c: int(sub.loc[sub.cell == c, "n"].sum()) for c in CELLS}
    for model, variants in out["models"].items():
        for variant, forms in variants.items():
            pooled = {}
            for name in ("memory_correct", "memory_correct_of_elicited", "mem_absent"):
                vals = [forms[fm][name]["value"] for fm in forms if forms[fm][name]["value"] is not None]
                pooled[name] = sum(vals) / len(vals) if vals else None
            forms["pooled"] = pooled
    if extra:
        out.update(extra)
    return out
