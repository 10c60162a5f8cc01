"""Statistics for MemToC (PROTOCOL.md §6): question-cluster bootstrap, paired sign-flip tests,
Holm families, two-proportion z-tests, the asymmetric success criterion and ranking stability.

Everything resampling-based is vectorized with numpy: one (B x K) matrix of cluster draws gives
every metric of an arm at once (``resample_weights`` + a matrix product), and a (P x K) matrix of
signs gives the permutation distribution. Percentile intervals use the release's index rule
(sorted replicates at ``int(0.025 B)`` and ``min(B-1, int(0.975 B))``; 25 and 975 for B = 1000).
Holm and the z-test come from statsmodels.

The paper's preregistered Holm families are data, defined and applied here: :data:`FAMILIES`
names each family, the metric it corrects, its members (models x variants, which models), its
slices and its test; :func:`apply_families` corrects the families whose contrasts sit in the model
summaries, slice by slice, and :func:`holm_family` one slice of a family computed across models
(the cross-model tests). :func:`success_criterion` is the one definition of the asymmetric
criterion (the notebooks, the report and ``memtoc verify --published`` use it). The
sign-flip draws and the default ``n_boot`` (1,000) are the release's, so the same units give the
release's intervals and p values.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from memtoc.core.errors import MemtocError
from memtoc.core.io import plain
from memtoc.core.vocab import ALT_FRAMES, FORMULATIONS, OBJECTIVES, PROMPTING_ARMS, REFERENCE_FORMULATION

DEFAULT_N_BOOT = 1000     # the release's n_boot (scripts/build_paired_treatment_summary.py: N_BOOT = 1000)
DEFAULT_N_PERM = 10000


class StatsInputError(MemtocError, ValueError):
    """Bad input to a statistical routine (mismatched lengths, NaN values, empty data)."""


def jsonable(x: Any) -> Any:
    """Plain Python floats/ints; NaN/inf -> None."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    return x if math.isfinite(x) else None


def percentile_ci(samples: np.ndarray, alpha: float = 0.05, axis: int = 0) -> np.ndarray:
    """Percentile interval with the release's index rule, ignoring non-finite replicates.

    ``samples``: (B,) or (B, M). Returns (2,) or (2, M); NaN where no replicate is finite."""
    s = np.asarray(samples, dtype=float)
    s = np.moveaxis(s, axis, 0)
    flat = s.reshape(s.shape[0], -1)
    out = np.full((2, flat.shape[1]), np.nan)
    for j in range(flat.shape[1]):
        v = np.sort(flat[np.isfinite(flat[:, j]), j])
        b = v.size
        if b:
            out[0, j] = v[int(alpha / 2 * b)]
            out[1, j] = v[min(b - 1, int((1 - alpha / 2) * b))]
    return out.reshape((2,) + s.shape[1:])


def resample_weights(n_clusters: int, n_boot: int = DEFAULT_N_BOOT,
                     rng: Optional[np.random.Generator] = None, seed: int = 0) -> np.ndarray:
    """(n_boot x n_clusters) multiplicities of a cluster bootstrap: row b counts how often each
    cluster was drawn in replicate b (draws: ``rng.integers(0, K, (B, K))``, as in the release)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    k = int(n_clusters)
    if k <= 0:
        return np.zeros((n_boot, 0))
    idx = rng.integers(0, k, size=(n_boot, k))
    flat = (idx + (np.arange(n_boot) * k)[:, None]).ravel()
    return np.bincount(flat, minlength=n_boot * k).reshape(n_boot, k).astype(float)


def cluster_sums(values: np.ndarray, cluster: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-cluster sums and counts of ``values`` ((n,) or (n, M)). Returns (sums (K[,M]), counts (K,),
    cluster labels (K,))."""
    codes, labels = pd.factorize(pd.Series(list(cluster)) if not isinstance(cluster, pd.Series) else cluster,
                                 sort=True)
    v = np.asarray(values, dtype=float)
    k = len(labels)
    counts = np.bincount(codes, minlength=k).astype(float)
    if v.ndim == 1:
        sums = np.bincount(codes, weights=v, minlength=k)
    else:
        sums = np.stack([np.bincount(codes, weights=v[:, j], minlength=k) for j in range(v.shape[1])], 1)
    return sums, counts, np.asarray(labels)


def ratio_replicates(num: np.ndarray, den: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Bootstrap replicates of sum(num)/sum(den) for clustered data: num, den (K,) or (K, M) per
    cluster, weights (B, K) from :func:`resample_weights`. Returns (B,) or (B, M); NaN where a
    replicate's denominator is 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ np.asarray(num, float)) / (weights @ np.asarray(den, float))


def cluster_bootstrap(values: Sequence[float], cluster: Sequence[Any], n_boot: int = DEFAULT_N_BOOT,
                      seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """Mean of ``values`` with a question-cluster percentile bootstrap CI.

    Each replicate draws K clusters with replacement and takes sum(values)/count over them."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"value": None, "ci95": [None, None], "n": 0, "n_clusters": 0}
    if len(cluster) != v.size:
        raise StatsInputError(f"values ({v.size}) and cluster ({len(cluster)}) differ in length")
    if not np.all(np.isfinite(v)):
        raise StatsInputError("values contain NaN/inf; drop those units first")
    s, c, _ = cluster_sums(v, cluster)
    reps = ratio_replicates(s, c, resample_weights(len(c), n_boot, seed=seed))
    lo, hi = percentile_ci(reps, alpha)
    return {"value": jsonable(v.mean()), "ci95": [jsonable(lo), jsonable(hi)], "n": int(v.size),
            "n_clusters": int(len(c))}


def sign_flip_pvalue(cluster_diff_sums: np.ndarray, n_units: int, delta: float,
                     n_perm: int = DEFAULT_N_PERM, rng: Optional[np.random.Generator] = None,
                     seed: int = 0) -> float:
    """Paired sign-flip permutation p-value on cluster sums (PROTOCOL §6.3): P x K random signs,
    perm = sum(sign * cluster_sum) / n_units, p = (#{|perm| >= |delta| - 1e-12} + 1) / (P + 1).

    The signs are drawn exactly as the release draws them, ``rng.integers(0, 2, size=(P, K)) * 2 - 1``
    with numpy's default int64 dtype: a narrower dtype consumes the generator differently and gives
    other p-values on the same units."""
    rng = np.random.default_rng(seed) if rng is None else rng
    s = np.asarray(cluster_diff_sums, dtype=float)
    signs = (rng.integers(0, 2, size=(n_perm, s.size)) * 2 - 1).astype(float)
    perm = (signs @ s) / n_units
    return float((np.count_nonzero(np.abs(perm) >= abs(delta) - 1e-12) + 1) / (n_perm + 1))


def paired_contrast(treated: Any, untreated: Optional[Sequence[float]] = None,
                    cluster: Optional[Sequence[Any]] = None, *, n_boot: int = DEFAULT_N_BOOT,
                    n_perm: int = DEFAULT_N_PERM, seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    """Paired contrast treated - untreated on units clustered by question (PROTOCOL §6.3).

    Call with three aligned arrays, or with a DataFrame holding columns ``treated``,
    ``untreated`` and ``cluster`` (or ``qkey``). delta = sum of unit differences / number of units;
    CI: ``default_rng(seed)`` draws a (n_boot x K) matrix of cluster indices, each replicate = sum
    of drawn cluster sums / sum of drawn cluster counts; then, with the same generator continuing,
    ``n_perm`` sign flips of the cluster sums give ``p_signflip``.
    """
    if isinstance(treated, pd.DataFrame):
        df = treated
        ccol = "cluster" if "cluster" in df.columns else "qkey"
        missing = [c for c in ("treated", "untreated", ccol) if c not in df.columns]
        if missing:
            raise StatsInputError(f"paired_contrast: DataFrame lacks column(s) {missing}; it needs "
                                  "treated, untreated and cluster (or qkey)")
        t, u, cl = df["treated"].to_numpy(float), df["untreated"].to_numpy(float), df[ccol].to_numpy()
    else:
        if untreated is None or cluster is None:
            raise StatsInputError("paired_contrast needs treated, untreated and cluster arrays (or a DataFrame)")
        t, u = np.asarray(treated, float), np.asarray(untreated, float)
        cl = np.asarray(cluster)
    if not (t.size == u.size == cl.size):
        raise StatsInputError(f"paired_contrast: lengths differ (treated {t.size}, untreated {u.size}, "
                              f"cluster {cl.size})")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(u))):
        raise StatsInputError("paired_contrast: NaN values; restrict both sides to the questions in the "
                              "metric's cell for both checkpoints first (the common support)")
    n = int(t.size)
    if n == 0:
        return {"delta": None, "ci95": [None, None], "p_signflip": None, "n_units": 0, "n_questions": 0}
    d = t - u
    s, c, _ = cluster_sums(d, cl)
    delta = float(d.sum() / n)
    rng = np.random.default_rng(seed)
    k = s.size
    idx = rng.integers(0, k, size=(n_boot, k))
    reps = s[idx].sum(1) / c[idx].sum(1)
    lo, hi = percentile_ci(reps, alpha)
    p = sign_flip_pvalue(s, n, delta, n_perm, rng=rng)
    return {"delta": delta, "ci95": [jsonable(lo), jsonable(hi)], "p_signflip": p,
            "n_units": n, "n_questions": int(k)}


def holm(pvals: Sequence[float] | Mapping[str, float]) -> Any:
    """Holm-adjusted p-values (statsmodels ``multipletests(method="holm")``). A mapping returns a
    mapping with the same keys; None/NaN entries are left out of the family and returned as None."""
    from statsmodels.stats.multitest import multipletests

    keys = list(pvals.keys()) if isinstance(pvals, Mapping) else None
    vals = list(pvals.values()) if keys is not None else list(pvals)
    ok = [i for i, p in enumerate(vals) if p is not None and math.isfinite(float(p))]
    adj: list[Optional[float]] = [None] * len(vals)
    if ok:
        res = multipletests([float(vals[i]) for i in ok], method="holm")[1]
        for i, a in zip(ok, res):
            adj[i] = float(a)
    return dict(zip(keys, adj)) if keys is not None else adj


def holm_families(families: Mapping[str, Mapping[str, Mapping[str, Any]]], alpha: float = 0.05
                  ) -> dict[str, dict[str, dict[str, Any]]]:
    """Add ``p_holm`` and ``significant`` to every contrast dict (with ``p_signflip`` or ``p``),
    Holm-correcting inside each named family. Returns new dicts."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for fam, contrasts in families.items():
        ps = {k: v.get("p_signflip", v.get("p")) for k, v in contrasts.items()}
        adj = holm(ps)
        out[fam] = {k: {**v, "p_holm": adj[k], "family": fam,
                        "significant": adj[k] is not None and adj[k] < alpha}
                    for k, v in contrasts.items()}
    return out


# --------------------------------------------------------------------------------------------
# The paper's preregistered Holm families (§4.5, App. E; PROTOCOL §6.3: "Holm correction inside
# pre-declared families"), defined once here and applied from this definition
# (:func:`apply_families` for the families whose contrasts sit in the model summaries,
# :func:`holm_family` for the cross-model ones computed across models). A family is corrected
# separately in each of its slices (a formulation, or "pooled"). Contrasts of metrics no family
# names (the diagnostics) stay uncorrected.

POOLED_SLICE = "pooled"
EVERY_SLICE = FORMULATIONS + (POOLED_SLICE,)       # each formulation and pooled
REFERENCE_SLICE = (REFERENCE_FORMULATION,)
TESTS = ("sign-flip", "z-test")                     # paired by question / unpaired two-proportion
MODEL_RULES = ("all", "instruct", "base_vs_instruct", "all_pairs")


@dataclass(frozen=True)
class HolmFamily:
    """One preregistered family. Members are keyed ``"|".join(axes values)``: ``model|variant`` when
    ``variants`` is not empty, ``model`` otherwise, ``a|b`` for the cross-model pairs.

    ``models``: which models contribute ("all"; "instruct": the base models left out;
    "base_vs_instruct": base minus each instruction-tuned model; "all_pairs": every pair).
    ``pointer``: where a member's contrast sits inside one model's summary (``{variant}``,
    ``{metric}``, ``{slice}``; ``{contrasts}`` is ``contrasts`` for the pooled slice and
    ``contrasts_by_formulation/<formulation>`` otherwise); None for the cross-model families,
    whose members are computed across models and corrected with :func:`holm_family`."""
    name: str
    metric: str                      # the metric whose contrasts the family corrects
    stage: str                       # the summary that holds it: "evaluation" | "finetune"
    axes: tuple[str, ...]            # what the member keys span, e.g. ("model", "strategy")
    variants: tuple[str, ...]        # the second axis' values (arms, frames, objectives); () = none
    models: str                      # one of MODEL_RULES
    slices: tuple[str, ...]          # each corrected separately
    test: str                        # one of TESTS
    pointer: Optional[str]
    description: str

    def key(self, *parts: Any) -> str:
        if len(parts) != len(self.axes):
            raise StatsInputError(f"Holm family {self.name}: a member key needs {len(self.axes)} part(s) "
                                  f"({', '.join(self.axes)}), got {parts}")
        return "|".join(map(str, parts))

    def locate(self, model_summary: Mapping[str, Any], variant: Optional[str], slice_: str) -> Optional[dict]:
        """The contrast dict of one member in one slice of a model summary (None when absent)."""
        if self.pointer is None:
            raise StatsInputError(f"Holm family {self.name} is computed across models; use holm_family")
        contrasts = "contrasts" if slice_ == POOLED_SLICE else f"contrasts_by_formulation/{slice_}"
        path = self.pointer.format(variant=variant, metric=self.metric, slice=slice_, contrasts=contrasts)
        node: Any = model_summary
        for part in path.split("/"):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node if isinstance(node, dict) and node else None



_EVAL, _FT, _PAIRED, _Z = "evaluation", "finetune", "sign-flip", "z-test"

FAMILIES: dict[str, HolmFamily] = {f.name: f for f in (
    HolmFamily("prompting_retention", "retention", _EVAL, ("model", "strategy"), PROMPTING_ARMS, "instruct",
               EVERY_SLICE, _PAIRED, "prompting/{variant}/{contrasts}/{metric}",
               "prompting: retention change over the instruction-tuned models x strategies "
               f"({', '.join(PROMPTING_ARMS)})"),
    HolmFamily("prompting_tool_follow", "tool_follow", _EVAL, ("model", "strategy"), PROMPTING_ARMS, "instruct",
               EVERY_SLICE, _PAIRED, "prompting/{variant}/{contrasts}/{metric}",
               "prompting: correct-tool following change over the instruction-tuned models x strategies "
               "(the success criterion's tool-drop guard)"),
    HolmFamily("frames_retention", "retention", _EVAL, ("model", "frame"), ALT_FRAMES, "all", EVERY_SLICE,
               _PAIRED, "frames/{variant}/{contrasts}/{metric}",
               "presentation frames: retention change over models x frames (no_schema, passage) vs schema"),
    HolmFamily("far_retention", "retention", _EVAL, ("model",), (), "all", REFERENCE_SLICE, _PAIRED,
               "far/contrasts_reference/{metric}",
               "far vs near incorrect values: retention change over every model, base included, on the "
               "Reference formulation (App. C: the base model +19.4 points, Holm p 0.0015, n 103)"),
    HolmFamily("finetune_retention", "retention", _FT, ("model", "objective"), OBJECTIVES, "all", EVERY_SLICE,
               _PAIRED, "objectives/{variant}/deltas/{metric}/{slice}",
               "fine-tuning: retention change over models x objectives (SFT, DPO)"),
    HolmFamily("finetune_tool_follow", "tool_follow", _FT, ("model", "objective"), OBJECTIVES, "all",
               EVERY_SLICE, _PAIRED, "objectives/{variant}/deltas/{metric}/{slice}",
               "fine-tuning: correct-tool following change over models x objectives (the tool-drop guard)"),
    HolmFamily("base_vs_instruct_paired_retention", "retention", _EVAL, ("base", "instruct"), (),
               "base_vs_instruct", REFERENCE_SLICE, _PAIRED, None,
               "cross-model, paired by question: base minus each instruction-tuned model, retention, "
               "Reference formulation (App. E family C)"),
    *(HolmFamily(f"cross_model_ztest_{m}", m, _EVAL, ("model_a", "model_b"), (), "all_pairs", REFERENCE_SLICE,
                 _Z, None, f"cross-model, unpaired two-proportion z-tests over every model pair, {m}, "
                 "Reference formulation (App. E)")
      for m in ("retention", "wrong_follow")),
    *(HolmFamily(f"base_vs_instruct_ztest_{m}", m, _EVAL, ("base", "instruct"), (), "base_vs_instruct",
                 REFERENCE_SLICE, _Z, None, "cross-model, unpaired two-proportion z-tests: base minus each "
                 f"instruction-tuned model, {m}, Reference formulation")
      for m in ("retention", "wrong_follow")),
)}


def declared_family(name: str) -> HolmFamily:
    """The declared family ``name`` (an unknown name is an error listing the declared ones)."""
    if name not in FAMILIES:
        raise StatsInputError(f"unknown Holm family {name!r}; declared: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def holm_family(family: str | HolmFamily, members: Mapping[str, Mapping[str, Any]],
                alpha: float = 0.05) -> dict[str, dict[str, Any]]:
    """Holm-correct one declared family in one slice: ``members`` maps member keys
    (``FAMILIES[f].key(...)``) to contrast dicts carrying ``p`` or ``p_signflip``. Returns new dicts
    with ``p_holm``, ``significant`` and ``family`` added; members without a p-value get ``p_holm`` None."""
    fam = declared_family(family) if isinstance(family, str) else family
    return holm_families({fam.name: members}, alpha)[fam.name]


def family_models(fam: HolmFamily, names: Sequence[str], base_models: Sequence[str] = ()) -> list[Any]:
    """The models (or model pairs) that contribute members to ``fam`` among ``names``."""
    base = set(base_models)
    if fam.models == "all":
        return list(names)
    if fam.models == "instruct":
        return [m for m in names if m not in base]
    if fam.models == "base_vs_instruct":
        return [(b, i) for b in names if b in base for i in names if i not in base]
    return list(itertools.combinations(names, 2))


def apply_families(model_summaries: Mapping[str, Mapping[str, Any]], stage: str,
                   base_models: Sequence[str] = (), alpha: float = 0.05) -> dict[str, dict[str, dict]]:
    """Apply every family of ``stage`` whose contrasts sit in the model summaries (in place):
    per family and slice, the members' contrasts get ``p_holm`` and ``family``. Returns
    ``{family: {slice: {member: p_holm}}}`` (slices without members left out)."""
    out: dict[str, dict[str, dict]] = {}
    for fam in FAMILIES.values():
        if fam.stage != stage or fam.pointer is None:
            continue
        models = family_models(fam, list(model_summaries), base_models)
        for sl in fam.slices:
            members = {}
            for m in models:
                for v in fam.variants or (None,):
                    c = fam.locate(model_summaries[m], v, sl)
                    if c is not None:
                        members[fam.key(m, v) if v is not None else fam.key(m)] = c
            if members:
                out.setdefault(fam.name, {})[sl] = correct_members(fam, members, alpha)
    return out


def correct_members(fam: HolmFamily, members: Mapping[str, dict], alpha: float = 0.05) -> dict[str, Any]:
    """Holm over ``members`` (contrast dicts with ``p``; changed in place: ``p_holm``, ``family``) as
    one slice of ``fam``. Returns ``{member: p_holm}``."""
    adj = holm_family(fam, {k: {"p": c.get("p", c.get("p_signflip"))} for k, c in members.items()}, alpha)
    for k, c in members.items():
        c["p_holm"], c["family"] = adj[k]["p_holm"], fam.name
    return {k: adj[k]["p_holm"] for k in members}


def families_summary(stage: str, applied: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The families of ``stage`` as plain data for the summaries: name -> metric, axes, models,
    slices, test, description and ``members`` ({slice: {member: p_holm}}, from ``applied``)."""
    return {n: {"metric": f.metric, "axes": list(f.axes), "models": f.models, "slices": list(f.slices),
                "test": f.test, "description": f.description, "members": dict(applied.get(n, {}))}
            for n, f in FAMILIES.items() if f.stage == stage}


def apply_finetune_families(summary: dict, alpha: float = 0.05) -> dict[str, dict]:
    """The fine-tuning families on a ``summaries/finetuning.json`` dict (in place,
    :func:`apply_families`): retention and correct-tool following, each over models x objectives
    and corrected separately in every slice (each formulation, and pooled); the other metrics
    (diagnostics) keep ``p_holm`` None. Recomputes ``criterion`` / ``criterion_by_formulation`` with
    the adjusted p values and records the families under ``/holm_families``. Returns ``{family:
    {slice: {member: p_holm}}}``."""
    models = summary.get("models") or {}
    for ms in models.values():
        for os_ in (ms.get("objectives") or {}).values():
            for by_slice in (os_.get("deltas") or {}).values():
                for c in by_slice.values():
                    c["p_holm"], c["family"] = None, None
    applied = apply_families(models, "finetune", (), alpha)
    for ms in models.values():
        for os_ in (ms.get("objectives") or {}).values():
            d = os_.get("deltas") or {}
            if "retention" not in d or "tool_follow" not in d:
                continue
            crit = {sl: plain(success_criterion(d["retention"][sl], d["tool_follow"][sl], alpha=alpha))
                    for sl in d["retention"] if sl in d["tool_follow"]}
            if POOLED_SLICE in crit:
                os_["criterion"] = crit.pop(POOLED_SLICE)
            os_["criterion_by_formulation"] = crit
    summary["holm_families"] = families_summary("finetune", applied)
    return applied


def two_proportion_holm(counts: Mapping[str, tuple[int, int]], family: str,
                        pairs: Optional[Sequence[tuple[str, str]]] = None,
                        alpha: float = 0.05) -> dict[str, dict[str, Any]]:
    """Unpaired cross-model contrasts (App. E): a two-proportion z-test per pair of ``counts``
    ({model: (k, n)}), Holm over the pairs as one slice of the declared z-test ``family``.
    ``pairs`` defaults to every pair (the 10-pair family of five models); pass the planned
    base-vs-instruct pairs for that family. Keys "a|b"; diff = a - b."""
    fam = FAMILIES.get(family)
    if fam is None or fam.test != "z-test":
        raise StatsInputError(f"two_proportion_holm: {family!r} is not a declared z-test family (a paired "
                              f"family is corrected with holm_family); z-test families: "
                              f"{', '.join(n for n, f in FAMILIES.items() if f.test == 'z-test')}")
    names = list(counts)
    pairs = list(pairs) if pairs is not None else list(itertools.combinations(names, 2))
    res = {}
    for a, b in pairs:
        (k1, n1), (k2, n2) = counts[a], counts[b]
        res[f"{a}|{b}"] = two_proportion_z(int(k1), int(n1), int(k2), int(n2))
    return holm_family(fam, res, alpha)


def two_proportion_z(k1: int, n1: int, k2: int, n2: int) -> dict[str, Any]:
    """Two-sided pooled two-proportion z-test (statsmodels ``proportions_ztest``) for unpaired
    cross-model contrasts. Returns {"p1", "p2", "diff", "z", "p"}."""
    from statsmodels.stats.proportion import proportions_ztest

    if min(n1, n2) <= 0:
        raise StatsInputError(f"two_proportion_z: empty sample (n1={n1}, n2={n2})")
    p1, p2 = k1 / n1, k2 / n2
    if (k1 + k2) in (0, n1 + n2):   # no variance: identical all-0 / all-1 samples
        return {"p1": p1, "p2": p2, "diff": p1 - p2, "z": 0.0, "p": 1.0}
    z, p = proportions_ztest(np.array([k1, k2]), np.array([n1, n2]), alternative="two-sided")
    return {"p1": p1, "p2": p2, "diff": p1 - p2, "z": float(z), "p": float(p)}


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> list[float]:
    """Exact (Clopper-Pearson) interval for k of n (scipy ``binomtest``), as the paper reports the
    acknowledgment rate (0 of 120, upper bound 3%)."""
    from scipy.stats import binomtest

    if n <= 0 or not 0 <= k <= n:
        raise StatsInputError(f"clopper_pearson: need 0 <= k <= n and n > 0 (k={k}, n={n})")
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=1 - alpha, method="exact")
    return [float(ci.low), float(ci.high)]


def _p(c: Mapping[str, Any]) -> Optional[float]:
    for key in ("p_holm", "p_signflip", "p"):
        if c.get(key) is not None:
            return float(c[key])
    return None


def success_criterion(retention_contrast: Mapping[str, Any], tool_contrast: Mapping[str, Any],
                      alpha: float = 0.05) -> dict[str, Any]:
    """The asymmetric success criterion: retention rises significantly (Holm-adjusted p < alpha and
    delta > 0) AND correct-tool following shows no significant drop (not (delta < 0 and p < alpha)).

    One rule for both sides and every adaptation (PROTOCOL §6.3, Holm inside pre-declared
    families): each p is the contrast's ``p_holm``, its family's adjustment (prompting_* and
    finetune_* in :data:`FAMILIES`); a contrast that carries none (a caller outside the families)
    is read by its raw ``p`` / ``p_signflip``."""
    rp, tp = _p(retention_contrast), _p(tool_contrast)
    rd, td = retention_contrast.get("delta"), tool_contrast.get("delta")
    retention_up = rp is not None and rd is not None and rd > 0 and rp < alpha
    tool_drop = tp is not None and td is not None and td < 0 and tp < alpha
    passed = bool(retention_up and not tool_drop and td is not None)
    why = []
    if not retention_up:
        why.append("retention did not rise significantly")
    if tool_drop:
        why.append("correct-tool following dropped significantly")
    if td is None:
        why.append("no correct-tool following contrast")
    return {"passed": passed, "retention_up": bool(retention_up), "tool_drop": bool(tool_drop),
            "retention_delta": rd, "retention_p": rp, "tool_delta": td, "tool_p": tp,
            "alpha": alpha, "reason": "; ".join(why) or "retention up, no significant tool drop"}


RANKING_RULE = ("an ordering of the models holds only if the FULL ordering is the same pooled and under "
                "every formulation (the paper's rule)")
PAIRWISE_NOTE = ("pairwise readings: one model pair at a time, ordered the same pooled and under every "
                 "formulation; a weaker reading than the paper's rule, reported beside it")


def ranking_stability(per_formulation_values: Mapping[str, Mapping[str, float]],
                      pooled_values: Mapping[str, float], reference_only: Sequence[str] = (),
                      reference: str = "reference") -> dict[str, Any]:
    """Ranking stability of models (the paper's rule: the full ordering pooled and under every
    formulation).

    ``per_formulation_values``: {formulation: {model: value}}; ``pooled_values``: {model: value}.
    Models in ``reference_only`` (the base model, which the paper reports on the Reference
    formulation only) are left out of the pooled and paraphrase orderings and compared in
    ``reference_order`` (all models, ``reference`` formulation). Returns ``rule``, ``orders``
    (ascending model order per scope, as the release lists them), ``full_order_stable`` (the
    paper's verdict), ``reference_order``, and, labelled as a different reading, ``pairs`` /
    ``stable_pairs`` (``pairwise_note``)."""
    ro = set(reference_only)
    models = [m for m in pooled_values if pooled_values[m] is not None and m not in ro]
    scopes = {"pooled": dict(pooled_values), **{f: dict(v) for f, v in per_formulation_values.items()}}
    orders = {s: sorted([m for m in models if vals.get(m) is not None], key=lambda m: vals[m])
              for s, vals in scopes.items()}
    pairs = []
    for a, b in itertools.combinations(models, 2):
        pa, pb = pooled_values[a], pooled_values[b]
        if pa == pb:
            pairs.append({"pair": [a, b], "pooled_order": None, "stable": False})
            continue
        lo, hi = (a, b) if pa < pb else (b, a)
        holds = [f for f, v in per_formulation_values.items()
                 if v.get(lo) is not None and v.get(hi) is not None and v[lo] < v[hi]]
        pairs.append({"pair": [a, b], "pooled_order": f"{lo}<{hi}",
                      "holds_in": holds, "stable": len(holds) == len(per_formulation_values)})
    full = all(o == orders["pooled"] for o in orders.values())
    ref_vals = per_formulation_values.get(reference, {})
    ref_order = sorted([m for m in ref_vals if ref_vals.get(m) is not None], key=lambda m: ref_vals[m])
    return {"rule": RANKING_RULE, "orders": orders, "full_order_stable": bool(full),
            "reference_order": ref_order, "reference_only": sorted(ro),
            "pairwise_note": PAIRWISE_NOTE, "pairs": pairs,
            "stable_pairs": [p["pooled_order"] for p in pairs if p["stable"]]}
