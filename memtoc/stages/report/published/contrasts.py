"""Checks on paired changes: fine-tuning (§5.2, Table 1's criterion), distractor distance and the
protocol sentence. Paired changes are rebuilt as units with the release's net counts and go
through ``stats.paired_contrast``; Holm families through ``stats.holm_family``; the criterion
through ``stats.success_criterion``."""
from __future__ import annotations

from typing import Any

import numpy as np

from memtoc.core import metrics, stats
from memtoc.stages.report.published.checks import MODELS, N_BOOT, N_PERM, RELEASE_METRIC, _release
from memtoc.stages.report.published.frames import count_of, release_frame, release_units
from memtoc.stages.report.published.printed import printed, prose_value, where
from memtoc.stages.report.published.release import ReleaseData
from memtoc.stages.report.published.result import Collector, MissingInput
from memtoc.stages.report.published.via import Traced, trace

FT_PROSE = {"llamai_sft_ret": ("llamai", "sft", "keep"), "llamai_dpo_ret": ("llamai", "dpo", "keep"),
            "qwen_sft_tool": ("qwen", "sft", "tool_gold_follow"), "qwen_sft_wrong": ("qwen", "sft", "prior_bw")}


def _contrast(per_slice: dict[str, dict[str, Any]], where_: str) -> Traced:
    return trace(stats.paired_contrast, release_units(per_slice, where_), n_boot=N_BOOT, n_perm=N_PERM)


def _pvs(blk: dict) -> dict[str, dict]:
    return {k: v for k, v in blk.items() if k.startswith("pv")}


def check_finetune(rd: ReleaseData, out: Collector) -> None:
    """Pooled paired changes and units, the §5.2 prose deltas, Table 1's criterion note."""
    ft = rd.get("finetuning")["judged"]["crossfit"]
    prose = printed("prose")
    src = rd.source("finetuning")
    for model, objs in ft.items():
        for obj, mets in objs.items():
            for met, blk in mets.items():
                res = _contrast(_pvs(blk), f"{model} {obj} {met}")
                cid = f"finetune.{model}.{obj}.{met}"
                if "pooled" in blk:
                    out.add(cid + ".pooled_delta", "finetune", blk["pooled"]["delta"], res.map(lambda r: r["delta"]),
                            "decimal:4", src, tolerance=0.0001)
                    out.add(cid + ".pooled_units", "finetune", blk["pooled"]["n_units"], res.map(lambda r: r["n_units"]),
                            "int", src)
                elif (model, obj, met) == FT_PROSE["qwen_sft_tool"]:
                    # no pooled block in this copy; the paper's prose gives the change, and the pooled
                    # support is the both-wrong support (the same memory-wrong questions)
                    out.add(cid + ".pooled_delta", "finetune", prose_value(prose, "sec5_2", "qwen_sft_tool"),
                            res.map(lambda r: 100 * r["delta"]), "decimal:1",
                            where(prose, "sec5_2", "qwen_sft_tool") + f"; {src} has no pooled block")
                    out.add(cid + ".pooled_units", "finetune", mets["prior_bw"]["pooled"]["n_units"],
                            res.map(lambda r: r["n_units"]), "int", f"{src} prior_bw pooled n_units (same support)")
    for key, (model, obj, met) in FT_PROSE.items():
        res = _contrast(_pvs(ft[model][obj][met]), key)
        out.add(f"sec5_2.{key}", "sec5_2", prose_value(prose, "sec5_2", key), res.map(lambda r: 100 * r["delta"]),
                "decimal:1", where(prose, "sec5_2", key))
    check_criterion(ft, out)


def finetune_ids() -> list[str]:
    return ([f"sec5_2.{k}" for k in FT_PROSE] + ["finetune.*"]
            + [f"finetune.{name}.{o}.criterion" for name in MODELS for o in ("sft", "dpo")])


def check_criterion(ft: dict, out: Collector) -> None:
    """Holm over the declared family (models x objectives); members the release lacks enter at
    p = 1, which bounds every present member's adjusted p from above (a "retention up" verdict is
    then robust to them); correct-tool following is read uncorrected (its smallest p)."""
    met_by = printed("table1")["criterion_met_by"]["value"]
    fam = stats.FAMILIES["finetune_retention"]
    members = {fam.key(m, o): {"p": 1.0} for m in MODELS.values() for o in ("sft", "dpo")}
    for m, objs in ft.items():
        for o, mets in objs.items():
            if "pooled" in mets.get("keep", {}) and fam.key(m, o) in members:
                members[fam.key(m, o)] = {"p": mets["keep"]["pooled"]["p_signflip"]}
    adj = trace(stats.holm_family, fam.name, members)
    for name, m in MODELS.items():
        for o in ("sft", "dpo"):
            mets = ft.get(m, {}).get(o, {})
            cid = f"finetune.{name}.{o}.criterion"
            src = "paper Table 1 caption (paper/published/table1.json criterion_met_by)"
            if "pooled" not in mets.get("keep", {}) or "tool_gold_follow" not in mets:
                out.absent(cid, "table1", _missing(f"finetuning judged.crossfit.{m}.{o} pooled retention"), src)
                continue
            tool = mets["tool_gold_follow"].get("pooled")
            if tool is None:     # no pooled block: the delta from the per-formulation units, no p
                tool = {"delta": _contrast(_pvs(mets["tool_gold_follow"]), cid).value["delta"], "p_signflip": None}
            ret = {**mets["keep"]["pooled"], "p_holm": adj.value[fam.key(m, o)]["p_holm"]}
            crit = trace(stats.success_criterion, ret, {"delta": tool["delta"], "p_signflip": tool["p_signflip"]})
            crit = Traced(crit.value, crit.calls + adj.calls)       # the verdict comes from success_criterion
            if tool["p_signflip"] is None and crit.value["retention_up"]:
                out.absent(cid, "table1", _missing(f"finetuning judged.crossfit.{m}.{o}.tool_gold_follow.pooled p"), src)
                continue
            out.add(cid, "table1", name in met_by, crit.map(lambda c: c["passed"]), "exact", src)


def _missing(what: str) -> MissingInput:
    return MissingInput(what, "is not in the release's fine-tuning summary")


def check_far_protocol(rd: ReleaseData, out: Collector) -> None:
    """The far contrast's canonical points (metrics.arm_metrics on the Reference formulation), the
    far family's Holm p (stats.holm_family), the printed far result of the pretrained model and the
    protocol-sentence changes (stats.paired_contrast on the full common support)."""
    dd = rd.get("distractor_distance")["judged"]
    am = rd.get("arm_metrics")["judged"]
    src = rd.source("distractor_distance")
    prose = printed("prose")
    for model in ("llamai", "qwen", "gemma", "mistral"):
        a = trace(metrics.arm_metrics, release_frame({"reference": am[model]["canonical_pv0"]}, None, model))
        for met in ("keep", "prior_bw", "CRA_arb"):
            out.add(f"far.{model}.canonical_{met}", "far", dd["far"][model][met]["canonical_point"]["rate"],
                    a.map(lambda r: r[RELEASE_METRIC[met]]), "decimal:4", f"{src} far canonical point (Reference)")
    pp = rd.get("pooled")
    for met, base in (("keep", "keep"), ("prior_bw", "prior")):
        out.add(f"far.base.canonical_{met}", "far", dd["far"]["base"][met]["canonical_point"]["rate"],
                _release(pp["base_pv0_only"][base]), "decimal:4", f"{rd.source('pooled')} base_pv0_only")
    fh = dd["far_keep_holm"]
    adj = trace(stats.holm_family, "far_retention", {m: {"p": v["p_signflip"]} for m, v in fh.items()})
    for m, v in fh.items():
        out.add(f"far_keep_holm.{m}", "far", v["p_holm"], adj.map(lambda r, m=m: r[m]["p_holm"]), "decimal:4",
                f"{src} far_keep_holm (far retention over the five models)")
    for key, value, rule in (("base_far_ret", _release(100 * fh["base"]["delta"]), "decimal:1"),
                             ("base_far_p_holm", adj.map(lambda r: r["base"]["p_holm"]), "decimal:4"),
                             ("base_far_n", _release(fh["base"]["n_units"]), "int")):
        out.add(f"far.printed.{key}", "far", prose_value(prose, "distractor_distance", key), value, rule,
                where(prose, "distractor_distance", key))
    for met, blk in dd["protocol"]["llamai"].items():
        n = blk["contrast"]["n_units"]
        kt = count_of(blk["nosentence_point"]["rate"], n, f"protocol {met}")
        ku = count_of(blk["canonical_point"]["rate"], n, f"protocol {met}")
        t, u = np.r_[np.ones(kt), np.zeros(n - kt)], np.r_[np.ones(ku), np.zeros(n - ku)]
        res = trace(stats.paired_contrast, t, u, np.arange(n), n_boot=N_BOOT, n_perm=N_PERM)
        out.add(f"protocol.llamai.{met}.delta", "protocol", blk["contrast"]["delta"], res.map(lambda r: r["delta"]),
                "decimal:4", f"{src} protocol (Reference formulation, full common support)", tolerance=0.0001)
        if met in prose.get("protocol_sentence", {}):
            out.add(f"protocol.printed.{met}", "protocol", prose_value(prose, "protocol_sentence", met),
                    res.map(lambda r: 100 * r["delta"]), "decimal:1", where(prose, "protocol_sentence", met))


def far_ids() -> list[str]:
    return ["far.*", "protocol.*"]
