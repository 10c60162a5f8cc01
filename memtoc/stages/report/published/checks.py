"""The checks: the paper's printed numbers (``paper/published/``) against values re-derived from
the release's computed summaries through memtoc's pipeline functions.

Every derived value is computed under :func:`memtoc.stages.report.published.via.trace`, so a check's ``via`` and
``calls`` are the functions that actually ran. A summary absent from the release makes the checks
that need it ABSENT (naming the file).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from memtoc.config.params import FORMULATIONS
from memtoc.core import metrics, stats
from memtoc.core.vocab import BASELINE_ARM, HEADLINE_METRICS, POOLED, REFERENCE_FORMULATION
from memtoc.stages.evaluation.analyses import arms
from memtoc.stages.report.published.frames import PV_FORMULATION, arm_blocks, arms_frame, release_frame
from memtoc.stages.report.published.printed import printed, prose_value, where
from memtoc.stages.report.published.release import ReleaseData
from memtoc.stages.report.published.result import Collector, MissingInput, PublishedCheckError, decimals_rule, fmt
from memtoc.stages.report.published.via import Traced, joined, trace

MODELS = {"Llama-3.1-8B-Instruct": "llamai", "gemma-2-9b-it": "gemma", "Qwen2.5-7B-Instruct": "qwen",
          "Mistral-7B-Instruct-v0.3": "mistral"}
LLAMA = "Llama-3.1-8B-Instruct"
COLUMNS = dict(zip(("ret", "tool", "wrong", "err"), HEADLINE_METRICS))
# release metric names -> memtoc's
RELEASE_METRIC = {"keep": "retention", "keep_strict": "retention", "CRA_arb": "cra_arb",
                  "tool_gold_follow": "tool_follow", "prior_bw": "wrong_follow", "prior": "wrong_follow",
                  "te_abstain": "err_abstain", "nc_CRA": "nc_acc"}
#: bootstrap / permutation sizes: only point values (deltas, rates) are compared, not intervals
N_BOOT, N_PERM = 10, 10
#: the release stores rates rounded to 4 decimals; the paper's tables print from those stored rates
STORED = 4


def release_value(value: Any) -> Any:
    """A value the release itself computed, compared as it is (no pipeline function involved)."""
    return value


def _release(value: Any) -> Traced:
    return trace(release_value, value, modules=(__name__,))


def guarded(out: Collector, family: str, ids: Callable[[], Iterable[str]], fn: Callable[[], None], source: str) -> None:
    """Run a group of checks; if an input is absent, report each of ``ids()`` ABSENT instead (the
    family is the id's first part; a criterion's is table1, as when it runs)."""
    n = len(out.checks)
    try:
        fn()
    except MissingInput as e:
        del out.checks[n:]
        for cid in ids():
            fam = "table1" if cid.endswith(".criterion") else cid.split(".")[0]
            out.absent(cid, fam if fam != "*" else family, e, source)


# --------------------------------------------------------------------------------------------------
# Table 1, §5.3


def check_table1(rd: ReleaseData, out: Collector) -> None:
    """Table 1's untreated rows (pooled over formulations: metrics.pooled_point_metrics), its
    headline ranges and §5.3's formulation spreads (metrics.formulation_spread)."""
    t1, prose = printed("table1"), printed("prose")
    am, n_err = rd.get("arm_metrics"), rd.analysis_set_size()
    pooled = {m: trace(metrics.pooled_point_metrics, release_frame(arm_blocks(am, key, BASELINE_ARM), n_err, m))
              for m, key in MODELS.items()}
    src = "paper Table 1 (paper/published/table1.json)"
    for m in MODELS:
        for col, metric in COLUMNS.items():
            v = pooled[m].map(lambda r, metric=metric: r[POOLED][metric])
            pub = t1["rows"][m]["untreated"][col]
            out.add(f"table1.untreated.{m}.{col}", "table1", pub, v, "percent:1", src,
                    published_rule="decimal:1", stored_decimals=STORED)
    for col, metric in (("ret", "retention"), ("tool", "tool_follow"), ("wrong", "wrong_follow")):
        rng = joined(list(pooled.values()), lambda *rs, metric=metric: (min(r[POOLED][metric] for r in rs),
                                                                        max(r[POOLED][metric] for r in rs)))
        out.add(f"table1.headline_range.{col}", "table1", t1["headline_ranges"][col], rng, "percent:1",
                t1["headline_ranges"]["source"], published_rule="decimal:1", stored_decimals=STORED)
    for col, key in (("ret", "ret_spread"), ("wrong", "wrong_spread")):
        metric = COLUMNS[col]
        spreads = trace(lambda metric=metric: [metrics.formulation_spread(
            {f: pooled[m].value[f][metric] for f in FORMULATIONS}) for m in MODELS])
        v = joined([spreads] + list(pooled.values()), lambda s, *_: (min(s), max(s)))
        out.add(f"sec5_3.formulation_spread.{col}", "sec5_3", prose_value(prose, "sec5_3", key), v, "percent:0",
                where(prose, "sec5_3", key), published_rule="decimal:0")


def table1_ids() -> list[str]:
    return ([f"table1.untreated.{m}.{c}" for m in MODELS for c in COLUMNS]
            + [f"table1.headline_range.{c}" for c in ("ret", "tool", "wrong")]
            + [f"sec5_3.formulation_spread.{c}" for c in ("ret", "wrong")])


# --------------------------------------------------------------------------------------------------
# Table 4 and §5.4: notebook 03's prompting section (analyses.arms.arm_comparison) on the release's arms


def table4_arms() -> tuple[str, ...]:
    """Table 4's rows as the printed file names them (``paper/published/table4.json`` ``prompts``): the
    untreated arm, then the paper's three prompting strategies. A prompting arm added to the package
    (``vocab.PROMPTING_ARMS``) is not among them: the paper printed none for it."""
    arms = tuple(printed("table4")["prompts"])
    if not arms or arms[0] != BASELINE_ARM:
        raise PublishedCheckError(f"paper/published/table4.json: 'prompts' must start with {BASELINE_ARM!r} "
                                  f"(the table's dash row), then the strategies; it has {list(arms)}")
    return arms


def paper_strategies() -> tuple[str, ...]:
    """The paper's prompting strategies (Table 4's rows after the untreated one)."""
    return table4_arms()[1:]


def prompting_sections(rd: ReleaseData) -> dict[str, Traced]:
    """``{model: analyses.arms.arm_comparison(...)}`` over untreated + the three strategies, judged layer,
    every formulation: per-formulation and pooled rates, question-paired contrasts vs untreated."""
    am, n_err = rd.get("arm_metrics"), rd.analysis_set_size()
    return {m: trace(arms.arm_comparison, arms_frame(am, key, table4_arms(), n_err), paper_strategies(),
                     HEADLINE_METRICS, "prompting", n_boot=N_BOOT, n_perm=N_PERM)
            for m, key in MODELS.items()}


def check_table4(sections: dict[str, Traced], out: Collector) -> None:
    """Table 4 = the Reference formulation's rates (64 values)."""
    t4 = printed("table4")
    for m in MODELS:
        for arm in table4_arms():
            for col, metric in COLUMNS.items():
                v = sections[m].map(lambda s, a=arm, k=metric: s[a][REFERENCE_FORMULATION][k]["value"])
                out.add(f"table4.{m}.{arm}.{col}", "table4", t4["rows"][m][arm][col], v, "percent:1",
                        "paper Table 4, Reference formulation (paper/published/table4.json)", published_rule="decimal:1",
                        stored_decimals=STORED)


def table4_ids() -> list[str]:
    return [f"table4.{m}.{a}.{c}" for m in MODELS for a in table4_arms() for c in COLUMNS]


def check_sec5_4(sections: dict[str, Traced], out: Collector) -> None:
    """§5.4: Llama's strategy-minus-untreated changes (the question-paired contrasts pooled over the
    formulations' units, intervals.contrast) and the directions over the 12 model x strategy cells."""
    prose = printed("prose")
    for arm in ("warn", "prior"):
        for col in ("ret", "tool", "err"):
            key = f"{arm}_{col}"
            pub = prose_value(prose, "sec5_4", key)
            d = sections[LLAMA].map(lambda s, a=arm, k=COLUMNS[col]: 100 * s[a]["contrasts"][k]["delta"])
            out.add(f"sec5_4.{LLAMA}.{arm}.{col}_delta", "sec5_4", pub, d, decimals_rule(pub), where(prose, "sec5_4", key))
    strategies = paper_strategies()
    cells = [(m, a) for m in MODELS for a in strategies]
    allsec = [sections[m] for m in MODELS]

    def deltas(metric: str) -> Traced:
        return joined(allsec, lambda *ss: {(m, a): s[a]["contrasts"][metric]["delta"]
                                           for (m, s) in zip(MODELS, ss) for a in strategies})
    up = deltas("retention").map(lambda d: f"{sum(v > 0 for v in d.values())} of {len(cells)}")
    out.add("sec5_4.retention_up_directions", "sec5_4", prose_value(prose, "sec5_4", "retention_up"), up, "exact",
            where(prose, "sec5_4", "retention_up"))
    err = deltas("err_abstain")
    raised = [f"{m} {a} ({fmt(100 * v, 'signed:1')})" for (m, a), v in err.value.items() if v >= 0]
    out.add("sec5_4.err_abstain_reduced_by_every_strategy", "sec5_4", prose_value(prose, "sec5_4", "err_reduced"),
            err.map(lambda d: f"{sum(v < 0 for v in d.values())} of {len(cells)}"), "exact",
            where(prose, "sec5_4", "err_reduced"),
            "§5.4 says every strategy reduces tool-error abstention; the release's arms (question-paired "
            "contrasts, as Table 4's Reference rates also show) have it rising for: " + ", ".join(raised))


def sec5_4_ids() -> list[str]:
    return ([f"sec5_4.{LLAMA}.{a}.{c}_delta" for a in ("warn", "prior") for c in ("ret", "tool", "err")]
            + ["sec5_4.retention_up_directions", "sec5_4.err_abstain_reduced_by_every_strategy"])


# --------------------------------------------------------------------------------------------------
# the release's own summaries against each other (pooled summary vs arm metrics)


def check_pooled(rd: ReleaseData, out: Collector) -> None:
    """The pooled summary: per-formulation values and sizes vs the arm metrics (metrics.arm_metrics),
    the pooled means (metrics.pooled_point_metrics), the orderings and the stability verdict
    (stats.ranking_stability)."""
    pp, am = rd.get("pooled"), rd.get("arm_metrics")["judged"]
    src = f"{rd.source('pooled')} vs {rd.source('arm_metrics')}"
    metric = {"prior": "wrong_follow", "keep": "retention"}
    nname = {"prior": "n_both_wrong", "keep": "n_arb"}
    per_form: dict[str, dict[str, dict[str, Traced]]] = {k: {} for k in metric}
    pooled_vals: dict[str, dict[str, Traced]] = {k: {} for k in metric}
    for model, blk in pp["pooled_instructs"].items():
        for k, ours in metric.items():
            b = blk[k]
            for pv, form in PV_FORMULATION.items():
                a = trace(metrics.arm_metrics, release_frame({form: am[model][pv]}, None, f"{model} {pv}"))
                out.add(f"pooled.{model}.{k}.{pv}", "pooled", b["per_pv"][pv], a.map(lambda r: r[ours]), "decimal:4", src)
                out.add(f"pooled.{model}.{k}.{pv}.n", "pooled", b["n_per_pv"][pv], a.map(lambda r: r[nname[k]]), "int", src)
                per_form[k].setdefault(pv, {})[model] = a.map(lambda r: r[ours])
            fr = {PV_FORMULATION[pv]: ({"n_arb": b["n_per_pv"][pv], "keep_strict": b["per_pv"][pv]} if k == "keep"
                                       else {"n_bw": b["n_per_pv"][pv], "prior_bw": b["per_pv"][pv]})
                  for pv in PV_FORMULATION}
            v = trace(metrics.pooled_point_metrics, release_frame(fr, None, f"{model} {k}")).map(lambda r: r[POOLED][ours])
            pooled_vals[k][model] = v
            out.add(f"pooled.{model}.{k}.pooled_mean", "pooled", b["pooled_mean"], v, "decimal:4",
                    rd.source("pooled"), tolerance=0.0001)
    for k, order_key in (("prior", "prior"), ("keep", "keepQ")):
        pf = {pv: {m: t.value for m, t in d.items()} for pv, d in per_form[k].items()}
        r = trace(stats.ranking_stability, pf, {m: t.value for m, t in pooled_vals[k].items()})
        for scope in (POOLED,) + tuple(PV_FORMULATION):
            out.add(f"pooled.order.{scope}.{k}", "pooled", pp["orders_by_scope"][scope][order_key],
                    r.map(lambda x, s=scope: x["orders"][s]), "exact", f"{rd.source('pooled')} orders_by_scope")
        out.add(f"pooled.stable.{k}", "pooled", pp.get("stable_any"), r.map(lambda x: x["full_order_stable"]), "exact",
                f"{rd.source('pooled')} stability verdict")
