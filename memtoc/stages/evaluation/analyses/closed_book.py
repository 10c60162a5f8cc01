"""The closed-book diagnostics of App. D: FINAL-line compliance and the forced vs permissive
closed-book passes."""
from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np
import pandas as pd

from memtoc.core.errors import DataError
from memtoc.core.io import plain
from memtoc.core.scoring import has_final_line
from memtoc.core.vocab import FORMULATIONS, POOLED
from memtoc.stages.elicitation import load_memory


def final_line_compliance(responses: Iterable[Optional[str]]) -> dict:
    """Share of replies that carry a ``FINAL:`` line (``scoring.has_final_line``), App. D."""
    flags = [has_final_line(r) for r in responses]
    return {"n": len(flags), "rate": float(np.mean(flags)) if flags else None}


def closed_book_agreement(forced: pd.DataFrame, permissive: pd.DataFrame) -> dict:
    """Forced vs permissive closed-book passes of one model (App. D), per formulation and pooled
    over (question, formulation): ``n`` pairs, ``both_answered`` (neither pass abstains),
    ``same_correctness`` (share of the both-answered pairs whose memory_correct agrees),
    ``permissive_abstained`` (share of pairs where only the permissive pass abstains: the
    memories the forced pass adds)."""
    on = ["formulation", "qkey"]
    m = forced[on + ["mem_absent", "memory_correct"]].merge(
        permissive[on + ["mem_absent", "memory_correct"]], on=on, suffixes=("_f", "_p"))
    out: dict[str, Any] = {}
    for f in [x for x in FORMULATIONS if x in set(m["formulation"])] + [POOLED]:
        d = m if f == POOLED else m[m["formulation"] == f]
        fa, pa = d["mem_absent_f"].astype(bool), d["mem_absent_p"].astype(bool)
        both = d[~fa & ~pa]
        out[f] = {"n": int(len(d)), "both_answered": int(len(both)),
                  "same_correctness": float((both["memory_correct_f"].astype(bool)
                                             == both["memory_correct_p"].astype(bool)).mean()) if len(both) else None,
                  "permissive_abstained": float((pa & ~fa).mean()) if len(d) else None}
    return out


def closed_book_section(scored: pd.DataFrame, memory: pd.DataFrame | None, run_dir, model_label: str) -> dict:
    """FINAL-line compliance of the with-tool replies and of the forced closed-book replies, and the
    forced-vs-permissive agreement when the run elicited the permissive pass (App. D)."""
    out: dict[str, Any] = {}
    if "response" in scored.columns:
        out["final_line_with_tool"] = final_line_compliance(scored["response"].tolist())
    if memory is not None and "response" in memory.columns:
        out["final_line_closed_book"] = final_line_compliance(memory["response"].tolist())
    if memory is not None and run_dir is not None:
        try:
            perm = load_memory(run_dir, model_label, "permissive")
        except DataError:
            perm = None
        if perm is not None:
            out["forced_vs_permissive"] = closed_book_agreement(memory, perm)
    return plain(out)
