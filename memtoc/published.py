"""``memtoc verify --published``: the published MemToC paper's numbers, re-derived from the release
data through memtoc's own analysis code.

The release (``../shared/memtoc-release``) ships aggregates, not episodes: per model x arm x
formulation rates with their cell sizes (``published_arm_metrics.json``), the pooled summary, the
fine-tuning paired changes, the distractor-distance and protocol contrasts. Every rate there is a
count over a known denominator, so :func:`release_frame` rebuilds a scored frame with exactly those
counts (episodes of the right condition and cell with the right flags) and the pipeline's functions
run on it: ``metrics.arm_metrics`` / ``metrics.pooled_point_metrics`` (cells, metric definitions,
the paper's pooling), ``metrics.formulation_spread``, ``stats.ranking_stability``. Paired changes
are rebuilt as paired units with the release's net counts and go through ``stats.paired_contrast``;
Holm families through ``stats.holm_family`` (``stats.FAMILIES``); the success criterion through
``stats.success_criterion`` (the one definition the notebooks, the report and ``memtoc verify``
share). No check re-implements a metric, a pooling rule, a correction or the criterion.

Each check is ``{"id", "family", "published", "derived", "status", "via", "detail", "source"}``:
``family`` names the table or section (``table1``, ``table4``, ``sec5_2``, ``sec5_3``, ``sec5_4``,
``pooled``, ``finetune``, ``far``, ``protocol``, ``acknowledgment``, ``construction``, ``review``),
``via`` the memtoc function that derived the value. Statuses:

``MATCH``          the printed and the re-derived value agree at the printed precision
``DISAGREEMENT``   a documented disagreement: the paper contradicts its own data or table (the
                   reason is in ``detail``); not a pass, not a failure
``UNPUBLISHED``    re-derived, but the paper's printed value is not in the release copy (transcribe
                   it under ``paper_prose`` in ``paper/claims.yaml`` to check it)
``N/A``            the release copy lacks the inputs (a partial file)
``MISMATCH``       a failure

Numbers the paper prints only in its prose (and the release files do not carry) are transcribed
under ``paper_prose:`` in ``paper/claims.yaml``; the bookkeeping counts of the release
(construction, review, acknowledgment) are checked by the generic ops of the registry's
``published:`` section (:func:`registry_checks`).
"""
from __future__ import annotations

import json
import math
import re
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from . import claims, metrics, stats
from .config import FORMULATIONS, MemtocError, resolve_release_dir

RANGE_DASH = "–"
MODELS = {"Llama-3.1-8B-Instruct": "llamai", "gemma-2-9b-it": "gemma", "Qwen2.5-7B-Instruct": "qwen",
          "Mistral-7B-Instruct-v0.3": "mistral"}
PV_FORMULATION = {"canonical_pv0": "reference", "canonical_pv1": "paraphrase_a", "canonical_pv2": "paraphrase_b"}
PROMPTS = {"untreated": "canonical", "warn": "control_warn", "prior": "control_prior", "flag": "control_flag"}
COLUMNS = {"ret": "retention", "tool": "tool_follow", "wrong": "wrong_follow", "err": "err_abstain"}
# release metric names -> memtoc's
RELEASE_METRIC = {"keep": "retention", "keep_strict": "retention", "CRA_arb": "cra_arb",
                  "tool_gold_follow": "tool_follow", "prior_bw": "wrong_follow", "prior": "wrong_follow",
                  "te_abstain": "err_abstain", "nc_CRA": "nc_acc"}
STATUSES = ("MATCH", "DISAGREEMENT", "UNPUBLISHED", "N/A", "MISMATCH")

V_POOLED = "memtoc.metrics.pooled_point_metrics"
V_ARM = "memtoc.metrics.arm_metrics"
V_SPREAD = "memtoc.metrics.formulation_spread"
V_CONTRAST = "memtoc.stats.paired_contrast"
V_HOLM = "memtoc.stats.holm_family"
V_CRIT = "memtoc.stats.success_criterion"
V_RANK = "memtoc.stats.ranking_stability"
V_CP = "memtoc.stats.clopper_pearson"


class PublishedCheckError(MemtocError):
    """The release copy or the registry's published part cannot be read as expected."""


# ==================================================================================================
# results

@dataclass
class Check:
    id: str
    family: str
    published: Any
    derived: Any
    status: str
    via: str
    detail: str = ""
    source: str = ""

    # the interface of claims.CheckRow, for notebooks and tables
    @property
    def printed(self) -> str:
        return "" if self.published is None else str(self.published)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PublishedResult:
    checks: list[Check] = field(default_factory=list)
    target: str = ""
    kind: str = "published"

    @property
    def rows(self) -> list[Check]:
        return self.checks

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "MISMATCH"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    def summary_dict(self) -> dict[str, Any]:
        by_family: dict[str, dict[str, int]] = {}
        by_via: dict[str, int] = {}
        for c in self.checks:
            by_family.setdefault(c.family, {s: 0 for s in STATUSES})[c.status] += 1
            by_via[c.via] = by_via.get(c.via, 0) + 1
        pipeline = sum(n for v, n in by_via.items()
                       if v.startswith(("memtoc.metrics.", "memtoc.stats.", "memtoc.evaluation.")))
        return {"release": self.target, "ok": self.ok, "n_checks": len(self.checks), "by_status": self.counts(),
                "by_family": by_family, "by_via": by_via, "n_via_pipeline": pipeline,
                "disagreements": [{"id": c.id, "published": c.published, "derived": c.derived, "reason": c.detail}
                                  for c in self.checks if c.status == "DISAGREEMENT"],
                "mismatches": [{"id": c.id, "published": c.published, "derived": c.derived, "detail": c.detail}
                               for c in self.failures]}

    def summary(self) -> str:
        k = self.counts()
        checked = k["MATCH"] + k["DISAGREEMENT"] + k["MISMATCH"]
        return (f"{k['MATCH']}/{checked} published values re-derived and matching; {k['DISAGREEMENT']} documented "
                f"disagreement(s), {k['MISMATCH']} mismatch(es); {k['UNPUBLISHED']} re-derived without a printed "
                f"value in the release copy; {k['N/A']} not derivable from the release copy "
                f"({len(self.checks)} checks)")

    def to_dict(self) -> dict[str, Any]:
        return {"checks": [c.to_dict() for c in self.checks], "summary": self.summary_dict()}

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame([c.to_dict() for c in self.checks])

    def table(self, width: int = 48) -> str:
        head = ("status", "check", "published", "derived", "via / detail")
        rows = [(c.status, c.id, _s(c.published), _s(c.derived), (c.via + ("  " + c.detail if c.detail else "")))
                for c in self.checks]
        return claims.text_table(head, rows, width)


def _s(v: Any) -> str:
    return "" if v is None else (json.dumps(v) if isinstance(v, (list, dict)) else str(v))


class _Collector:
    """Builds checks: compares printed and derived values at the printed precision."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(self, cid: str, family: str, via: str, published: Any, derived: Any, rule: str = "exact",
            source: str = "", disagreement: Optional[str] = None, tolerance: Optional[float] = None,
            published_rule: Optional[str] = None) -> Check:
        der = fmt(derived, rule)
        pub = None if published is None else fmt(published, published_rule or rule)
        if published is None:
            status, detail = "UNPUBLISHED", "the paper's printed value is not in the release copy"
        elif pub == der:
            status, detail = "MATCH", ""
        elif (tolerance is not None and _num(published) is not None and _num(derived) is not None
              and abs(_num(published) - _num(derived)) <= tolerance + 1e-12):
            status, detail = "MATCH", f"within {tolerance} (the release's inputs are themselves rounded): exact {derived!r}"
        elif disagreement:
            status, detail = "DISAGREEMENT", disagreement
        else:
            status, detail = "MISMATCH", f"published {pub!r}, re-derived {der!r}"
        c = Check(cid, family, pub, der, status, via, detail, source)
        self.checks.append(c)
        return c

    def na(self, cid: str, family: str, via: str, why: str, source: str = "") -> None:
        self.checks.append(Check(cid, family, None, None, "N/A", via, why, source))


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.replace(RANGE_DASH, "-")) if re.fullmatch(r"-?[\d.]+", v.strip()) else None
        except ValueError:
            return None
    return None


def fmt(v: Any, rule: str) -> Any:
    """A value at the printed precision: numbers through ``claims.format_value`` (half-up on the
    shortest decimal representation); (lo, hi) tuples as "lo–hi"; lists element-wise; strings that
    are numbers or ranges re-rounded; anything else as it is."""
    if isinstance(v, tuple):
        return RANGE_DASH.join(str(fmt(x, rule)) for x in v)
    if isinstance(v, list):
        return [fmt(x, rule) for x in v] if rule != "exact" else v
    if isinstance(v, str) and rule != "exact":
        s = v.strip().replace("-", RANGE_DASH) if re.fullmatch(r"\s*-?[\d.]+\s*[-–]\s*[\d.]+\s*", v) else v
        if RANGE_DASH in s and not s.startswith(RANGE_DASH):
            return RANGE_DASH.join(str(fmt(float(x), rule)) for x in s.split(RANGE_DASH))
        try:
            return claims.format_value(float(v), rule)
        except ValueError:
            return v
    if isinstance(v, (np.integer,)):
        v = int(v)
    if isinstance(v, (np.floating,)):
        v = float(v)
    return claims.format_value(v, rule)


# ==================================================================================================
# the release as scored frames

class Release:
    """The release files, read once."""

    def __init__(self, release_dir: str | Path | None = None):
        self.dir = resolve_release_dir(release_dir)
        self._cache: dict[str, Any] = {}

    def json(self, name: str) -> Any:
        if name not in self._cache:
            path = self.dir / name
            if not path.is_file():
                raise PublishedCheckError(f"{path} does not exist; the release copy must hold {name}")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]

    def analysis_set_size(self) -> int:
        excl = set(self.json("qc_lists.json")["exclude_qkeys"])
        rows = [json.loads(l) for l in (self.dir / "questions_575.jsonl").read_text().splitlines() if l.strip()]
        return sum(r["qkey"] not in excl for r in rows)


def count_of(rate: float, n: int, where: str) -> int:
    """The integer count behind a release rate printed to 4 decimals over ``n``."""
    k = int(round(float(rate) * n))
    if n and round(k / n, 4) != round(float(rate), 4):
        raise PublishedCheckError(f"{where}: rate {rate} is not a count over n={n}")
    return k


def release_frame(blocks: dict[str, dict[str, Any]], n_err: Optional[int] = None, where: str = "") -> pd.DataFrame:
    """A scored frame (the columns ``metrics`` reads) whose counts are the release's: ``blocks``
    maps formulation -> one release arm block (keep_strict, n_both_in_arb, CRA_arb, n_arb,
    prior_bw, tool_gold_follow, nc_CRA, n_bw, te_abstain; absent fields are skipped). Per
    formulation: ``n_arb`` tool_wrong episodes in the arb cell (kept / both / followed, CRA_arb of
    them correct), ``n_bw`` tool_wrong episodes in both_wrong (prior_bw of them follow the tool),
    ``n_bw`` tool_right episodes in tool_gold (the same questions: memory wrong; tool_gold_follow
    follow, nc_CRA correct) and ``n_err`` tool_error episodes (te_abstain abstain)."""
    rows: list[dict[str, Any]] = []

    def ep(form, i, cond, cell, outcome="neither", correct=False, abstain=False):
        rows.append({"formulation": form, "qkey": f"q{i:04d}", "condition": cond, "cell": cell,
                     "followed_tool": outcome in ("followed_tool", "both"),
                     "kept_memory": outcome in ("kept_memory", "both"), "outcome": outcome,
                     "final_correct": bool(correct), "abstain": bool(abstain)})

    for form, b in blocks.items():
        w = f"{where} {form}"
        n_arb = b.get("n_arb")
        if n_arb is not None and "keep_strict" in b:
            keep = count_of(b["keep_strict"], n_arb, w + " keep")
            both = int(b.get("n_both_in_arb", 0))
            cra = count_of(b["CRA_arb"], n_arb, w + " CRA_arb") if "CRA_arb" in b else 0
            for i in range(n_arb):
                out = "kept_memory" if i < keep else "both" if i < keep + both else "followed_tool"
                ep(form, i, "tool_wrong", "arb", out, correct=i < cra)
        n_bw = b.get("n_bw")
        if n_bw is not None:
            if "prior_bw" in b:
                k = count_of(b["prior_bw"], n_bw, w + " prior_bw")
                for i in range(n_bw):
                    ep(form, 5000 + i, "tool_wrong", "both_wrong", "followed_tool" if i < k else "neither")
            if "tool_gold_follow" in b:
                k = count_of(b["tool_gold_follow"], n_bw, w + " tool_gold_follow")
                c = count_of(b["nc_CRA"], n_bw, w + " nc_CRA") if "nc_CRA" in b else 0
                for i in range(n_bw):
                    ep(form, 5000 + i, "tool_right", "tool_gold", "followed_tool" if i < k else "neither",
                       correct=i < c)
        if n_err and "te_abstain" in b:
            k = count_of(b["te_abstain"], n_err, w + " te_abstain")
            for i in range(n_err):
                ep(form, i, "tool_error", "tool_error", abstain=i < k)
    return pd.DataFrame(rows)


def release_units(per_slice: dict[str, dict[str, Any]], where: str = "") -> pd.DataFrame:
    """Paired units (``treated``, ``untreated``, ``cluster``) whose per-slice net change is the
    release's: slice s has ``n_units`` units, round(delta x n) of them +1 (or -1), the rest 0.
    The arrangement is unknown (the release ships no units), so only the delta and the unit
    counts of ``stats.paired_contrast`` on them are the release's, not its interval or p."""
    t, u, cl = [], [], []
    for sl, c in per_slice.items():
        n = int(c["n_units"])
        net = count_of(c["delta"], n, f"{where} {sl}")
        for i in range(n):
            up = i < abs(net)
            t.append(1.0 if up and net > 0 else 0.0)
            u.append(1.0 if up and net < 0 else 0.0)
            cl.append(f"{sl}:{i}")
    return pd.DataFrame({"treated": t, "untreated": u, "cluster": cl})


def _contrast_delta(per_slice: dict[str, dict[str, Any]], where: str) -> dict[str, Any]:
    return stats.paired_contrast(release_units(per_slice, where), n_boot=10, n_perm=10)


# ==================================================================================================
# the checks

def _arm_blocks(rel: Release, model: str, prompt: str, layer: str = "judged") -> dict[str, dict]:
    arms = rel.json("published_arm_metrics.json")[layer][model]
    return {PV_FORMULATION[f"canonical_pv{i}"]: arms[f"{PROMPTS[prompt]}_pv{i}"] for i in range(3)}


def _pooled(rel: Release, model: str, prompt: str, n_err: int) -> dict[str, Any]:
    return metrics.pooled_point_metrics(release_frame(_arm_blocks(rel, model, prompt), n_err, f"{model} {prompt}"))


def check_tables(rel: Release, out: _Collector, prose: dict) -> dict[str, dict[str, dict]]:
    """Table 1 untreated rows, Table 4 (4 models x 4 prompts x 4 columns), the headline ranges,
    the §5.3 spreads and the §5.4 prompting deltas."""
    n_err = rel.analysis_set_size()
    t1 = rel.json("published_table1.json")
    pooled = {(m, p): _pooled(rel, key, p, n_err) for m, key in MODELS.items() for p in PROMPTS}
    t4 = (prose.get("table4") or {})

    def twice(pub, v, what: str) -> Optional[str]:
        """A print that comes from rounding twice (the pooled rate to 4 decimals, then to one
        decimal of a percent), as the release's own note documents for gemma's 99.5."""
        if pub is None or v is None or fmt(pub, "decimal:1") == fmt(v, "percent:1"):
            return None
        r4 = round(float(v), 4)
        if fmt(pub, "decimal:1") != fmt(r4, "percent:1"):
            return None
        return (f"{what}: rounded twice in the paper; the release's per-formulation counts pool to "
                f"{100 * float(v):.3f} ({fmt(v, 'percent:1')} at one decimal), the paper prints "
                f"{fmt(pub, 'decimal:1')} = the pooled rate rounded to 4 decimals first ({r4}); the release "
                "documents the same for gemma's tool-error abstention (published_table1.json notes)")

    for m, key in MODELS.items():
        for col, metric in COLUMNS.items():
            v = pooled[(m, "untreated")]["pooled"][metric]
            pub = t1["rows"][m]["untreated"][col]
            note = twice(pub, v, f"{m} {col}")
            out.add(f"table1.untreated.{m}.{col}", "table1", V_POOLED, pub, v, "percent:1",
                    "published_table1.json", note, published_rule="decimal:1")
            for p in PROMPTS:
                v = pooled[(m, p)]["pooled"][metric]
                if p == "untreated":      # Table 4's untreated row repeats Table 1's
                    pub4 = pub
                else:
                    pub4 = ((t4.get(m) or {}).get(p) or {}).get(col)
                out.add(f"table4.{m}.{p}.{col}", "table4", V_POOLED, pub4, v, "percent:1",
                        "published_arm_metrics.json (judged, pooled over the three formulations)",
                        twice(pub4, v, f"{m} {p} {col}"), published_rule="decimal:1")
    # Table 1 notes: headline ranges over the four models
    notes = " ".join(t1["notes"])
    for col, pat in (("ret", r"retention ([0-9.]+-[0-9.]+)"), ("tool", r"(?<!in)correct-tool following ([0-9.]+-[0-9.]+)"),
                     ("wrong", r"incorrect-tool following ([0-9.]+-[0-9.]+)")):
        vals = [pooled[(m, "untreated")]["pooled"][COLUMNS[col]] for m in MODELS]
        pub = re.search(pat, notes).group(1)
        ends = [twice(p_, v_, "range end") for p_, v_ in zip(pub.split("-"), (min(vals), max(vals)))]
        out.add(f"table1.headline_range.{col}", "table1", V_POOLED, pub, (min(vals), max(vals)), "percent:1",
                "published_table1.json notes", "; ".join(e for e in ends if e) or None, published_rule="decimal:1")
    # §5.3: how far a model's rate moves between formulations, range over the models
    for col, key in (("ret", "ret_spread"), ("wrong", "wrong_spread")):
        spreads = [metrics.formulation_spread({f: pooled[(m, "untreated")][f][COLUMNS[col]]
                                               for f in FORMULATIONS}) for m in MODELS]
        out.add(f"sec5_3.formulation_spread.{col}", "sec5_3", V_SPREAD, (prose.get("sec5_3") or {}).get(key),
                (min(spreads), max(spreads)), "percent:0", "paper §5.3 prose (paper_prose in claims.yaml)",
                published_rule="decimal:0")
    # §5.4: prompting deltas (pooled strategy minus pooled untreated, Llama-3.1-8B-Instruct)
    s4 = prose.get("sec5_4") or {}
    llama = "Llama-3.1-8B-Instruct"
    for p in ("warn", "prior"):
        for col in ("ret", "tool", "err"):
            d = pooled[(llama, p)]["pooled"][COLUMNS[col]] - pooled[(llama, "untreated")]["pooled"][COLUMNS[col]]
            pub = s4.get(f"{p}_{col}")
            why = None
            if (p, col) == ("prior", "ret"):
                why = (f"the paper's §5.4 prose gives +{pub} points of retention for source-priority; its own "
                       f"data (the release's judged per-formulation rates, pooled) give "
                       f"{fmt(pooled[(llama, p)]['pooled']['retention'], 'percent:1')} - "
                       f"{fmt(pooled[(llama, 'untreated')]['pooled']['retention'], 'percent:1')} = +30.0; no layer "
                       "(det +28.5) or formulation-pooled metric of the release gives +32")
            out.add(f"sec5_4.{llama}.{p}.{col}_delta", "sec5_4", V_POOLED, pub, d * 100, "signed:0",
                    "paper §5.4 prose (paper_prose in claims.yaml)", why)
    ups = [(m, p) for m in MODELS for p in PROMPTS if p != "untreated"
           if pooled[(m, p)]["pooled"]["retention"] > pooled[(m, "untreated")]["pooled"]["retention"]]
    out.add("sec5_4.retention_up_directions", "sec5_4", V_POOLED, s4.get("retention_up"),
            f"{len(ups)} of {len(MODELS) * 3}", "exact", "paper §5.4 prose")
    down = [(m, p) for m in MODELS for p in PROMPTS if p != "untreated"
            if pooled[(m, p)]["pooled"]["err_abstain"] < pooled[(m, "untreated")]["pooled"]["err_abstain"]]
    raised = [f"{m} {p} ({fmt(100 * (pooled[(m, p)]['pooled']['err_abstain'] - pooled[(m, 'untreated')]['pooled']['err_abstain']), 'signed:1')})"
              for m in MODELS for p in PROMPTS if p != "untreated" and (m, p) not in down]
    out.add("sec5_4.err_abstain_reduced_by_every_strategy", "sec5_4", V_POOLED, s4.get("err_reduced"),
            f"{len(down)} of {len(MODELS) * 3}", "exact", "paper §5.4 prose vs Table 4",
            "§5.4 says every strategy reduces tool-error abstention; the paper's own Table 4 values (the "
            "release's pooled rates) show abstain-and-flag raising it: " + ", ".join(raised))
    return {m: {p: pooled[(m, p)] for p in PROMPTS} for m in MODELS}


def check_pooled(rel: Release, out: _Collector) -> None:
    """published_pooled.json: per-formulation values and sizes vs the arm metrics, the pooled means,
    the orderings and the stability verdict (stats.ranking_stability)."""
    pp = rel.json("published_pooled.json")
    am = rel.json("published_arm_metrics.json")["judged"]
    metric = {"prior": "wrong_follow", "keep": "retention"}
    nname = {"prior": "n_both_wrong", "keep": "n_arb"}
    per_form: dict[str, dict[str, dict[str, float]]] = {k: {} for k in metric}
    pooled_vals: dict[str, dict[str, float]] = {k: {} for k in metric}
    for model, blk in pp["pooled_instructs"].items():
        for k, ours in metric.items():
            b = blk[k]
            for pv, form in PV_FORMULATION.items():
                a = metrics.arm_metrics(release_frame({form: am[model][pv]}, None, f"{model} {pv}"))
                out.add(f"pooled.{model}.{k}.{pv}", "pooled", V_ARM, b["per_pv"][pv], a[ours], "decimal:4",
                        "published_pooled.json vs published_arm_metrics.json")
                out.add(f"pooled.{model}.{k}.{pv}.n", "pooled", V_ARM, b["n_per_pv"][pv], a[nname[k]], "int",
                        "published_pooled.json vs published_arm_metrics.json")
                per_form[k].setdefault(pv, {})[model] = a[ours]
            fr = {PV_FORMULATION[pv]: ({"n_arb": b["n_per_pv"][pv], "keep_strict": b["per_pv"][pv]} if k == "keep"
                                       else {"n_bw": b["n_per_pv"][pv], "prior_bw": b["per_pv"][pv]})
                  for pv in PV_FORMULATION}
            v = metrics.pooled_point_metrics(release_frame(fr, None, f"{model} {k}"))["pooled"][ours]
            pooled_vals[k][model] = v
            out.add(f"pooled.{model}.{k}.pooled_mean", "pooled", V_POOLED, b["pooled_mean"], v, "decimal:4",
                    "published_pooled.json", tolerance=0.0001)
    for k, order_key in (("prior", "prior"), ("keep", "keepQ")):
        r = stats.ranking_stability(per_form[k], pooled_vals[k])
        for scope in ("pooled",) + tuple(PV_FORMULATION):
            out.add(f"pooled.order.{scope}.{k}", "pooled", V_RANK, pp["orders_by_scope"][scope][order_key],
                    r["orders"][scope], "exact", "published_pooled.json orders_by_scope")
        m = re.search(r"(none) of the tested orderings is stable", pp["stable_core_rule"])
        out.add(f"pooled.stable.{k}", "pooled", V_RANK, False if m else None, r["full_order_stable"], "exact",
                "published_pooled.json stable_core_rule")


def check_finetune(rel: Release, out: _Collector, prose: dict) -> None:
    """published_finetuning.json: pooled paired changes and units (stats.paired_contrast on units
    with the release's net counts), the §5.2 prose deltas, and the Table 1 criterion note
    (stats.holm_family + stats.success_criterion)."""
    ft = rel.json("published_finetuning.json")["judged"]["crossfit"]
    s2 = prose.get("sec5_2") or {}
    for model, objs in ft.items():
        for obj, mets in objs.items():
            for met, blk in mets.items():
                pvs = {k: v for k, v in blk.items() if k.startswith("pv")}
                res = _contrast_delta(pvs, f"{model} {obj} {met}")
                cid = f"finetune.{model}.{obj}.{met}"
                if "pooled" in blk:
                    out.add(cid + ".pooled_delta", "finetune", V_CONTRAST, blk["pooled"]["delta"], res["delta"],
                            "decimal:4", "published_finetuning.json", tolerance=0.0001)
                    out.add(cid + ".pooled_units", "finetune", V_CONTRAST, blk["pooled"]["n_units"], res["n_units"],
                            "int", "published_finetuning.json")
                elif (model, obj, met) == ("qwen", "sft", "tool_gold_follow"):
                    # the release copy lacks this pooled block; the paper's prose gives the change, and
                    # the pooled support is the both-wrong support (the same memory-wrong questions)
                    out.add(cid + ".pooled_delta", "finetune", V_CONTRAST, s2.get("qwen_sft_tool"), 100 * res["delta"],
                            "decimal:1", "paper §5.2 prose (the release copy has no pooled block)")
                    out.add(cid + ".pooled_units", "finetune", V_CONTRAST,
                            mets["prior_bw"]["pooled"]["n_units"], res["n_units"], "int",
                            "published_finetuning.json prior_bw pooled n_units (the same memory-wrong support)")
    for key, (model, obj, met) in {"llamai_sft_ret": ("llamai", "sft", "keep"), "llamai_dpo_ret": ("llamai", "dpo", "keep"),
                                   "qwen_sft_tool": ("qwen", "sft", "tool_gold_follow"),
                                   "qwen_sft_wrong": ("qwen", "sft", "prior_bw")}.items():
        blk = ft[model][obj][met]
        res = _contrast_delta({k: v for k, v in blk.items() if k.startswith("pv")}, key)
        out.add(f"sec5_2.{key}", "sec5_2", V_CONTRAST, s2.get(key), 100 * res["delta"], "decimal:1",
                "paper §5.2 prose (paper_prose in claims.yaml)")
    # the criterion: Holm over the declared family (models x objectives); members the release copy
    # lacks enter at p = 1, which bounds every present member's adjusted p from above (the verdict
    # "retention up" is then robust to them), and correct-tool following is read uncorrected (its
    # smallest p, so "no significant drop" is robust too)
    t1 = rel.json("published_table1.json")
    met_note = next(n for n in t1["notes"] if "criterion" in n.lower())
    named = re.search(r"met by SFT and DPO on (.+?) only", met_note).group(1)
    fam = stats.FAMILIES["finetune_retention"]
    members = {fam.key(m, o): {"p": None} for m in MODELS.values() for o in ("sft", "dpo")}
    for m, objs in ft.items():
        for o, mets in objs.items():
            if "pooled" in mets.get("keep", {}):
                members[fam.key(m, o)] = {"p": mets["keep"]["pooled"]["p_signflip"]}
    bounded = {k: {"p": 1.0 if v["p"] is None else v["p"]} for k, v in members.items()}
    adj = stats.holm_family(fam.name, bounded)
    for name, m in MODELS.items():
        for o in ("sft", "dpo"):
            mets = ft.get(m, {}).get(o, {})
            cid = f"finetune.{name}.{o}.criterion"
            if "pooled" not in mets.get("keep", {}) or "tool_gold_follow" not in mets:
                out.na(cid, "table1", V_CRIT, f"the release copy has no pooled {m}/{o} retention contrast")
                continue
            ret = {**mets["keep"]["pooled"], "p_holm": adj[fam.key(m, o)]["p_holm"]}
            tool = mets["tool_gold_follow"].get("pooled")
            if tool is None:     # Qwen SFT: no pooled block; the delta from the per-formulation units, no p
                tool = {"delta": _contrast_delta({k: v for k, v in mets["tool_gold_follow"].items()
                                                  if k.startswith("pv")}, cid)["delta"], "p_signflip": None}
            crit = stats.success_criterion(ret, {"delta": tool["delta"], "p_signflip": tool["p_signflip"]})
            if tool["p_signflip"] is None and crit["retention_up"]:
                out.na(cid, "table1", V_CRIT, "retention rose; the verdict needs the pooled tool-following p, "
                       "which the release copy lacks")
                continue
            out.add(cid, "table1", V_CRIT, name in named, crit["passed"], "exact",
                    "published_table1.json notes (criterion met by ...)")


def check_far_protocol(rel: Release, out: _Collector) -> None:
    """published_other.json: the far contrast's canonical points (metrics.arm_metrics on the
    Reference formulation), the far family's Holm p (stats.holm_family) and the protocol-sentence
    deltas (stats.paired_contrast)."""
    other = rel.json("published_other.json")["distractor_distance"]["judged"]
    am = rel.json("published_arm_metrics.json")["judged"]
    pp = rel.json("published_pooled.json")
    for model in ("llamai", "qwen", "gemma", "mistral"):
        a = metrics.arm_metrics(release_frame({"reference": am[model]["canonical_pv0"]}, None, model))
        for met in ("keep", "prior_bw", "CRA_arb"):
            out.add(f"far.{model}.canonical_{met}", "far", V_ARM,
                    other["far"][model][met]["canonical_point"]["rate"], a[RELEASE_METRIC[met]], "decimal:4",
                    "published_other.json far canonical point (Reference formulation)")
    for met, base in (("keep", "keep"), ("prior_bw", "prior")):
        out.add(f"far.base.canonical_{met}", "far", "memtoc.published.release_value",
                other["far"]["base"][met]["canonical_point"]["rate"], pp["base_pv0_only"][base], "decimal:4",
                "published_pooled.json base_pv0_only (the base model on the Reference formulation only)")
    fh = other["far_keep_holm"]
    adj = stats.holm_family("far_retention", {m: {"p": v["p_signflip"]} for m, v in fh.items()})
    for m, v in fh.items():
        out.add(f"far_keep_holm.{m}", "far", V_HOLM, v["p_holm"], adj[m]["p_holm"], "decimal:4",
                "published_other.json far_keep_holm (family A: far retention over the five models)")
    for met, blk in other["protocol"]["llamai"].items():
        n = blk["contrast"]["n_units"]
        kt = count_of(blk["nosentence_point"]["rate"], n, f"protocol {met}")
        ku = count_of(blk["canonical_point"]["rate"], n, f"protocol {met}")
        t = np.r_[np.ones(kt), np.zeros(n - kt)]
        u = np.r_[np.ones(ku), np.zeros(n - ku)]
        res = stats.paired_contrast(t, u, np.arange(n), n_boot=10, n_perm=10)
        out.add(f"protocol.llamai.{met}.delta", "protocol", V_CONTRAST, blk["contrast"]["delta"], res["delta"],
                "decimal:4", "published_other.json protocol (Reference formulation, full common support)",
                tolerance=0.0001)


# --------------------------------------------------------------------------------------------------
# generic registry checks (construction, review, acknowledgment bookkeeping)

class _Fmt(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _fill(template: str, env: dict, escape: bool = False) -> str:
    vals = {k: (_esc(v) if escape else v) for k, v in env.items()}
    return string.Formatter().vformat(template, (), _Fmt(vals))


def _esc(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _esc(x) for k, x in v.items()}
    if isinstance(v, str) and v.startswith("/"):
        return v
    return claims.escape_token(v)


class _Files:
    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, Any] = {}

    def load(self, rel: str) -> Any:
        if rel not in self.cache:
            path = self.root / rel
            if not path.is_file():
                raise claims.MissingSource(f"file {path} does not exist")
            text = path.read_text()
            if path.suffix == ".jsonl":
                self.cache[rel] = [json.loads(l) for l in text.splitlines() if l.strip()]
            elif path.suffix == ".json":
                self.cache[rel] = json.loads(text)
            else:
                self.cache[rel] = text
        return self.cache[rel]

    def get(self, rel: str, pointer: str) -> Any:
        return claims.json_pointer(self.load(rel), pointer, where=str(self.root / rel))


def _value(spec: dict, env: dict, files: _Files) -> Any:
    node = files.get(_fill(spec["file"], env), _fill(spec.get("pointer", ""), env, escape=True))
    if "regex" in spec:
        pattern = spec["regex"]
        m = re.fullmatch(r"\{(\w+)\[(\w+)\]\}", pattern)
        if m:
            pattern = env[m.group(1)][m.group(2)]
        hit = re.search(pattern, node if isinstance(node, str) else "")
        if not hit:
            raise claims.MissingSource(f"{spec['file']}: pattern {pattern!r} not found")
        node = hit.group(spec.get("group", 1))
        if re.fullmatch(r"[\d,]+", node):
            node = int(node.replace(",", ""))
        elif re.fullmatch(r"\d*\.\d+", node):
            node = float(node)
    if spec.get("sum_values"):
        node = sum(node.values())
    if spec.get("len"):
        node = len(node)
    return node


def _rows(d: dict, env: dict, files: _Files) -> list[dict]:
    rows = files.load(_fill(d["file"], env))
    for cond in d.get("where", []):
        f = cond["field"]
        if "equals" in cond:
            rows = [r for r in rows if r.get(f) == cond["equals"]]
        if "not_equals" in cond:
            rows = [r for r in rows if r.get(f) != cond["not_equals"]]
        if "prefix" in cond:
            rows = [r for r in rows if str(r.get(f, "")).startswith(cond["prefix"])]
        if cond.get("not_null"):
            rows = [r for r in rows if r.get(f) is not None]
        if "not_in" in cond:
            ref = cond["not_in"]
            vals = set(files.get(ref["file"], ref["pointer"]))
            rows = [r for r in rows if r.get(f) not in vals]
    return rows


def _derive(d: dict, env: dict, files: _Files) -> tuple[Any, str]:
    """Value and the function that derived it, for the registry's ops."""
    op = d["op"]
    if op == "value":
        return _value(d, env, files), "memtoc.published.release_value"
    if op == "from_env":
        return _derive(env[d["key"]]["derived"], env, files)
    if op == "count_rows":
        rows = _rows(d, env, files)
        return (len({r.get(d["distinct"]) for r in rows}) if d.get("distinct") else len(rows)), "memtoc.published.count_rows"
    if op == "len":
        return len(files.get(_fill(d["file"], env), _fill(d.get("pointer", ""), env, escape=True))), "memtoc.published.count_rows"
    if op in ("product", "difference", "ratio", "sum"):
        parts = [_derive(x, env, files)[0] for x in d["of"]]
        if op == "product":
            return math.prod(parts), "memtoc.published.arithmetic"
        if op == "difference":
            return parts[0] - parts[1], "memtoc.published.arithmetic"
        if op == "sum":
            return sum(parts), "memtoc.published.arithmetic"
        return parts[0] / parts[1], "memtoc.published.arithmetic"
    if op == "sum_over":      # the sum of <pointer>/<key><tail> over the keys at <pointer>
        rel_, ptr = _fill(d["file"], env), _fill(d["pointer"], env, escape=True)
        vals = [files.get(rel_, f"{ptr}/{claims.escape_token(k)}{d.get('tail', '')}") for k in files.get(rel_, ptr)]
        return sum(vals), "memtoc.published.arithmetic"
    if op == "clopper_pearson":
        k, _ = _derive(d["k"], env, files)
        n, _ = _derive(d["n"], env, files)
        return stats.clopper_pearson(int(k), int(n)), V_CP
    raise PublishedCheckError(f"paper/claims.yaml published: unknown op {op!r}")


def _envs(foreach: Optional[dict]) -> list[dict]:
    envs = [{}]
    for var, dom in (foreach or {}).items():
        if not isinstance(dom, list):
            raise PublishedCheckError(f"paper/claims.yaml published: foreach {var} must be a list")
        envs = [{**e, var: v} for e in envs for v in dom]
    return envs


def registry_checks(rel: Release, specs: list[dict], out: _Collector) -> None:
    """The registry's ``published:`` specs (bookkeeping counts of the release files)."""
    files = _Files(rel.dir)
    for spec in specs:
        for env in _envs(spec.get("foreach")):
            cid = _fill(spec["id"], env)
            fam = spec.get("family", cid.split(".")[0])
            try:
                pub = _value(spec["published"], env, files)
                der, via = _derive(spec["derived"], env, files)
            except claims.MissingSource as e:
                out.na(cid, fam, "memtoc.published.registry_checks", f"not in the release copy: {e}")
                continue
            out.add(cid, fam, via, pub, der, spec.get("rounding", "exact"), _fill(spec.get("describe", ""), env),
                    tolerance=spec.get("tolerance"), published_rule=spec.get("published_rounding"))


# ==================================================================================================
# entry points

def verify_published(release_dir: str | Path | None = None, registry: str | Path | dict | None = None) -> PublishedResult:
    """Every derivable published number, re-derived through memtoc's analysis functions."""
    rel = Release(release_dir)
    reg = claims.load_registry(registry)
    prose = reg.get("paper_prose") or {}
    out = _Collector()
    check_tables(rel, out, prose)
    check_pooled(rel, out)
    check_finetune(rel, out, prose)
    check_far_protocol(rel, out)
    registry_checks(rel, reg.get("published") or [], out)
    ids = [c.id for c in out.checks]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise PublishedCheckError(f"published check ids are produced twice: {sorted(dup)[:5]}")
    return PublishedResult(out.checks, str(rel.dir))
