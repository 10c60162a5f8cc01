"""The LLM-judge overlay: the "judged" layer of PROTOCOL §4b (opt-in, params ``judge:``).

One pass of an LLM judge that only *normalises text*; the deterministic matcher
(:func:`memtoc.core.scoring.match`) still makes every decision. With ``judge: null`` (the default)
nothing here runs and every output of the run is the det layer's.

Pieces (pure unless marked I/O)::

    reqs = judge_requests(scored)                  # which rows the judge reads, and the prompts
    judgments = run_judge(generator, label, scored, run_dir)     # I/O: generation through the cache
    judged = apply_overlay(scored, judgments)      # a copy of the scored frame, layer "judged"
    car_judge(judged)                              # {"value", "n", "n_missing"}
    add_judged(summary, scored_by_model, cfg)      # notebook 03's one call (I/O)

Requests (PROTOCOL §4b)
-----------------------
* ``extract`` on a with-tool final (target ``final``): every ``tool_wrong`` episode whose outcome is
  ``neither`` with ``neither_subtype == "other"``. The judge reads the full reply.
* ``extract`` on a closed-book span (target ``closed_book``): one request per (model, formulation,
  qkey) whose span is *suspicious*: more words than the gold's word count + 2 (whitespace words) AND
  ``canon(gold)`` is a substring of ``canon(question)`` (a likely echo of the question). The judge
  reads the span (``memory_span``). Spans that are already mem_absent are not sent: an absent
  memory has no memory_correct that an echo could inflate (our reading; §4b does not say).
* ``ack`` (conflict acknowledgment) on every ``tool_wrong`` final.

Which rows: every arm and frame alike (untreated, the prompting arms, no_protocol_sentence, the
presentation frames): the judged layer is a property of an episode, not of an analysis. Only
``tool_wrong`` finals are judged, as in the paper ("the judge only touches tool_wrong"): the
``tool_far`` episodes (the far-distractor arm), tool_right, tool_error, no_tool and noop finals
keep their det values, so far-vs-near contrasts stay a det-layer analysis. Closed-book fixes
apply per hop, i.e. to every row (every condition, arm and frame) of that (model, formulation,
qkey), since all arms of one (model, formulation) share the closed-book pass.

Prompts
-------
PROTOCOL does not give the judge prompts. The wording of :data:`EXTRACT_PROMPT` and
:data:`ACK_PROMPT` is memtoc's own: short and explicit (extract: give only the entity the reply
commits to as its final answer, or ABSTAIN; ack: does the reply explicitly signal a conflict,
discrepancy or doubt between the tool output and its own knowledge, plain hedging does not count,
answer YES or NO). Judged numbers from another wording are not the paper's judged numbers.

Reply parsing (:func:`parse_extract`, :func:`parse_ack`)
-------------------------------------------------------
The reply is stripped, its first line taken, stripped, and ``"`` / ``*`` stripped from both ends.
extract: an empty line, more than 12 words or an error (no reply) -> ignored (None: the det label
stays); a line starting with ``ABSTAIN`` (any case) -> abstain; else the entity. The word limit is
checked before the ABSTAIN prefix (a long "ABSTAIN because ..." line is ignored). ack: a line
starting with the word YES -> True, the word NO -> False (any case; "NOT SURE" or "Nothing" is
neither), anything else -> None (missing).

Overlay (:func:`apply_overlay`)
-------------------------------
Closed-book fixes first (per hop): ABSTAIN or ``is_abstain(entity)`` -> mem_absent True,
memory_correct None; else memory_span = entity, memory_correct = match(entity, gold); the cell is
recomputed with :func:`memtoc.core.metrics.assign_cell`. Then corrected finals: ABSTAIN ->
neither_subtype "abstain", abstain True; else followed_tool = match(entity, tool_value),
kept_memory = match(entity, parametric span) with the judged-layer span ("" when mem_absent), the
outcome rebuilt with :func:`memtoc.core.scoring.outcome_of`. ``final_correct`` and ``extracted`` are
NOT recomputed; a final the judge did not correct keeps its det followed_tool / kept_memory even
when its hop's span was fixed (only what §4b names is recomputed). Added columns: ``layer``
("judged"), ``ack_judge`` (True/False/None on tool_wrong rows, None elsewhere), ``judge_final``
and ``judge_memory`` (the judge's entity, "ABSTAIN", or None when not asked / ignored).

A caution on the judge model: with the embedded 135M model as judge the overlay is a pipeline
check, not a measurement. A real judged layer needs a 7-9B instruction model (e.g. one of the
paper's) or an OpenAI-compatible endpoint (``judge: {model: ..., backend: openai, backend_options:
{base_url: ...}}``).

Files: ``generations/<judge_label>/judge_extract.jsonl`` and ``judge_ack.jsonl`` (the cache: a rerun
reuses them), ``scored_judged/<model>/<arm_key>.jsonl`` (the judged rows, laid out like
``scored/``), and the ``/judged`` section of ``summaries/evaluation.json``::

    /judged/judge                                  {"model", "backend", "label", "max_new_tokens"}
    /judged/models/<model>/headline/<form>/<metric>   as /models/<model>/headline, on the judged rows
    /judged/models/<model>/car_judge/<form>        interval object: ack_judge over untreated,
                                                   schema-frame tool_wrong episodes in arb ∪
                                                   both_wrong (missing acks left out; pooled =
                                                   unweighted mean over formulations)
    /judged/models/<model>/car_judge_missing       int: such episodes whose ack reply was unparsable
    /judged/models/<model>/requests                {"extract_final", "extract_closed_book", "ack"}: counts
    /judged/models/<model>/parsed                  per request kind: {"entity", "abstain", "ignored"}
                                                   or {"yes", "no", "missing"}
    /judged/models/<model>/changed                 rows (all arms) whose value differs from det:
                                                   outcome, abstain, memory_correct, cell
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from memtoc.config.params import DEFAULTS, FORMULATIONS
from memtoc.config.runconfig import RunConfig, RunPaths, expect_config
from memtoc.core import intervals, metrics, scoring
from memtoc.core.errors import ConfigError, MemtocError
from memtoc.core.io import plain
from memtoc.core.metrics import isna
from memtoc.core.scoring import canon
from memtoc.generation import models
from memtoc.stages.evaluation import analyses, read_scored, write_scored

TASKS = ("extract", "ack")
TARGETS = ("final", "closed_book")
LAYER = "judged"
MAX_WORDS = 12
CHANGED_FIELDS = ("outcome", "abstain", "memory_correct", "cell")

EXTRACT_PROMPT = (
    "Below is a question and a reply written by someone else.\n"
    "Give only the entity this reply commits to as its final answer (a name, place, title, date or "
    "number, copied as written in the reply), or ABSTAIN if the reply gives no answer or declines "
    "to answer.\n"
    "Write one line with nothing else on it.\n\n"
    "Question: {question}\n"
    "Reply:\n<<<\n{reply}\n>>>\n"
)
ACK_PROMPT = (
    "Below is a question, the output of a tool that was called for it, and a reply written by "
    "someone else.\n"
    "Does the reply explicitly signal a conflict, discrepancy or doubt between the tool output and "
    "its own knowledge? Plain hedging (\"I think\", \"probably\") does not count.\n"
    "Answer YES or NO.\n\n"
    "Question: {question}\n"
    "Tool output: {tool_value}\n"
    "Reply:\n<<<\n{reply}\n>>>\n"
)


class JudgeError(MemtocError):
    """The judge's inputs are inconsistent (a scored frame without the needed columns, ...)."""


@dataclass(frozen=True)
class JudgeRequest:
    """One judge prompt and the row(s) it is about.

    ``target`` "final": one with-tool episode (``episode_id``); "closed_book": the closed-book span
    of one hop (``formulation``, ``qkey``; ``hop`` = the question id), applied to all its rows.
    ``model`` is the evaluated model (None when the scored frame has no model column)."""

    task: str                    # extract | ack
    target: str                  # final | closed_book
    model: Optional[str]
    formulation: str
    qkey: str
    hop: Optional[str]           # question_id ("instance.hop")
    episode_id: Optional[str]    # None for closed_book
    prompt: str

    @property
    def key(self) -> tuple:
        """Identity used to join a judgment back to its rows."""
        if self.target == "final":
            return (self.task, self.target, self.model, self.episode_id)
        return (self.task, self.target, self.model, self.formulation, self.qkey)


@dataclass(frozen=True)
class Judgment:
    """A request and the judge's raw reply (None: no reply, an error -> ignored)."""

    request: JudgeRequest
    text: Optional[str]
    cached: bool = False


# ==================================================================================================
# parsing (PROTOCOL §4b)


def first_line(text: Optional[str]) -> str:
    """The reply's first line, stripped, with ``"`` and ``*`` stripped from both ends."""
    if text is None or not isinstance(text, str):
        return ""
    s = text.strip()
    line = s.splitlines()[0] if s else ""
    prev = None
    while prev != line:                  # '**"Paris"**' -> 'Paris'
        prev = line
        line = line.strip().strip('"*')
    return line.strip()


def parse_extract(text: Optional[str]) -> Optional[tuple[str, Optional[str]]]:
    """``("entity", str)``, ``("abstain", None)``, or None (ignored: empty, > 12 words, an error)."""
    line = first_line(text)
    if not line or len(line.split()) > MAX_WORDS:
        return None
    if line.upper().startswith("ABSTAIN"):
        return ("abstain", None)
    return ("entity", line)


_ACK = re.compile(r"(YES|NO)\b", re.IGNORECASE)


def parse_ack(text: Optional[str]) -> Optional[bool]:
    """True for a reply starting with the word YES, False for NO, None otherwise (missing)."""
    m = _ACK.match(first_line(text))
    if not m:
        return None
    return m.group(1).upper() == "YES"


# ==================================================================================================
# requests


def _words(s: Any) -> int:
    return len(str(s).split()) if isinstance(s, str) else 0


def suspicious_span(span: Optional[str], gold: str, question: str) -> bool:
    """PROTOCOL §4b: the span has more than (gold word count + 2) words AND canon(gold) is contained
    in canon(question) (a likely echo of the question)."""
    if not isinstance(span, str) or not span:
        return False
    g = canon(gold)
    return _words(span) > _words(gold) + 2 and bool(g) and g in canon(question)


def extract_prompt(question: str, reply: str) -> str:
    return EXTRACT_PROMPT.format(question=question, reply=reply)


def ack_prompt(question: str, tool_value: Optional[str], reply: str) -> str:
    return ACK_PROMPT.format(question=question, tool_value="" if tool_value is None else tool_value, reply=reply)


_NEED = ("episode_id", "question_id", "qkey", "formulation", "condition", "question", "gold", "tool_value",
         "response", "outcome", "neither_subtype", "memory_span", "mem_absent")


def _check(scored: pd.DataFrame, need: Sequence[str], what: str) -> None:
    missing = [c for c in need if c not in scored.columns]
    if missing:
        raise JudgeError(f"{what}: the scored frame lacks column(s) {missing}; pass the frame returned by "
                         "evaluation.evaluate (or read back with evaluation.read_scored)")


def _text(x: Any) -> str:
    return "" if isna(x) else str(x)


def judge_requests(scored: pd.DataFrame) -> list[JudgeRequest]:
    """Every judge request of a scored frame (one or more models; every arm and frame), in row
    order: the extract requests of the finals, then the closed-book extract requests, then the
    ack requests. See the module docstring for the rules."""
    _check(scored, _NEED, "judge_requests")
    has_model = "model" in scored.columns
    rows = scored.to_dict("records")
    finals, books, acks = [], [], []
    seen_book: set[tuple] = set()
    for r in rows:
        model = r.get("model") if has_model else None
        model = None if isna(model) else model
        base = dict(model=model, formulation=r["formulation"], qkey=r["qkey"], hop=_text(r["question_id"]) or None)
        reply = _text(r["response"])
        if r["condition"] == "tool_wrong":
            if r["outcome"] == "neither" and r["neither_subtype"] == "other":
                finals.append(JudgeRequest("extract", "final", episode_id=r["episode_id"],
                                           prompt=extract_prompt(r["question"], reply), **base))
            acks.append(JudgeRequest("ack", "final", episode_id=r["episode_id"],
                                     prompt=ack_prompt(r["question"], None if isna(r["tool_value"]) else
                                                       str(r["tool_value"]), reply), **base))
        hop = (model, r["formulation"], r["qkey"])
        if hop in seen_book:
            continue
        seen_book.add(hop)
        if not bool(r["mem_absent"]) and suspicious_span(r["memory_span"], r["gold"], r["question"]):
            books.append(JudgeRequest("extract", "closed_book", episode_id=None,
                                      prompt=extract_prompt(r["question"], r["memory_span"]), **base))
    return finals + books + acks


def request_counts(requests: Iterable[JudgeRequest]) -> dict[str, int]:
    reqs = list(requests)
    return {"extract_final": sum(q.task == "extract" and q.target == "final" for q in reqs),
            "extract_closed_book": sum(q.task == "extract" and q.target == "closed_book" for q in reqs),
            "ack": sum(q.task == "ack" for q in reqs)}


# ==================================================================================================
# generation (I/O)


def judge_label(model: str) -> str:
    """The folder name of a judge's cache under ``generations/``: ``judge__<model>``."""
    return "judge__" + re.sub(r"[^A-Za-z0-9_.-]+", "_", str(model)).strip("_")


def run_judge(generator, judge_label: str, scored: pd.DataFrame, run_dir,
              requests: Optional[Sequence[JudgeRequest]] = None) -> list[Judgment]:
    """Generate the judge's replies for ``judge_requests(scored)`` (or ``requests``) through the
    generator and its cache: ``generations/<judge_label>/judge_<task>.jsonl``, one file per task,
    so a rerun reuses every reply. Returns one Judgment per request, same order."""
    reqs = list(judge_requests(scored) if requests is None else requests)
    paths = RunPaths(run_dir)
    paths.generations(judge_label).mkdir(parents=True, exist_ok=True)
    out: list[Optional[Judgment]] = [None] * len(reqs)
    for task in TASKS:
        idx = [i for i, q in enumerate(reqs) if q.task == task]
        if not idx:
            continue
        got = generator.generate([reqs[i].prompt for i in idx],
                                 cache_path=paths.generation_file(judge_label, f"judge_{task}"),
                                 desc=f"judge {task} ({judge_label})")
        if len(got) != len(idx):
            raise JudgeError(f"the judge returned {len(got)} replies for {len(idx)} {task} prompts")
        for i, rep in zip(idx, got):
            text = getattr(rep, "text", rep)
            out[i] = Judgment(reqs[i], text if isinstance(text, str) else None, bool(getattr(rep, "cached", False)))
    return out  # type: ignore[return-value]


# ==================================================================================================
# the overlay (pure)


def _judged_maps(judgments: Iterable[Judgment]) -> tuple[dict, dict, dict]:
    finals, books, acks = {}, {}, {}
    for j in judgments:
        q = j.request
        if q.task == "ack":
            acks[(q.model, q.episode_id)] = parse_ack(j.text)
        elif q.target == "final":
            finals[(q.model, q.episode_id)] = parse_extract(j.text)
        else:
            books[(q.model, q.formulation, q.qkey)] = parse_extract(j.text)
    return finals, books, acks


def _label(parsed: Optional[tuple[str, Optional[str]]]) -> Optional[str]:
    if parsed is None:
        return None
    return "ABSTAIN" if parsed[0] == "abstain" else parsed[1]


def apply_overlay(scored: pd.DataFrame, judgments: Iterable[Judgment], matcher: str = "paper") -> pd.DataFrame:
    """A copy of ``scored`` with the judged layer applied (module docstring: Overlay). Rows the
    judge did not touch keep their det values."""
    _check(scored, ("episode_id", "qkey", "formulation", "condition", "gold", "tool_value", "tool_correct",
                    "outcome", "followed_tool", "kept_memory", "abstain", "neither_subtype", "memory_span",
                    "mem_absent", "memory_correct", "cell"), "apply_overlay")
    scoring.check_choice("matcher", matcher, scoring.MATCHERS)
    finals, books, acks = _judged_maps(judgments)
    has_model = "model" in scored.columns
    rows = scored.to_dict("records")
    out = []
    for r in rows:
        r = dict(r)
        model = r.get("model") if has_model else None
        model = None if isna(model) else model
        kind = None if isna(r.get("gold_kind")) else r.get("gold_kind")
        r["judge_final"] = None
        r["judge_memory"] = None
        # closed-book fix, per hop (every condition / arm / frame of the hop)
        book = books.get((model, r["formulation"], r["qkey"]))
        if book is not None:
            r["judge_memory"] = _label(book)
            if book[0] == "abstain" or scoring.is_abstain(book[1]):
                r["mem_absent"], r["memory_correct"] = True, None
            else:
                r["memory_span"] = book[1]
                r["mem_absent"] = False
                r["memory_correct"] = bool(scoring.match(book[1], r["gold"], matcher, kind))
            tc = None if isna(r["tool_correct"]) else bool(r["tool_correct"])
            r["cell"] = metrics.assign_cell(r["memory_correct"], r["mem_absent"], tc)
        # corrected final (tool_wrong, neither/other)
        ack = None
        if r["condition"] == "tool_wrong":
            ack = acks.get((model, r["episode_id"]))
            fin = finals.get((model, r["episode_id"]))
            if fin is not None:
                r["judge_final"] = _label(fin)
                if fin[0] == "abstain":
                    r["neither_subtype"], r["abstain"] = "abstain", True
                else:
                    mem = "" if bool(r["mem_absent"]) else _text(r["memory_span"])
                    tool = None if isna(r["tool_value"]) else str(r["tool_value"])
                    ft, km = scoring.source_matches(fin[1], tool, mem, matcher, kind)
                    r["followed_tool"], r["kept_memory"] = ft, km
                    r["outcome"] = scoring.outcome_of(ft, km)
                    r["neither_subtype"] = scoring.neither_subtype(r["outcome"], bool(r["abstain"]))
        r["ack_judge"] = ack
        r["layer"] = LAYER
        out.append(r)
    df = pd.DataFrame(out, index=scored.index, columns=list(dict.fromkeys(list(scored.columns) + [
        "judge_final", "judge_memory", "ack_judge", "layer"])))
    for c in ("ack_judge", "judge_final", "judge_memory", "memory_correct", "neither_subtype"):
        df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df


def car_units(scored_judged: pd.DataFrame) -> pd.DataFrame:
    """Per-episode units of CAR_judge: tool_wrong episodes in arb ∪ both_wrong with a parsed
    ack_judge; columns formulation, qkey, value (+ model / arm / frame when present)."""
    _check(scored_judged, ("condition", "cell", "ack_judge", "formulation", "qkey"), "car_units")
    d = scored_judged[(scored_judged["condition"] == "tool_wrong") & scored_judged["cell"].isin(["arb", "both_wrong"])]
    d = d[np.array([not isna(a) for a in d["ack_judge"]], dtype=bool)]
    cols = [c for c in ("model", "arm", "frame", "formulation", "qkey") if c in d.columns]
    out = d[cols].copy()
    out["value"] = np.asarray([1.0 if bool(a) else 0.0 for a in d["ack_judge"]], dtype=float)
    return out.reset_index(drop=True)


def car_judge(scored_judged: pd.DataFrame) -> dict[str, Any]:
    """CAR_judge (PROTOCOL §4b): mean ack_judge over tool_wrong episodes in cells arb ∪
    both_wrong. ``{"value": float|None, "n": parsed acks, "n_missing": unparsable/absent acks}``."""
    u = car_units(scored_judged)
    d = scored_judged[(scored_judged["condition"] == "tool_wrong") & scored_judged["cell"].isin(["arb", "both_wrong"])]
    return {"value": float(u["value"].mean()) if len(u) else None, "n": int(len(u)),
            "n_missing": int(len(d) - len(u))}


def parse_counts(judgments: Iterable[Judgment]) -> dict[str, dict[str, int]]:
    """How the judge's replies parsed, per request kind."""
    out = {"extract_final": {"entity": 0, "abstain": 0, "ignored": 0},
           "extract_closed_book": {"entity": 0, "abstain": 0, "ignored": 0},
           "ack": {"yes": 0, "no": 0, "missing": 0}}
    for j in judgments:
        q = j.request
        if q.task == "ack":
            a = parse_ack(j.text)
            out["ack"]["missing" if a is None else "yes" if a else "no"] += 1
        else:
            p = parse_extract(j.text)
            out[f"extract_{q.target}"]["ignored" if p is None else p[0]] += 1
    return out


def changed_counts(det: pd.DataFrame, judged: pd.DataFrame) -> dict[str, int]:
    """Rows whose value differs between the det and the judged layer, per field."""
    out = {}
    for c in CHANGED_FIELDS:
        a = det[c].astype(object).where(det[c].notna(), None).to_numpy()
        b = judged[c].astype(object).where(judged[c].notna(), None).to_numpy()
        out[c] = int(sum(x != y for x, y in zip(a, b)))
    return out


# ==================================================================================================
# pipeline glue (I/O at the edge): notebook 03


def load_judge(cfg: RunConfig):
    """The judge's Generator (``models.load_generator`` with the ``judge`` block's settings and the
    run's batch size, dtype and model cache). ``cfg``: the run configuration (a dict is refused)."""
    cfg = expect_config(cfg, "judge.load_judge")
    j = cfg.judge
    if j is None:
        raise ConfigError("no judge configured (parameter 'judge' is null)")
    return models.load_generator(j.model, backend=j.backend, batch_size=cfg.batch_size, dtype=cfg.dtype,
                                 max_new_tokens=j.max_new_tokens, model_cache_dir=cfg.model_cache_dir,
                                 **j.backend_options)


def write_judged(judged: pd.DataFrame, run_dir, model_label: str) -> list[Path]:
    """``scored_judged/<model>/<arm_key>.jsonl`` (the layout of ``scored/``)."""
    return write_scored(judged, run_dir, model_label, folder="scored_judged")


def read_judged(run_dir, model_label: Optional[str] = None) -> pd.DataFrame:
    """Read back ``scored_judged/<model>/*.jsonl`` (all models when ``model_label`` is None)."""
    return read_scored(run_dir, model_label, folder="scored_judged",
                       hint="set the parameter 'judge' and run notebook 03_evaluation")


def judged_model_section(det: pd.DataFrame, judged: pd.DataFrame, judgments: Sequence[Judgment],
                         formulations: Sequence[str] | None = None, n_boot: int = DEFAULTS["n_boot"],
                         seed: int = 0, alpha: float = DEFAULTS["alpha"]) -> dict:
    """``/judged/models/<model>`` of the evaluation summary (module docstring). Pure."""
    forms = list(formulations or FORMULATIONS)
    head = analyses.select_arm(judged)
    units = car_units(head)
    cw = head[(head["condition"] == "tool_wrong") & head["cell"].isin(["arb", "both_wrong"])]
    car = intervals.rate_intervals(units, forms, n_boot, seed, alpha) or {"pooled": intervals.interval_obj(None, None, 0)}
    return plain({
        "headline": analyses.headline_metrics(judged, forms, n_boot=n_boot, seed=seed, alpha=alpha),
        "car_judge": car,
        "car_judge_missing": int(len(cw) - len(units)),
        "requests": request_counts(j.request for j in judgments),
        "parsed": parse_counts(judgments),
        "changed": changed_counts(det, judged),
    })


def add_judged(summary: dict, scored_by_model: dict[str, pd.DataFrame], cfg: RunConfig, generator=None) -> dict:
    """Notebook 03's one call: with the ``judge`` block set, judge every model's scored frame (requests,
    generation through ``generations/<judge_label>/``, overlay), write
    ``scored_judged/<model>/<arm_key>.jsonl`` and return ``summary`` plus a ``judged`` section.
    With ``judge: null`` it returns ``summary`` itself, unchanged. ``generator``: an already
    loaded judge (tests); by default the configured one is loaded and closed here. ``cfg``: the run
    configuration (a dict is refused)."""
    cfg = expect_config(cfg, "judge.add_judged")
    j = cfg.judge
    if j is None:
        return summary
    run_dir = cfg.run_dir
    label = judge_label(j.model)
    matcher = cfg.matcher
    kw = dict(formulations=list(cfg.formulations), n_boot=cfg.n_boot, seed=0, alpha=float(cfg.alpha))
    gen = generator if generator is not None else load_judge(cfg)
    section: dict[str, Any] = {"judge": {"model": j.model, "backend": j.backend, "label": label,
                                         "max_new_tokens": j.max_new_tokens}, "models": {}}
    try:
        for model, det in scored_by_model.items():
            judgments = run_judge(gen, label, det, run_dir)
            judged = apply_overlay(det, judgments, matcher=matcher)
            write_judged(judged, run_dir, model)
            section["models"][model] = judged_model_section(det, judged, judgments, **kw)
            n_new = sum(not x.cached for x in judgments)
            print(f"{model}: judged layer: {len(judgments)} judge requests ({n_new} generated now), "
                  f"changed rows {section['models'][model]['changed']}")
    finally:
        if generator is None:
            gen.close()
    return {**summary, "judged": section}
