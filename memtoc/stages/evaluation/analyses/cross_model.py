"""The comparisons across models: ranking stability, the unpaired two-proportion z-tests and the
question-paired base-vs-instruct contrasts (App. E), each corrected in its ``stats.FAMILIES`` family."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import pandas as pd

from memtoc.core import intervals, stats
from memtoc.core.errors import MemtocError
from memtoc.core.io import plain
from memtoc.core.metrics import metric_units
from memtoc.core.vocab import FORMULATIONS, HEADLINE_METRICS, POOLED, REFERENCE_FORMULATION
from memtoc.generation import models
from memtoc.stages.evaluation.analyses.subsets import select_arm


def base_models(names: Iterable[str]) -> list[str]:
    """The base (non-chat) models among ``names`` (memtoc.generation.models registry; unknown names are taken
    as instruction-tuned). The paper compares the base model on the Reference formulation only."""
    out = []
    for n in names:
        try:
            if not models.get_model(n).chat:
                out.append(n)
        except MemtocError:
            pass
    return out


def ranking_section(model_summaries: dict[str, dict], metric_names: Sequence[str] = HEADLINE_METRICS) -> dict:
    """Ranking stability of the models on each headline metric (``stats.ranking_stability``): the
    paper's rule is the FULL ordering, pooled and under every formulation (``full_order_stable``);
    ``pairs`` / ``stable_pairs`` are a weaker pairwise reading, labelled as such. A base model is
    compared on the Reference formulation only (``reference_order``)."""
    reference_only = base_models(model_summaries)
    out = {}
    for m in metric_names:
        pooled = {mod: s["headline"].get(POOLED, {}).get(m, {}).get("value") for mod, s in model_summaries.items()}
        forms = sorted({f for s in model_summaries.values() for f in s["headline"] if f != POOLED},
                       key=lambda f: FORMULATIONS.index(f) if f in FORMULATIONS else 99)
        per = {f: {mod: s["headline"].get(f, {}).get(m, {}).get("value") for mod, s in model_summaries.items()}
               for f in forms}
        out[m] = plain(stats.ranking_stability(per, pooled, reference_only=reference_only))
    return out


def cross_model_section(model_summaries: dict[str, dict], metric_names: Sequence[str] = ("retention", "wrong_follow"),
                        alpha: float = 0.05) -> dict:
    """Unpaired cross-model contrasts (App. E): per metric, two-proportion z-tests on the Reference
    formulation's counts (the base model is reported there only), Holm over every model pair
    (``cross_model_ztest_<metric>``) and over the planned base-vs-instruct pairs (base minus each
    instruct, ``base_vs_instruct_ztest_<metric>``) when the run has a base model.
    ``{metric: {"formulation", "all_pairs": {"a|b": {...}}, "base_vs_instruct": {...}}}``."""
    out: dict[str, Any] = {}
    names = list(model_summaries)
    if len(names) < 2:
        return out
    bases = base_models(names)
    for m in metric_names:
        counts = {}
        for mod, s in model_summaries.items():
            iv = (s["headline"].get(REFERENCE_FORMULATION) or {}).get(m) or {}
            if iv.get("value") is not None and iv.get("n"):
                counts[mod] = (int(round(iv["value"] * iv["n"])), int(iv["n"]))
        if len(counts) < 2:
            continue
        sec = {"formulation": REFERENCE_FORMULATION,
               "all_pairs": stats.two_proportion_holm(counts, f"cross_model_ztest_{m}", alpha=alpha)}
        fam = stats.declared_family(f"base_vs_instruct_ztest_{m}")
        pairs = stats.family_models(fam, list(counts), bases)
        if pairs:
            sec["base_vs_instruct"] = stats.two_proportion_holm(counts, fam.name, pairs, alpha)
        out[m] = plain(sec)
    return out


def paired_base_vs_instruct(scored_by_model: dict[str, pd.DataFrame], n_boot: int = stats.DEFAULT_N_BOOT,
                            n_perm: int = 10000, seed: int = 0, alpha: float = 0.05) -> dict:
    """The question-paired base-vs-instruct families (App. E family C; ``stats.FAMILIES`` entries
    with ``models == "base_vs_instruct"`` and the sign-flip test): per family, base minus each
    instruction-tuned model on the untreated, schema-frame episodes of each slice (the Reference
    formulation), paired on common (formulation, qkey) support and clustered by question, Holm over
    the pairs. ``{metric: {"base|instruct": contrast object}}``."""
    out: dict[str, Any] = {}
    bases = base_models(scored_by_model)
    for fam in stats.FAMILIES.values():
        if fam.models != "base_vs_instruct" or fam.test != "sign-flip":
            continue
        for sl in fam.slices:
            members = {}
            for b, i in stats.family_models(fam, list(scored_by_model), bases):
                ub, ui = (metric_units(select_arm(scored_by_model[x]), fam.metric) for x in (b, i))
                if sl != POOLED:
                    ub, ui = ub[ub["formulation"] == sl], ui[ui["formulation"] == sl]
                members[fam.key(b, i)] = intervals.contrast(ub, ui, n_boot, n_perm, seed, b, i)
            if members:
                stats.correct_members(fam, members, alpha)
                out.setdefault(fam.metric, {}).update(members)
    return plain(out)


def cross_model_families(cross: dict) -> dict[str, dict]:
    """``{family: {slice: {member: p_holm}}}`` of the cross-model families in a ``/cross_model``
    section (every member carries its ``family``; the slice is the section's formulation)."""
    out: dict[str, dict] = {}
    for sec in cross.values():
        for part in ("all_pairs", "base_vs_instruct", "base_vs_instruct_paired"):
            for k, c in (sec.get(part) or {}).items():
                out.setdefault(c["family"], {}).setdefault(sec["formulation"], {})[k] = c["p_holm"]
    return out
