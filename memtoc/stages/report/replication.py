"""This run and the paper: the report section that sets every paper model of a run beside the
numbers the paper prints (``paper/published/``, read through :mod:`memtoc.stages.report.published.printed`).

A *paper model* is a model of the run whose registry entry is one the paper reports
(:func:`paper_model`: Table 1, Table 4, Table 6, Table 7 or App. F.2 names it). For each printed
number the run has a counterpart for, :func:`build` makes four claims
(``replication.<model>.<key>.<part>``), each re-derived by ``memtoc verify``:

``run``      the run's value (its summary file and JSON pointer)
``ci``       the run's 95% interval, lo–hi, when the summary records one
``paper``    the paper's printed value (``project:paper/published/<file>.json`` and a pointer)
``verdict``  ``inside`` / ``outside``: whether the paper's value lies in the run's interval
             (``derive: covers``, :func:`memtoc.stages.report.claims.covers`: up to half a unit of the printed
             last digit); recomputed from the run's interval and the paper's file, so a changed
             summary value or a changed printed number makes ``memtoc verify`` fail

The comparisons (:func:`comparisons`): Table 1 (untreated pooled rates with intervals; the SFT/DPO
levels, for which fine-tuning records no interval), §5.2 (fine-tuning changes), Table 4 (Reference
formulation), §5.4 (prompting changes; the agent loop's guided → auto change), Table 6 (transfer
changes), Table 7 (agent agreement on the memory-right slice) and App. F.2 (the 70B scale point).
Rates print in percent, changes in percentage points. Table 8 and App. C print medians, ranks and
k/n counts without intervals, from a recipe the run departs from (``docs/departures.md``); they are
not compared. The figure (:func:`memtoc.core.figures.replication_intervals`) draws each interval with the
paper's point.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Optional

import pandas as pd

from memtoc.config.runconfig import RunPaths
from memtoc.core import figures
from memtoc.core.errors import MemtocError
from memtoc.core.project import REPO_ROOT
from memtoc.generation.models import get_model
from memtoc.stages.report import claims as C
from memtoc.stages.report.published.printed import PUBLISHED_DIR, printed

SECTION = "replication"
TITLE = "This run and the paper"
FIGURE = "replication"
NO_PAPER_MODELS = ("No model of this run is one the paper reports, so the run has nothing to set "
                   "beside the paper's tables.")
NOT_COMPARED = ("`Table 8` and `App. C` are not compared: the paper prints medians, ranks and counts "
                "there, without intervals, from a recipe this package departs from (`docs/departures.md`).")
COLUMNS = ("This run", "`95%` interval", "Paper", "Paper inside?")
# registry names whose paper name is not the last part of the hub id
PAPER_NAMES = {"llama-3.3-70b-instruct-awq": "Llama-3.3-70B-Instruct"}
TABLE1_KEYS = {"ret": "retention", "tool": "tool_follow", "wrong": "wrong_follow", "err": "err_abstain"}
EVALUATION, FINETUNING, TRANSFER, AGENT = ("summaries/evaluation.json", "summaries/finetuning.json",
                                           "summaries/transfer.json", "summaries/agent.json")
# §5.2 / §5.4 sentences: prose.json key -> (arm or objective, metric), per paper model
SEC5_2 = {"Llama-3.1-8B-Instruct": {"llamai_sft_ret": ("sft", "retention"), "llamai_dpo_ret": ("dpo", "retention")},
          "Qwen2.5-7B-Instruct": {"qwen_sft_tool": ("sft", "tool_follow"), "qwen_sft_wrong": ("sft", "wrong_follow")}}
SEC5_4 = {"Llama-3.1-8B-Instruct": {f"{arm}_{k}": (arm, TABLE1_KEYS[k]) for arm in ("warn", "prior")
                                    for k in ("ret", "tool", "err")}}
TABLE6 = {"value_frame": "retention_value", "passage_frame": "retention_passage", "abstention": "abstention"}
TABLE7 = ("guided", "auto", "two_stage")
APP_F2 = {"retention_pooled": ("pooled", "retention"), "correct_tool_following_pooled": ("pooled", "tool_follow"),
          "incorrect_tool_following_pooled": ("pooled", "wrong_follow"),
          "tool_error_abstention_reference": ("reference", "err_abstain")}


@dataclass(frozen=True)
class Comparison:
    """One printed number of the paper and where the run keeps its counterpart."""

    key: str                    # id part, e.g. "table1.untreated.retention"
    table: str                  # "Table 1", "§5.2", ...
    label: str                  # row label (no digits: the report prints digits only in claims)
    file: str                   # the run's summary, relative to the run directory
    node: str                   # JSON pointer of the object holding the value (and its ci95)
    field: str                  # "value" | "delta" | "treated"
    paper_file: str             # a file of paper/published/ (its stem)
    paper_pointer: str
    scale: float                # paper unit -> the run's (0.01: the paper prints percent or points)
    interval: bool = True       # the object records ci95 for the value


@dataclass
class Replication:
    """What :func:`build` made: the claims, the figure rows, the models and the section's notes."""

    claims: list[C.Claim] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)    # run key -> paper name
    figure: Optional[Path] = None

    @property
    def note(self) -> str:
        return NOT_COMPARED if self.models else NO_PAPER_MODELS

    @property
    def captions(self) -> dict[str, str]:
        return {table_name(m): (f"`{p}`: the run's value and its interval, the paper's printed value, and "
                                "whether the printed value lies inside the interval (rates in percent, "
                                "changes in percentage points; — where the run records no interval).")
                for m, p in self.models.items()}


def table_name(model: str) -> str:
    return f"{SECTION}.{model}"


@lru_cache(maxsize=None)
def paper_names() -> frozenset[str]:
    """Every model name the paper's tables print (Table 1, 4, 6, 7 and App. F.2)."""
    pat = printed("probes_agent_transfer")
    names = set(printed("table1")["rows"]) | set(printed("table4")["rows"])
    names |= {r["model"] for r in pat["agent_table7"]["rows"]} | {a["model"] for a in pat["transfer_table6"]["arms"]}
    return frozenset(names | {pat["scale_70b"]["model"]})


def paper_model(run_key: str) -> Optional[str]:
    """The paper's name for a model of the run, or None when the paper does not report it."""
    try:
        spec = get_model(run_key)
    except MemtocError:
        return None
    if spec.source != "hub" or not spec.hub_id:
        return None
    name = PAPER_NAMES.get(spec.name, spec.hub_id.split("/")[-1])
    return name if name in paper_names() else None


def comparisons(model: str, paper: str, agent_variant: Optional[str] = None) -> Iterator[Comparison]:
    """The paper's numbers for one paper model, each with its place in the run's summaries."""
    m = C.escape_token(model)
    for k, metric in TABLE1_KEYS.items():
        yield Comparison(f"table1.untreated.{metric}", "Table 1", f"untreated {metric}", EVALUATION,
                         f"/models/{m}/headline/pooled/{metric}", "value", "table1", f"/rows/{paper}/untreated/{k}", 0.01)
        for obj in ("sft", "dpo"):
            yield Comparison(f"table1.{obj}.{metric}", "Table 1", f"{obj} {metric}", FINETUNING,
                             f"/models/{m}/objectives/{obj}/deltas/{metric}/pooled", "treated", "table1",
                             f"/rows/{paper}/{obj}/{k}", 0.01, interval=False)
    for key, (obj, metric) in SEC5_2.get(paper, {}).items():
        yield Comparison(f"sec5_2.{obj}.{metric}", "§5.2", f"{obj} change in {metric}", FINETUNING,
                         f"/models/{m}/objectives/{obj}/deltas/{metric}/pooled", "delta", "prose",
                         f"/sec5_2/{key}/value", 0.01)
    for arm in ("untreated", "warn", "prior", "flag"):
        for k, metric in TABLE1_KEYS.items():
            yield Comparison(f"table4.{arm}.{metric}", "Table 4", f"{arm} {metric} (reference)", EVALUATION,
                             f"/models/{m}/prompting/{arm}/reference/{metric}", "value", "table4",
                             f"/rows/{paper}/{arm}/{k}", 0.01)
    for key, (arm, metric) in SEC5_4.get(paper, {}).items():
        yield Comparison(f"sec5_4.{arm}.{metric}", "§5.4", f"{arm} change in {metric}", EVALUATION,
                         f"/models/{m}/prompting/{arm}/contrasts/{metric}", "delta", "prose", f"/sec5_4/{key}/value", 0.01)
    yield from _loop_comparisons(m, paper, agent_variant)


def _loop_comparisons(m: str, paper: str, variant: Optional[str]) -> Iterator[Comparison]:
    """Table 6, Table 7, the §5.4 agent-loop change and App. F.2 (probes_agent_transfer.json)."""
    pat = printed("probes_agent_transfer")
    for i, arm in enumerate(pat["transfer_table6"]["arms"]):
        if arm["model"] == paper:
            for col, metric in TABLE6.items():
                yield Comparison(f"table6.{arm['method']}.{metric}", "Table 6", f"{arm['method']} change in {metric}",
                                 TRANSFER, f"/models/{m}/forward/{arm['method']}/deltas/{metric}/pooled", "delta",
                                 "probes_agent_transfer", f"/transfer_table6/arms/{i}/{col}/delta", 1.0)
    if variant is not None:
        base = f"/models/{m}/slices/memory_right/{C.escape_token(variant)}"
        for i, row in enumerate(pat["agent_table7"]["rows"]):
            if row["model"] == paper:
                for p in TABLE7:
                    yield Comparison(f"table7.{p}", "Table 7", f"{p} answer agreement (memory-right)", AGENT,
                                     f"{base}/protocols/{p}/answer_agreement/pooled", "value",
                                     "probes_agent_transfer", f"/agent_table7/rows/{i}/{p}", 1.0)
        if paper in pat["agent_table7"]["section_5_4"]:
            yield Comparison("sec5_4.guided_to_auto", "§5.4", "guided to auto change in answer agreement", AGENT,
                             f"{base}/contrasts/guided_to_auto/answer_agreement", "delta", "probes_agent_transfer",
                             f"/agent_table7/section_5_4/{paper}/delta", 1.0)
    if paper == pat["scale_70b"]["model"]:
        for key, (form, metric) in APP_F2.items():
            yield Comparison(f"app_f2.{metric}", "App. F.2", f"{metric} ({form})", EVALUATION,
                             f"/models/{m}/headline/{form}/{metric}", "value", "probes_agent_transfer",
                             f"/scale_70b/appendix_f2/{key}", 1.0)


def run_models(files: Any) -> list[str]:
    """The models of a run, in the order its summaries list them (evaluation first)."""
    out: list[str] = []
    for rel in (EVALUATION, FINETUNING, TRANSFER, AGENT):
        try:
            models = files.get(rel, "/models")
        except C.MissingSource:
            continue
        out += [m for m in (models if isinstance(models, dict) else {}) if m not in out]
    return out


def _agent_variant(files: Any, model: str) -> Optional[str]:
    """The first schema variant of the model's memory-right slice in 07's summary (None: no 07)."""
    try:
        node = files.get(AGENT, f"/models/{C.escape_token(model)}/slices/memory_right")
    except C.MissingSource:
        return None
    return next(iter(node), None) if isinstance(node, dict) else None


def _published_file(stem: str) -> str:
    return C.PROJECT_PREFIX + (PUBLISHED_DIR / f"{stem}.json").relative_to(REPO_ROOT).as_posix()


def _claims_for(files: Any, model: str, paper: str, cmp: Comparison) -> list[C.Claim]:
    """The run / ci / paper / verdict claims of one comparison ([] when the run lacks the value)."""
    cid = f"{SECTION}.{model}.{cmp.key}"
    row = f"`{cmp.table}` {cmp.label}"
    where = f"{cmp.table}, {paper}, {cmp.label}"
    cell = lambda col: {"name": table_name(model), "row": row, "col": col}     # noqa: E731
    paper_file = _published_file(cmp.paper_file)
    try:
        out = [C.build_claim(files, f"{cid}.run", f"{where}: this run {{value}}", cmp.file,
                             [f"{cmp.node}/{cmp.field}"], "percent:1", section=SECTION, table=cell(COLUMNS[0]))]
    except C.MissingSource:
        return []
    if cmp.interval:
        try:
            out.append(C.build_claim(files, f"{cid}.ci", f"{where}: the run's 95% interval {{value}}", cmp.file,
                                     [f"{cmp.node}/ci95/0", f"{cmp.node}/ci95/1"], "percent:1", derive="range",
                                     section=SECTION, table=cell(COLUMNS[1])))
        except C.MissingSource:
            pass
    rounding = "decimal:1" if cmp.scale == 0.01 else "percent:1"
    out.append(C.build_claim(files, f"{cid}.paper", f"{where}: the paper prints {{value}}", paper_file,
                             [cmp.paper_pointer], rounding, section=SECTION, table=cell(COLUMNS[2])))
    if len(out) == 3:       # an interval: the verdict
        out.append(C.build_claim(
            files, f"{cid}.verdict", f"{where}: the paper's value lies {{value}} the run's 95% interval",
            cmp.file, [f"{cmp.node}/ci95"], "exact", derive="covers", section=SECTION, table=cell(COLUMNS[3]),
            reference={"file": paper_file, "pointer": cmp.paper_pointer, "scale": cmp.scale}))
    return out


def _figure_row(paper: str, cmp: Comparison, made: list[C.Claim]) -> Optional[dict[str, Any]]:
    if len(made) < 4:
        return None
    (lo, hi), point = made[3].raw
    return {"label": f"{paper} · {cmp.table} · {cmp.label}", "run": made[0].raw, "lo": lo, "hi": hi,
            "paper": point * cmp.scale, "inside": made[3].value == "inside"}


def build(run_dir: str | Path) -> Replication:
    """The section's claims for every paper model of the run, and its figure
    (``figures/replication.png``; removed when the run has no interval to draw)."""
    paths = RunPaths(run_dir)
    files = C.run_files(run_dir)
    rep = Replication()
    for model in run_models(files):
        paper = paper_model(model)
        if paper is None:
            continue
        rep.models[model] = paper
        for cmp in comparisons(model, paper, _agent_variant(files, model)):
            made = _claims_for(files, model, paper, cmp)
            rep.claims += made
            row = _figure_row(paper, cmp, made)
            if row:
                rep.rows.append(row)
    target = paths.figure(FIGURE)
    if rep.rows:
        rep.figure = figures.replication_intervals(pd.DataFrame(rep.rows), target)
    elif target.is_file():
        target.unlink()     # a figure of an earlier build of this run directory
    return rep
