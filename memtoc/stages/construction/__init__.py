"""Construction steps that run offline.

* ``qc_checks`` / ``qc_report``: the paper's programmatic QC over the table (distractor non-empty,
  distinct from gold and from the paired distractor, same answer type where it can be checked).
* ``nonentity_distractors`` / ``reproduce_nonentity``: the deterministic non-entity distractor
  generator for years, dates and time zones (PROTOCOL.md §9), and its comparison with the frozen
  values of the table.
* ``flatten_toolhop`` / ``dedup_exact`` / ``factual_filter`` / ``toolhop_pool``: from a ToolHop JSON
  file (given by a user; not shipped) to flattened, de-duplicated, factual sub-questions, with counts.
* ``related_links`` / ``related_summary``: questions of different chains where one question's gold
  is the subject of the other (related-question leakage across the cross-fitting folds).
"""
from __future__ import annotations

import datetime as dt
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import pandas as pd

from memtoc.config.params import PAPER_SEED
from memtoc.core.errors import DataError
from memtoc.core.records import Question, unique_by
from memtoc.core.scoring import normalize
from memtoc.data.benchmark import PAPER_COUNTS, qkey_of

# ----------------------------------------------------------------------------------------------
# Programmatic QC

_YEAR = re.compile(r"^\d{3,4}$")
_TZ = re.compile(r"^[A-Z][A-Za-z_]+/[A-Za-z_/+\-]+$")


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().casefold()


def _shape(value: str) -> Optional[str]:
    """The answer type a value visibly has, for the kinds that can be checked from the string."""
    v = value.strip()
    if _YEAR.match(v):
        return "year"
    if _TZ.match(v):
        return "timezone"
    if parse_date(v) is not None:
        return "date"
    return None


def qc_checks(q: Question, near: Optional[str] = None) -> list[str]:
    """Failed checks for one question (empty list = pass). ``near`` defaults to ``q.near``.

    Checks: ``near_empty``; ``near_equals_gold`` / ``far_equals_gold`` (case- and
    space-insensitive); ``near_equals_far``; ``near_type_mismatch`` / ``far_type_mismatch`` where
    the gold's type can be read off the string (year, date, timezone): the distractor must have the
    same shape. Entity types (person, place, ...) cannot be checked offline and are not.
    """
    near = q.near if near is None else near
    fails = []
    if not near or not near.strip():
        fails.append("near_empty")
    else:
        if _norm(near) == _norm(q.gold):
            fails.append("near_equals_gold")
        if q.far is not None and _norm(near) == _norm(q.far):
            fails.append("near_equals_far")
    if q.far is not None:
        if not q.far.strip():
            fails.append("far_empty")
        elif _norm(q.far) == _norm(q.gold):
            fails.append("far_equals_gold")
    if q.gold_kind in ("year", "date", "timezone"):
        want = q.gold_kind if _shape(q.gold) == q.gold_kind else None
        if want is not None:
            if near and _shape(near) != want:
                fails.append("near_type_mismatch")
            if q.far and _shape(q.far) != want:
                fails.append("far_type_mismatch")
    return fails


def qc_report(questions: Iterable[Question]) -> dict[str, Any]:
    """Run ``qc_checks`` over the table on the evaluated near value and on the original one."""
    questions = list(questions)
    rows = []
    for q in questions:
        for which, near in (("evaluated", q.near), ("original", q.near_original)):
            for f in qc_checks(q, near):
                rows.append({"qkey": q.qkey, "id": q.id, "near": which, "check": f})
    ev = [r for r in rows if r["near"] == "evaluated"]
    return {
        "n_questions": len(questions),
        "n_failed_evaluated": len({r["qkey"] for r in ev}),
        "n_failed_original": len({r["qkey"] for r in rows if r["near"] == "original"}),
        "by_check_evaluated": dict(Counter(r["check"] for r in ev)),
        "by_check_original": dict(Counter(r["check"] for r in rows if r["near"] == "original")),
        "failures": rows,
    }


# ----------------------------------------------------------------------------------------------
# Deterministic non-entity distractors (PROTOCOL.md §9)

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
_MONTH_NO = {m.lower(): i for i, m in enumerate(MONTHS, 1)}
DEFAULT_TZ_POOL = (
    "America/New_York", "America/Chicago", "America/Denver", "America/Los_Angeles", "America/Toronto",
    "America/Mexico_City", "America/Sao_Paulo", "Europe/London", "Europe/Paris", "Europe/Berlin",
    "Europe/Madrid", "Europe/Rome", "Europe/Moscow", "Europe/Warsaw", "Asia/Tokyo", "Asia/Shanghai",
    "Asia/Kolkata", "Asia/Dubai", "Australia/Sydney", "Africa/Cairo", "Africa/Lagos", "Pacific/Auckland",
)
YEAR_NEAR, YEAR_FAR = (1, 15), (80, 400)
DATE_NEAR, DATE_FAR = (15, 1500), (18_000, 110_000)
MAX_YEAR = 2026
TRIES = 12

_MONTH_RE = "(" + "|".join(MONTHS) + ")"
_DATE_FORMATS = (
    ("iso", re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")),
    ("dmy", re.compile(r"^(\d{1,2})\s+" + _MONTH_RE + r"\s+(\d{3,4})$", re.I)),
    ("mdy", re.compile(r"^" + _MONTH_RE + r"\s+(\d{1,2}),\s*(\d{3,4})$", re.I)),
    ("my", re.compile(r"^" + _MONTH_RE + r"\s+(\d{3,4})$", re.I)),
)


def parse_date(text: str) -> Optional[tuple[dt.date, str]]:
    """(date, format) for the four formats of §9, tried in order; None if none parses or the
    date is invalid. Years below 1 are clamped to 1."""
    s = text.strip()
    for fmt, rx in _DATE_FORMATS:
        m = rx.match(s)
        if not m:
            continue
        g = m.groups()
        if fmt == "iso":
            y, mo, d = int(g[0]), int(g[1]), int(g[2])
        elif fmt == "dmy":
            d, mo, y = int(g[0]), _MONTH_NO[g[1].lower()], int(g[2])
        elif fmt == "mdy":
            mo, d, y = _MONTH_NO[g[0].lower()], int(g[1]), int(g[2])
        else:
            mo, d, y = _MONTH_NO[g[0].lower()], 1, int(g[1])
        try:
            return dt.date(max(1, y), mo, d), fmt
        except ValueError:
            return None
    return None


def render_date(d: dt.date, fmt: str) -> str:
    month = MONTHS[d.month - 1]
    if fmt == "iso":
        return f"{d.year:04d}-{d.month:02d}-{d.day:02d}"
    if fmt == "dmy":
        return f"{d.day} {month} {d.year}"
    if fmt == "mdy":
        return f"{month} {d.day}, {d.year}"
    return f"{month} {d.year}"


def _signed(rng: random.Random, lo: int, hi: int) -> int:
    mag = rng.randint(lo, hi)
    return mag * rng.choice((-1, 1))


def _year(gold: str, rng: random.Random, rng_range: tuple[int, int]) -> tuple[Optional[str], list[str]]:
    s = gold.strip()
    if not _YEAR.match(s):
        return None, ["year_unparsed"]
    g = int(s)
    for _ in range(TRIES):
        c = g + _signed(rng, *rng_range)
        if c != g and 1 <= c <= MAX_YEAR:
            return str(c), []
    return None, ["year_shift_failed"]


def _date(gold: str, rng: random.Random, rng_range: tuple[int, int]) -> tuple[Optional[str], list[str]]:
    parsed = parse_date(gold)
    if parsed is None:
        return None, ["date_unparsed"]
    g, fmt = parsed
    for _ in range(TRIES):
        shift = _signed(rng, *rng_range)
        try:
            c = g + dt.timedelta(days=shift)
        except OverflowError:
            continue
        if c != g and 1 <= c.year <= MAX_YEAR:
            return render_date(c, fmt), []
    for _ in range(TRIES):
        try:
            c = g - dt.timedelta(days=rng.randint(*rng_range))
        except OverflowError:
            continue
        if c != g and c.year >= 1:
            return render_date(c, fmt), ["date_forced_past"]
    return None, ["date_shift_failed"]


def _timezone(gold: str, rng: random.Random, which: str, pool: Iterable[str]) -> tuple[Optional[str], list[str]]:
    pool = list(pool)
    if not pool:
        return None, ["tz_pool_empty"]
    g = gold.strip()
    region = g.split("/", 1)[0]
    same = [z for z in pool if z.split("/", 1)[0] == region and z != g]
    other = [z for z in pool if z.split("/", 1)[0] != region]
    first, second = (same, other) if which == "near" else (other, same)
    flags = []
    cands = first
    if not cands:
        cands, flags = second, ["tz_fallback_region"]
    if not cands:
        return None, ["tz_pool_empty"]
    return rng.choice(sorted(cands)), flags


def generate_nonentity(gold: str, gold_kind: str, rng: random.Random, which: str,
                       tz_pool: Iterable[str] = DEFAULT_TZ_POOL) -> tuple[Optional[str], list[str]]:
    """One distractor (``which`` = near | far) drawn from ``rng``; returns (value or None, flags)."""
    if gold_kind == "year":
        return _year(gold, rng, YEAR_NEAR if which == "near" else YEAR_FAR)
    if gold_kind == "date":
        return _date(gold, rng, DATE_NEAR if which == "near" else DATE_FAR)
    if gold_kind == "timezone":
        return _timezone(gold, rng, which, tz_pool)
    return None, [f"unsupported_kind:{gold_kind}"]


def nonentity_distractors(qkey: str, gold: str, gold_kind: str, seed: int = PAPER_SEED,
                          tz_pool: Iterable[str] = DEFAULT_TZ_POOL) -> dict[str, Any]:
    """Near then far for one question, on one ``random.Random(f"{seed}|{qkey}")``."""
    rng = random.Random(f"{seed}|{qkey}")
    near, nf = generate_nonentity(gold, gold_kind, rng, "near", tz_pool)
    far, ff = generate_nonentity(gold, gold_kind, rng, "far", tz_pool)
    return {"near": near, "far": far, "flags": nf + ff}


def reproduce_nonentity(questions: Iterable[Question], seed: int = PAPER_SEED,
                        tz_pool: Iterable[str] = DEFAULT_TZ_POOL) -> dict[str, Any]:
    """Regenerate the year/date/timezone distractors and compare with the table's frozen values.

    Compared against ``near_original`` (the table before the repair overlay) and ``far``. Reports
    the reproduced share over all year/date/timezone questions and over the generator branch
    (``method == "nonentity"``), per kind, and the rows that differ.
    """
    rows = []
    for q in questions:
        if q.gold_kind not in ("year", "date", "timezone"):
            continue
        g = nonentity_distractors(q.qkey, q.gold, q.gold_kind, seed, tz_pool)
        rows.append({
            "qkey": q.qkey, "id": q.id, "kind": q.gold_kind, "method": q.method, "gold": q.gold,
            "near_table": q.near_original, "near_gen": g["near"], "far_table": q.far, "far_gen": g["far"],
            "near_match": g["near"] == q.near_original,
            "far_match": (q.far is None) or (g["far"] == q.far),
            "flags": g["flags"],
        })

    def share(rs: list[dict], key: str) -> dict[str, Any]:
        n = len(rs)
        k = sum(r[key] for r in rs)
        return {"n": n, "reproduced": k, "share": (k / n) if n else None}

    gen = [r for r in rows if r["method"] == "nonentity"]
    for r in rows:
        r["both_match"] = r["near_match"] and r["far_match"]
    by_kind = {}
    for kind in ("year", "date", "timezone"):
        rs = [r for r in gen if r["kind"] == kind]
        by_kind[kind] = {"near": share(rs, "near_match"), "far": share([r for r in rs if r["far_table"]], "far_match"),
                         "both": share(rs, "both_match")}
    return {
        "seed": seed,
        "all_kinds": {"near": share(rows, "near_match"), "both": share(rows, "both_match")},
        "generator_branch": {"near": share(gen, "near_match"),
                             "far": share([r for r in gen if r["far_table"]], "far_match"),
                             "both": share(gen, "both_match")},
        "by_kind": by_kind,
        "mismatches": [r for r in rows if not r["both_match"]],
    }


# ----------------------------------------------------------------------------------------------
# ToolHop: flatten, exact de-duplication, factual filter

@dataclass(frozen=True)
class SubQuestion:
    instance_id: int
    hop_idx: int
    question: str
    answer: str
    qkey: str
    schema: Optional[dict] = None


_SUB_KEYS = ("sub_task", "sub_tasks", "subtask", "subtasks", "sub_questions", "subquestions", "hops", "decomposition")
_TOOL_KEYS = ("tools", "tool_schemas", "functions_schema")


def _sub_items(item: dict) -> list[tuple[str, str]]:
    for k in _SUB_KEYS:
        if k in item:
            v = item[k]
            if isinstance(v, dict):          # {"sub question": "answer", ...}
                return [(str(a), str(b)) for a, b in v.items()]
            if isinstance(v, list):
                out = []
                for s in v:
                    if isinstance(s, dict):
                        q = s.get("question", s.get("sub_question", s.get("q")))
                        a = s.get("answer", s.get("sub_answer", s.get("a")))
                        out.append((q, a))
                    elif isinstance(s, (list, tuple)) and len(s) == 2:
                        out.append((s[0], s[1]))
                    else:
                        out.append((None, None))
                return out
    return []


def flatten_toolhop(path) -> tuple[list[SubQuestion], dict[str, int]]:
    """Read a ToolHop JSON file and flatten every chain into its sub-questions (hops).

    Accepts a list of chains or a mapping holding one; each chain needs a list (or mapping) of
    sub-questions under one of ``sub_task``/``sub_questions``/``hops``/... with ``question`` and
    ``answer``; tool schemas, when present under ``tools``, are attached by hop position. The
    chain id is the item's ``id``/``instance_id`` if integer, else its position.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"ToolHop file {path} does not exist (ToolHop is not shipped with memtoc; "
                        "download ToolHop.json from its release and pass its path)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of ToolHop chains")
    out: list[SubQuestion] = []
    skipped = 0
    for pos, item in enumerate(data):
        if not isinstance(item, dict):
            raise DataError(f"{path}: chain {pos} is not a JSON object")
        subs = _sub_items(item)
        if not subs:
            raise DataError(f"{path}: chain {pos} has no sub-questions (looked for fields {', '.join(_SUB_KEYS)})")
        iid = item.get("instance_id", item.get("id"))
        iid = iid if isinstance(iid, int) and not isinstance(iid, bool) else pos
        tools = next((item[k] for k in _TOOL_KEYS if isinstance(item.get(k), list)), [])
        for hop, (q, a) in enumerate(subs):
            if not isinstance(q, str) or not q.strip() or a is None or not str(a).strip():
                skipped += 1
                continue
            schema = tools[hop] if hop < len(tools) and isinstance(tools[hop], dict) else None
            out.append(SubQuestion(iid, hop, q.strip(), str(a).strip(), qkey_of(q), schema))
    return out, {"chains": len(data), "sub_questions": len(out), "skipped_malformed": skipped}


def dedup_exact(subs: Iterable[SubQuestion]) -> list[SubQuestion]:
    """Exact de-duplication on the qkey (first occurrence kept)."""
    return unique_by(subs, lambda s: s.qkey)


_NONFACTUAL_ANSWERS = {"yes", "no", "true", "false", "none", "unknown", "n a", "na"}
_NONFACTUAL_Q = re.compile(r"\b(how many|how much|how long|how old|what is the (sum|difference|product)|"
                           r"calculate|compute|count|sort|reverse|concatenat|which is (larger|older|bigger)|"
                           r"first letter|last letter|number of (letters|characters|words)|"
                           r"(older|younger|earlier|later|larger|smaller) than)\b", re.I)


def is_factual(s: SubQuestion, max_answer_words: int = 12) -> bool:
    """memtoc's factual filter (the paper's exact rule is not in the release): keep a hop whose
    answer is a short entity/date/value a model could know (not yes/no, not a bare count, at most
    ``max_answer_words`` words) and whose question is a lookup, not a computation or comparison."""
    a = re.sub(r"[^\w\s]", " ", s.answer.casefold()).strip()
    a = re.sub(r"\s+", " ", a)
    if not a or a in _NONFACTUAL_ANSWERS:
        return False
    if re.fullmatch(r"\d{1,2}", a):           # small integers: counts/arithmetic, not facts
        return False
    if len(a.split()) > max_answer_words:
        return False
    return not _NONFACTUAL_Q.search(s.question)


def factual_filter(subs: Iterable[SubQuestion]) -> list[SubQuestion]:
    return [s for s in subs if is_factual(s)]


def toolhop_pool(path) -> tuple[list[SubQuestion], dict[str, int]]:
    """Flatten, de-duplicate and filter a ToolHop file; returns the kept hops and the counts."""
    subs, counts = flatten_toolhop(path)
    dd = dedup_exact(subs)
    kept = factual_filter(dd)
    counts.update(after_dedup=len(dd), duplicates_removed=len(subs) - len(dd), after_factual_filter=len(kept),
                  nonfactual_removed=len(dd) - len(kept), chains_kept=len({s.instance_id for s in kept}))
    return kept, counts


# ----------------------------------------------------------------------------------------------
# Construction notebook helpers (tables, figure, summary file)

_COUNT_ROWS = (
    ("pool", "construction pool (questions)"), ("chains", "ToolHop chains"),
    ("analysis", "analysis set (pool - EXCLUDE)"), ("pass", "semantic review: PASS"),
    ("repaired", "semantic review: REPAIR (near replaced)"), ("excluded", "semantic review: EXCLUDE"),
    ("human", "distractor branch: human-authored"), ("generated", "distractor branch: generator-built"),
    ("far_pool", "far value available (pool)"), ("far_analysis", "far value available (analysis set)"),
    ("episodes_core", "evaluation episodes (542 x 4 conditions x 3 formulations)"),
)


def counts_table(counts: dict[str, Any]):
    """memtoc's counts beside the paper's, as a pandas DataFrame (columns memtoc, paper, match)."""

    flat = dict(counts)
    if "episodes" in counts:
        flat["episodes_core"] = counts["episodes"]["core"]
    rows = []
    for key, label in _COUNT_ROWS:
        ours, paper = flat.get(key), PAPER_COUNTS.get(key)
        rows.append({"count": label, "key": key, "memtoc": ours, "paper": paper, "match": ours == paper})
    fq = sorted(counts["folds_questions"].values())
    fc = sorted(counts["folds_chains"].values())
    rows.append({"count": "cross-fitting folds: questions", "key": "folds_questions", "memtoc": f"{fq[0]}/{fq[-1]}",
                 "paper": f"{PAPER_COUNTS['fold_questions_small']}/{PAPER_COUNTS['fold_questions_large']}",
                 "match": fq == [PAPER_COUNTS["fold_questions_small"], PAPER_COUNTS["fold_questions_large"]]})
    rows.append({"count": "cross-fitting folds: chains", "key": "folds_chains", "memtoc": f"{fc[0]}/{fc[-1]}",
                 "paper": f"{PAPER_COUNTS['fold_chains_small']}/{PAPER_COUNTS['fold_chains_large']}",
                 "match": fc == [PAPER_COUNTS["fold_chains_small"], PAPER_COUNTS["fold_chains_large"]]})
    return pd.DataFrame(rows).set_index("count")


def distribution_table(questions: Iterable[Question], attr: str):
    """Counts and shares of ``attr`` (gold_kind or family) in the pool and in the analysis set,
    with the far-value coverage of each group in the analysis set."""

    qs = list(questions)
    rows = []
    for v in sorted({getattr(q, attr) for q in qs}):
        pool = [q for q in qs if getattr(q, attr) == v]
        an = [q for q in pool if not q.excluded]
        rows.append({attr: v, "pool": len(pool), "analysis": len(an),
                     "analysis_share": len(an) / max(1, sum(not q.excluded for q in qs)),
                     "far_analysis": sum(q.far is not None for q in an),
                     "repaired": sum(q.repaired for q in pool), "excluded": sum(q.excluded for q in pool)})
    df = pd.DataFrame(rows).set_index(attr).sort_values("pool", ascending=False)
    return df


def plot_answer_types(questions: Iterable[Question], path) -> Path:
    """Seaborn bar chart of the answer-type distribution (pool vs analysis set), saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    qs = list(questions)
    pool_label = f"pool ({len(qs)})"
    an_label = f"analysis set ({sum(not q.excluded for q in qs)})"
    rows = [{"answer type": q.gold_kind, "set": pool_label} for q in qs]
    rows += [{"answer type": q.gold_kind, "set": an_label} for q in qs if not q.excluded]
    df = pd.DataFrame(rows).groupby(["answer type", "set"], as_index=False).size().rename(columns={"size": "n"})
    order = df[df["set"] == pool_label].sort_values("n", ascending=False)["answer type"].tolist()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    sns.barplot(data=df, x="answer type", y="n", hue="set", order=order, hue_order=[pool_label, an_label], ax=ax)
    for c in ax.containers:
        ax.bar_label(c, fontsize=7)
    ax.set_ylabel("questions")
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_title("MemToC answer types")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def episode_table(episodes):
    """Episode counts by condition, frame, arm and payload kind (columns: formulations)."""

    df = pd.DataFrame([{"condition": e.condition, "frame": e.frame, "arm": e.arm,
                        "payload_kind": e.payload_kind or "-", "formulation": e.formulation} for e in episodes])
    if df.empty:
        return df
    return df.pivot_table(index=["condition", "frame", "arm", "payload_kind"], columns="formulation",
                          aggfunc="size", fill_value=0)


# ----------------------------------------------------------------------------------------------
# Related questions across chains (cross-fitting leakage)

#: Answer types whose gold is a value, not an entity a question can be about (a year inside a film
#: title is not the film's subject); their golds are not searched for.
VALUE_KINDS = ("year", "date", "timezone")
LINK_RULE = ("question A's gold (base normalize, PROTOCOL §2a; entity answer types only, i.e. not "
             + "/".join(VALUE_KINDS) + "; at least 3 characters) occurs as a whole-word phrase in the text "
             "of question B of another chain: B asks about A's answer")


def related_links(questions: Iterable[Question]) -> list[dict[str, Any]]:
    """Ordered links (A, B) between questions of different chains where A's gold is the subject of
    B (:data:`LINK_RULE`), e.g. A "Who is the father of Chiang Hsiao-wu?" (gold Chiang Ching-kuo)
    and B "Who is the child of Chiang Ching-kuo?". One dict per link: the two ids, qkeys, texts,
    A's gold, both folds and exclusion flags, ``cross_fold``. Sorted by (A id, B id)."""
    qs = list(questions)
    texts = [f" {normalize(q.question)} " for q in qs]
    out = []
    for a in qs:
        g = normalize(a.gold)
        if a.gold_kind in VALUE_KINDS or len(g) < 3:
            continue
        for b, t in zip(qs, texts):
            if b.instance_id != a.instance_id and f" {g} " in t:
                out.append({"gold_id": a.id, "gold_qkey": a.qkey, "gold": a.gold, "gold_question": a.question,
                            "subject_id": b.id, "subject_qkey": b.qkey, "subject_question": b.question,
                            "gold_fold": a.fold, "subject_fold": b.fold,
                            "gold_excluded": a.excluded, "subject_excluded": b.excluded,
                            "cross_fold": a.fold is not None and b.fold is not None and a.fold != b.fold})
    return sorted(out, key=lambda r: (r["gold_id"], r["subject_id"]))


def related_summary(questions: Iterable[Question]) -> dict[str, Any]:
    """The ``related_questions`` block of ``summaries/construction.json``: the rule, link counts
    (all, cross-fold, cross-fold unordered pairs, cross-fold with both questions in the analysis
    set) and every cross-fold link."""
    links = related_links(questions)
    cross = [r for r in links if r["cross_fold"]]
    return {
        "rule": LINK_RULE,
        "n_links": len(links),
        "n_cross_fold": len(cross),
        "n_cross_fold_pairs": len({frozenset((r["gold_id"], r["subject_id"])) for r in cross}),
        "n_cross_fold_analysis": sum(not r["gold_excluded"] and not r["subject_excluded"] for r in cross),
        "cross_fold_links": cross,
        "note": ("the paper says related-question groups never straddle folds; the release's frozen folds do "
                 "not enforce it. finetune.exclude_linked: true drops linked questions from the training data"),
    }


def construction_summary(bench, run_episodes_list=None) -> dict[str, Any]:
    """The content of ``summaries/construction.json``: counts, paper counts, QC, generator share,
    and the run's episode counts."""

    counts = bench.counts()
    qc = qc_report(bench.questions)
    rep = reproduce_nonentity(bench.questions, seed=PAPER_SEED)
    out = {
        "counts": counts,
        "paper": dict(PAPER_COUNTS),
        "matches_paper": {k: counts.get(k) == v for k, v in PAPER_COUNTS.items() if k in counts},
        "qc": {k: v for k, v in qc.items() if k != "failures"},
        "generator": {k: v for k, v in rep.items() if k != "mismatches"} | {"n_mismatches": len(rep["mismatches"])},
        "generator_share": rep["generator_branch"]["both"]["share"],
        "related_questions": related_summary(bench.questions),
        "files": bench.files,
    }
    if run_episodes_list is not None:
        eps = list(run_episodes_list)
        out["run_episodes"] = {
            "total": len(eps),
            "by_formulation": dict(Counter(e.formulation for e in eps)),
            "by_condition": dict(Counter(e.condition for e in eps)),
            "by_arm_key": dict(Counter(e.arm_key for e in eps)),
            "questions": len({e.qkey for e in eps}),
            "schema_kinds": dict(Counter(e.schema_kind for e in eps)),
        }
    return out
