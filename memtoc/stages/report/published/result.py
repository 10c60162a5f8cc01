"""Checks and their results: a printed value, a re-derived value, a status."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from memtoc.core.errors import MemtocError
from memtoc.stages.report import claims
from memtoc.stages.report.published.via import Traced, via_pipeline

RANGE_DASH = "–"
STATUSES = ("MATCH", "DISAGREEMENT", "UNPUBLISHED", "ABSENT", "MISMATCH")


class PublishedCheckError(MemtocError):
    """The release copy, ``paper/published/`` or the registry's published part cannot be read as expected."""


class MissingInput(Exception):
    """A check's input is not in the release directory (reported as ABSENT, naming ``path``)."""

    def __init__(self, path: str, why: str = "does not exist"):
        super().__init__(f"{path} {why}".strip())
        self.path = path


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
    calls: list[str] = field(default_factory=list)

    # the interface of claims.CheckRow, for notebooks and tables
    @property
    def printed(self) -> str:
        return "" if self.published is None else str(self.published)

    @property
    def via_pipeline(self) -> bool:
        return via_pipeline(self.calls)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PublishedResult:
    checks: list[Check] = field(default_factory=list)
    target: str = ""
    layout: str = ""
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
        return {"release": self.target, "layout": self.layout, "ok": self.ok, "n_checks": len(self.checks),
                "by_status": self.counts(), "by_family": by_family, "by_via": by_via,
                "n_via_pipeline": sum(c.via_pipeline for c in self.checks),
                "absent": sorted({c.detail for c in self.checks if c.status == "ABSENT"}),
                "disagreements": [{"id": c.id, "published": c.published, "derived": c.derived, "reason": c.detail}
                                  for c in self.checks if c.status == "DISAGREEMENT"],
                "mismatches": [{"id": c.id, "published": c.published, "derived": c.derived, "detail": c.detail}
                               for c in self.failures]}

    def summary(self) -> str:
        k = self.counts()
        checked = k["MATCH"] + k["DISAGREEMENT"] + k["MISMATCH"]
        return (f"{k['MATCH']}/{checked} published values re-derived and matching; {k['DISAGREEMENT']} documented "
                f"disagreement(s), {k['MISMATCH']} mismatch(es); {k['UNPUBLISHED']} re-derived without a printed "
                f"value; {k['ABSENT']} whose input is absent from the release ({self.layout} layout; "
                f"{len(self.checks)} checks)")

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


class Collector:
    """Builds checks: compares printed and derived values at the printed precision. A derived value
    is a :class:`~memtoc.stages.report.published.via.Traced` (its ``via`` and ``calls`` come from the call)."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(self, cid: str, family: str, published: Any, derived: Traced, rule: str = "exact",
            source: str = "", disagreement: Optional[str] = None, tolerance: Optional[float] = None,
            published_rule: Optional[str] = None, stored_decimals: Optional[int] = None) -> Check:
        """``stored_decimals``: the release stores this rate rounded to that many decimals and the
        paper printed from the stored value; a print that equals the stored rate at the printed
        precision (but not the exact count rate: rounded twice) is a MATCH with the reason in detail."""
        if not isinstance(derived, Traced):
            raise TypeError(f"check {cid}: the derived value must be Traced (memtoc.stages.report.published.via.trace)")
        der = fmt(derived.value, rule)
        pub = None if published is None else fmt(published, published_rule or rule)
        pn, dn = _num(published), _num(derived.value)
        if published is None:
            status, detail = "UNPUBLISHED", "the paper's printed value is not in paper/published/"
        elif pub == der:
            status, detail = "MATCH", ""
        elif tolerance is not None and pn is not None and dn is not None and abs(pn - dn) <= tolerance + 1e-12:
            status, detail = "MATCH", f"within {tolerance} (the release's inputs are themselves rounded): exact {derived.value!r}"
        elif stored_decimals is not None and pub == fmt(_stored(derived.value, stored_decimals), rule):
            status, detail = "MATCH", (f"rounded twice: the paper prints the release's stored rate "
                                       f"{_stored(derived.value, stored_decimals)} at the printed precision; "
                                       f"the exact count rate {_stored(derived.value, 6)} gives {der}")
        elif disagreement:
            status, detail = "DISAGREEMENT", disagreement
        else:
            status, detail = "MISMATCH", f"published {pub!r}, re-derived {der!r}"
        c = Check(cid, family, pub, der, status, derived.via, detail, source, list(derived.calls))
        self.checks.append(c)
        return c

    def absent(self, cid: str, family: str, missing: MissingInput, source: str = "") -> None:
        self.checks.append(Check(cid, family, None, None, "ABSENT", "", f"absent: {missing}", source))


def _stored(v: Any, decimals: int) -> Any:
    """A rate (or a (lo, hi) range of rates) as the release stores it: rounded to ``decimals``."""
    if isinstance(v, tuple):
        return tuple(_stored(x, decimals) for x in v)
    return round(float(v), decimals) if _num(v) is not None else v


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    if isinstance(v, str) and re.fullmatch(r"\s*-?[\d.]+\s*", v):
        try:
            return float(v)
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
    if isinstance(v, np.integer):
        v = int(v)
    if isinstance(v, np.floating):
        v = float(v)
    return claims.format_value(v, rule)


def decimals_rule(printed: Any) -> str:
    """``decimal:<k>`` with k the decimals of a printed number as written (31.75 -> decimal:2)."""
    text = str(printed)
    return f"decimal:{len(text.split('.')[1]) if '.' in text else 0}"
