"""Verification results of :mod:`memtoc.stages.report.claims` (``memtoc verify``): one :class:`CheckRow` per claim
or report check, gathered in a :class:`VerificationResult`; re-exported there."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import pandas as pd


@dataclass
class CheckRow:
    id: str
    status: str                 # PASS | FAIL (run claims); MATCH | MISMATCH | NOTE (published)
    printed: str = ""
    derived: str = ""
    source: str = ""
    detail: str = ""


def text_table(head: tuple[str, ...], rows: Iterable[tuple[str, ...]], width: int = 48) -> str:
    """A plain-text table of five columns: the first four padded to their widest cell (cut at
    ``width`` with "…"), the last as is."""
    rows = list(rows)
    w = [max([len(head[i])] + [min(len(x[i]), width) for x in rows]) for i in range(4)]
    fmt = "  ".join("{:<%d}" % n for n in w) + "  {}"
    lines = [fmt.format(*head), fmt.format(*("-" * n for n in w), "-" * 15)]
    lines += [fmt.format(*(x[i] if len(x[i]) <= width else x[i][:width - 1] + "…" for i in range(4)), x[4])
              for x in rows]
    return "\n".join(lines)


@dataclass
class VerificationResult:
    rows: list[CheckRow] = field(default_factory=list)
    kind: str = "run"           # run | published
    target: str = ""

    FAILING = ("FAIL", "MISMATCH")
    STATUSES = ("PASS", "FAIL", "MATCH", "NOTE", "N/A", "MISMATCH")

    @property
    def failures(self) -> list[CheckRow]:
        return [r for r in self.rows if r.status in self.FAILING]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def n_claims(self) -> int:
        return sum(1 for r in self.rows if not r.id.startswith("report:"))

    @property
    def n_pass(self) -> int:
        return sum(1 for r in self.rows if not r.id.startswith("report:") and r.status not in self.FAILING)

    def summary(self) -> str:
        if self.kind == "published":
            counts = {s: sum(r.status == s for r in self.rows) for s in ("MATCH", "NOTE", "N/A", "MISMATCH")}
            checked = len(self.rows) - counts["N/A"]
            return (f"{counts['MATCH']}/{checked} published values re-derived and matching; "
                    f"{counts['NOTE']} documented disagreement(s), {counts['MISMATCH']} mismatch(es), "
                    f"{counts['N/A']} not derivable from the release copy")
        extra = len(self.rows) - self.n_claims
        fails_report = sum(1 for r in self.failures if r.id.startswith("report:"))
        s = f"{self.n_pass}/{self.n_claims} claims pass"
        if extra:
            s += f"; report checks: {extra - fails_report}/{extra} pass"
        return s

    def table(self, width: int = 48) -> str:
        head = ("status", "claim", "printed", "derived", "source / detail")
        rows = [(r.status, r.id, r.printed, r.derived, (r.source + ("  " + r.detail if r.detail else "")).strip())
                for r in self.rows]
        return text_table(head, rows, width)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "ok": self.ok, "summary": self.summary(),
                "n_claims": self.n_claims, "n_pass": self.n_pass, "rows": [asdict(r) for r in self.rows]}

    def to_frame(self):
        return pd.DataFrame([asdict(r) for r in self.rows])
