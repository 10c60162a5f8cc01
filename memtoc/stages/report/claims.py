"""Claims: every number the report prints, tied to the file and JSON pointer that carries it.

The registry (``paper/claims.yaml``) lists claims. A claim has

``id``         unique name; may contain ``{var}`` placeholders expanded by ``foreach``
``statement``  the sentence it supports, with a ``{value}`` placeholder (and ``{var}``s)
``file``       path relative to the run directory (``summaries/evaluation.json``)
``pointer``    RFC 6901 JSON pointer to the value (``{var}``s are substituted escaped)
``rounding``   how the value is printed (see :func:`format_value`)
``derive``     optional, one of ``min | max | range | count``: the claim is computed from the
               pointer expanded over the ``over`` variables (e.g. the range over models)
``foreach``    optional mapping ``var -> domain``; a domain is a literal list, or
               ``{file, pointer}`` whose mapping keys (those whose values are mappings, unless
               ``mappings_only: false``) or list items are the values, optionally
               ``{..., exclude: [..]}``, ``{..., missing_ok: true}`` (a missing pointer gives no
               values instead of an omission). Later domains may use earlier variables; a value that
               starts with "/" is inserted into pointers as a pointer fragment (not escaped).
``section``    report section; ``table`` (optional) ``{name, row, col}`` places the claim in a table
``required``   default true: a required claim whose file/pointer is missing stops the report;
               an optional one is left out of the report (listed under ``omitted`` in claims.json)

Rounding rules: ``percent:N`` (x100, N decimals), ``pp:N`` (x100, signed, percentage points),
``decimal:N``, ``signed:N``, ``int``, ``thousands`` (int with a thousands comma), ``exact``
(strings as they are; booleans as ``yes``/``no``). Rounding is half-up on the shortest decimal
representation of the value (``repr``); ``None``/NaN print as ``n/a``.

The report marks each printed claim as ``<!--claim:ID-->VALUE<!--/claim-->``: invisible once
rendered, and :func:`verify` checks every marker against ``claims.json``, every claim against the
report, and flags digits in the report text that are not inside a marker (untagged numbers).

A claim made in code (:func:`build_claim`; :mod:`memtoc.stages.report.replication`'s "This run and the paper") may
read a file of the project folder (``file: "project:paper/published/table1.json"``) and may be a
verdict (``derive: covers``): whether a ``reference`` point (``{file, pointer, scale}``, e.g. the
paper's printed value) lies inside the run's interval at ``pointers[0]`` (:func:`covers`).

:func:`resolve` reads a run's files and produces :class:`Claim` objects; :func:`write_claims`
writes ``<run_dir>/paper/claims.json``; :func:`verify` re-derives every claim from its file and
diffs the printed value. The published paper's numbers are re-derived by :mod:`memtoc.stages.report.published`;
``memtoc verify`` is :mod:`memtoc.cli.verify`.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import string
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

import yaml

from memtoc.config.locks import check_run_versions
from memtoc.config.runconfig import RunPaths
from memtoc.core.errors import MemtocError
from memtoc.core.io import atomic_write_text
from memtoc.core.metrics import metric_spec
from memtoc.core.project import REPO_ROOT
from memtoc.core.vocab import HEADLINE_METRICS

# the values (pointers, rounding) and the results are their own modules, importable from here
from memtoc.stages.report.claimfmt import (
    MARKER_RE, RANGE_DASH, ClaimError, MissingSource, _is_missing, escape_token, fill_statement,
    format_value, json_pointer, parse_rounding, tag, tagged_statement, unescape_token, untagged_numbers)
from memtoc.stages.report.claimresult import CheckRow, VerificationResult, text_table

REGISTRY_PATH = REPO_ROOT / "paper" / "claims.yaml"
DERIVATIONS = ("min", "max", "range", "count")   # a registry claim's; "covers" is made in code (build_claim)
PROJECT_PREFIX = "project:"     # a claim file under the project folder (paper/published/...), not the run
VERDICTS = ("inside", "outside", "no interval")


# --------------------------------------------------------------------------------------------
# Registry

@dataclass
class Claim:
    """One resolved claim: what the report prints and where it comes from."""

    id: str
    statement: str              # the sentence with the value filled in
    template: str               # the sentence with {value}
    file: str                   # relative to the run directory
    pointers: list[str]         # one pointer, or several for a derivation
    rounding: str
    value: str                  # as printed
    raw: Any                    # the value(s) read from the file
    derive: Optional[str] = None
    sha256: str = ""
    section: str = ""
    table: Optional[dict] = None
    required: bool = True
    reference: Optional[dict] = None    # derive "covers": {file, pointer, scale} of the point tested

    @property
    def pointer(self) -> str:
        return self.pointers[0] if len(self.pointers) == 1 else self.pointers[0] + " …"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pointer"] = self.pointers[0] if len(self.pointers) == 1 else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "claims.json") -> "Claim":
        missing = [k for k in ("id", "statement", "template", "file", "pointers", "rounding", "value") if k not in d]
        if missing:
            raise ClaimError(f"{where}: claim {d.get('id', '?')!r} lacks field(s) {missing}; rebuild it "
                             "with notebooks/08_paper.ipynb")
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def load_registry(registry: str | Path | dict | None = None) -> dict[str, Any]:
    """Read and check the registry (a path, an already-loaded dict, or the default file)."""
    if isinstance(registry, dict):
        reg, where = registry, "<registry>"
    else:
        path = Path(registry) if registry else REGISTRY_PATH
        where = str(path)
        if not path.is_file():
            raise ClaimError(f"claim registry {path} does not exist; the shipped one is paper/claims.yaml")
        try:
            reg = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ClaimError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(reg, dict) or not isinstance(reg.get("claims"), list):
        raise ClaimError(f"{where}: the registry must be a mapping with a 'claims' list")
    seen: set[str] = set()
    for i, c in enumerate(reg["claims"]):
        if not isinstance(c, dict):
            raise ClaimError(f"{where}: claims[{i}] must be a mapping")
        cid = c.get("id", f"claims[{i}]")
        for k in ("id", "statement", "file", "pointer", "rounding"):
            if k not in c:
                raise ClaimError(f"{where}: claim {cid!r}: field {k!r} is missing")
        if "{value}" not in c["statement"]:
            raise ClaimError(f"{where}: claim {cid!r}: the statement needs a {{value}} placeholder")
        parse_rounding(c["rounding"])
        if c.get("derive") is not None:
            if c["derive"] not in DERIVATIONS:
                raise ClaimError(f"{where}: claim {cid!r}: derive {c['derive']!r} is not one of {DERIVATIONS}")
            if not c.get("over"):
                raise ClaimError(f"{where}: claim {cid!r}: derive needs 'over' (variable -> domain)")
        if cid in seen:
            raise ClaimError(f"{where}: duplicate claim id {cid!r}")
        seen.add(cid)
    return reg


class _Files:
    """Reads run files once, remembers their sha256."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.cache: dict[str, tuple[Any, str]] = {}

    def path(self, rel: str) -> Path:
        if rel.startswith(PROJECT_PREFIX):
            return REPO_ROOT / rel[len(PROJECT_PREFIX):]
        return self.root / rel

    def load(self, rel: str) -> tuple[Any, str]:
        if rel not in self.cache:
            path = self.path(rel)
            if not path.is_file():
                raise MissingSource(f"file {path} does not exist")
            data = path.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            text = data.decode("utf-8")
            try:
                if path.suffix == ".jsonl":
                    doc: Any = [json.loads(l) for l in text.splitlines() if l.strip()]
                elif path.suffix in (".yaml", ".yml"):
                    doc = yaml.safe_load(text)
                elif path.suffix == ".json":
                    doc = json.loads(text)
                else:
                    doc = text
            except (json.JSONDecodeError, yaml.YAMLError) as e:
                raise ClaimError(f"file {path} is not valid {path.suffix[1:].upper()}: {e}") from None
            self.cache[rel] = (doc, sha)
        return self.cache[rel]

    def get(self, rel: str, pointer: str) -> Any:
        doc, _ = self.load(rel)
        return json_pointer(doc, pointer, where=str(self.path(rel)))


class _Fmt(dict):
    """str.format_map helper: unknown names stay as ``{name}``."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _fill(template: str, env: dict[str, Any], escape: bool = False) -> str:
    vals = {k: (_escape_deep(v) if escape else v) for k, v in env.items()}
    return string.Formatter().vformat(template, (), _Fmt(vals))


def _escape_deep(v: Any) -> Any:
    """Escape a foreach value for use as one pointer token; a string starting with "/" is a
    pointer fragment and is inserted as it is."""
    if isinstance(v, dict):
        return {k: _escape_deep(x) for k, x in v.items()}
    if isinstance(v, str) and v.startswith("/"):
        return v
    return escape_token(v)


def _domain(spec: Any, env: dict[str, Any], files: _Files, where: str) -> list[Any]:
    if isinstance(spec, list):
        return list(spec)
    if isinstance(spec, dict) and "metrics" in spec:     # the metric registry: {key, col, name} per metric
        names = spec["metrics"]
        names = list(HEADLINE_METRICS) if names == "headline" else names
        if not isinstance(names, list):
            raise ClaimError(f"{where}: foreach domain {{metrics: ...}} takes 'headline' or a list of metric names")
        try:
            specs = [metric_spec(n) for n in names]
        except MemtocError as e:
            raise ClaimError(f"{where}: {e}") from None
        return [{"key": m.name, "col": m.column, "name": m.label} for m in specs]
    if isinstance(spec, dict) and "pointer" in spec:
        rel = _fill(spec.get("file", ""), env)
        try:
            node = files.get(rel, _fill(spec["pointer"], env, escape=True))
        except ClaimError:
            if spec.get("missing_ok"):   # a section that exists only in some runs: no claims, no omission
                return []
            raise
        if isinstance(node, dict):   # the keys whose values are mappings (skips counts, labels)
            vals = [k for k, v in node.items() if not str(k).startswith("_")
                    and (isinstance(v, dict) or not spec.get("mappings_only", True))]
        elif isinstance(node, list):
            vals = list(node)
        else:
            raise ClaimError(f"{where}: foreach domain {spec} is a {type(node).__name__}, not a mapping or list")
        excl = set(spec.get("exclude", []))
        return [v for v in vals if v not in excl]
    raise ClaimError(f"{where}: a foreach domain must be a list, {{file, pointer}} or {{metrics: ...}}, got {spec!r}")


def _expand(vars_: dict[str, Any], env: dict[str, Any], files: _Files, where: str) -> list[dict[str, Any]]:
    envs = [dict(env)]
    for var, spec in (vars_ or {}).items():
        nxt = []
        for e in envs:
            for v in _domain(spec, e, files, where):
                nxt.append({**e, var: v})
        envs = nxt
    return envs


def _derive(op: str, values: list[Any], rule: str) -> str:
    if op == "count":
        return format_value(len(values), "int" if parse_rounding(rule)[0] != "thousands" else rule)
    nums = [v for v in values if not _is_missing(v)]
    if not nums:
        return "n/a"
    if op == "min":
        return format_value(min(nums), rule)
    if op == "max":
        return format_value(max(nums), rule)
    if op == "range":
        return f"{format_value(min(nums), rule)}{RANGE_DASH}{format_value(max(nums), rule)}"
    raise ClaimError(f"unknown derivation {op!r}; valid: {', '.join(DERIVATIONS)}")


def covers(interval: Any, point: Any, scale: float = 1.0) -> str:
    """Whether ``point`` (as printed, times ``scale``) lies in ``interval`` = [lo, hi]: "inside",
    "outside", or "no interval". The point may sit up to half a unit of its last printed digit
    outside (17.1 printed covers 0.1705 with scale 0.01): its printed precision, no more."""
    if (not isinstance(interval, (list, tuple)) or len(interval) != 2
            or any(_is_missing(x) or isinstance(x, bool) or not isinstance(x, (int, float)) for x in interval)):
        return "no interval"
    if isinstance(point, bool) or not isinstance(point, (int, float)):
        raise ClaimError(f"the point tested against an interval is {point!r}, not a number")
    half = Decimal(1).scaleb(Decimal(repr(point)).as_tuple().exponent) / 2 * Decimal(repr(scale))
    value, lo, hi = Decimal(repr(point)) * Decimal(repr(scale)), Decimal(repr(interval[0])), Decimal(repr(interval[1]))
    return "inside" if lo - half <= value <= hi + half else "outside"


def _compute(files: _Files, rel: str, pointers: list[str], derive: Optional[str], rule: str,
             reference: Optional[dict] = None) -> tuple[str, Any]:
    if derive == "covers":      # pointers[0]: the run's [lo, hi]; reference: the point (another file)
        if not isinstance(reference, dict) or not {"file", "pointer"} <= set(reference):
            raise ClaimError(f"a 'covers' claim needs reference {{file, pointer, scale}}, got {reference!r}")
        interval, point = files.get(rel, pointers[0]), files.get(reference["file"], reference["pointer"])
        return covers(interval, point, float(reference.get("scale", 1.0))), [interval, point]
    if derive:
        raw = [files.get(rel, p) for p in pointers]
        return _derive(derive, raw, rule), raw
    raw = files.get(rel, pointers[0])
    return format_value(raw, rule), raw


def resolve_all(run_dir: str | Path, registry: str | Path | dict | None = None) -> tuple[list[Claim], list[dict]]:
    """Resolve every registry claim against a run. Returns (claims, omitted optional claims)."""
    reg = load_registry(registry)
    files = _Files(Path(run_dir))
    out: list[Claim] = []
    omitted: list[dict] = []
    ids: set[str] = set()
    for spec in reg["claims"]:
        required = bool(spec.get("required", True))
        try:
            envs = _expand(spec.get("foreach"), {}, files, spec["id"])
        except MissingSource as e:
            if required:
                raise ClaimError(f"required claim {spec['id']!r}: {e}. Run the stage that writes this "
                                 "file (or mark the claim required: false in the registry)") from None
            omitted.append({"id": spec["id"], "reason": str(e)})
            continue
        for env in envs:
            cid = _fill(spec["id"], env)
            rel = _fill(spec["file"], env)
            try:
                if spec.get("derive"):
                    sub = _expand(spec["over"], env, files, cid)
                    pointers = [_fill(spec["pointer"], e, escape=True) for e in sub]
                else:
                    pointers = [_fill(spec["pointer"], env, escape=True)]
                value, raw = _compute(files, rel, pointers, spec.get("derive"), spec["rounding"])
            except MissingSource as e:
                if required:
                    raise ClaimError(f"required claim {cid!r}: {e}. Run the stage that writes {rel}, or "
                                     f"fix the pointer in the registry") from None
                omitted.append({"id": cid, "reason": str(e)})
                continue
            if cid in ids:
                raise ClaimError(f"claim id {cid!r} is produced twice; make the id template unique")
            ids.add(cid)
            table = None
            if spec.get("table"):
                table = {k: _fill(str(v), env) for k, v in spec["table"].items()}
            template = _fill(spec["statement"], {**env, "value": "{value}"})
            out.append(Claim(
                id=cid, statement=fill_statement(template, value), template=template, file=rel,
                pointers=pointers, rounding=spec["rounding"], value=value, raw=raw,
                derive=spec.get("derive"), sha256=files.load(rel)[1], section=spec.get("section", ""),
                table=table, required=required))
    return out, omitted


def run_files(run_dir: str | Path) -> _Files:
    """The reader claims resolve through: files of the run (and ``project:`` files), read once."""
    return _Files(Path(run_dir))


def build_claim(files: _Files, cid: str, template: str, file: str, pointers: list[str], rounding: str, *,
                derive: Optional[str] = None, reference: Optional[dict] = None, section: str = "",
                table: Optional[dict] = None) -> Claim:
    """One claim made in code rather than by the registry (:mod:`memtoc.stages.report.replication`); ``memtoc verify``
    re-derives it like any other. Raises :class:`MissingSource` when a file or pointer is absent."""
    if "{value}" not in template:
        raise ClaimError(f"claim {cid!r}: the statement needs a {{value}} placeholder")
    parse_rounding(rounding)
    value, raw = _compute(files, file, pointers, derive, rounding, reference)
    return Claim(id=cid, statement=fill_statement(template, value), template=template, file=file,
                 pointers=list(pointers), rounding=rounding, value=value, raw=raw, derive=derive,
                 sha256=files.load(file)[1], section=section, table=table, reference=reference)


def resolve(run_dir: str | Path, registry: str | Path | dict | None = None) -> list[Claim]:
    """The printed value of each registry claim, read from the run's files."""
    return resolve_all(run_dir, registry)[0]


# What a run's report rests on besides the claim files: everything the run wrote, except the report
# itself (paper/), the executed notebooks, the run's bookkeeping (config.json, params.yaml) and
# transient files.
_MANIFEST_SKIP_SUFFIXES = (".tmp", ".rejected")
_FIGURE_RE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def output_manifest(run_dir: str | Path) -> dict[str, str]:
    """sha256 of every output file of a run the report rests on (relative path -> hex digest):
    summaries, scored and generation files, episodes, figures, adapters."""
    paths = RunPaths(run_dir)
    root = paths.root
    skip_dirs, skip_files = (paths.paper, paths.notebooks), (paths.config_json, paths.params_yaml)
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if (not p.is_file() or any(d in p.parents for d in skip_dirs) or p in skip_files
                or any(part.startswith(".") for part in rel.parts) or p.name.endswith(_MANIFEST_SKIP_SUFFIXES)):
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        out[rel.as_posix()] = h.hexdigest()
    return out


def write_claims(run_dir: str | Path, claims: list[Claim], omitted: list[dict] | None = None,
                 registry: str | Path | None = None) -> Path:
    path = RunPaths(run_dir).claims_json
    reg_path = Path(registry) if registry and not isinstance(registry, dict) else REGISTRY_PATH
    doc = {
        "schema": "memtoc-claims-v1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "registry": str(reg_path),
        "registry_sha256": hashlib.sha256(reg_path.read_bytes()).hexdigest() if reg_path.is_file() else None,
        "n_claims": len(claims),
        "claims": [c.to_dict() for c in claims],
        "omitted": omitted or [],
        # sha256 of every output the claims rest on; `memtoc verify` fails when one changed or went
        "inputs": output_manifest(run_dir),
    }
    return atomic_write_text(path, json.dumps(doc, indent=1, ensure_ascii=False, default=str) + "\n")


def read_claims(run_dir: str | Path) -> tuple[list[Claim], dict]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ClaimError(f"run directory {run_dir} does not exist; run `memtoc run PARAMS.yaml` first "
                         "(a run directory is outputs/<run_name>)")
    path = RunPaths(run_dir).claims_json
    if not path.is_file():
        raise ClaimError(f"{path} does not exist; build the report first (notebooks/08_paper.ipynb, "
                         "or `memtoc run PARAMS.yaml --only 08`)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ClaimError(f"{path}: not valid JSON ({e}); rebuild it with notebooks/08_paper.ipynb") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("claims"), list):
        raise ClaimError(f"{path}: field 'claims' (a list) is missing; rebuild it with notebooks/08_paper.ipynb")
    return [Claim.from_dict(d, str(path)) for d in doc["claims"]], doc


# --------------------------------------------------------------------------------------------
# Verification

def verify(run_dir: str | Path, check_report: bool = True,
           registry: str | Path | dict | None = None) -> VerificationResult:
    """Re-derive every claim of ``<run_dir>/paper/claims.json`` from its file and diff it."""
    run_dir = Path(run_dir)
    claims, doc = read_claims(run_dir)
    if registry is None and doc.get("registry") and Path(doc["registry"]).is_file():
        registry = doc["registry"]          # the registry the report was built from
    files = _Files(run_dir)
    res = VerificationResult(kind="run", target=str(run_dir))
    for c in claims:
        src = f"{c.file}#{c.pointer}" + (f" ({c.derive} over {len(c.pointers)})" if c.derive else "")
        row = CheckRow(id=c.id, status="FAIL", printed=c.value, source=src)
        try:
            derived, _raw = _compute(files, c.file, c.pointers, c.derive, c.rounding, c.reference)
        except ClaimError as e:
            row.detail = f"cannot re-derive: {e}"
            res.rows.append(row)
            continue
        row.derived = derived
        notes = []
        if derived != c.value:
            notes.append(f"printed {c.value!r} but the file gives {derived!r}")
        if fill_statement(c.template, c.value) != c.statement:
            notes.append("statement text does not carry the printed value")
        if notes:
            row.detail = "; ".join(notes)
        else:
            row.status = "PASS"
            if c.sha256 and files.load(c.file)[1] != c.sha256:
                row.detail = "note: file changed since the report was built (value unchanged)"
        res.rows.append(row)
    if check_report:
        res.rows += _check_report(run_dir, claims)
        res.rows.append(_check_registry(run_dir, claims, registry))
        res.rows.append(_check_inputs(run_dir, doc))
        res.rows.append(_check_figures(run_dir, doc))
        warn = check_run_versions(run_dir)   # a NOTE (not a failure) when the versions differ from the locks
        res.rows.append(CheckRow(id="report:versions", status="NOTE" if warn else "PASS",
                                 source="config.json vs requirements/*.lock", detail="; ".join(warn)))
    return res


def _check_inputs(run_dir: Path, doc: dict) -> CheckRow:
    """Every output recorded in claims.json (``inputs``) still exists with the same sha256."""
    row = CheckRow(id="report:inputs", status="FAIL", source="paper/claims.json#/inputs")
    recorded = doc.get("inputs")
    if not isinstance(recorded, dict) or not recorded:
        row.detail = "claims.json records no output hashes (built by an older memtoc); rebuild the report"
        return row
    now = output_manifest(run_dir)
    missing = [f for f in recorded if f not in now]
    changed = [f for f in recorded if f in now and now[f] != recorded[f]]
    row.printed = f"{len(recorded) - len(missing) - len(changed)}/{len(recorded)}"
    notes = []
    if missing:
        notes.append("missing: " + ", ".join(missing[:5]) + (" …" if len(missing) > 5 else ""))
    if changed:
        notes.append("changed since the report was built: " + ", ".join(changed[:5])
                     + (" …" if len(changed) > 5 else ""))
    if notes:
        row.detail = "; ".join(notes) + " (rebuild the report: memtoc run PARAMS --only 08 09)"
    else:
        row.status = "PASS"
    return row


def _check_figures(run_dir: Path, doc: dict) -> CheckRow:
    """Every figure embedded in report.md exists and is one whose hash claims.json recorded."""
    row = CheckRow(id="report:figures", status="FAIL", source="paper/report.md")
    path = RunPaths(run_dir).report_md
    if not path.is_file():
        row.detail = "report.md is missing"
        return row
    recorded = doc.get("inputs") if isinstance(doc.get("inputs"), dict) else {}
    bad = []
    figs = _FIGURE_RE.findall(path.read_text(encoding="utf-8"))
    for ref in figs:
        target = (path.parent / ref).resolve()
        try:
            rel = target.relative_to(run_dir.resolve()).as_posix()
        except ValueError:
            bad.append(f"{ref} (outside the run directory)")
            continue
        if not target.is_file():
            bad.append(f"{ref} (missing)")
        elif rel not in recorded:
            bad.append(f"{ref} (no hash recorded)")
    row.printed = f"{len(figs) - len(bad)}/{len(figs)}"
    if bad:
        row.detail = "embedded figures: " + ", ".join(bad[:5])
    else:
        row.status = "PASS"
    return row


def _check_registry(run_dir: Path, claims: list[Claim], registry: str | Path | dict | None) -> CheckRow:
    """Every claim the registry yields on the run's current files must be in claims.json."""
    row = CheckRow(id="report:registry", status="FAIL", source=str(registry or "paper/claims.yaml"))
    try:
        expected, _ = resolve_all(run_dir, registry)
    except ClaimError as e:
        row.detail = f"the registry does not resolve on this run: {e}"
        return row
    have = {c.id: c for c in claims}
    missing = [c.id for c in expected if c.id not in have]
    # a derived claim (range, count over models) must still cover the same pointers and value
    changed = [c.id for c in expected if c.id in have
               and (have[c.id].pointers != c.pointers or have[c.id].value != c.value)]
    row.printed = f"{len(expected) - len(missing) - len(changed)}/{len(expected)}"
    notes = []
    if missing:
        notes.append("registry claims absent from claims.json (rebuild the report): "
                     + ", ".join(missing[:10]) + (" …" if len(missing) > 10 else ""))
    if changed:
        notes.append("claims whose sources or values differ when the registry is resolved again: "
                     + ", ".join(changed[:10]) + (" …" if len(changed) > 10 else ""))
    if notes:
        row.detail = "; ".join(notes)
    else:
        row.status = "PASS"
    return row


def _check_report(run_dir: Path, claims: list[Claim]) -> list[CheckRow]:
    path = RunPaths(run_dir).report_md
    rows: list[CheckRow] = []
    if not path.is_file():
        return [CheckRow(id="report:file", status="FAIL", source=str(path),
                         detail="report.md is missing; rebuild it with notebooks/08_paper.ipynb")]
    md = path.read_text()
    by_id = {c.id: c for c in claims}
    seen: set[str] = set()
    bad = []
    n = 0
    for m in MARKER_RE.finditer(md):
        n += 1
        cid, val = m.group(1), m.group(2)
        seen.add(cid)
        if cid not in by_id:
            bad.append(f"{cid}: tagged in report.md but not in claims.json")
        elif by_id[cid].value != val:
            bad.append(f"{cid}: report.md prints {val!r}, claims.json {by_id[cid].value!r}")
    rows.append(CheckRow(id="report:markers", status="FAIL" if bad else "PASS", printed=str(n),
                         source="paper/report.md", detail="; ".join(bad)))
    missing = [c.id for c in claims if c.id not in seen]
    rows.append(CheckRow(id="report:coverage", status="FAIL" if missing else "PASS",
                         printed=f"{len(claims) - len(missing)}/{len(claims)}", source="paper/report.md",
                         detail=("claims not printed in the report: " + ", ".join(missing[:10])) if missing else ""))
    stray = untagged_numbers(md)
    rows.append(CheckRow(id="report:untagged", status="FAIL" if stray else "PASS", printed=str(len(stray)),
                         source="paper/report.md",
                         detail=("numbers outside claim markers: " + " | ".join(s[:60] for s in stray[:5])) if stray else ""))
    return rows


def check_report(run_dir: str | Path, claims: list[Claim]) -> list[CheckRow]:
    """The report's claim markers, coverage and untagged numbers against ``claims`` (public form of
    the checks :func:`verify` runs on a run directory; ``memtoc.run.snapshot`` runs them on a snapshot)."""
    return _check_report(Path(run_dir), claims)
